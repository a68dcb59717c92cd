//! The plan computed: Kilo's `Conf()`, `Routes()` and `Rules()` for one node, as desired state.
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
//! - IPIP is the datapath's ([`IpipPlan`](super::IpipPlan)): the routes still name `tunl0`
//!   here (Kilo's text), the reconciler sends them out of the private interface with a realm,
//!   where the datapath encapsulates what they route, by destination (on a kernel without route
//!   realms, every packet to such a destination: then the node's own traffic to a location
//!   node's private IP is wrapped too, where Kilo wraps only what its pods and kilo0 send there,
//!   by ip rules into table 1107). The fast path does not redirect to a destination so wrapped.
//! - Routes to a destination whose family differs from the WireGuard subnet's go to the
//!   WireGuard interface without a gateway (WireGuard picks the peer by allowed IP).
use std::{
    collections::{BTreeSet, HashMap, HashSet, hash_map::Entry},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{
    Compatibility, Device, Encapsulation, ForwardAccept, ForwardWhat, KILO_TABLE, KeepaliveSource,
    MAIN_TABLE, NextHop, Plan, PlanError, Planned, Route, Rule, Settings, WireGuardPeer,
    WireGuardPlan,
    datapath::{datapath, ipip},
};
use crate::{
    mesh::{self, Granularity, Snapshot},
    topology::{self, Segment, Topology, host_net},
};

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
        kg_nodes: {
            let mut kg = snapshot.kg_nodes.clone();
            if settings.runs_kg {
                kg.insert(settings.hostname.clone());
            }
            kg
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
    out.plan = out.topology.as_ref().map(|t| from_topology(t, settings));
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
pub fn from_topology(t: &Topology, s: &Settings) -> Plan {
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
    // node's private IP goes, by table 1107, to the CNI's gateway for it (Kilo's
    // <https://github.com/squat/kilo/pull/409>).
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
        forward: forward(t, s),
    }
}

/// Kilo's FORWARD accepts (`--iptables-forward-rules`, only with `--cni`): a leader forwards
/// for its whole location (pod CIDRs, allowed-location IPs and private IPs of every node in
/// it), any other node for its own pod CIDRs (Kilo: its one pod CIDR).
fn forward(t: &Topology, s: &Settings) -> Vec<ForwardAccept> {
    if !(s.cni && s.iptables_forward_rules) {
        return Vec::new();
    }
    let accept = |what| move |net| ForwardAccept { net, what };
    if !t.leader {
        return t
            .pod_cidrs
            .iter()
            .copied()
            .map(accept(ForwardWhat::NodePodSubnet))
            .collect();
    }
    let mut out = Vec::new();
    for seg in t.segments.iter().filter(|seg| seg.location == t.location) {
        out.extend(seg.cidrs().map(accept(ForwardWhat::PodSubnet)));
        out.extend(
            (seg.allowed_location_ips.iter().copied()).map(accept(ForwardWhat::AllowedLocationIps)),
        );
        out.extend((seg.private_ips().map(host_net)).map(accept(ForwardWhat::PrivateIps)));
    }
    out
}
