//! The plan builder: Kilo's `Conf()`, `Routes()` and `Rules()` for one node, as desired state.
//!
//! # Deliberate differences from Kilo (each has a test in `tests/golden.rs` or below)
//! - Route destinations and datapath keys are truncated (`10.5.0.1/24` → `10.5.0.0/24`): the
//!   kernel rejects a route with host bits, and an LPM key must have none.
//! - One destination is routed to one place: when Kilo emits two routes for the same
//!   destination in the same table (two nodes sharing an internal IP, two peers claiming the
//!   same network), the first one in Kilo's order wins; Kilo adds both and the last
//!   `RouteReplace` wins by accident.
//! - The WireGuard plan is normalized: allowed IPs truncated, every CIDR on one peer only (the
//!   first in Kilo's order), and entries sharing a public key merged into one peer (the kernel
//!   keeps one peer per key; Kilo's config would silently replace the first entry's allowed
//!   IPs with the second's). `kgctl showconf` still prints Kilo's text.
//! - IPIP (tunl0) carries IPv4 only: IPv6 routes inside a location use the private interface.
//! - IPIP is the datapath's ([`IpipPlan`]): the routes still name `tunl0` here (Kilo's text),
//!   the reconciler sends them out of the private interface with a realm, where the datapath
//!   encapsulates what they route, by destination (on a kernel without route realms, every
//!   packet to such a destination: then the node's own traffic to a location node's private IP
//!   is wrapped too, where Kilo wraps only what its pods and kilo0 send there, by ip rules into
//!   table 1107). The fast path does not redirect to a destination so wrapped.
//! - With `--compatibility`, IPIP is the CNI's device's: the datapath neither wraps nor filters
//!   it, where Kilo's cilium encapsulator also adds its `KILO-IPIP` accept/drop rules.
//! - Routes to a destination whose family differs from the WireGuard subnet's go to the
//!   WireGuard interface without a gateway (WireGuard picks the peer by allowed IP).
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet, hash_map::Entry},
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

use ipnet::IpNet;

use super::{
    DatapathEntry, DatapathPlan, Device, EntryKind, IpipPlan, KILO_TABLE, MAIN_TABLE, NextHop,
    Plan, Route, Rule, WireGuardPeer, WireGuardPlan,
};
use crate::{
    mesh::{self, Granularity, ObjectError, Snapshot},
    topology::{self, Segment, Topology, TopologyError, host_net},
};

/// `--compatibility`: Kilo's encapsulator, which decides the gateway through which a node of
/// the location is reached (and `Device::Tunnel` is then the CNI's device: `flannel.1`,
/// Cilium's `cilium_tunl` or `tunl0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compatibility {
    /// Kilo's IPIP encapsulator: the node's private IP.
    #[default]
    None,
    /// Kilo's flannel encapsulator: the first address of the node's pod CIDR.
    Flannel,
    /// Kilo's cilium encapsulator: the node's `cni-compatibility-ip`, else as flannel.
    Cilium,
}

impl Compatibility {
    /// Kilo's `Encapsulator.Gw` for a route of family `v6` to node `n`.
    fn gateway(self, n: &topology::SegmentNode, v6: bool) -> Option<IpAddr> {
        let pods = || {
            n.pod_cidrs
                .iter()
                .find(|c| c.addr().is_ipv6() == v6)
                .map(|c| c.trunc().addr())
        };
        match self {
            Compatibility::None => n.private_ip(v6),
            Compatibility::Flannel => pods(),
            Compatibility::Cilium => n
                .cni_compatibility_ip
                .map(|c| c.addr())
                .filter(|a| a.is_ipv6() == v6)
                .or_else(pods),
        }
    }
}

impl FromStr for Compatibility {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" => Ok(Compatibility::None),
            "flannel" => Ok(Compatibility::Flannel),
            "cilium" => Ok(Compatibility::Cilium),
            _ => Err(format!("unknown compatibility {s:?} (flannel, cilium)")),
        }
    }
}

/// `--encapsulate`: when traffic inside a location is IPIP-encapsulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encapsulation {
    Never,
    /// Only when the gateway is outside the local private subnet.
    CrossSubnet,
    #[default]
    Always,
}

impl FromStr for Encapsulation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "never" => Ok(Encapsulation::Never),
            "crosssubnet" => Ok(Encapsulation::CrossSubnet),
            "always" => Ok(Encapsulation::Always),
            _ => Err(format!(
                "unknown encapsulation {s:?} (never, crosssubnet, always)"
            )),
        }
    }
}

impl fmt::Display for Encapsulation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Encapsulation::Never => "never",
            Encapsulation::CrossSubnet => "crosssubnet",
            Encapsulation::Always => "always",
        })
    }
}

/// Where the keepalive the local node sends to its WireGuard peers comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepaliveSource {
    /// The local node's `kilo.squat.ai/persistent-keepalive` annotation (what `kg` does).
    #[default]
    LocalNode,
    /// A fixed value in seconds (Kilo's unit tests and goldens use 0).
    Fixed(u16),
}

/// Everything besides the snapshot that decides one node's plan.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The local node's name (`--hostname`).
    pub hostname: String,
    pub granularity: Granularity,
    /// `--subnet` (10.4.0.0/16).
    pub subnet: IpNet,
    /// `--port` (51820).
    pub port: u16,
    /// `--service-cidr` (none).
    pub service_cidrs: Vec<IpNet>,
    /// `--local` (true): manage routes inside the location.
    pub local: bool,
    /// `--encapsulate` (always).
    pub encapsulate: Encapsulation,
    /// `--compatibility` (none).
    pub compatibility: Compatibility,
    /// `--cni` (true): the local pod CIDR is a NAT source and the CNI configuration's range.
    pub cni: bool,
    /// `--topology-label` (topology.kubernetes.io/region).
    pub topology_label: String,
    pub persistent_keepalive: KeepaliveSource,
    /// Unix seconds, for the last-seen freshness check of readiness; `None` skips that check
    /// (the caller reads the clock; this code stays pure).
    pub now: Option<i64>,
    /// Endpoints the agent observed on its WireGuard device for NAT-ed peers (Kilo's
    /// `discoverNATEndpoints`); they replace the local node's `discovered-endpoints`
    /// annotation. `None` uses the annotation.
    pub discovered_endpoints: Option<BTreeMap<mesh::Key, SocketAddr>>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            hostname: String::new(),
            granularity: Granularity::Location,
            subnet: "10.4.0.0/16".parse().expect("valid default subnet"),
            port: 51820,
            service_cidrs: Vec::new(),
            local: true,
            encapsulate: Encapsulation::Always,
            compatibility: Compatibility::None,
            cni: true,
            topology_label: mesh::DEFAULT_TOPOLOGY_LABEL.to_string(),
            persistent_keepalive: KeepaliveSource::LocalNode,
            now: None,
            discovered_endpoints: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Object(#[from] ObjectError),
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

/// What [`plan_for`] returns.
#[derive(Debug, Clone, Default)]
pub struct Planned {
    /// `None` when the local node is not in the snapshot, not ready, or the topology failed.
    pub plan: Option<Plan>,
    pub topology: Option<Topology>,
    /// Per-object problems (those objects were skipped) and topology errors.
    pub errors: Vec<PlanError>,
    /// Ready nodes and peers (Kilo's `kilo_nodes` / `kilo_peers`).
    pub ready_nodes: usize,
    pub ready_peers: usize,
}

/// Parses the snapshot, keeps ready objects, resolves their conflicts
/// ([`mesh::resolve_conflicts`]) and computes the topology seen from `settings.hostname`
/// (None if that node is absent, not ready or left out).
pub fn topology_for(snapshot: &Snapshot, settings: &Settings) -> Planned {
    let parsed = mesh::parse_snapshot(snapshot, &settings.topology_label);
    let mut out = Planned {
        errors: parsed.errors.into_iter().map(PlanError::from).collect(),
        ..Default::default()
    };
    let mut nodes = parsed.nodes;
    nodes.retain(|_, n| n.ready(settings.now));
    let mut peers = parsed.peers;
    peers.retain(|_, p| p.ready());
    let subnet = settings.subnet.trunc();
    let lost = mesh::resolve_conflicts(&mut nodes, &mut peers, &settings.service_cidrs, subnet);
    out.errors.extend(lost.into_iter().map(PlanError::from));
    out.ready_nodes = nodes.len();
    out.ready_peers = peers.len();
    let Some(local) = nodes.get_mut(&settings.hostname) else {
        return out;
    };
    if let Some(d) = &settings.discovered_endpoints {
        local.discovered_endpoints = d.clone();
    }
    let local = &nodes[&settings.hostname];
    let opts = topology::Options {
        granularity: settings.granularity,
        hostname: settings.hostname.clone(),
        port: settings.port,
        subnet: settings.subnet.trunc(),
        service_cidrs: settings.service_cidrs.clone(),
        persistent_keepalive: match settings.persistent_keepalive {
            KeepaliveSource::LocalNode => local.persistent_keepalive,
            KeepaliveSource::Fixed(k) => k,
        },
    };
    match Topology::new(&nodes, &peers, &opts) {
        Ok(t) => out.topology = Some(t),
        Err(e) => out.errors.push(e.into()),
    }
    out
}

/// THE entry point of the agent: snapshot + settings → the plan for the local node.
pub fn plan_for(snapshot: &Snapshot, settings: &Settings) -> Planned {
    let mut out = topology_for(snapshot, settings);
    out.plan = out.topology.as_ref().map(|t| build(t, settings));
    out
}

/// Normalizes Kilo's WireGuard peers for a device: allowed IPs truncated, each CIDR on the
/// first peer that claims it, peers with the same public key merged into the first.
pub fn normalize_wireguard(peers: Vec<WireGuardPeer>) -> Vec<WireGuardPeer> {
    let mut out: Vec<WireGuardPeer> = Vec::with_capacity(peers.len());
    let mut by_key: HashMap<mesh::Key, usize> = HashMap::with_capacity(peers.len());
    let mut claimed: HashSet<IpNet> = HashSet::new();
    for p in peers {
        let ips: Vec<IpNet> = p
            .allowed_ips
            .iter()
            .map(IpNet::trunc)
            .filter(|n| claimed.insert(*n))
            .collect();
        match by_key.entry(p.public_key) {
            Entry::Occupied(e) => {
                let q = &mut out[*e.get()];
                q.allowed_ips.extend(ips);
                if q.endpoint.is_none() {
                    q.endpoint = p.endpoint;
                }
                if q.preshared_key.is_none() {
                    q.preshared_key = p.preshared_key;
                }
            }
            Entry::Vacant(e) => {
                e.insert(out.len());
                out.push(WireGuardPeer {
                    allowed_ips: ips,
                    ..p
                });
            }
        }
    }
    out
}

/// Collects routes, first one per (table, destination) wins.
#[derive(Default)]
struct Routes {
    seen: HashSet<(u32, IpNet)>,
    routes: Vec<Route>,
    rules: BTreeSet<Rule>,
}

impl Routes {
    fn add(&mut self, mut r: Route) {
        r.dst = r.dst.trunc();
        if self.seen.insert((r.table, r.dst)) {
            self.routes.push(r);
        }
    }
    fn rule(&mut self, r: Rule) {
        self.rules.insert(Rule {
            src: r.src.map(|n| n.trunc()),
            dst: r.dst.map(|n| n.trunc()),
            ..r
        });
    }
}

fn same_family(a: &IpNet, b: IpAddr) -> bool {
    a.addr().is_ipv6() == b.is_ipv6()
}

/// Builds the plan of the topology's local node (Kilo's `Routes()`, `Conf()`, `Rules()`).
pub fn build(t: &Topology, s: &Settings) -> Plan {
    let my_priv = |v6: bool| {
        t.private_ips
            .iter()
            .find(|n| n.addr().is_ipv6() == v6)
            .copied()
    };
    let src_for = |dst: &IpNet| my_priv(dst.addr().is_ipv6()).map(|n| n.addr());
    let enc = s.encapsulate;
    // Kilo's encapsulateRoute, IPv4 only.
    let encap = |mut r: Route| -> Route {
        if r.dst.addr().is_ipv6() {
            return r;
        }
        let priv4 = my_priv(false);
        let cross = enc == Encapsulation::CrossSubnet
            && priv4.is_some_and(|p| r.gateway.is_none_or(|g| !p.contains(&g)));
        if enc == Encapsulation::Always || cross {
            r.device = Device::Tunnel;
            if r.src.is_none() {
                r.src = priv4.map(|p| p.addr());
            }
        }
        r
    };
    let via = |dst: IpNet, gw: Option<IpAddr>, dev: Device, src: Option<IpAddr>| Route {
        dst,
        gateway: gw,
        src,
        device: dev,
        onlink: gw.is_some(),
        table: MAIN_TABLE,
    };
    let mut rt = Routes::default();
    let local_group: Vec<&Segment> = t.segments.iter().filter(|x| x.group == t.group).collect();
    let my_primary = t.private_ips.first().map(|n| n.addr());

    // Routes to the other nodes of the local location (`--local`), Kilo's intra-location block.
    let local_routes = |rt: &mut Routes, iif_rule: bool| {
        let Some(_) = my_primary else { return };
        for seg in &local_group {
            for n in &seg.nodes {
                if n.internal_ips.first().map(|i| i.addr()) == my_primary || n.name == t.hostname {
                    continue;
                }
                for c in &n.pod_cidrs {
                    if let Some(gw) = s.compatibility.gateway(n, c.addr().is_ipv6()) {
                        rt.add(encap(via(*c, Some(gw), Device::Private, None)));
                    }
                }
                if t.granularity == Granularity::Cross {
                    // The node's own WireGuard IP lives on its kilo0: reach it privately.
                    let wg = host_net(seg.wireguard_ip);
                    if let Some(gw) = n.private_ip(wg.addr().is_ipv6()) {
                        rt.add(encap(via(wg, Some(gw), Device::Private, None)));
                    }
                }
                let (Some(p4), Some(mine)) = (n.private_ip(false), my_priv(false)) else {
                    continue;
                };
                if enc == Encapsulation::Always
                    || (enc == Encapsulation::CrossSubnet && !mine.contains(&p4))
                {
                    let dst = host_net(p4);
                    rt.add(Route {
                        dst,
                        gateway: s.compatibility.gateway(n, false),
                        src: Some(mine.addr()),
                        device: Device::Tunnel,
                        onlink: true,
                        table: KILO_TABLE,
                    });
                    for c in t.pod_cidrs.iter().filter(|c| !c.addr().is_ipv6()) {
                        rt.rule(Rule {
                            src: Some(*c),
                            dst: Some(dst),
                            iif: None,
                            table: KILO_TABLE,
                        });
                    }
                    if iif_rule {
                        rt.rule(Rule {
                            src: None,
                            dst: Some(dst),
                            iif: Some(Device::WireGuard),
                            table: KILO_TABLE,
                        });
                    }
                }
            }
        }
    };

    // Without `--local`, a leader behind a CNI overlay (flannel, cilium) still returns
    // WireGuard traffic to its location's nodes through that overlay: what kilo0 delivers to a
    // node's private IP goes, by table 1107, to the CNI's gateway for it (Kilo PR #409).
    let overlay_return = |rt: &mut Routes| {
        if my_primary.is_none() || enc == Encapsulation::Never {
            return;
        }
        for n in local_group.iter().flat_map(|seg| &seg.nodes) {
            let Some(p4) = n.private_ip(false) else {
                continue;
            };
            if Some(p4) == my_primary || n.name == t.hostname {
                continue;
            }
            let Some(gw) = s.compatibility.gateway(n, false).filter(|g| *g != p4) else {
                continue;
            };
            let dst = host_net(p4);
            rt.add(Route {
                table: KILO_TABLE,
                ..via(dst, Some(gw), Device::Tunnel, None)
            });
            rt.rule(Rule {
                src: None,
                dst: Some(dst),
                iif: Some(Device::WireGuard),
                table: KILO_TABLE,
            });
        }
    };

    let mut local_done = false;
    if t.leader {
        for seg in &t.segments {
            if seg.group == t.group {
                if !local_done {
                    if s.local {
                        local_routes(&mut rt, true);
                    } else {
                        overlay_return(&mut rt);
                    }
                }
                local_done = true;
                continue;
            }
            let wg = |dst: &IpNet| same_family(dst, seg.wireguard_ip).then_some(seg.wireguard_ip);
            let ep_ip = t
                .update_endpoint(seg.endpoint.as_ref(), &seg.key, seg.persistent_keepalive)
                .and_then(|e| e.ip());
            for n in &seg.nodes {
                for c in &n.pod_cidrs {
                    rt.add(via(*c, wg(c), Device::WireGuard, src_for(c)));
                }
                for p in &n.internal_ips {
                    if Some(p.addr()) == ep_ip {
                        continue;
                    }
                    let d = host_net(p.addr());
                    rt.add(via(d, wg(&d), Device::WireGuard, src_for(&d)));
                }
            }
            for a in &seg.allowed_location_ips {
                rt.add(via(*a, wg(a), Device::WireGuard, src_for(a)));
            }
        }
        for p in &t.peers {
            for a in &p.allowed_ips {
                rt.add(via(*a, None, Device::WireGuard, src_for(a)));
            }
        }
    } else if let Some(ls) = t.local_segment() {
        let leader = &ls.nodes[ls.leader];
        let gw = |dst: &IpNet| s.compatibility.gateway(leader, dst.addr().is_ipv6());
        let route = |rt: &mut Routes, dst: IpNet| {
            if let Some(g) = gw(&dst) {
                rt.add(encap(via(dst, Some(g), Device::Private, None)));
            }
        };
        for seg in &t.segments {
            route(&mut rt, host_net(seg.wireguard_ip));
            if seg.group == t.group {
                if s.local && !local_done {
                    local_routes(&mut rt, false);
                }
                local_done = true;
                continue;
            }
            for c in seg.cidrs() {
                route(&mut rt, c);
            }
            for p in seg.private_ips() {
                route(&mut rt, host_net(p));
            }
            for a in &seg.allowed_location_ips {
                route(&mut rt, *a);
            }
        }
        for p in &t.peers {
            for a in &p.allowed_ips {
                route(&mut rt, *a);
            }
        }
    }
    let mut routes = rt.routes;
    routes.sort();

    let wireguard = WireGuardPlan {
        listen_port: t.port,
        peers: if t.leader {
            normalize_wireguard(t.conf())
        } else {
            Vec::new()
        },
    };
    let mut datapath = datapath(t, s);
    let ipip = ipip(t, s, &routes, &datapath);
    // A destination the datapath encapsulates is reached through `tunl0`, as Kilo's route
    // says: no fast-path redirect straight out of the private interface, where the packet,
    // without a route and so without its realm, would leave bare.
    for (net, e) in &mut datapath.mesh_destinations {
        if let Some(NextHop::Gateway { device, .. }) = &mut e.next_hop
            && ipip.encapsulate.contains_key(net)
        {
            *device = Device::Tunnel;
        }
    }
    Plan {
        addresses: if t.leader {
            vec![t.wireguard_cidr]
        } else {
            Vec::new()
        },
        wireguard,
        ipip,
        routes,
        rules: rt.rules.into_iter().collect(),
        datapath,
        cni_ranges: if s.cni {
            t.pod_cidrs.clone()
        } else {
            Vec::new()
        },
    }
}

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
fn ipip(t: &Topology, s: &Settings, routes: &[Route], d: &DatapathPlan) -> IpipPlan {
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
fn datapath(t: &Topology, s: &Settings) -> DatapathPlan {
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

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::WireGuard => "kilo0",
            Device::Private => "eth0",
            Device::Tunnel => "tunl0",
        })
    }
}

/// `route DST [via GW] dev DEV [src SRC] [table T] [onlink]`, the golden files' layout without
/// the protocol (Device prints Kilo's test names: kilo0, eth0, tunl0).
impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "route {}", self.dst)?;
        if let Some(g) = self.gateway {
            write!(f, " via {g}")?;
        }
        write!(f, " dev {}", self.device)?;
        if let Some(s) = self.src {
            write!(f, " src {s}")?;
        }
        if self.table != MAIN_TABLE {
            write!(f, " table {}", self.table)?;
        }
        if self.onlink {
            f.write_str(" onlink")?;
        }
        Ok(())
    }
}

/// `ip rule [from SRC] [to DST] [iif DEV] lookup T`.
impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ip rule")?;
        if let Some(s) = self.src {
            write!(f, " from {s}")?;
        }
        if let Some(d) = self.dst {
            write!(f, " to {d}")?;
        }
        if let Some(i) = self.iif {
            write!(f, " iif {i}")?;
        }
        write!(f, " lookup {}", self.table)
    }
}
