//! The datapath's part of the plan: the maps that replace Kilo's iptables rules, and IPIP
//! inside the location (Kilo's `tunl0` routes and `KILO-IPIP` chain).
//!
//! Deliberate difference from Kilo: with `--compatibility`, IPIP is the CNI's device's: the
//! datapath neither wraps nor filters it, where Kilo's cilium encapsulator also adds its
//! `KILO-IPIP` accept/drop rules.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{
    Compatibility, DatapathEntry, DatapathPlan, Device, Encapsulation, EntryKind, IpipPlan,
    NextHop, Route, Settings,
};
use crate::{
    mesh::Granularity,
    topology::{Topology, host_net},
};

/// The sources Kilo accepts IPIP from (`KILO-IPIP -s <ip>/32 -j ACCEPT`): the IPv4 private IPs
/// of the local node's *logical* location, even for a node that is its own segment (none in
/// `full`; in `cross`, the nodes of the local location),
/// when encapsulating with `--local`. Everything else is dropped by Kilo's `INPUT -p ipencap`.
pub fn ipip_sources(t: &Topology, s: &Settings) -> Vec<IpNet> {
    if s.encapsulate == Encapsulation::Never || !s.local || t.granularity == Granularity::Full {
        return Vec::new();
    }
    t.segments
        .iter()
        .filter(|x| x.group == t.logical_location)
        .flat_map(|x| x.private_ips())
        .filter(IpAddr::is_ipv4)
        .map(host_net)
        .collect()
}

/// The datapath's IPIP maps, with Kilo's own encapsulator only (with `--compatibility` the
/// CNI's device encapsulates): every route through `tunl0` becomes a destination to wrap toward
/// its gateway; the location's other nodes may send IPIP; and what this node serves is its own
/// pod CIDRs and addresses, plus, on a leader, every destination it routes into WireGuard.
pub(super) fn ipip(t: &Topology, s: &Settings, routes: &[Route], d: &DatapathPlan) -> IpipPlan {
    let mut out = IpipPlan::default();
    let local = t.private_ips.iter().find_map(|n| match n.addr() {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(_) => None,
    });
    let Some(local) = local.filter(|_| s.compatibility == Compatibility::None) else {
        return out;
    };
    let entry = |kind, owner: &str, next_hop| DatapathEntry {
        kind,
        owner: owner.to_string(),
        next_hop,
    };
    for r in routes.iter().filter(|r| r.device == Device::Tunnel) {
        let Some(IpAddr::V4(remote)) = r.gateway else {
            continue;
        };
        let hop = Some(NextHop::Ipip { local, remote });
        let e = match d.mesh_destinations.get(&r.dst) {
            Some(m) => entry(m.kind, &m.owner, hop),
            None => entry(EntryKind::Node, &remote.to_string(), hop),
        };
        out.encapsulate.entry(r.dst).or_insert(e);
    }
    let accepted: BTreeSet<IpNet> = ipip_sources(t, s).into_iter().collect();
    for seg in t.segments.iter().filter(|x| x.group == t.logical_location) {
        for n in seg.nodes.iter().filter(|n| n.name != t.hostname) {
            for ip in n.internal_ips.iter().map(|i| host_net(i.addr())) {
                if accepted.contains(&ip) && !t.private_ips.iter().any(|p| p.addr() == ip.addr()) {
                    out.sources
                        .entry(ip)
                        .or_insert_with(|| entry(EntryKind::Node, &n.name, None));
                }
            }
        }
    }
    if out.sources.is_empty() {
        return out;
    }
    let own = t
        .pod_cidrs
        .iter()
        .copied()
        .chain(t.private_ips.iter().map(|p| host_net(p.addr())))
        .chain(t.leader.then(|| host_net(t.wireguard_cidr.addr())));
    for net in own.filter(|n| n.addr().is_ipv4()) {
        out.decapsulate
            .entry(net.trunc())
            .or_insert_with(|| entry(EntryKind::Node, &t.hostname, None));
    }
    if t.leader {
        for r in routes.iter().filter(|r| r.device == Device::WireGuard) {
            if r.dst.addr().is_ipv4() {
                let e = match d.mesh_destinations.get(&r.dst) {
                    Some(m) => entry(m.kind, &m.owner, None),
                    None => entry(EntryKind::AllowedLocation, "", None),
                };
                out.decapsulate.entry(r.dst).or_insert(e);
            }
        }
    }
    out
}

/// The datapath maps that replace Kilo's iptables rules (`Topology.Rules`).
pub(super) fn datapath(t: &Topology, s: &Settings) -> DatapathPlan {
    let mut d = DatapathPlan::default();
    let leader_gw = |dst: &IpNet| -> Option<NextHop> {
        if t.leader {
            return Some(NextHop::WireGuard);
        }
        let ls = t.local_segment()?;
        let ip = ls.nodes[ls.leader].private_ip(dst.addr().is_ipv6())?;
        Some(NextHop::Gateway {
            address: ip,
            device: Device::Private,
        })
    };
    let put = |m: &mut BTreeMap<IpNet, DatapathEntry>,
               n: IpNet,
               kind: EntryKind,
               owner: &str,
               next_hop: Option<NextHop>| {
        m.entry(n.trunc()).or_insert_with(|| DatapathEntry {
            kind,
            owner: owner.to_string(),
            next_hop,
        });
    };
    for seg in &t.segments {
        let remote = seg.group != t.group;
        let hop = |n: &IpNet| if remote { leader_gw(n) } else { None };
        let wg = host_net(seg.wireguard_ip);
        put(
            &mut d.mesh_destinations,
            wg,
            EntryKind::WireGuardIp,
            &seg.location,
            hop(&wg),
        );
        for n in &seg.nodes {
            for c in &n.pod_cidrs {
                put(
                    &mut d.mesh_destinations,
                    *c,
                    EntryKind::Node,
                    &n.name,
                    hop(c),
                );
            }
            for p in &n.internal_ips {
                let h = host_net(p.addr());
                put(
                    &mut d.mesh_destinations,
                    h,
                    EntryKind::Node,
                    &n.name,
                    hop(&h),
                );
            }
        }
        if !remote {
            for a in &seg.allowed_location_ips {
                put(
                    &mut d.masquerade_destinations,
                    *a,
                    EntryKind::AllowedLocation,
                    &seg.location,
                    None,
                );
            }
        }
    }
    if s.cni {
        for c in &t.pod_cidrs {
            put(
                &mut d.nat_sources,
                *c,
                EntryKind::LocalPods,
                &t.hostname,
                None,
            );
        }
    }
    for p in &t.peers {
        for a in &p.allowed_ips {
            put(&mut d.nat_sources, *a, EntryKind::Peer, &p.name, None);
            put(
                &mut d.mesh_destinations,
                *a,
                EntryKind::Peer,
                &p.name,
                leader_gw(a),
            );
        }
    }
    for c in &t.service_cidrs {
        put(
            &mut d.mesh_destinations,
            *c,
            EntryKind::Service,
            "service-cidr",
            None,
        );
    }
    d
}
