//! Liveness: which nodes the agent counts as alive, judged only on what the backend delivered.
//!
//! With a check-in period ([`Policy::LastSeen`]) a node is alive while its latest
//! `kilo.squat.ai/last-seen` heartbeat is younger than the window (2 × the period, Kilo's rule).
//! The heartbeat is written in whole seconds, so it vouches for the node until the end of the
//! second it names plus the window. The backend hands over every heartbeat it receives, also
//! those that change nothing else; the agent records them here without planning and re-plans only
//! when a node crosses the boundary, at [`Tracker::next_expiry`] or when a heartbeat revives one.
//!
//! While the backend is disconnected (watch failing, directory unreadable) no node expires for
//! lack of heartbeats it could not deliver: nodes alive when it lost its view stay alive, and once
//! it is back they get the window again from that moment. The local node is never judged dead.
//!
//! With `--check-in-period=0` ([`Policy::NodeReady`]) a node is alive unless its `Ready` condition
//! says otherwise; nothing expires on a timer.
//!
//! Pure: the caller passes the time, in unix milliseconds.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::Duration,
};

use crate::mesh::KubeNode;

/// How a node's liveness is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Kilo's: a `kilo.squat.ai/last-seen` heartbeat within `window_ms` (Kilo: 60 s = 2 × its
    /// 30 s check-in). Needed while Kilo agents remain in the cluster.
    LastSeen { window_ms: i64 },
    /// Kubernetes' own: the Node's `Ready` condition (kept current by the node lifecycle
    /// controller from the kubelet's Lease in `kube-node-lease`); a node without status (the
    /// file backend) is alive. No per-agent heartbeat traffic at all.
    NodeReady,
}

impl Policy {
    /// `--check-in-period`: a period keeps Kilo's heartbeat (window = 2 × period), none selects
    /// [`Policy::NodeReady`].
    pub fn from_check_in(period: Option<Duration>) -> Self {
        match period {
            Some(p) => Policy::LastSeen {
                window_ms: 2 * i64::try_from(p.as_millis()).unwrap_or(i64::MAX / 4),
            },
            None => Policy::NodeReady,
        }
    }
}

/// Whether the node's `Ready` condition, if it has one, is `True`.
pub fn node_ready(node: &KubeNode) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_none_or(|c| c.status == "True")
}

/// The latest heartbeats and the backend's connection, as the agent last saw them.
#[derive(Debug, Clone)]
pub struct Tracker {
    policy: Policy,
    local: String,
    /// The latest `last-seen` of each node, unix seconds.
    last_seen: Arc<BTreeMap<String, i64>>,
    /// Set while the backend is disconnected: when (unix ms) it lost its view.
    lost_at: Option<i64>,
    /// Nodes alive when the backend lost its view, vouched for until this instant (unix ms).
    grace: BTreeMap<String, i64>,
}

impl Tracker {
    pub fn new(policy: Policy, local: impl Into<String>) -> Self {
        Tracker {
            policy,
            local: local.into(),
            last_seen: Arc::default(),
            lost_at: None,
            grace: BTreeMap::new(),
        }
    }

    /// Records what the backend delivered, seen at `now`: its latest heartbeats and whether it
    /// is connected. Returns the connection state when it changed.
    pub fn observe(
        &mut self,
        last_seen: &Arc<BTreeMap<String, i64>>,
        connected: bool,
        now: i64,
    ) -> Option<bool> {
        let changed = match (connected, self.lost_at) {
            (false, None) => {
                self.lost_at = Some(now);
                Some(false)
            }
            (true, Some(lost)) => {
                let window = self.window();
                self.grace = self
                    .last_seen
                    .keys()
                    .filter(|n| self.vouched_until(n).is_some_and(|d| d > lost))
                    .map(|n| (n.clone(), now.saturating_add(window)))
                    .collect();
                self.lost_at = None;
                Some(true)
            }
            _ => None,
        };
        if !Arc::ptr_eq(&self.last_seen, last_seen) {
            self.last_seen = last_seen.clone();
            self.grace.retain(|n, _| self.last_seen.contains_key(n));
        }
        changed
    }

    fn window(&self) -> i64 {
        match self.policy {
            Policy::LastSeen { window_ms } => window_ms,
            Policy::NodeReady => 0,
        }
    }

    /// Until when (unix ms) the node's heartbeats, or a grace after a reconnect, vouch for it.
    fn vouched_until(&self, node: &str) -> Option<i64> {
        let heartbeat = self
            .last_seen
            .get(node)
            .map(|s| s.saturating_add(1).saturating_mul(1000) + self.window());
        heartbeat.max(self.grace.get(node).copied())
    }

    /// Whether `name` counts as alive at `now`.
    pub fn alive(&self, name: &str, node: &KubeNode, now: i64) -> bool {
        if name == self.local {
            return true;
        }
        match self.policy {
            Policy::NodeReady => node_ready(node),
            Policy::LastSeen { .. } => self
                .vouched_until(name)
                .is_some_and(|d| d > now || self.lost_at.is_some_and(|lost| d > lost)),
        }
    }

    /// The nodes of `nodes` that are not alive at `now`.
    pub fn down(&self, nodes: &BTreeMap<String, KubeNode>, now: i64) -> BTreeSet<String> {
        nodes
            .iter()
            .filter(|(name, n)| !self.alive(name, n, now))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The earliest instant (unix ms) after `now` at which a node alive now would expire; `None`
    /// when nothing can (no heartbeats, [`Policy::NodeReady`], or the backend is disconnected).
    pub fn next_expiry(&self, now: i64) -> Option<i64> {
        if self.lost_at.is_some() || self.policy == Policy::NodeReady {
            return None;
        }
        self.last_seen
            .keys()
            .filter(|n| **n != self.local)
            .filter_map(|n| self.vouched_until(n))
            .filter(|d| *d > now)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(ready: Option<&str>) -> KubeNode {
        let mut v = serde_json::json!({"metadata": {"name": "a"}});
        if let Some(r) = ready {
            v["status"] = serde_json::json!({"conditions": [{"type": "Ready", "status": r}]});
        }
        serde_json::from_value(v).unwrap()
    }

    fn beats(b: &[(&str, i64)]) -> Arc<BTreeMap<String, i64>> {
        Arc::new(b.iter().map(|(n, t)| (n.to_string(), *t)).collect())
    }

    #[test]
    fn heartbeats_vouch_until_the_end_of_their_second_plus_the_window() {
        let policy = Policy::from_check_in(Some(Duration::from_secs(30)));
        assert_eq!(policy, Policy::LastSeen { window_ms: 60_000 });
        let mut t = Tracker::new(policy, "me");
        let n = node(None);
        t.observe(&beats(&[("a", 1000), ("b", 1010)]), true, 1_000_500);
        assert!(t.alive("a", &n, 1_060_999));
        assert!(!t.alive("a", &n, 1_061_000));
        assert!(!t.alive("c", &n, 1_000_500), "no heartbeat at all");
        assert!(t.alive("me", &n, 9_999_999_999), "never itself");
        assert_eq!(t.next_expiry(1_000_500), Some(1_061_000));
        assert_eq!(t.next_expiry(1_061_000), Some(1_071_000));
        assert_eq!(t.next_expiry(1_071_000), None);
        // A heartbeat moves the expiry.
        t.observe(&beats(&[("a", 1030), ("b", 1010)]), true, 1_031_000);
        assert_eq!(t.next_expiry(1_031_000), Some(1_071_000));
    }

    #[test]
    fn nothing_expires_while_disconnected_and_the_window_restarts_after() {
        let mut t = Tracker::new(Policy::LastSeen { window_ms: 2000 }, "me");
        let n = node(None);
        let hb = beats(&[("a", 100), ("dead", 90)]);
        t.observe(&hb, true, 101_000);
        assert!(!t.alive("dead", &n, 101_000));
        assert_eq!(t.observe(&hb, false, 102_000), Some(false));
        assert_eq!(t.next_expiry(102_000), None);
        assert!(t.alive("a", &n, 500_000), "alive when the view was lost");
        assert!(!t.alive("dead", &n, 500_000), "already dead then");
        assert_eq!(t.observe(&hb, true, 500_000), Some(true));
        assert!(t.alive("a", &n, 501_999));
        assert_eq!(t.next_expiry(500_000), Some(502_000));
        assert!(!t.alive("a", &n, 502_000));
        assert!(!t.alive("dead", &n, 500_000));
        // A fresh heartbeat after the reconnect takes over when it vouches for longer.
        t.observe(&beats(&[("a", 501)]), true, 501_500);
        assert_eq!(t.next_expiry(501_500), Some(504_000));
    }

    #[test]
    fn node_ready_rule_reads_the_condition_and_never_expires() {
        let mut t = Tracker::new(Policy::from_check_in(None), "me");
        t.observe(&beats(&[("a", 1)]), true, 1_000_000);
        assert!(t.alive("a", &node(Some("True")), 1_000_000));
        assert!(!t.alive("a", &node(Some("Unknown")), 1_000_000));
        assert!(t.alive("a", &node(None), 1_000_000), "no status = alive");
        assert!(t.alive("me", &node(Some("False")), 1_000_000));
        assert_eq!(t.next_expiry(0), None);
    }
}
