//! What the agent publishes about its own node: the annotations it wants ([`Local`]), the
//! difference from what the backend shows ([`annotation_changes`]), the `last-seen` check-in
//! (with kg's copy, which tells kg's nodes from Kilo's), and the `cni-compatibility-ip` probe.
use std::{collections::BTreeMap, net::SocketAddr, sync::Arc};

use ipnet::IpNet;

use super::{Agent, CniProbe, PlanOutcome, Planner};
use crate::{
    backend::{Annotations, BackendError},
    datapath::DatapathOps,
    mesh::{Key, Snapshot, annotations},
    reconcile::{Kernel, wireguard::WireGuard},
};

/// What the agent publishes about its own node.
#[derive(Debug, Clone)]
pub struct Local {
    pub hostname: String,
    pub public_key: Key,
    pub endpoint: Option<SocketAddr>,
    pub internal_ip: Option<IpNet>,
    pub granularity: String,
    /// `--compatibility=cilium`: the IPv4 address of `cilium_host`, published as
    /// `kilo.squat.ai/cni-compatibility-ip` (empty otherwise, as Kilo publishes it).
    pub cni_compatibility_ip: Option<IpNet>,
}

impl Local {
    /// The annotations this node should carry (without `last-seen`).
    pub fn annotations(&self, wireguard_ip: Option<IpNet>) -> BTreeMap<String, String> {
        BTreeMap::from([
            (annotations::KEY.into(), self.public_key.to_string()),
            (
                annotations::ENDPOINT.into(),
                self.endpoint.map(|e| e.to_string()).unwrap_or_default(),
            ),
            (
                annotations::INTERNAL_IP.into(),
                self.internal_ip.map(|i| i.to_string()).unwrap_or_default(),
            ),
            (
                annotations::WIREGUARD_IP.into(),
                wireguard_ip.map(|i| i.to_string()).unwrap_or_default(),
            ),
            (annotations::GRANULARITY.into(), self.granularity.clone()),
            (
                annotations::CNI_COMPATIBILITY_IP.into(),
                self.cni_compatibility_ip
                    .map(|i| i.to_string())
                    .unwrap_or_default(),
            ),
        ])
    }
}

/// The annotations to publish so that `current` carries `want`. Pure.
pub fn annotation_changes(
    current: Option<&BTreeMap<String, String>>,
    want: &BTreeMap<String, String>,
) -> Annotations {
    want.iter()
        .filter(|(k, v)| current.and_then(|c| c.get(*k)) != Some(*v))
        .map(|(k, v)| (k.clone(), Some(v.clone())))
        .collect()
}

/// Kilo's format for `kilo.squat.ai/discovered-endpoints`: Go's JSON of
/// `map[string]*net.UDPAddr`, keyed by public key.
pub fn discovered_endpoints_json(endpoints: &BTreeMap<&Key, &SocketAddr>) -> String {
    let map: serde_json::Map<String, serde_json::Value> = endpoints
        .iter()
        .map(|(k, a)| {
            (
                k.to_string(),
                serde_json::json!({"IP": a.ip().to_string(), "Port": a.port(), "Zone": ""}),
            )
        })
        .collect();
    serde_json::Value::Object(map).to_string()
}

impl<P: Planner, K: Kernel, W: WireGuard, D: DatapathOps> Agent<P, K, W, D> {
    /// Re-reads the local node's `cni-compatibility-ip` with `probe` at every pass, as Kilo
    /// re-reads `cilium_host` whenever it handles its own node: a new address is published
    /// and planned with at once.
    pub fn with_cni_compatibility_probe(mut self, probe: CniProbe) -> Self {
        self.cni_probe = Some(probe);
        self
    }

    pub(super) async fn refresh_cni_compatibility_ip(&mut self) {
        let Some(probe) = self.cni_probe.as_mut() else {
            return;
        };
        match probe().await {
            Ok(ip) if ip != self.local.cni_compatibility_ip => {
                tracing::info!(old = ?self.local.cni_compatibility_ip, new = ?ip, "cni-compatibility-ip changed");
                self.local.cni_compatibility_ip = ip;
            }
            Ok(_) => {}
            Err(e) => {
                self.metrics.error("local");
                tracing::warn!(error = %e, "reading the cni-compatibility-ip failed; keeping the last one");
            }
        }
    }

    /// `snapshot` as it will be once this node's own annotations are published (all but the
    /// WireGuard IP, which the plan decides): planned so, this node is ready (its key,
    /// endpoint, internal IP) from the first pass, and the first publish already carries its
    /// WireGuard IP instead of a second patch after the first one comes back.
    pub(super) fn with_own_annotations(&self, snapshot: Arc<Snapshot>) -> Arc<Snapshot> {
        let Some(node) = snapshot.nodes.get(&self.local.hostname) else {
            return snapshot;
        };
        let mut want = self.local.annotations(None);
        want.remove(annotations::WIREGUARD_IP);
        let current = node.metadata.annotations.as_ref();
        if annotation_changes(current, &want).is_empty() {
            return snapshot;
        }
        let mut node = node.clone();
        node.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .extend(want);
        let mut snapshot = (*snapshot).clone();
        snapshot.nodes.insert(self.local.hostname.clone(), node);
        Arc::new(snapshot)
    }

    /// Publishes the local annotations that differ from what the backend shows. Without a plan
    /// (`planned` false) the WireGuard IP is left as it is.
    pub(super) async fn publish(
        &mut self,
        snapshot: &Snapshot,
        outcome: &PlanOutcome,
        planned: bool,
        endpoints: &BTreeMap<Key, SocketAddr>,
    ) {
        let mut want = self.local.annotations(outcome.wireguard_ip);
        if !planned {
            want.remove(annotations::WIREGUARD_IP);
        }
        let discovered: BTreeMap<&Key, &SocketAddr> = endpoints
            .iter()
            .filter(|(k, _)| outcome.nat_keys.contains(k))
            .collect();
        if !discovered.is_empty() {
            want.insert(
                annotations::DISCOVERED_ENDPOINTS.into(),
                discovered_endpoints_json(&discovered),
            );
        }
        if self.settings.check_in.is_none() {
            want.insert(annotations::KG_LAST_SEEN.into(), "-".into());
        } else if self.last_seen_due {
            want.extend(self.heartbeat());
        }
        let current = snapshot
            .nodes
            .get(&self.local.hostname)
            .and_then(|n| n.metadata.annotations.as_ref());
        let changes = annotation_changes(current, &want);
        if changes.is_empty() {
            self.last_seen_due = false;
            return;
        }
        match self.backend.publish(&self.local.hostname, &changes).await {
            Ok(wrote) => {
                self.last_seen_due = false;
                if wrote {
                    self.stats.publishes += 1;
                    tracing::debug!(changed = changes.len(), "published local annotations");
                }
            }
            Err(e) => {
                self.publish_failed = true;
                self.metrics.error("local");
                self.log_publish_failure("local annotations", &e);
            }
        }
    }

    /// A warning, or a debug line while the backend is disconnected (it reports the outage).
    fn log_publish_failure(&self, what: &str, e: &BackendError) {
        if self.backend.updates().borrow().connected {
            tracing::warn!(error = %e, "publishing {what} failed");
        } else {
            tracing::debug!(error = %e, "publishing {what} failed");
        }
    }

    /// `last-seen` now, and kg's copy of it in the same patch: the mark of a node that runs kg
    /// ([`annotations::runs_kg`]).
    fn heartbeat(&self) -> BTreeMap<String, String> {
        let now = (self.settings.clock.now_ms() / 1000).to_string();
        BTreeMap::from([
            (annotations::LAST_SEEN.into(), now.clone()),
            (annotations::KG_LAST_SEEN.into(), now),
        ])
    }

    /// A check-in on the way out (the mesh stays up): a restart, such as a rolling update, then
    /// has a whole heartbeat expiry to come back in before the others leave this node out.
    /// Bounded like the clean-up's publish, so an unreachable backend cannot hold the process.
    pub(super) async fn last_check_in(&mut self) {
        if self.settings.check_in.is_none() {
            return;
        }
        if tokio::time::timeout(super::ANNOTATION_REMOVAL_TIMEOUT, self.check_in())
            .await
            .is_err()
        {
            tracing::debug!("no last check-in: the backend did not answer");
        }
    }

    /// The check-in: refreshes `last-seen` alone (no plan, no reconcile). Returns whether a
    /// full pass is needed instead, because the local node is not published yet.
    pub(super) async fn check_in(&mut self) -> bool {
        let published = self
            .backend
            .updates()
            .borrow()
            .snapshot
            .nodes
            .contains_key(&self.local.hostname);
        if !published {
            self.last_seen_due = true;
            return true;
        }
        let changes = self
            .heartbeat()
            .into_iter()
            .map(|(k, v)| (k, Some(v)))
            .collect();
        match self.backend.publish(&self.local.hostname, &changes).await {
            Ok(wrote) => self.stats.publishes += u64::from(wrote),
            Err(e) => {
                self.metrics.error("checkin");
                self.log_publish_failure("the heartbeat", &e);
            }
        }
        false
    }
}
