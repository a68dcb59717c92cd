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

use crate::mesh::{Snapshot, annotations::LAST_SEEN};

/// Annotations to publish on the local node: `Some(v)` sets, `None` removes.
pub type Annotations = BTreeMap<String, Option<String>>;

/// What a backend has seen.
#[derive(Debug, Clone, Default)]
pub struct Update {
    pub snapshot: Arc<Snapshot>,
    /// Objects that could not be read, each naming the object (or file) and the problem.
    pub errors: Vec<String>,
    /// Bumped on every change of `snapshot`; 0 = nothing received yet.
    pub generation: u64,
    /// The latest `kilo.squat.ai/last-seen` of every node (unix seconds). Kept current also when
    /// only heartbeats changed, which leaves `generation` and `snapshot` as they were: recording
    /// a heartbeat costs no plan.
    pub last_seen: Arc<BTreeMap<String, i64>>,
    /// Whether the backend currently receives changes (its watch works, its directory is
    /// readable). While it does not, heartbeats cannot arrive and no node expires.
    pub connected: bool,
}

/// The `kilo.squat.ai/last-seen` of each node that has a valid one.
pub fn last_seen_of(nodes: &BTreeMap<String, crate::mesh::KubeNode>) -> BTreeMap<String, i64> {
    nodes
        .iter()
        .filter_map(|(name, n)| {
            let t = n
                .metadata
                .annotations
                .as_ref()?
                .get(LAST_SEEN)?
                .parse()
                .ok()?;
            Some((name.clone(), t))
        })
        .collect()
}

/// Sets `u`'s heartbeats and connection state; returns whether either changed (for
/// `watch::Sender::send_if_modified`, which then wakes the agent without a new generation).
pub fn refresh(u: &mut Update, last_seen: BTreeMap<String, i64>, connected: bool) -> bool {
    let changed = *u.last_seen != last_seen || u.connected != connected;
    if changed {
        u.last_seen = Arc::new(last_seen);
        u.connected = connected;
    }
    changed
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

/// Whether `new` differs from `old` in a way the mesh cares about: a node added, removed or
/// changed beyond its `last-seen` heartbeat (see [`kubernetes::node_changed`]), any Peer
/// spec, the service CIDRs, or which nodes run kg. Heartbeats travel in [`Update::last_seen`] instead.
pub fn snapshot_changed(old: &Snapshot, new: &Snapshot) -> bool {
    old.nodes.len() != new.nodes.len()
        || new
            .nodes
            .iter()
            .any(|(name, n)| kubernetes::node_changed(old.nodes.get(name), n))
        || old.peers.len() != new.peers.len()
        || new
            .peers
            .iter()
            .any(|(name, p)| old.peers.get(name).map(|o| &o.spec) != Some(&p.spec))
        || old.service_cidrs != new.service_cidrs
        || old.kg_nodes != new.kg_nodes
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
