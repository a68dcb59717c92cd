//! The agent's planner: the pure [`plan_for`] behind the [`Planner`] seam. The agent has already
//! left out the nodes it judges not alive ([`super::liveness`]). The service CIDRs planned with
//! are `--service-cidr`'s followed by those the cluster's ServiceCIDR objects add
//! ([`crate::mesh::Snapshot::service_cidrs`]).
use std::collections::BTreeSet;

use super::{PlanOutcome, Planner};
use crate::{
    mesh::Snapshot,
    plan::{Planned, Settings, plan_for},
    telemetry::Graph,
};

/// Plans with `settings`, its service CIDRs joined by the snapshot's.
pub fn planner(mut settings: Settings) -> impl Planner {
    let flags = std::mem::take(&mut settings.service_cidrs);
    move |snapshot: &Snapshot| {
        settings.service_cidrs = flags.clone();
        for c in &snapshot.service_cidrs {
            if !settings.service_cidrs.contains(c) {
                settings.service_cidrs.push(*c);
            }
        }
        PlanOutcome {
            service_cidrs: settings.service_cidrs.clone(),
            ..outcome(plan_for(snapshot, &settings))
        }
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
    let location_leaders = topology
        .filter(|t| t.granularity == crate::mesh::Granularity::Location)
        .map(|t| {
            t.segments
                .iter()
                .map(|s| {
                    let location = super::failover::location_name(&s.location);
                    (location.to_string(), s.leader_name().to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    PlanOutcome {
        duty: topology.map(super::failover::duty).unwrap_or_default(),
        failover_blocked: topology
            .and_then(|t| t.local_segment())
            .and_then(|s| s.failover_blocked.clone()),
        location_leaders,
        // Set by `planner`, which knows the flags.
        service_cidrs: Vec::new(),
        peer_names,
        wireguard_ip: topology.filter(|t| t.leader).map(|t| t.wireguard_cidr),
        graph: planned
            .topology
            .map(|t| Graph::new(move || crate::graph::render_dot(&t))),
        plan: planned.plan,
        errors: planned.errors,
        ready_nodes: planned.ready_nodes,
        ready_peers: planned.ready_peers,
        leader,
        nat_keys,
    }
}

#[cfg(test)]
mod tests {
    use ipnet::IpNet;

    use super::*;
    use crate::plan::EntryKind;

    /// The service CIDRs of the datapath's mesh destinations in `outcome`'s plan.
    fn services(outcome: &PlanOutcome) -> Vec<IpNet> {
        let plan = outcome.plan.as_ref().expect("a plan");
        plan.datapath
            .mesh_destinations
            .iter()
            .filter(|(_, e)| e.kind == EntryKind::Service)
            .map(|(c, _)| *c)
            .collect()
    }

    /// The flags' service CIDRs, then the cluster's that they lack; a change of the cluster's
    /// reaches the datapath's mesh destinations at the next plan.
    #[test]
    fn service_cidrs_are_the_flags_and_the_clusters() {
        let nets = |v: &[&str]| v.iter().map(|c| c.parse().unwrap()).collect::<Vec<IpNet>>();
        let mut planner = planner(Settings {
            hostname: "a".into(),
            service_cidrs: nets(&["10.96.0.0/12"]),
            ..Settings::default()
        });
        let mut snapshot = crate::mesh::cloned_snapshot();
        let flag_only = planner.plan(&snapshot);
        assert_eq!(flag_only.service_cidrs, nets(&["10.96.0.0/12"]));
        assert_eq!(services(&flag_only), nets(&["10.96.0.0/12"]));
        snapshot.service_cidrs = nets(&["10.96.0.0/12", "fd00:10:96::/112", "10.100.0.0/16"]);
        let both = planner.plan(&snapshot);
        assert_eq!(
            both.service_cidrs,
            nets(&["10.96.0.0/12", "fd00:10:96::/112", "10.100.0.0/16"])
        );
        assert_eq!(
            services(&both),
            nets(&["10.96.0.0/12", "10.100.0.0/16", "fd00:10:96::/112"])
        );
        snapshot.service_cidrs.clear();
        assert_eq!(
            planner.plan(&snapshot).service_cidrs,
            nets(&["10.96.0.0/12"])
        );
    }
}
