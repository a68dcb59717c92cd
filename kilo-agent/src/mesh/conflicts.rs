//! Duplicate identities and conflicting claims between ready objects (pure), resolved by a rule
//! that depends only on names and the kind of object, never on arrival order, so every agent
//! and kgctl reach the same answer from the same snapshot.
//!
//! Between Peers nothing is resolved here: as in Kilo, a Peer's allowed IP equal (as text, host
//! bits included) to one an earlier Peer (name order) claims is dropped by the topology
//! (`deduplicatePeerIPs`), and a narrower or broader one is kept, since WireGuard and the
//! routes pick the longest prefix (`172.20.5.0/24` of one Peer next to `172.20.0.0/16` of
//! another: the first gets the /24, the second the rest of the /16).
//!
//! What nodes own is protected; Kilo protects none of it. In Kilo's WireGuard configuration the
//! Peers come after the segments, and WireGuard gives an allowed IP listed twice to the last
//! peer listing it, so there a Peer takes any node range it claims exactly or more narrowly. Here
//! the claim is dropped from the Peer (only the Peer's `AllowedIPs` differ from Kilo's):
//! - two ready nodes with the same WireGuard key (a cloned disk), or with overlapping pod CIDRs:
//!   the node whose name sorts first stays; the other is left out of the mesh (as if not ready);
//! - a Peer's allowed IP equal to or inside a node's pod CIDR (Kilo: the Peer takes those pods);
//! - equal to a node's internal IP as a host route (`/32`, `/128`; Kilo: the Peer takes it);
//! - equal to one of the first N addresses of the WireGuard subnet after its network address,
//!   N the number of ready nodes (Kilo gives segment i the address i + 1; there are at most as
//!   many segments as nodes in every granularity, so an unused one of these, which Kilo would
//!   leave to the Peer, is dropped too);
//! - equal to or inside a `--service-cidr` (Kilo puts service CIDRs in no WireGuard
//!   configuration and leaves such an address to the Peer; kgctl knows no service CIDRs and
//!   keeps it).
//!
//! A dropped claim also no longer filters allowed-location IPs (`filterAllowedLocationIPs`).
//! A claim containing a node's range (`10.0.0.0/8` next to a pod CIDR `10.2.1.0/24`) takes
//! only what nobody more specific claims, and is kept.
//!
//! Each loser is an [`ObjectError`] naming both objects and the losing field, so it is
//! logged and counted like any invalid value (`kilo_invalid_objects_total{kind,field}`).
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
};

use ipnet::IpNet;

use super::{Key, MeshPeer, Node, ObjectError, ObjectKind, annotations};

/// Who claims a network, described (only when an error names it) as `pod CIDR 10.2.1.0/24 of
/// node "a"` and the like.
#[derive(Clone, Copy)]
enum Owner<'a> {
    PodCidr(IpNet, &'a str),
    InternalIp(IpNet, &'a str),
    ServiceCidr(IpNet),
    WireGuardIp(IpNet, IpNet),
}

impl fmt::Display for Owner<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::PodCidr(c, node) => write!(f, "pod CIDR {c} of node {node:?}"),
            Owner::InternalIp(ip, node) => write!(f, "internal IP {ip} of node {node:?}"),
            Owner::ServiceCidr(s) => write!(f, "service CIDR {s}"),
            Owner::WireGuardIp(ip, subnet) => {
                write!(f, "WireGuard IP {ip} (one per ready node in {subnet})")
            }
        }
    }
}

/// Who claims which network (truncated): the first claimant.
#[derive(Default)]
struct Claims<'a> {
    owners: BTreeMap<IpNet, Owner<'a>>,
    /// The prefix lengths claimed, per family (IPv4, IPv6): a lookup tries only these.
    lens: [BTreeSet<u8>; 2],
}

impl<'a> Claims<'a> {
    fn add(&mut self, net: IpNet, owner: Owner<'a>) {
        self.owners.entry(net.trunc()).or_insert(owner);
        self.lens[usize::from(net.addr().is_ipv6())].insert(net.prefix_len());
    }

    /// The most specific claim containing `net` with a prefix length in `lens`.
    fn longest(&self, net: &IpNet, lens: impl DoubleEndedIterator<Item = u8>) -> Option<Owner<'a>> {
        lens.rev()
            .filter_map(|l| IpNet::new(net.addr(), l).ok())
            .find_map(|n| self.owners.get(&n.trunc()).copied())
    }

    /// The most specific claim equal to or containing `net`.
    fn containing(&self, net: &IpNet) -> Option<Owner<'a>> {
        let lens = &self.lens[usize::from(net.addr().is_ipv6())];
        self.longest(net, lens.range(..=net.prefix_len()).copied())
    }

    /// A claim inside `net` (equal included): claims are truncated, so their network address
    /// lies between `net`'s first and last address.
    fn inside(&self, net: &IpNet) -> Option<Owner<'a>> {
        let (first, last) = (net.trunc(), IpNet::from(net.broadcast()));
        self.owners
            .range(first..=last)
            .find(|(n, _)| net.contains(*n))
            .map(|(_, o)| *o)
    }

    fn overlapping(&self, net: &IpNet) -> Option<Owner<'a>> {
        self.containing(net).or_else(|| self.inside(net))
    }
}

/// Leaves out the nodes and drops the Peer allowed IPs that lose a conflict (see the module
/// docs), and returns one error per lost field. `nodes` and `peers` should be the ready ones;
/// `subnet` is the WireGuard subnet.
pub fn resolve_conflicts(
    nodes: &mut BTreeMap<String, Node>,
    peers: &mut BTreeMap<String, MeshPeer>,
    service_cidrs: &[IpNet],
    subnet: IpNet,
) -> Vec<ObjectError> {
    let mut errors = Vec::new();
    let mut keys: BTreeMap<Key, &str> = BTreeMap::new();
    let mut pods = Claims::default();
    let mut kept_nodes = Vec::with_capacity(nodes.len());
    let mut left_out = Vec::new();
    for n in nodes.values() {
        let out = |field: &str, problem: String| {
            ObjectError::new(
                ObjectKind::Node,
                &n.name,
                field,
                format!("{problem}; node {:?} left out of the mesh", n.name),
            )
        };
        let mut lost = Vec::new();
        if let Some(owner) = n.key.and_then(|k| keys.get(&k)) {
            lost.push(out(
                &format!("annotation {}", annotations::KEY),
                format!("same WireGuard key as node {owner:?}"),
            ));
        }
        for c in &n.pod_cidrs {
            if let Some(owner) = pods.overlapping(c) {
                lost.push(out("spec.podCIDR", format!("{c} overlaps {owner}")));
            }
        }
        if lost.is_empty() {
            if let Some(k) = n.key {
                keys.insert(k, &n.name);
            }
            for c in &n.pod_cidrs {
                pods.add(*c, Owner::PodCidr(*c, &n.name));
            }
            kept_nodes.push(n);
        } else {
            errors.extend(lost);
            left_out.push(n.name.clone());
        }
    }

    let mut reserved = pods;
    for n in &kept_nodes {
        for ip in &n.internal_ips {
            let host = IpNet::from(ip.addr());
            reserved.add(host, Owner::InternalIp(host, &n.name));
        }
    }
    for s in service_cidrs {
        reserved.add(*s, Owner::ServiceCidr(*s));
    }
    // Segment i gets the subnet's address i + 1, and there are at most as many segments as nodes.
    let network = subnet.network();
    let wireguard_ips = subnet
        .hosts()
        .filter(|a| *a != network)
        .take(kept_nodes.len());
    for ip in wireguard_ips.map(IpNet::from) {
        reserved.add(ip, Owner::WireGuardIp(ip, subnet));
    }
    for p in peers.values_mut() {
        let mut i = 0;
        p.allowed_ips.retain(|ip| {
            let owner = reserved.containing(ip);
            if let Some(owner) = owner {
                errors.push(ObjectError::new(
                    ObjectKind::Peer,
                    &p.name,
                    format!("spec.allowedIPs[{i}]"),
                    format!("{ip} lies within {owner}; dropped from the peer"),
                ));
            }
            i += 1;
            owner.is_none()
        });
    }
    for name in left_out {
        nodes.remove(&name);
    }
    errors
}

#[cfg(test)]
pub(crate) mod tests;
