//! The agent's planner: the pure [`plan_for`] behind the [`Planner`] seam. The agent has already
//! left out the nodes it judges not alive ([`super::liveness`]).
use std::collections::BTreeSet;

use super::{PlanOutcome, Planner};
use crate::{
    mesh::Snapshot,
    plan::{PlanError, Planned, Settings, plan_for},
    telemetry::Graph,
};

/// Plans with `settings`.
pub fn planner(settings: Settings) -> impl Planner {
    move |snapshot: &Snapshot| outcome(plan_for(snapshot, &settings))
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
    // The WireGuard peers by name: each segment's leader, each Peer.
    let peer_names = topology
        .map(|t| {
            let segments = t
                .segments
                .iter()
                .map(|s| (s.key, s.leader_name().to_string()));
            let peers = t.peers.iter().map(|p| (p.public_key, p.name.clone()));
            segments.chain(peers).collect()
        })
        .unwrap_or_default();
    PlanOutcome {
        peer_names,
        wireguard_ip: topology.filter(|t| t.leader).map(|t| t.wireguard_cidr),
        graph: planned
            .topology
            .map(|t| Graph::new(move || crate::kgctl::render_dot(&t))),
        plan: planned.plan,
        errors: planned.errors.iter().map(ToString::to_string).collect(),
        invalid: planned
            .errors
            .iter()
            .filter_map(|e| match e {
                PlanError::Object(o) => Some(o.clone()),
                PlanError::Topology(_) => None,
            })
            .collect(),
        ready_nodes: planned.ready_nodes,
        ready_peers: planned.ready_peers,
        leader,
        nat_keys,
    }
}
