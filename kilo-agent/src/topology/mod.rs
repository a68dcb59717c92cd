//! Topology (pure): segments, leaders, WireGuard IPs and allowed IPs from ready nodes and
//! peers, with Kilo's `NewTopology` semantics (`pkg/mesh/topology.go`), plus `cross`
//! granularity and IPv6/dual-stack.
//!
//! # Granularities
//! - `location` (Kilo's default): one segment per location (`location:<name>`); a node without
//!   an internal IP is its own segment (`node:<name>`). Each segment has one leader (Kilo's
//!   `findLeader`: first annotated leader with a public endpoint, else first annotated, else
//!   first with a public endpoint, else the first node by name), one WireGuard IP and one
//!   WireGuard key (the leader's). Only leaders run WireGuard; other nodes route through them.
//! - `full`: every node is its own segment (`node:<name>`) and leader.
//! - `cross`: every node is its own segment (`node:<name>`) with its own WireGuard IP and
//!   tunnel, but segments are grouped by location (the *group*, `location:<name>`, or
//!   `node:<name>` for a node without an internal IP). Nodes of the same group talk over the
//!   private network, without WireGuard (pod CIDRs and WireGuard IPs of the other nodes are
//!   routed via their private IP, IPIP-encapsulated as `--encapsulate` says); every node has a
//!   WireGuard peer for every node of every *other* group and for every Peer, so there is no
//!   leader bottleneck. The allowed-location IPs of a location are attached to one node of it
//!   (the one `findLeader` would choose), since a CIDR can belong to one WireGuard peer only.
//!   External peers see every node as a peer (as in `full`).
//!
//! For `location` and `full` the group is the segment itself, so all rules below read the same.
//!
//! # IPv6 and dual-stack
//! Pod CIDRs (`spec.podCIDRs`), internal IPs (one per family), endpoints, allowed IPs and the
//! WireGuard subnet may be IPv6. The WireGuard subnet has one family; the plan routes the
//! other family over the WireGuard interface without a gateway (WireGuard picks the peer by
//! allowed IP), and via a leader's private IP of the destination's family.
//!
//! # Deliberate differences from Kilo (each has a test)
//! - `isPublic` treats all of `fc00::/7` (RFC 4193) as private; Kilo checks only `fd00::/16`.
//! - Running out of WireGuard IPs is an error; Kilo's allocator hands out an empty IP once
//!   before failing.
//! - The topology as WireGuard peers (`conf()`, in `plan/conf.rs`) stays byte-compatible with
//!   Kilo (CIDRs as written, duplicates kept); the plan normalizes it.
mod addresses;
mod allowed_ips;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

pub use addresses::{find_leader, host_net, is_private, is_public, nth_address};

use ipnet::IpNet;

use self::allowed_ips::{Containment, FilterIndex, dedup_peer_ips, merged_alips};
use crate::mesh::{Endpoint, Granularity, Key, MeshPeer, Node};

const LOGICAL_PREFIX: &str = "location:";
const NODE_PREFIX: &str = "node:";

/// What `NewTopology` takes besides the nodes and peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub granularity: Granularity,
    /// The local node.
    pub hostname: String,
    pub port: u16,
    /// `--subnet`: the WireGuard overlay network (Kilo's default 10.4.0.0/16).
    pub subnet: IpNet,
    pub service_cidrs: Vec<IpNet>,
    /// Seconds the local node sends keepalives at (Kilo: its own annotation).
    pub persistent_keepalive: u16,
    /// The nodes that run kg (see [`Segment::failover_blocked`]).
    pub kg_nodes: BTreeSet<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("the local node {0:?} is not among the ready nodes")]
    LocalNodeMissing(String),
    #[error("subnet {subnet} has no address left for segment {segment:?}")]
    OutOfAddresses { subnet: IpNet, segment: String },
}

/// One node inside a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentNode {
    pub name: String,
    pub pod_cidrs: Vec<IpNet>,
    /// Host bits kept; at most one per family.
    pub internal_ips: Vec<IpNet>,
    pub endpoint: Option<Endpoint>,
    /// `kilo.squat.ai/cni-compatibility-ip` (Cilium's `cilium_host` address).
    pub cni_compatibility_ip: Option<IpNet>,
    /// `kg.kilo.squat.ai/demoted`: the node that demoted this one.
    pub demoted_by: Option<String>,
}

impl SegmentNode {
    pub fn private_ip(&self, v6: bool) -> Option<IpAddr> {
        self.internal_ips
            .iter()
            .find(|n| n.addr().is_ipv6() == v6)
            .map(|n| n.addr())
    }
}

/// One WireGuard peer of the mesh: a location (or a node), led by one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// `location:<name>` or `node:<name>`.
    pub location: String,
    /// Which segments share a private network: equal to `location` except in `cross`.
    pub group: String,
    /// Sorted by name.
    pub nodes: Vec<SegmentNode>,
    /// Index into `nodes`.
    pub leader: usize,
    /// Index into `nodes`: who leads if the leader is demoted, and so watches it (none when
    /// the segment cannot fail over).
    pub successor: Option<usize>,
    /// Why this location keeps Kilo's leader whatever is demoted (`location` granularity
    /// only): a node of it, or another location's leader, runs Kilo, which would not follow.
    pub failover_blocked: Option<String>,
    /// Pod CIDRs and internal IPs (/32, /128) of every node, then the WireGuard IP.
    pub allowed_ips: Vec<IpNet>,
    /// The leader's.
    pub endpoint: Option<Endpoint>,
    pub key: Key,
    pub persistent_keepalive: u16,
    pub wireguard_ip: IpAddr,
    pub allowed_location_ips: Vec<IpNet>,
}

impl Segment {
    pub fn leader_name(&self) -> &str {
        &self.nodes[self.leader].name
    }
    pub fn hostnames(&self) -> impl Iterator<Item = &str> {
        self.nodes.iter().map(|n| n.name.as_str())
    }
    pub fn cidrs(&self) -> impl Iterator<Item = IpNet> + '_ {
        self.nodes.iter().flat_map(|n| n.pod_cidrs.iter().copied())
    }
    pub fn private_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.nodes
            .iter()
            .flat_map(|n| n.internal_ips.iter().map(|i| i.addr()))
    }
}

/// The logical structure of the overlay as seen from one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub granularity: Granularity,
    pub hostname: String,
    pub port: u16,
    /// The local segment's location key.
    pub location: String,
    /// The local segment's group (see the module docs).
    pub group: String,
    /// `location:<the local node's location>`, even when the node is its own segment because
    /// it has no internal IP (Kilo's IPIP accept rules use it).
    pub logical_location: String,
    /// The local node leads its segment (always true in `full` and `cross`).
    pub leader: bool,
    pub persistent_keepalive: u16,
    /// The local node's internal IPs (host bits and mask kept).
    pub private_ips: Vec<IpNet>,
    /// The local node's pod CIDRs.
    pub pod_cidrs: Vec<IpNet>,
    /// `--subnet`, truncated.
    pub subnet: IpNet,
    /// The local WireGuard IP with the subnet's prefix length on a leader, else the subnet.
    pub wireguard_cidr: IpNet,
    pub service_cidrs: Vec<IpNet>,
    /// Sorted by location key.
    pub segments: Vec<Segment>,
    /// Sorted by name, allowed IPs deduplicated (an IP claimed by an earlier peer is dropped).
    pub peers: Vec<MeshPeer>,
    pub discovered_endpoints: BTreeMap<Key, SocketAddr>,
}

/// A location or group key, `(LOGICAL_PREFIX or NODE_PREFIX, name)`: it sorts as the joined
/// string would, since the two prefixes differ in their first byte.
type Place<'a> = (&'static str, &'a str);

/// Which segments share a private network (see the module docs).
fn group_of(n: &Node, g: Granularity) -> Place<'_> {
    match g {
        Granularity::Full => (NODE_PREFIX, &n.name),
        _ if n.internal_ips.is_empty() => (NODE_PREFIX, &n.name),
        _ => (LOGICAL_PREFIX, &n.location),
    }
}

/// The segment of a node.
fn location_of(n: &Node, g: Granularity) -> Place<'_> {
    match g {
        Granularity::Location => group_of(n, g),
        Granularity::Full | Granularity::Cross => (NODE_PREFIX, &n.name),
    }
}

/// kg's failover of a location's leader: Kilo's `findLeader` over the members not demoted (all
/// of them when every one is), and the next in that order without the leader, who watches it.
fn leader_and_successor(members: &[&Node]) -> (usize, Option<usize>) {
    let pick = |skip: &dyn Fn(usize) -> bool| {
        let idx: Vec<usize> = (0..members.len()).filter(|i| !skip(*i)).collect();
        let candidates: Vec<&Node> = idx.iter().map(|i| members[*i]).collect();
        (!idx.is_empty()).then(|| idx[find_leader(&candidates)])
    };
    let demoted = |i: usize| members[i].demoted_by.is_some();
    let leader = pick(&demoted).unwrap_or_else(|| find_leader(members));
    (leader, pick(&|i| i == leader || demoted(i)))
}

/// Why a location must keep Kilo's leader: a member, or another location's Kilo leader, does
/// not run kg (a Kilo agent would keep routing to the demoted leader).
fn failover_blocked(
    members: &[&Node],
    kilo_leaders: &[&str],
    kg_nodes: &BTreeSet<String>,
) -> Option<String> {
    if let Some(n) = members.iter().find(|n| !kg_nodes.contains(&n.name)) {
        return Some(format!("node {} runs Kilo", n.name));
    }
    let leader = kilo_leaders.iter().find(|l| !kg_nodes.contains(**l))?;
    Some(format!("the leader {leader} of another location runs Kilo"))
}

impl Topology {
    /// Kilo's `NewTopology`. `nodes` and `peers` should hold only ready objects.
    pub fn new(
        nodes: &BTreeMap<String, Node>,
        peers: &BTreeMap<String, MeshPeer>,
        opts: &Options,
    ) -> Result<Topology, TopologyError> {
        let local = nodes
            .get(&opts.hostname)
            .ok_or_else(|| TopologyError::LocalNodeMissing(opts.hostname.clone()))?;
        let g = opts.granularity;
        let key = |(prefix, name): Place| format!("{prefix}{name}");
        // BTreeMap iteration gives nodes sorted by name inside each location, and locations
        // sorted by key: Kilo's two sorts.
        let mut by_location: BTreeMap<Place, Vec<&Node>> = BTreeMap::new();
        for n in nodes.values() {
            by_location.entry(location_of(n, g)).or_default().push(n);
        }
        // In cross, a location's allowed-location IPs go to the node findLeader picks.
        let mut cross_alips: BTreeMap<Place, Vec<IpNet>> = BTreeMap::new();
        if g == Granularity::Cross {
            let mut by_group: BTreeMap<Place, Vec<&Node>> = BTreeMap::new();
            for n in nodes.values() {
                by_group.entry(group_of(n, g)).or_default().push(n);
            }
            for members in by_group.values() {
                let owner = members[find_leader(members)];
                cross_alips.insert((NODE_PREFIX, &owner.name), merged_alips(members));
            }
        }
        let location = location_of(local, g);
        let group = group_of(local, g);
        let kilo_leaders: Vec<&str> = by_location
            .values()
            .map(|m| m[find_leader(m)].name.as_str())
            .collect();
        let mut leader = false;
        let mut segments = Vec::with_capacity(by_location.len());
        for (loc, members) in &by_location {
            let failover_blocked = (g == Granularity::Location)
                .then(|| failover_blocked(members, &kilo_leaders, &opts.kg_nodes))
                .flatten();
            let (li, successor) = if g == Granularity::Location && failover_blocked.is_none() {
                leader_and_successor(members)
            } else {
                (find_leader(members), None)
            };
            if *loc == location && members[li].name == opts.hostname {
                leader = true;
            }
            let mut allowed_ips = Vec::new();
            for n in members {
                allowed_ips.extend(n.pod_cidrs.iter().copied());
                allowed_ips.extend(n.internal_ips.iter().map(|i| host_net(i.addr())));
            }
            let allowed_location_ips = if g == Granularity::Cross {
                cross_alips.remove(loc).unwrap_or_default()
            } else {
                merged_alips(members)
            };
            let l = members[li];
            segments.push(Segment {
                location: key(*loc),
                group: key(group_of(l, g)),
                nodes: members
                    .iter()
                    .map(|n| SegmentNode {
                        name: n.name.clone(),
                        pod_cidrs: n.pod_cidrs.clone(),
                        internal_ips: n.internal_ips.clone(),
                        endpoint: n.endpoint.clone(),
                        cni_compatibility_ip: n.cni_compatibility_ip,
                        demoted_by: n.demoted_by.clone(),
                    })
                    .collect(),
                leader: li,
                successor,
                failover_blocked,
                allowed_ips,
                endpoint: l.endpoint.clone(),
                key: l.key.unwrap_or(Key([0; 32])),
                persistent_keepalive: l.persistent_keepalive,
                wireguard_ip: opts.subnet.network(),
                allowed_location_ips,
            });
        }
        let (location, group) = (key(location), key(group));
        let subnet = opts.subnet.trunc();
        let mut t = Topology {
            granularity: opts.granularity,
            hostname: opts.hostname.clone(),
            port: opts.port,
            location,
            group,
            logical_location: format!("{LOGICAL_PREFIX}{}", local.location),
            leader,
            persistent_keepalive: opts.persistent_keepalive,
            private_ips: local.internal_ips.clone(),
            pod_cidrs: local.pod_cidrs.clone(),
            subnet,
            wireguard_cidr: subnet,
            service_cidrs: opts.service_cidrs.clone(),
            segments,
            peers: dedup_peer_ips(peers.values()),
            discovered_endpoints: local.discovered_endpoints.clone(),
        };
        // Indexes for Kilo's allowed-location-IP filter (same answers, without its N² scans).
        let node_ips = Containment::new(t.segments.iter().flat_map(|s| s.allowed_ips.iter()));
        let peer_ips = Containment::new(t.peers.iter().flat_map(|p| p.allowed_ips.iter()));
        let mut peer_addrs: Vec<IpAddr> = t
            .peers
            .iter()
            .flat_map(|p| p.allowed_ips.iter().map(|i| i.addr()))
            .collect();
        peer_addrs.sort_unstable();
        let mut index = FilterIndex {
            node_ips,
            peer_ips,
            peer_addrs,
            wireguard_ips: HashSet::new(),
        };
        for (i, members) in by_location.values().enumerate() {
            let ip = nth_address(subnet, i as u128 + 1).ok_or_else(|| {
                TopologyError::OutOfAddresses {
                    subnet,
                    segment: t.segments[i].location.clone(),
                }
            })?;
            index.wireguard_ips.insert(ip);
            let s = &mut t.segments[i];
            s.wireguard_ip = ip;
            s.allowed_ips.push(host_net(ip));
            if t.leader && s.location == t.location {
                t.wireguard_cidr =
                    IpNet::new(ip, subnet.prefix_len()).expect("prefix of the subnet");
            }
            for n in members {
                for (k, v) in &n.discovered_endpoints {
                    t.discovered_endpoints.entry(*k).or_insert(*v);
                }
            }
            let alips = std::mem::take(&mut t.segments[i].allowed_location_ips);
            t.segments[i].allowed_location_ips = t.filter_allowed_location_ips(alips, i, &index);
        }
        Ok(t)
    }

    /// The local segment.
    pub fn local_segment(&self) -> Option<&Segment> {
        self.segments.iter().find(|s| s.location == self.location)
    }

    /// Number of nodes in all segments.
    pub fn node_count(&self) -> usize {
        self.segments.iter().map(|s| s.nodes.len()).sum()
    }

    /// A text dump in the format of the golden files' `## topology` section.
    pub fn dump(&self) -> String {
        fn list<T: std::fmt::Display>(it: impl IntoIterator<Item = T>) -> String {
            let v: Vec<String> = it.into_iter().map(|x| x.to_string()).collect();
            format!("[{}]", v.join(" "))
        }
        let ep = |e: &Option<Endpoint>| e.as_ref().map(ToString::to_string).unwrap_or_default();
        let mut o = String::new();
        let _ = writeln!(o, "leader: {}", self.leader);
        let _ = writeln!(o, "location: {}", self.location);
        let _ = writeln!(o, "wireGuardCIDR: {}", self.wireguard_cidr);
        let _ = writeln!(
            o,
            "privateIP: {}",
            self.private_ips
                .first()
                .map_or("<nil>".to_string(), ToString::to_string)
        );
        let _ = writeln!(
            o,
            "subnet: {}",
            self.pod_cidrs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        );
        for (i, s) in self.segments.iter().enumerate() {
            let _ = writeln!(
                o,
                "segment[{i}]: location={} leader={} endpoint={} key={} wireGuardIP={}",
                s.location,
                s.leader_name(),
                ep(&s.endpoint),
                s.key,
                s.wireguard_ip
            );
            let _ = writeln!(
                o,
                "  hostnames={} cidrs={} privateIPs={}",
                list(s.hostnames()),
                list(s.cidrs()),
                list(s.private_ips())
            );
            let _ = writeln!(o, "  allowedIPs={}", list(&s.allowed_ips));
            let _ = writeln!(o, "  allowedLocationIPs={}", list(&s.allowed_location_ips));
        }
        for p in &self.peers {
            let _ = writeln!(
                o,
                "peer: name={} key={} endpoint={} allowedIPs={}",
                p.name,
                p.public_key,
                ep(&p.endpoint),
                list(&p.allowed_ips)
            );
        }
        o
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testutil;
