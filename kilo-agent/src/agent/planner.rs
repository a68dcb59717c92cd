//! The agent's planner: the pure [`plan_for`] behind the [`Planner`] seam, with the clock and the
//! liveness rule (which nodes count as alive) applied on the way in.
use std::collections::BTreeSet;

use super::{PlanOutcome, Planner, unix_now};
use crate::{
    backend::Liveness,
    mesh::Snapshot,
    plan::{Planned, Settings, plan_for},
};

/// Plans with `settings`, leaving out nodes that `liveness` says are down.
pub fn planner(settings: Settings, liveness: Liveness) -> impl Planner {
    move |snapshot: &Snapshot| {
        let now = unix_now() as i64;
        let down: Vec<&String> = snapshot
            .nodes
            .iter()
            .filter(|(_, n)| !liveness.alive(n, now))
            .map(|(name, _)| name)
            .collect();
        let planned = if down.is_empty() {
            plan_for(snapshot, &settings)
        } else {
            tracing::debug!(?down, "nodes left out as not alive");
            let mut alive = snapshot.clone();
            alive.nodes.retain(|name, _| !down.contains(&name));
            plan_for(&alive, &settings)
        };
        outcome(planned)
    }
}

/// What the agent needs of a [`Planned`].
pub fn outcome(planned: Planned) -> PlanOutcome {
    let topology = planned.topology.as_ref();
    let leader = topology.is_some_and(|t| t.leader);
    let nat_keys: BTreeSet<_> = topology
        .map(|t| {
            let segments = t
                .segments
                .iter()
                .filter(|s| s.persistent_keepalive > 0)
                .map(|s| s.key);
            let peers = t
                .peers
                .iter()
                .filter(|p| p.persistent_keepalive > 0)
                .map(|p| p.public_key);
            segments.chain(peers).collect()
        })
        .unwrap_or_default();
    PlanOutcome {
        wireguard_ip: topology.filter(|t| t.leader).map(|t| t.wireguard_cidr),
        plan: planned.plan,
        errors: planned.errors.iter().map(ToString::to_string).collect(),
        ready_nodes: planned.ready_nodes,
        ready_peers: planned.ready_peers,
        leader,
        nat_keys,
    }
}
