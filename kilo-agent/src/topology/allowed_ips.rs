//! Which allowed IPs segments and peers keep: Kilo's `filterAllowedLocationIPs` (over
//! containment indexes instead of its N² scans), `deduplicatePeerIPs`, and a location's merged
//! allowed-location IPs.
use std::{
    collections::{BTreeSet, HashSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::Topology;
use crate::mesh::{MeshPeer, Node};

pub(super) fn intersect(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.addr()) || b.contains(&a.addr())
}

impl Topology {
    /// Kilo's `filterAllowedLocationIPs`, run while segments get their WireGuard IPs (so it
    /// sees the later segments' allowed IPs without their WireGuard IP, as Kilo does): drop an
    /// IP that overlaps another location's allowed-location IPs, whose address lies in any
    /// segment's allowed IP, or that overlaps a peer's allowed IP.
    pub(super) fn filter_allowed_location_ips(
        &self,
        ips: Vec<IpNet>,
        seg: usize,
        idx: &FilterIndex,
    ) -> Vec<IpNet> {
        let group = &self.segments[seg].group;
        ips.into_iter()
            .filter(|ip| {
                let other_location = self
                    .segments
                    .iter()
                    .filter(|s| s.group != *group)
                    .any(|s| s.allowed_location_ips.iter().any(|i| intersect(ip, i)));
                let in_allowed =
                    idx.node_ips.contains(ip.addr()) || idx.wireguard_ips.contains(&ip.addr());
                let start = idx.peer_addrs.partition_point(|a| *a < ip.network());
                let peer = idx.peer_ips.contains(ip.addr())
                    || idx
                        .peer_addrs
                        .get(start)
                        .is_some_and(|a| *a <= ip.broadcast());
                !(other_location || in_allowed || peer)
            })
            .collect()
    }
}

/// The allowed-location IPs of a location's nodes, merged (first occurrence) and sorted by
/// text, as Kilo sorts them.
pub(super) fn merged_alips(members: &[&Node]) -> Vec<IpNet> {
    let mut seen = HashSet::new();
    let mut v: Vec<IpNet> = members
        .iter()
        .flat_map(|n| n.allowed_location_ips.iter().copied())
        .filter(|ip| seen.insert(*ip))
        .collect();
    if v.len() > 1 {
        v.sort_by_cached_key(|ip| ip.to_string());
    }
    v
}

/// Answers "does any of these networks contain this address" with one hash lookup per
/// prefix length in use.
pub(super) struct Containment {
    nets: HashSet<IpNet>,
    lens_v4: BTreeSet<u8>,
    lens_v6: BTreeSet<u8>,
}

impl Containment {
    pub(super) fn new<'a>(nets: impl Iterator<Item = &'a IpNet>) -> Self {
        let mut c = Containment {
            nets: HashSet::new(),
            lens_v4: BTreeSet::new(),
            lens_v6: BTreeSet::new(),
        };
        for n in nets {
            c.nets.insert(n.trunc());
            match n {
                IpNet::V4(_) => c.lens_v4.insert(n.prefix_len()),
                IpNet::V6(_) => c.lens_v6.insert(n.prefix_len()),
            };
        }
        c
    }

    fn contains(&self, a: IpAddr) -> bool {
        let lens = if a.is_ipv4() {
            &self.lens_v4
        } else {
            &self.lens_v6
        };
        lens.iter()
            .any(|l| IpNet::new(a, *l).is_ok_and(|n| self.nets.contains(&n.trunc())))
    }
}

pub(super) struct FilterIndex {
    /// Every segment's allowed IPs without the WireGuard IPs.
    pub(super) node_ips: Containment,
    pub(super) peer_ips: Containment,
    /// Peer allowed-IP addresses (host bits kept), sorted.
    pub(super) peer_addrs: Vec<IpAddr>,
    /// WireGuard IPs allocated so far.
    pub(super) wireguard_ips: HashSet<IpAddr>,
}

/// Kilo's `deduplicatePeerIPs`: peers in name order; an allowed IP already claimed (same text)
/// by an earlier peer is dropped.
pub(super) fn dedup_peer_ips<'a>(peers: impl Iterator<Item = &'a MeshPeer>) -> Vec<MeshPeer> {
    // IpNet equality (address with host bits, prefix length) is Go's `IPNet.String()` equality.
    let mut seen = HashSet::new();
    peers
        .map(|p| {
            let mut p = p.clone();
            p.allowed_ips.retain(|ip| seen.insert(*ip));
            p
        })
        .collect()
}
