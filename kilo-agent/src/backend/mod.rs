//! Backends: where nodes and peers come from (Kubernetes, or a local directory) and where the
//! local node publishes its own annotations.
//!
//! A backend delivers the raw objects it has seen as a [`Snapshot`] through a `watch` channel:
//! a slow consumer only ever sees the latest state, so bursts coalesce by construction. Objects
//! it could not read are reported in [`Update::errors`] (and logged) and left out; one bad object
//! never hides the others.
pub mod file;
pub mod kubernetes;

use std::{collections::BTreeMap, sync::Arc};

use futures::future::BoxFuture;
use tokio::sync::watch;

use crate::mesh::Snapshot;

/// Annotations to publish on the local node: `Some(v)` sets, `None` removes.
pub type Annotations = BTreeMap<String, Option<String>>;

/// What a backend has seen.
#[derive(Debug, Clone, Default)]
pub struct Update {
    pub snapshot: Arc<Snapshot>,
    /// Objects that could not be read, each naming the object (or file) and the problem.
    pub errors: Vec<String>,
    /// Bumped on every change; 0 = nothing received yet.
    pub generation: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("watching {path}: {message}")]
    Watch { path: String, message: String },
    #[error("kubernetes: {0}")]
    Kube(String),
}

impl BackendError {
    /// The `event` label of `kilo_errors_total` for this error.
    pub fn metric_label(&self) -> &'static str {
        match self {
            BackendError::Io { .. } | BackendError::Parse { .. } => "backend",
            BackendError::Watch { .. } => "watch",
            BackendError::Kube(_) => "kubernetes",
        }
    }
}

/// A source of nodes and peers.
pub trait Backend: Send + Sync {
    /// The latest objects; `changed()` fires whenever they change.
    fn updates(&self) -> watch::Receiver<Update>;
    /// Sets or removes annotations on the local node `node`. Returns whether anything was
    /// written (publishing what is already there writes nothing).
    fn publish<'a>(
        &'a self,
        node: &'a str,
        annotations: &'a Annotations,
    ) -> BoxFuture<'a, Result<bool, BackendError>>;
}

/// How a node's liveness is judged (for the planner's readiness check).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Kilo's: `kilo.squat.ai/last-seen` within `window` seconds (Kilo: 60 = 2 × 30 s check-in).
    /// Needed while Kilo agents remain in the cluster.
    LastSeen { window: i64 },
    /// Kubernetes' own: the Node's `Ready` condition (kept current by the node lifecycle
    /// controller from the kubelet's Lease in `kube-node-lease`); a node without status (the
    /// file backend) is alive. No per-agent heartbeat traffic at all.
    NodeReady,
}

impl Liveness {
    /// `--check-in-period`: a period keeps Kilo's heartbeat (window = 2 × period), 0 selects
    /// [`Liveness::NodeReady`].
    pub fn from_check_in(period: Option<std::time::Duration>) -> Self {
        match period {
            Some(p) => Liveness::LastSeen {
                window: 2 * p.as_secs() as i64,
            },
            None => Liveness::NodeReady,
        }
    }

    /// Whether the node counts as alive at `now` (unix seconds).
    pub fn alive(self, node: &crate::mesh::KubeNode, now: i64) -> bool {
        match self {
            Liveness::LastSeen { window } => node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("kilo.squat.ai/last-seen"))
                .and_then(|v| v.parse::<i64>().ok())
                .is_some_and(|t| now - t < window),
            Liveness::NodeReady => node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
                .is_none_or(|c| c.status == "True"),
        }
    }
}

/// Whether `new` differs from `old` in a way the mesh cares about: a node added, removed or
/// changed beyond its `last-seen` heartbeat (see [`kubernetes::node_changed`]), or any Peer
/// spec. `now` is in unix seconds.
pub fn snapshot_changed(old: &Snapshot, new: &Snapshot, now: i64) -> bool {
    old.nodes.len() != new.nodes.len()
        || new
            .nodes
            .iter()
            .any(|(name, n)| kubernetes::node_changed(old.nodes.get(name), n, now))
        || old.peers.len() != new.peers.len()
        || new
            .peers
            .iter()
            .any(|(name, p)| old.peers.get(name).map(|o| &o.spec) != Some(&p.spec))
}

/// Applies `changes` to `current`; returns whether anything changed.
pub fn apply_annotations(current: &mut BTreeMap<String, String>, changes: &Annotations) -> bool {
    let mut changed = false;
    for (k, v) in changes {
        match v {
            Some(v) => {
                if current.get(k) != Some(v) {
                    current.insert(k.clone(), v.clone());
                    changed = true;
                }
            }
            None => changed |= current.remove(k).is_some(),
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(last_seen: Option<&str>, ready: Option<&str>) -> crate::mesh::KubeNode {
        let mut v = serde_json::json!({"metadata": {"name": "a", "annotations": {}}});
        if let Some(t) = last_seen {
            v["metadata"]["annotations"]["kilo.squat.ai/last-seen"] = t.into();
        }
        if let Some(r) = ready {
            v["status"] = serde_json::json!({"conditions": [{"type": "Ready", "status": r}]});
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn liveness_by_last_seen_or_node_ready() {
        let kilo = Liveness::from_check_in(Some(std::time::Duration::from_secs(30)));
        assert_eq!(kilo, Liveness::LastSeen { window: 60 });
        assert!(kilo.alive(&node(Some("1000"), None), 1059));
        assert!(!kilo.alive(&node(Some("1000"), None), 1060));
        assert!(!kilo.alive(&node(None, Some("True")), 1000));
        let k8s = Liveness::from_check_in(None);
        assert!(k8s.alive(&node(None, Some("True")), 1000));
        assert!(!k8s.alive(&node(Some("1000"), Some("Unknown")), 1000));
        assert!(
            k8s.alive(&node(None, None), 1000),
            "no status (file backend) = alive"
        );
    }
}
