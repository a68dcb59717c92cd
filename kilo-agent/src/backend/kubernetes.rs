//! The Kubernetes backend (`--backend kubernetes`): a Node watcher filtered to the changes that
//! matter, a Peer watcher, a ServiceCIDR watcher where the API server serves them, and a merge
//! patch of the local node's own annotations.
//!
//! Node filter: an update makes a new snapshot only when labels, annotations (other than
//! `kilo.squat.ai/last-seen`), `spec.podCIDR(s)` or the `Ready` condition changed. Status
//! heartbeats (kubelet) are stored but cost nothing; Kilo's `last-seen` refreshes only update
//! [`Update::last_seen`], which the agent's liveness tracker records without planning. The
//! Node watch failing, or a patch that cannot reach the API server, marks the backend
//! disconnected ([`Update::connected`]) until the watch delivers again. Objects are trimmed on
//! arrival (managed fields, images, most of status) to keep memory flat.
//!
//! Service CIDRs: where the API server serves `networking.k8s.io/v1` `servicecidrs` (Kubernetes
//! 1.33 on; asked once at start), the snapshot carries the CIDRs of every ServiceCIDR that is
//! Ready or being deleted (Services still hold ClusterIPs from it until then); the planner adds
//! them to `--service-cidr`'s. Elsewhere, and when RBAC refuses the list, there are none.
//!
//! Outages ([`Link`]): losing the API server is one warning, its return one line saying for how
//! long and after how many retries; the failures in between are debug lines, counted in
//! `kilo_backend_retries_total`.
//!
//! Liveness (`--check-in-period`): Kilo agents drop a node whose `last-seen` is older than
//! 60 s, so during a migration kg keeps refreshing it every 30 s (every agent still *receives*
//! N updates per 30 s from the API server, each recorded without a plan or a reconcile). Once
//! no Kilo agent is left, `--check-in-period=0` stops the heartbeat: liveness is then
//! Kubernetes' own (the node lifecycle controller marks a node NotReady from its kubelet Lease
//! in `kube-node-lease`; that `Ready` transition passes the filter), and the steady-state cost
//! per agent is zero updates whatever N is.
use std::{
    collections::BTreeMap,
    ops::ControlFlow,
    sync::{Arc, Mutex},
};

use futures::{FutureExt, StreamExt, future::BoxFuture};
use ipnet::IpNet;
use k8s_openapi::api::{
    core::v1::{NodeCondition, NodeStatus},
    networking::v1::ServiceCIDR,
};
use kube::{
    Api, Client, Resource,
    api::{Patch, PatchParams},
    runtime::watcher,
};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

use super::{Annotations, Backend, BackendError, Update, last_seen_of, refresh};
use crate::mesh::{KubeNode, Peer, Snapshot, annotations::LAST_SEEN};

/// The parts of a Node the mesh depends on; an update that leaves them equal is dropped.
#[derive(Debug, PartialEq, Eq)]
struct NodeView {
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    pod_cidr: Option<String>,
    pod_cidrs: Vec<String>,
    ready: Option<String>,
}

fn view(n: &KubeNode) -> NodeView {
    let mut annotations = n.metadata.annotations.clone().unwrap_or_default();
    annotations.remove(LAST_SEEN);
    let spec = n.spec.as_ref();
    NodeView {
        labels: n.metadata.labels.clone().unwrap_or_default(),
        annotations,
        pod_cidr: spec.and_then(|s| s.pod_cidr.clone()),
        pod_cidrs: spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default(),
        ready: ready_condition(n).map(|c| c.status.clone()),
    }
}

fn ready_condition(n: &KubeNode) -> Option<&NodeCondition> {
    n.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
}

/// Whether `new` differs from `old` in a way the snapshot must show (a heartbeat does not). Pure.
pub fn node_changed(old: Option<&KubeNode>, new: &KubeNode) -> bool {
    old.is_none_or(|old| view(old) != view(new))
}

/// Drops what the agent never reads (managed fields, images, heartbeat timestamps).
pub fn trim_node(mut n: KubeNode) -> KubeNode {
    n.metadata.managed_fields = None;
    if let Some(status) = n.status.take() {
        let conditions = status.conditions.map(|cs| {
            cs.into_iter()
                .filter(|c| c.type_ == "Ready")
                .map(|c| NodeCondition {
                    last_heartbeat_time: None,
                    ..c
                })
                .collect()
        });
        n.status = Some(NodeStatus {
            addresses: status.addresses,
            conditions,
            ..NodeStatus::default()
        });
    }
    n
}

/// Whether a ServiceCIDR's ranges hold ClusterIPs: it is Ready, or it is being deleted (the
/// Services allocated from it keep their addresses until they are gone).
fn holds_cluster_ips(s: &ServiceCIDR) -> bool {
    s.metadata.deletion_timestamp.is_some()
        || s.status
            .as_ref()
            .and_then(|st| st.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The service CIDRs of `objects` ([`holds_cluster_ips`]), each once, and one error per value
/// that is not a CIDR (naming the object and the field).
pub fn service_cidrs(objects: &BTreeMap<String, ServiceCIDR>) -> (Vec<IpNet>, Vec<String>) {
    let (mut cidrs, mut errors) = (Vec::new(), Vec::new());
    for (name, s) in objects.iter().filter(|(_, s)| holds_cluster_ips(s)) {
        let values = s.spec.as_ref().and_then(|spec| spec.cidrs.as_deref());
        for (i, value) in values.unwrap_or_default().iter().enumerate() {
            match crate::mesh::parse_cidr(value) {
                Ok(c) if !cidrs.contains(&c.trunc()) => cidrs.push(c.trunc()),
                Ok(_) => {}
                Err(e) => errors.push(format!("ServiceCIDR {name}: spec.cidrs[{i}]: {e}")),
            }
        }
    }
    (cidrs, errors)
}

/// Whether a ServiceCIDR changed in a way [`service_cidrs`] sees.
fn service_cidr_changed(old: Option<&ServiceCIDR>, new: &ServiceCIDR) -> bool {
    old.is_none_or(|o| o.spec != new.spec || holds_cluster_ips(o) != holds_cluster_ips(new))
}

/// Whether the API server can be reached, as an operator hears of it: one warning when it is
/// lost, one line when it is back (for how long, after how many retries), debug lines between.
/// Every failed attempt, a server's refusal included, counts in `retries`.
#[derive(Default)]
struct Link {
    retries: Counter,
    /// Since when the server cannot be reached, and the failures since.
    lost: Option<(tokio::time::Instant, u64)>,
}

impl Link {
    fn failed(&mut self, error: &str) {
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
    fn delivered(&mut self) {
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
struct Watched<K> {
    objects: BTreeMap<String, K>,
    listing: Option<BTreeMap<String, K>>,
    synced: bool,
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
struct Watch<K> {
    /// Its name in logs (`nodes`, `peers.kilo.squat.ai`).
    resource: &'static str,
    watched: fn(&mut State) -> &mut Watched<K>,
    trim: fn(K) -> K,
    /// Whether an update matters (see [`apply`]).
    changed: fn(Option<&K>, &K) -> bool,
    /// What to tell an operator when the server refuses the watch.
    hint: fn(&watcher::Error) -> &'static str,
}

const NODES: Watch<KubeNode> = Watch {
    resource: "nodes",
    watched: |s| &mut s.nodes,
    trim: trim_node,
    changed: node_changed,
    hint: |_| "the Kubernetes API server refused the node watch; retrying with backoff",
};

const PEERS: Watch<Peer> = Watch {
    resource: "peers.kilo.squat.ai",
    watched: |s| &mut s.peers,
    trim: |mut p| {
        p.metadata.managed_fields = None;
        p
    },
    changed: |old, new| old.map(|o| &o.spec) != Some(&new.spec),
    hint: peer_watch_hint,
};

const SERVICE_CIDRS: Watch<ServiceCIDR> = Watch {
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
struct State {
    nodes: Watched<KubeNode>,
    peers: Watched<Peer>,
    service_cidrs: Watched<ServiceCIDR>,
    /// The Node watch works (cleared by its errors, set by its next event).
    connected: bool,
    /// The last failure of each watch (by resource) that was an answer of the server, logged
    /// once while it repeats.
    failures: BTreeMap<&'static str, String>,
    link: Link,
    generation: u64,
}

impl State {
    /// Sends a new snapshot (a new generation), once every list has completed.
    fn publish(&mut self, tx: &watch::Sender<Update>) {
        if !(self.nodes.synced && self.peers.synced && self.service_cidrs.synced) {
            return;
        }
        self.generation += 1;
        let (service_cidrs, errors) = service_cidrs(&self.service_cidrs.objects);
        let _ = tx.send(Update {
            snapshot: Arc::new(Snapshot {
                nodes: self.nodes.objects.clone(),
                peers: self.peers.objects.clone(),
                service_cidrs,
            }),
            errors,
            generation: self.generation,
            last_seen: Arc::new(last_seen_of(&self.nodes.objects)),
            connected: self.connected,
        });
    }

    /// Applies one event of `w`'s watch, publishing what changed. Returns whether the server
    /// delivered something (`Some(false)`: the watcher only starts a list; `None`: a failure).
    fn on_event<K: Resource>(
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
    fn delivered<K>(&mut self, resource: &'static str, event: &watcher::Event<K>) -> bool {
        let delivering = !matches!(event, watcher::Event::Init);
        if delivering {
            self.link.delivered();
            self.failures.remove(resource);
        }
        delivering
    }

    /// Counts and logs a failure of the watch of `resource`: the link's, while the server cannot
    /// be reached; an answer of a reachable server once per cause, with `hint`.
    fn failed(&mut self, resource: &'static str, e: &watcher::Error, hint: &str) {
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

    /// Sends the latest heartbeats and connection state if they changed, keeping the snapshot.
    fn refresh(&self, tx: &watch::Sender<Update>) {
        if self.generation == 0 {
            return;
        }
        let last_seen = last_seen_of(&self.nodes.objects);
        tx.send_if_modified(|u| refresh(u, last_seen, self.connected));
    }
}

fn name_of<K: Resource>(k: &K) -> String {
    k.meta().name.clone().unwrap_or_default()
}

/// The Kubernetes backend. Dropping it stops the watchers.
pub struct KubeBackend {
    client: Client,
    state: Arc<Mutex<State>>,
    tx: Arc<watch::Sender<Update>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for KubeBackend {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The client configuration from `--kubeconfig` (else `$KUBECONFIG`, `~/.kube/config`, or the
/// in-cluster service account), with `--master` overriding the server address.
pub async fn config(
    kubeconfig: Option<&std::path::Path>,
    master: Option<&str>,
) -> Result<kube::Config, BackendError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| {
                BackendError::Kube(format!(
                    "reading kubeconfig {}: {}",
                    path.display(),
                    error_chain(&e)
                ))
            })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| {
                    BackendError::Kube(format!(
                        "kubeconfig {}: {}",
                        path.display(),
                        error_chain(&e)
                    ))
                })?
        }
        None => kube::Config::infer().await.map_err(|e| {
            BackendError::Kube(format!(
                "no Kubernetes configuration: give --kubeconfig, set $KUBECONFIG, provide \
                 ~/.kube/config or run in a pod with a service account ({})",
                error_chain(&e)
            ))
        })?,
    };
    if let Some(m) = master {
        config.cluster_url = m
            .parse()
            .map_err(|e| BackendError::Kube(format!("--master {m:?}: {e}")))?;
    }
    Ok(config)
}

/// A client for `config`. TLS is rustls with the ring provider, installed here for the whole
/// process so that the choice never depends on which crypto features other crates enable.
///
/// kube's own retry layer is off: it follows the API server's `Retry-After`, which a restarted
/// server that is not ready yet sets to 10 s, so a watch would reconnect that much later. The
/// watches retry on [`watch_backoff`] instead, and a failed publish is sent again by the
/// agent's next pass.
pub fn client(mut config: kube::Config) -> Result<Client, BackendError> {
    config.default_retry = false;
    // An error only says a provider is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = config.cluster_url.clone();
    Client::try_from(config)
        .map_err(|e| BackendError::Kube(format!("client for {url}: {}", error_chain(&e))))
}

/// An error with all its causes, `outer: inner: innermost` (a TLS or connection failure is
/// usually only named by the innermost one).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// What went wrong when `action` (e.g. "listing nodes") failed, in an operator's words: an
/// HTTP status from the API server with its message, or the cause of a connection failure.
pub fn describe(action: &str, e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 401 => format!(
            "{action}: 401 Unauthorized: the API server rejected the kubeconfig's credentials ({})",
            s.message
        ),
        kube::Error::Api(s) if s.code == 403 => format!(
            "{action}: 403 Forbidden: {} (the ClusterRole in manifests/base/rbac.yaml grants what kg needs)",
            s.message
        ),
        kube::Error::Api(s) => format!("{action}: {} {}: {}", s.code, s.reason, s.message),
        other => format!("{action}: {}", error_chain(other)),
    }
}

/// How long the watches wait between attempts while the API server cannot be reached: from
/// 0.5 s doubling to 2.5 s, plus a random jitter of up to as much again (so at most 5 s, and a
/// cluster's agents do not all come back in the same instant). kube's default grows to 30 s,
/// so after an outage of a minute kg would learn of the server's return up to 30 s late.
fn watch_backoff() -> watcher::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(500))
        .with_max_delay(std::time::Duration::from_millis(2500))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .into()
}

/// [`describe`] for a watcher's error.
fn describe_watch(resource: &str, e: &watcher::Error) -> String {
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
enum Applied {
    /// A (re)list completed: the objects are now exactly the listed ones.
    Listed,
    /// An object was added, removed or changed in a way `changed` says matters.
    Changed,
    Unchanged,
}

/// Applies one watch event to `objects`; a (re)list collects into `listing` and replaces
/// `objects` at its end. Objects are trimmed on arrival.
fn apply<K: Resource>(
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

/// Whether a watch failed without an answer from the API server (refused, reset, timed out),
/// rather than with one (a 403, a missing resource).
fn unreachable(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => !matches!(e, kube::Error::Api(_)),
        _ => false,
    }
}

/// What to tell an operator when the Peer watch fails: only a 404 means the CRD is missing.
fn peer_watch_hint(e: &watcher::Error) -> &'static str {
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
async fn watch_forever<K>(
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
async fn serves_service_cidrs(client: &Client, state: &Mutex<State>) -> bool {
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
fn service_cidrs_refused(e: &watcher::Error) -> Option<String> {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
            if matches!(s.code, 401 | 403 | 404) =>
        {
            Some(describe_watch(SERVICE_CIDRS.resource, e))
        }
        _ => None,
    }
}

impl KubeBackend {
    /// Starts the Node, Peer and ServiceCIDR watchers, counting failed attempts in `retries`.
    /// The first update (generation 1) comes once all have listed everything; until then the
    /// agent does not reconcile (an empty view must never remove the mesh).
    pub fn start(client: Client, retries: Counter) -> Self {
        let mut backend = Self::unwatched(client);
        backend.state.lock().expect("state lock").link.retries = retries;
        let (state, tx, client) = (
            backend.state.clone(),
            backend.tx.clone(),
            backend.client.clone(),
        );
        let nodes = {
            let (state, tx) = (state.clone(), tx.clone());
            tokio::spawn(watch_forever(Api::all(client.clone()), move |ev| {
                let mut s = state.lock().expect("state lock");
                match s.on_event(&NODES, ev, &tx) {
                    Some(true) => s.connected = true,
                    Some(false) => {}
                    None => s.connected = false,
                }
                // Heartbeats and the connection state reach the agent without a snapshot.
                s.refresh(&tx);
                ControlFlow::Continue(())
            }))
        };
        let peers = {
            let (state, tx) = (state.clone(), tx.clone());
            tokio::spawn(watch_forever(Api::all(client.clone()), move |ev| {
                state.lock().expect("state lock").on_event(&PEERS, ev, &tx);
                ControlFlow::Continue(())
            }))
        };
        let services = tokio::spawn(async move {
            if serves_service_cidrs(&client, &state).await {
                watch_forever(Api::all(client), move |ev| {
                    let mut s = state.lock().expect("state lock");
                    if let Err(e) = &ev
                        && let Some(reason) = service_cidrs_refused(e)
                    {
                        tracing::warn!(
                            error = %reason,
                            "cannot list ServiceCIDRs: service CIDRs come from --service-cidr \
                             only (grant list and watch on servicecidrs.networking.k8s.io, as \
                             manifests/base/rbac.yaml does, and restart kg)"
                        );
                        s.service_cidrs.synced = true;
                        s.publish(&tx);
                        return ControlFlow::Break(());
                    }
                    s.on_event(&SERVICE_CIDRS, ev, &tx);
                    ControlFlow::Continue(())
                })
                .await;
            } else {
                let mut s = state.lock().expect("state lock");
                s.service_cidrs.synced = true;
                s.publish(&tx);
            }
        });
        backend.tasks = vec![nodes, peers, services];
        backend
    }

    /// A backend that watches nothing (yet).
    fn unwatched(client: Client) -> Self {
        KubeBackend {
            client,
            state: Arc::default(),
            tx: Arc::new(watch::channel(Update::default()).0),
            tasks: Vec::new(),
        }
    }
}

/// The merge patch that sets or removes annotations.
pub fn annotation_patch(annotations: &Annotations) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = annotations
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_ref().map_or(serde_json::Value::Null, |v| {
                    serde_json::Value::String(v.clone())
                }),
            )
        })
        .collect();
    serde_json::json!({ "metadata": { "annotations": map } })
}

impl Backend for KubeBackend {
    fn updates(&self) -> watch::Receiver<Update> {
        self.tx.subscribe()
    }

    /// A patch that does not reach the API server also marks the backend disconnected (until
    /// the Node watch delivers again): a watch to an unreachable server may take minutes to
    /// fail, and no heartbeat arrives meanwhile.
    fn publish<'a>(
        &'a self,
        node: &'a str,
        annotations: &'a Annotations,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        async move {
            if annotations.is_empty() {
                return Ok(false);
            }
            let api: Api<KubeNode> = Api::all(self.client.clone());
            api.patch(
                node,
                &PatchParams::default(),
                &Patch::Merge(annotation_patch(annotations)),
            )
            .await
            .map_err(|e| {
                let error = describe(&format!("patching node {node}"), &e);
                if !matches!(e, kube::Error::Api(_)) {
                    let mut s = self.state.lock().expect("state lock");
                    s.link.failed(&error);
                    s.connected = false;
                    s.refresh(&self.tx);
                }
                BackendError::Kube(error)
            })?;
            Ok(true)
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::{Method, Request, Response};
    use kube::client::Body;

    use super::*;
    use crate::mesh::annotations::{KEY, LEADER, LOCATION};

    fn node(annotations: &[(&str, &str)], ready: &str, heartbeat: &str) -> KubeNode {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": "a", "resourceVersion": "1",
                "labels": {"topology.kubernetes.io/region": "eu"},
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
                "managedFields": [{"manager": "kubelet", "operation": "Update"}],
            },
            "spec": {"podCIDR": "10.2.1.0/24"},
            "status": {
                "conditions": [
                    {"type": "Ready", "status": ready, "lastHeartbeatTime": heartbeat},
                    {"type": "MemoryPressure", "status": "False", "lastHeartbeatTime": heartbeat},
                ],
                "images": [{"names": ["busybox"], "sizeBytes": 1}],
            },
        }))
        .unwrap()
    }

    /// A refused connection is named as such and sends nobody looking for the CRD; only the
    /// server's 404 for the Peer resource does.
    #[test]
    fn watch_failures_say_what_is_wrong() {
        let refused = || {
            kube::Error::Service(Box::new(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "tcp connect error: Connection refused (os error 111)",
            )))
        };
        let e = watcher::Error::InitialListFailed(refused());
        let text = describe_watch("peers.kilo.squat.ai", &e);
        assert!(text.starts_with("listing peers.kilo.squat.ai: "), "{text}");
        assert!(text.contains("Connection refused"), "{text}");
        assert!(!peer_watch_hint(&e).contains("CRD"));
        let e = watcher::Error::WatchFailed(refused());
        assert!(describe_watch("nodes", &e).starts_with("watching nodes: "));
        let missing = kube::core::Status::failure(
            "the server could not find the requested resource",
            "NotFound",
        )
        .with_code(404);
        let e = watcher::Error::InitialListFailed(kube::Error::Api(Box::new(missing)));
        assert!(peer_watch_hint(&e).contains("Peer CRD is not installed"));
        assert!(
            describe_watch("peers.kilo.squat.ai", &e).contains("404 NotFound"),
            "{}",
            describe_watch("peers.kilo.squat.ai", &e)
        );
        let forbidden =
            kube::core::Status::failure("peers is forbidden", "Forbidden").with_code(403);
        let e = watcher::Error::InitialListFailed(kube::Error::Api(Box::new(forbidden)));
        assert!(describe_watch("peers.kilo.squat.ai", &e).contains("ClusterRole"));
        assert!(!peer_watch_hint(&e).contains("CRD"));
    }

    #[test]
    fn heartbeats_are_filtered_and_real_changes_pass() {
        let now = 1_000_000;
        let t = |s: i64| (now - s).to_string();
        let old = trim_node(node(&[(LAST_SEEN, &t(30))], "True", "2026-01-01T00:00:00Z"));
        // Kilo's last-seen refresh and a kubelet heartbeat: filtered.
        let hb = trim_node(node(&[(LAST_SEEN, &t(0))], "True", "2026-01-01T00:00:10Z"));
        assert!(!node_changed(Some(&old), &hb));
        // An annotation, the Ready condition, a stale node coming back: not filtered.
        let ann = trim_node(node(
            &[(LAST_SEEN, &t(0)), (LEADER, "")],
            "True",
            "2026-01-01T00:00:05Z",
        ));
        assert!(node_changed(Some(&old), &ann));
        let notready = trim_node(node(
            &[(LAST_SEEN, &t(30))],
            "False",
            "2026-01-01T00:00:05Z",
        ));
        assert!(node_changed(Some(&old), &notready));
        // Even a stale heartbeat refreshed: liveness is the agent's, from `Update::last_seen`.
        let stale = trim_node(node(
            &[(LAST_SEEN, &t(600))],
            "True",
            "2026-01-01T00:00:05Z",
        ));
        assert!(!node_changed(Some(&stale), &hb));
        assert!(node_changed(None, &hb));
        // Trimmed: no managed fields, no images, only the Ready condition without heartbeat.
        assert!(old.metadata.managed_fields.is_none());
        let status = old.status.unwrap();
        assert!(status.images.is_none());
        let cs = status.conditions.unwrap();
        assert_eq!(cs.len(), 1);
        assert!(cs[0].last_heartbeat_time.is_none());
    }

    #[tokio::test]
    async fn publish_sends_one_merge_patch_of_the_annotations() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.expect("a request");
            assert_eq!(req.method(), Method::PATCH);
            assert_eq!(req.uri().path(), "/api/v1/nodes/node-a");
            assert_eq!(
                req.headers().get("content-type").unwrap(),
                "application/merge-patch+json"
            );
            let body = req.into_body().collect_bytes().await.unwrap();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(
                body,
                serde_json::json!({"metadata": {"annotations": {
                    KEY: "a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
                    LAST_SEEN: null,
                }}})
            );
            let n = node(&[], "True", "2026-01-01T00:00:05Z");
            send.send_response(
                Response::builder()
                    .body(Body::from(serde_json::to_vec(&n).unwrap()))
                    .unwrap(),
            );
        });
        let backend = KubeBackend::unwatched(Client::new(service, "default"));
        let changes = Annotations::from([
            (
                KEY.to_string(),
                Some("a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".to_string()),
            ),
            (LAST_SEEN.to_string(), None),
        ]);
        assert!(backend.publish("node-a", &changes).await.unwrap());
        assert!(
            !backend
                .publish("node-a", &Annotations::new())
                .await
                .unwrap()
        );
        server.await.unwrap();
    }

    const NETWORKING: &str = "/apis/networking.k8s.io/v1";

    /// The API server's answer for a group version it does not serve.
    fn not_found() -> Response<Body> {
        Response::builder()
            .status(404)
            .body(Body::from(b"404 page not found\n".to_vec()))
            .unwrap()
    }

    fn list(kind: &str, items: serde_json::Value) -> Response<Body> {
        Response::builder()
            .body(Body::from(
                serde_json::to_vec(&serde_json::json!({
                    "apiVersion": "v1", "kind": kind,
                    "metadata": {"resourceVersion": "10"}, "items": items,
                }))
                .unwrap(),
            ))
            .unwrap()
    }

    #[tokio::test]
    async fn watchers_list_then_watch_and_filter_heartbeats() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let backend = KubeBackend::start(Client::new(service, "default"), Counter::default());
        let mut rx = backend.updates();
        assert_eq!(rx.borrow().generation, 0, "nothing before every list");
        let mut node_watch = None;
        let mut lists = 0;
        while lists < 3 || node_watch.is_none() {
            let (req, send) = handle.next_request().await.expect("a request");
            assert_eq!(req.method(), Method::GET);
            let path = req.uri().path().to_string();
            let query = req.uri().query().unwrap_or_default().to_string();
            let watching = query.contains("watch=true");
            match (path.as_str(), watching) {
                ("/api/v1/nodes", false) => {
                    lists += 1;
                    let n = node(&[(LAST_SEEN, "1")], "True", "2026-01-01T00:00:05Z");
                    send.send_response(list("NodeList", serde_json::json!([n])));
                }
                ("/apis/kilo.squat.ai/v1alpha1/peers", false) => {
                    lists += 1;
                    send.send_response(list("PeerList", serde_json::json!([])));
                }
                ("/api/v1/nodes", true) => node_watch = Some(send),
                ("/apis/kilo.squat.ai/v1alpha1/peers", true) => {
                    std::mem::forget(send); // never answers: the watch stays open
                }
                (NETWORKING, false) => {
                    lists += 1;
                    send.send_response(not_found());
                }
                other => panic!("unexpected request {other:?} ?{query}"),
            }
        }
        rx.changed().await.unwrap();
        let first = rx.borrow_and_update().clone();
        assert_eq!(first.generation, 1);
        assert!(first.snapshot.nodes.contains_key("a"));
        // A watch stream: a heartbeat-only update, then a real change.
        let hb = node(&[(LAST_SEEN, "1")], "True", "2026-01-01T00:00:20Z");
        let real = node(
            &[(LAST_SEEN, "1"), (LOCATION, "b")],
            "True",
            "2026-01-01T00:00:20Z",
        );
        let mut lines = Vec::new();
        for n in [hb, real] {
            lines.extend(
                serde_json::to_vec(&serde_json::json!({"type": "MODIFIED", "object": n})).unwrap(),
            );
            lines.push(b'\n');
        }
        node_watch
            .unwrap()
            .send_response(Response::builder().body(Body::from(lines)).unwrap());
        rx.changed().await.unwrap();
        let second = rx.borrow_and_update().clone();
        assert_eq!(
            second.generation, 2,
            "the heartbeat must not have produced an update"
        );
        assert_eq!(
            second.snapshot.nodes["a"]
                .metadata
                .annotations
                .as_ref()
                .unwrap()[LOCATION],
            "b"
        );
    }

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn service_cidr(
        name: &str,
        cidrs: &[&str],
        ready: Option<&str>,
        deleting: bool,
    ) -> serde_json::Value {
        let mut o = serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": name, "resourceVersion": "5"},
            "spec": {"cidrs": cidrs},
        });
        if let Some(status) = ready {
            o["status"] = serde_json::json!({"conditions": [{
                "type": "Ready", "status": status, "reason": "", "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }]});
        }
        if deleting {
            o["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        }
        o
    }

    /// Serves one node, no Peers, the discovery document of `networking.k8s.io/v1` with
    /// ServiceCIDRs in it, and `servicecidrs`: the list `answer`, then one watch answered with
    /// `events` once `release` is notified. Records every request as `METHOD path[?watch]`.
    async fn serve_service_cidrs(
        mut handle: Handle,
        answer: Response<Body>,
        mut events: Vec<serde_json::Value>,
        release: Arc<tokio::sync::Notify>,
        requests: Arc<Mutex<Vec<String>>>,
    ) {
        let mut answer = Some(answer);
        while let Some((req, send)) = handle.next_request().await {
            let path = req.uri().path().to_string();
            let watching = req.uri().query().unwrap_or_default().contains("watch=true");
            requests.lock().unwrap().push(format!(
                "{} {path}{}",
                req.method(),
                if watching { "?watch" } else { "" }
            ));
            match (path.as_str(), watching) {
                ("/api/v1/nodes", false) => send.send_response(list(
                    "NodeList",
                    serde_json::json!([node(&[], "True", "2026-01-01T00:00:05Z")]),
                )),
                ("/apis/kilo.squat.ai/v1alpha1/peers", false) => {
                    send.send_response(list("PeerList", serde_json::json!([])))
                }
                (NETWORKING, false) => send.send_response(json_response(&serde_json::json!({
                    "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "networking.k8s.io/v1",
                    "resources": [
                        {"name": "networkpolicies", "singularName": "networkpolicy", "namespaced": true,
                         "kind": "NetworkPolicy", "verbs": ["list", "watch"]},
                        {"name": "servicecidrs", "singularName": "servicecidr", "namespaced": false,
                         "kind": "ServiceCIDR", "verbs": ["list", "watch"]},
                    ],
                }))),
                ("/apis/networking.k8s.io/v1/servicecidrs", false) => {
                    send.send_response(answer.take().expect("one list"))
                }
                ("/apis/networking.k8s.io/v1/servicecidrs", true) if !events.is_empty() => {
                    let mut body = Vec::new();
                    for e in events.drain(..) {
                        body.extend(serde_json::to_vec(&e).unwrap());
                        body.push(b'\n');
                    }
                    let release = release.clone();
                    tokio::spawn(async move {
                        release.notified().await;
                        send.send_response(Response::builder().body(Body::from(body)).unwrap());
                    });
                }
                // Open watches that never deliver.
                (_, true) => std::mem::forget(send),
                other => panic!("unexpected request {other:?}"),
            }
        }
    }

    /// Where the API server serves ServiceCIDRs, the snapshot carries the ranges of those that
    /// are Ready or being deleted, follows their changes, and names a value that is no CIDR.
    #[tokio::test]
    async fn service_cidrs_are_learned_from_the_api() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let items = serde_json::json!([
            service_cidr(
                "kubernetes",
                &["10.96.0.0/12", "fd00:10:96::/112"],
                Some("True"),
                false
            ),
            // Not Ready yet: no ClusterIP comes from it.
            service_cidr("extra", &["10.100.0.0/16"], None, false),
            // Being deleted while Services still hold addresses from it.
            service_cidr("old", &["10.200.0.0/16"], Some("False"), true),
            service_cidr("typo", &["10.300.0.0/16"], Some("True"), false),
        ]);
        let mut ready = service_cidr("extra", &["10.100.0.0/16"], Some("True"), false);
        ready["metadata"]["resourceVersion"] = "11".into();
        let mut gone = service_cidr("old", &["10.200.0.0/16"], Some("False"), true);
        gone["metadata"]["resourceVersion"] = "12".into();
        let events = vec![
            serde_json::json!({"type": "MODIFIED", "object": ready}),
            serde_json::json!({"type": "DELETED", "object": gone}),
        ];
        let release = Arc::new(tokio::sync::Notify::new());
        tokio::spawn(serve_service_cidrs(
            handle,
            list("ServiceCIDRList", items),
            events,
            release.clone(),
            requests.clone(),
        ));
        let retries = Counter::default();
        let backend = KubeBackend::start(Client::new(service, "default"), retries.clone());
        let mut rx = backend.updates();
        let first = rx.wait_for(|u| u.generation > 0).await.unwrap().clone();
        let nets = |v: &[&str]| v.iter().map(|c| c.parse().unwrap()).collect::<Vec<IpNet>>();
        assert_eq!(
            first.snapshot.service_cidrs,
            nets(&["10.96.0.0/12", "fd00:10:96::/112", "10.200.0.0/16"]),
            "Ready or being deleted, in the order of their names"
        );
        assert_eq!(
            first.errors,
            ["ServiceCIDR typo: spec.cidrs[0]: invalid CIDR \"10.300.0.0/16\""]
        );
        release.notify_one();
        let last = rx
            .wait_for(|u| {
                u.snapshot
                    .service_cidrs
                    .contains(&"10.100.0.0/16".parse().unwrap())
                    && !u
                        .snapshot
                        .service_cidrs
                        .contains(&"10.200.0.0/16".parse().unwrap())
            })
            .await
            .unwrap()
            .clone();
        assert_eq!(
            last.snapshot.service_cidrs,
            nets(&["10.100.0.0/16", "10.96.0.0/12", "fd00:10:96::/112"])
        );
        assert_eq!(last.snapshot.nodes.len(), 1);
        let mut seen = requests.lock().unwrap().clone();
        seen.sort();
        seen.dedup();
        assert_eq!(
            seen,
            [
                "GET /api/v1/nodes",
                "GET /api/v1/nodes?watch",
                "GET /apis/kilo.squat.ai/v1alpha1/peers",
                "GET /apis/kilo.squat.ai/v1alpha1/peers?watch",
                "GET /apis/networking.k8s.io/v1",
                "GET /apis/networking.k8s.io/v1/servicecidrs",
                "GET /apis/networking.k8s.io/v1/servicecidrs?watch",
            ]
        );
        let discoveries = requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.ends_with(NETWORKING))
            .count();
        assert_eq!(discoveries, 1, "asked once");
        assert_eq!(retries.get(), 0);
    }

    /// An old ClusterRole without `servicecidrs`: the mesh goes on with none learned, and the
    /// refused list is not asked again.
    #[tokio::test(start_paused = true)]
    async fn a_refused_service_cidr_list_leaves_none_and_stops() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let forbidden = Response::builder()
            .status(403)
            .body(Body::from(
                serde_json::to_vec(&serde_json::json!({
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": "servicecidrs.networking.k8s.io is forbidden", "reason": "Forbidden", "code": 403,
                }))
                .unwrap(),
            ))
            .unwrap();
        tokio::spawn(serve_service_cidrs(
            handle,
            forbidden,
            Vec::new(),
            Arc::default(),
            requests.clone(),
        ));
        let backend = KubeBackend::start(Client::new(service, "default"), Counter::default());
        let mut rx = backend.updates();
        let first = rx.wait_for(|u| u.generation > 0).await.unwrap().clone();
        assert!(first.snapshot.service_cidrs.is_empty());
        assert_eq!(first.snapshot.nodes.len(), 1);
        // Longer than the longest backoff: no second list.
        tokio::time::sleep(Duration::from_secs(6)).await;
        let lists = requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.ends_with("/servicecidrs") || r.ends_with("/servicecidrs?watch"))
            .count();
        assert_eq!(lists, 1, "{:?}", requests.lock().unwrap());
    }

    fn json_response(v: &serde_json::Value) -> Response<Body> {
        Response::builder()
            .body(Body::from(serde_json::to_vec(v).unwrap()))
            .unwrap()
    }
}
