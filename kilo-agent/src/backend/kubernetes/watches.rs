//! The watches: one per resource (Nodes, Peers, ServiceCIDRs), listing then watching with
//! backoff, folding events into the state a snapshot is made of, and telling an operator once
//! when the API server is lost and once when it is back ([`Link`]).
use std::{
    collections::BTreeMap,
    ops::ControlFlow,
    sync::{Arc, Mutex},
};

use futures::StreamExt;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::{Api, Client, Resource, runtime::watcher};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

use super::super::{Update, last_seen_of, refresh};
use super::{
    describe, error_chain,
    filter::{node_changed, service_cidr_changed, service_cidrs, trim_node},
};
use crate::mesh::annotations::kg_nodes;
use crate::mesh::{KubeNode, Peer, Snapshot};

/// Whether the API server can be reached, as an operator hears of it: one warning when it is
/// lost, one line when it is back (for how long, after how many retries), debug lines between.
/// Every failed attempt, a server's refusal included, counts in `retries`.
#[derive(Default)]
pub(super) struct Link {
    pub(super) retries: Counter,
    /// Since when the server cannot be reached, and the failures since.
    pub(super) lost: Option<(tokio::time::Instant, u64)>,
}

impl Link {
    pub(super) fn failed(&mut self, error: &str) {
        self.retries.inc();
        match &mut self.lost {
            Some((_, failures)) => {
                *failures += 1;
                tracing::debug!(%error, "the Kubernetes API server is still unreachable");
            }
            None => {
                tracing::warn!(
                    %error,
                    "Kubernetes API server unreachable: keeping the last applied state, no node \
                     expires meanwhile; retrying with backoff"
                );
                self.lost = Some((tokio::time::Instant::now(), 1));
            }
        }
    }

    /// Something arrived from the server.
    pub(super) fn delivered(&mut self) {
        if let Some((since, retries)) = self.lost.take() {
            tracing::info!(
                down_seconds = since.elapsed().as_secs(),
                retries,
                "Kubernetes API server reachable again"
            );
        }
    }
}

/// The objects of one watched resource as of its last event, a (re)list in progress, and
/// whether a list has completed (or, for ServiceCIDRs, none can: not served, not permitted).
pub(super) struct Watched<K> {
    pub(super) objects: BTreeMap<String, K>,
    pub(super) listing: Option<BTreeMap<String, K>>,
    pub(super) synced: bool,
}

impl<K> Default for Watched<K> {
    fn default() -> Self {
        Watched {
            objects: BTreeMap::new(),
            listing: None,
            synced: false,
        }
    }
}

/// How one resource is watched.
pub(super) struct Watch<K> {
    /// Its name in logs (`nodes`, `peers.kilo.squat.ai`).
    pub(super) resource: &'static str,
    pub(super) watched: fn(&mut State) -> &mut Watched<K>,
    pub(super) trim: fn(K) -> K,
    /// Whether an update matters (see [`apply`]).
    pub(super) changed: fn(Option<&K>, &K) -> bool,
    /// What to tell an operator when the server refuses the watch.
    pub(super) hint: fn(&watcher::Error) -> &'static str,
}

pub(super) const NODES: Watch<KubeNode> = Watch {
    resource: "nodes",
    watched: |s| &mut s.nodes,
    trim: trim_node,
    changed: node_changed,
    hint: |_| "the Kubernetes API server refused the node watch; retrying with backoff",
};

pub(super) const PEERS: Watch<Peer> = Watch {
    resource: "peers.kilo.squat.ai",
    watched: |s| &mut s.peers,
    trim: |mut p| {
        p.metadata.managed_fields = None;
        p
    },
    changed: |old, new| old.map(|o| &o.spec) != Some(&new.spec),
    hint: peer_watch_hint,
};

pub(super) const SERVICE_CIDRS: Watch<ServiceCIDR> = Watch {
    resource: "servicecidrs.networking.k8s.io",
    watched: |s| &mut s.service_cidrs,
    trim: |mut c| {
        c.metadata.managed_fields = None;
        c
    },
    changed: service_cidr_changed,
    hint: |_| "the Kubernetes API server refused the ServiceCIDR watch; retrying with backoff",
};

#[derive(Default)]
pub(super) struct State {
    pub(super) nodes: Watched<KubeNode>,
    pub(super) peers: Watched<Peer>,
    pub(super) service_cidrs: Watched<ServiceCIDR>,
    /// The Node watch works (cleared by its errors, set by its next event).
    pub(super) connected: bool,
    /// The last failure of each watch (by resource) that was an answer of the server, logged
    /// once while it repeats.
    pub(super) failures: BTreeMap<&'static str, String>,
    pub(super) link: Link,
    pub(super) generation: u64,
}

impl State {
    /// Sends a new snapshot (a new generation), once every list has completed.
    pub(super) fn publish(&mut self, tx: &watch::Sender<Update>) {
        if !(self.nodes.synced && self.peers.synced && self.service_cidrs.synced) {
            return;
        }
        self.generation += 1;
        let (service_cidrs, errors) = service_cidrs(&self.service_cidrs.objects);
        // Kept for a later subscriber too (`send` drops it while there is none): the first
        // snapshot may come before the agent subscribes.
        tx.send_replace(Update {
            snapshot: Arc::new(Snapshot {
                nodes: self.nodes.objects.clone(),
                peers: self.peers.objects.clone(),
                service_cidrs,
                kg_nodes: kg_nodes(&self.nodes.objects),
            }),
            errors,
            generation: self.generation,
            last_seen: Arc::new(last_seen_of(&self.nodes.objects)),
            connected: self.connected,
        });
    }

    /// Applies one event of `w`'s watch, publishing what changed. Returns whether the server
    /// delivered something (`Some(false)`: the watcher only starts a list; `None`: a failure).
    pub(super) fn on_event<K: Resource>(
        &mut self,
        w: &Watch<K>,
        event: Result<watcher::Event<K>, watcher::Error>,
        tx: &watch::Sender<Update>,
    ) -> Option<bool> {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                self.failed(w.resource, &e, (w.hint)(&e));
                return None;
            }
        };
        let delivering = self.delivered(w.resource, &event);
        let watched = (w.watched)(self);
        match apply(
            &mut watched.objects,
            &mut watched.listing,
            event,
            w.trim,
            w.changed,
        ) {
            Applied::Listed => {
                watched.synced = true;
                self.publish(tx);
            }
            Applied::Changed => self.publish(tx),
            Applied::Unchanged => {}
        }
        Some(delivering)
    }

    /// Whether `event` carries what the server sent (a list or a change; `Init` only starts a
    /// list): the server is reachable, and the last failure of `resource` is over.
    pub(super) fn delivered<K>(
        &mut self,
        resource: &'static str,
        event: &watcher::Event<K>,
    ) -> bool {
        let delivering = !matches!(event, watcher::Event::Init);
        if delivering {
            self.link.delivered();
            self.failures.remove(resource);
        }
        delivering
    }

    /// Counts and logs a failure of the watch of `resource`: the link's, while the server cannot
    /// be reached; an answer of a reachable server once per cause, with `hint`.
    pub(super) fn failed(&mut self, resource: &'static str, e: &watcher::Error, hint: &str) {
        let error = describe_watch(resource, e);
        if unreachable(e) || self.link.lost.is_some() {
            self.link.failed(&error);
            return;
        }
        self.link.retries.inc();
        if self.failures.get(resource) == Some(&error) {
            tracing::debug!(%error, "{hint}");
        } else {
            tracing::warn!(%error, "{hint}");
            self.failures.insert(resource, error);
        }
    }

    /// Sends the latest heartbeats and connection state if they changed, keeping the snapshot;
    /// a new snapshot when a heartbeat changed which nodes run kg.
    pub(super) fn refresh(&mut self, tx: &watch::Sender<Update>) {
        if self.generation == 0 {
            return;
        }
        if tx.borrow().snapshot.kg_nodes != kg_nodes(&self.nodes.objects) {
            self.publish(tx);
            return;
        }
        let last_seen = last_seen_of(&self.nodes.objects);
        tx.send_if_modified(|u| refresh(u, last_seen, self.connected));
    }
}

pub(super) fn name_of<K: Resource>(k: &K) -> String {
    k.meta().name.clone().unwrap_or_default()
}

/// How long the watches wait between attempts while the API server cannot be reached: from
/// 0.5 s doubling to 2.5 s, plus a random jitter of up to as much again (so at most 5 s, and a
/// cluster's agents do not all come back in the same instant). kube's default grows to 30 s,
/// so after an outage of a minute kg would learn of the server's return up to 30 s late.
pub(super) fn watch_backoff() -> watcher::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(500))
        .with_max_delay(std::time::Duration::from_millis(2500))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .into()
}

/// [`describe`] for a watcher's error.
pub(super) fn describe_watch(resource: &str, e: &watcher::Error) -> String {
    match e {
        watcher::Error::InitialListFailed(e) => describe(&format!("listing {resource}"), e),
        watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => {
            describe(&format!("watching {resource}"), e)
        }
        other => format!("watching {resource}: {}", error_chain(other)),
    }
}

/// What a watch event did to the objects it keeps.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Applied {
    /// A (re)list completed: the objects are now exactly the listed ones.
    Listed,
    /// An object was added, removed or changed in a way `changed` says matters.
    Changed,
    Unchanged,
}

/// Applies one watch event to `objects`; a (re)list collects into `listing` and replaces
/// `objects` at its end. Objects are trimmed on arrival.
pub(super) fn apply<K: Resource>(
    objects: &mut BTreeMap<String, K>,
    listing: &mut Option<BTreeMap<String, K>>,
    event: watcher::Event<K>,
    trim: impl Fn(K) -> K,
    changed: impl Fn(Option<&K>, &K) -> bool,
) -> Applied {
    match event {
        watcher::Event::Init => *listing = Some(BTreeMap::new()),
        watcher::Event::InitApply(k) => {
            let k = trim(k);
            listing
                .get_or_insert_with(BTreeMap::new)
                .insert(name_of(&k), k);
        }
        watcher::Event::InitDone => {
            *objects = listing.take().unwrap_or_default();
            return Applied::Listed;
        }
        watcher::Event::Apply(k) => {
            let k = trim(k);
            let name = name_of(&k);
            if objects.get(&name).is_some_and(|old| older(&k, old)) {
                return Applied::Unchanged;
            }
            let changed = changed(objects.get(&name), &k);
            objects.insert(name.clone(), k);
            if changed {
                tracing::debug!(object = %name, "changed");
                return Applied::Changed;
            }
        }
        watcher::Event::Delete(k) => {
            if objects.remove(&name_of(&k)).is_some() {
                return Applied::Changed;
            }
        }
    }
    Applied::Unchanged
}

/// Whether `new` is an older version of `old`: the watch delivering, late, a version from
/// before one the backend already holds (its own patch's answer). Resource versions are
/// compared as the integers the API server issues; any other form is taken as newer.
fn older<K: Resource>(new: &K, old: &K) -> bool {
    let version = |k: &K| k.meta().resource_version.as_deref()?.parse::<u64>().ok();
    matches!((version(new), version(old)), (Some(n), Some(o)) if n < o)
}

/// Whether a watch failed without an answer from the API server (refused, reset, timed out),
/// rather than with one (a 403, a missing resource).
pub(super) fn unreachable(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => !matches!(e, kube::Error::Api(_)),
        _ => false,
    }
}

/// What to tell an operator when the Peer watch fails: only a 404 means the CRD is missing.
pub(super) fn peer_watch_hint(e: &watcher::Error) -> &'static str {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
            if s.code == 404 =>
        {
            "the Peer CRD is not installed (manifests/base/crds.yaml); retrying with backoff"
        }
        _ => "the Kubernetes API server refused the Peer watch; retrying with backoff",
    }
}

/// Watches `api` until `on_event` breaks, handing it every event (failures as `Err`). After a
/// failure it waits ([`watch_backoff`]), then lists afresh (a quorum read) instead of resuming
/// the watch: a restarted API server's watch cache can take seconds to fill, and a watch
/// resumed from an old resource version then only ends in `410 Gone` after that wait.
pub(super) async fn watch_forever<K>(
    api: Api<K>,
    mut on_event: impl FnMut(Result<watcher::Event<K>, watcher::Error>) -> ControlFlow<()>,
) where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use kube::runtime::utils::Backoff as _;
    let mut backoff = watch_backoff();
    loop {
        let mut stream = watcher(api.clone(), watcher::Config::default()).boxed();
        while let Some(event) = stream.next().await {
            match event {
                Ok(event) => {
                    backoff.reset();
                    if on_event(Ok(event)).is_break() {
                        return;
                    }
                }
                Err(e) => {
                    if on_event(Err(e)).is_break() {
                        return;
                    }
                    break;
                }
            }
        }
        let delay = backoff.next().unwrap_or(std::time::Duration::from_secs(5));
        tokio::time::sleep(delay).await;
    }
}

/// Whether the API server serves `networking.k8s.io/v1` `servicecidrs`, from its discovery
/// document: one request, asked again with backoff while the server cannot answer.
pub(super) async fn serves_service_cidrs(client: &Client, state: &Mutex<State>) -> bool {
    const GROUP: &str = "networking.k8s.io/v1";
    const FLAG_ONLY: &str = "service CIDRs come from --service-cidr only";
    let mut backoff = watch_backoff();
    loop {
        let answer = client.list_api_group_resources(GROUP).await;
        let action = format!("discovering {GROUP}");
        // `None` while the server cannot answer (the guard is not held across the wait).
        let served = {
            let mut s = state.lock().expect("state lock");
            match answer {
                Ok(list) => Some(list.resources.iter().any(|r| r.name == "servicecidrs")),
                Err(kube::Error::Api(e)) if e.code == 404 => Some(false),
                Err(kube::Error::Api(e)) if matches!(e.code, 401 | 403) => {
                    let error = describe(&action, &kube::Error::Api(e));
                    tracing::warn!(%error, "cannot ask whether ServiceCIDRs are served: {FLAG_ONLY}");
                    s.link.delivered();
                    return false;
                }
                Err(e) => {
                    s.link.failed(&describe(&action, &e));
                    None
                }
            }
        };
        match served {
            Some(served) => {
                state.lock().expect("state lock").link.delivered();
                if !served {
                    tracing::info!(
                        "the Kubernetes API server does not serve {GROUP} ServiceCIDRs \
                         (Kubernetes 1.33 on): {FLAG_ONLY}"
                    );
                }
                return served;
            }
            None => {
                let delay = backoff.next().unwrap_or(std::time::Duration::from_secs(5));
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Why the server refuses to list ServiceCIDRs for good (no permission), if it does.
pub(super) fn service_cidrs_refused(e: &watcher::Error) -> Option<String> {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
            if matches!(s.code, 401 | 403 | 404) =>
        {
            Some(describe_watch(SERVICE_CIDRS.resource, e))
        }
        _ => None,
    }
}
