//! Duplicate identities and conflicting claims between ready objects (pure), resolved by a rule
//! that depends only on names and the kind of object, never on arrival order, so every agent
//! and kgctl reach the same answer from the same snapshot:
//! - Two nodes with the same WireGuard key (a cloned disk), or with overlapping pod CIDRs: the
//!   node whose name sorts first stays; the other is left out of the mesh (as if not ready).
//! - Nodes beat Peers: a Peer's allowed IP equal to or inside a node's pod CIDR, a node's
//!   internal IP, a service CIDR or a WireGuard IP the topology may hand out (the first address
//!   of the WireGuard subnet for each ready node) is dropped from that Peer; the rest stays.
//! - Between Peers, in name order: an allowed IP strictly inside one an earlier Peer claims is
//!   dropped. The same network twice stays as Kilo leaves it (`deduplicatePeerIPs`, then the
//!   plan gives the network to the first Peer).
//!
//! Every route and lookup on the way (kernel routes, WireGuard's allowed IPs, the datapath's
//! LPM tries) picks the longest prefix, so only a claim equal to or inside someone else's range
//! can take its traffic. A claim containing another range (a Peer for `10.0.0.0/8` next to a
//! node's `10.2.1.0/24`) takes only what nobody more specific claims, and is kept.
//!
//! Each loser is an [`ObjectError`] naming both objects and the losing field, so it is
//! logged and counted like any invalid value (`kilo_invalid_objects_total{kind,field}`).
use std::collections::BTreeMap;

use ipnet::IpNet;

use super::{Key, MeshPeer, Node, ObjectError, ObjectKind, annotations};

/// Who claims which network (truncated), with the first claimant's description.
#[derive(Default)]
struct Claims(BTreeMap<IpNet, String>);

impl Claims {
    fn add(&mut self, net: IpNet, owner: impl FnOnce() -> String) {
        self.0.entry(net.trunc()).or_insert_with(owner);
    }

    /// The most specific claim equal to or containing `net`.
    fn containing(&self, net: &IpNet) -> Option<&str> {
        (0..=net.prefix_len())
            .rev()
            .filter_map(|l| IpNet::new(net.addr(), l).ok())
            .find_map(|n| self.0.get(&n.trunc()))
            .map(String::as_str)
    }

    /// A claim strictly containing `net`.
    fn containing_strictly(&self, net: &IpNet) -> Option<&str> {
        (0..net.prefix_len())
            .rev()
            .filter_map(|l| IpNet::new(net.addr(), l).ok())
            .find_map(|n| self.0.get(&n.trunc()))
            .map(String::as_str)
    }

    /// A claim inside `net` (equal included): claims are truncated, so their network address
    /// lies between `net`'s first and last address.
    fn inside(&self, net: &IpNet) -> Option<&str> {
        let (first, last) = (net.trunc(), IpNet::from(net.broadcast()));
        self.0
            .range(first..=last)
            .find(|(n, _)| net.contains(*n))
            .map(|(_, o)| o.as_str())
    }

    fn overlapping(&self, net: &IpNet) -> Option<&str> {
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
                pods.add(*c, || format!("pod CIDR {c} of node {:?}", n.name));
            }
        } else {
            errors.extend(lost);
            left_out.push(n.name.clone());
        }
    }
    for name in left_out {
        nodes.remove(&name);
    }

    let mut reserved = pods;
    for n in nodes.values() {
        for ip in &n.internal_ips {
            let host = IpNet::from(ip.addr());
            reserved.add(host, || format!("internal IP {host} of node {:?}", n.name));
        }
    }
    for s in service_cidrs {
        reserved.add(*s, || format!("service CIDR {s}"));
    }
    // Segment i gets the subnet's address i + 1, and there are at most as many segments as nodes.
    let network = subnet.network();
    let wireguard_ips = subnet.hosts().filter(|a| *a != network).take(nodes.len());
    for ip in wireguard_ips.map(IpNet::from) {
        reserved.add(ip, || {
            format!("WireGuard IP {ip} (one per ready node in {subnet})")
        });
    }
    let mut claimed = Claims::default();
    for p in peers.values_mut() {
        let mut kept = Vec::with_capacity(p.allowed_ips.len());
        for (i, ip) in p.allowed_ips.iter().enumerate() {
            let owner = reserved.containing(ip).or_else(|| {
                // The same network as an earlier Peer is Kilo's deduplication, not a conflict.
                let same = claimed.0.contains_key(&ip.trunc());
                (!same).then(|| claimed.containing_strictly(ip)).flatten()
            });
            match owner {
                Some(owner) => errors.push(ObjectError::new(
                    ObjectKind::Peer,
                    &p.name,
                    format!("spec.allowedIPs[{i}]"),
                    format!("{ip} lies within {owner}; dropped from the peer"),
                )),
                None => kept.push(*ip),
            }
        }
        for ip in &kept {
            claimed.add(*ip, || format!("{ip} of peer {:?}", p.name));
        }
        p.allowed_ips = kept;
    }
    errors
}

#[cfg(test)]
pub(crate) mod tests;
