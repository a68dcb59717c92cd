//! Plan builder tests: cross granularity and dual-stack checked by hand, and properties over
//! random clusters.
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use proptest::prelude::*;

use super::*;
use crate::{
    mesh::{Granularity, Key},
    topology::{Topology, testutil::*},
};

fn set(lines: &[&str]) -> BTreeSet<String> {
    lines.iter().map(|s| s.to_string()).collect()
}

fn routes(p: &Plan) -> BTreeSet<String> {
    let v: BTreeSet<String> = p.routes.iter().map(ToString::to_string).collect();
    assert_eq!(v.len(), p.routes.len());
    v
}

fn rules(p: &Plan) -> BTreeSet<String> {
    p.rules.iter().map(ToString::to_string).collect()
}

fn settings(enc: Encapsulation, local: bool) -> Settings {
    Settings {
        encapsulate: enc,
        local,
        ..Settings::default()
    }
}

#[test]
fn cross_plan_from_a() {
    let (n, p) = cross_fixture();
    let t = topo(&n, &p, Granularity::Cross, "a", "10.4.0.0/16");
    let plan = from_topology(&t, &settings(Encapsulation::Never, true));
    assert_eq!(plan.addresses, nets("10.4.0.1/16"));
    assert_eq!(
        routes(&plan),
        set(&[
            "route 10.2.2.0/24 via 192.168.1.2 dev eth0 onlink",
            "route 10.4.0.2/32 via 192.168.1.2 dev eth0 onlink",
            "route 10.2.3.0/24 via 10.4.0.3 dev kilo0 src 192.168.1.1 onlink",
            "route 192.168.2.1/32 via 10.4.0.3 dev kilo0 src 192.168.1.1 onlink",
            "route 10.2.4.0/24 via 10.4.0.4 dev kilo0 src 192.168.1.1 onlink",
            "route 192.168.2.2/32 via 10.4.0.4 dev kilo0 src 192.168.1.1 onlink",
            "route 10.5.0.0/24 dev kilo0 src 192.168.1.1",
        ])
    );
    assert!(plan.rules.is_empty());
    let keys: Vec<Key> = plan.wireguard.peers.iter().map(|p| p.public_key).collect();
    assert_eq!(
        keys,
        vec![key(3), key(4), key(5)],
        "no tunnel to b, same location"
    );
    let d = &plan.datapath;
    let n = |s: &str| s.parse::<IpNet>().unwrap();
    assert_eq!(d.mesh_destinations[&n("10.2.2.0/24")].next_hop, None);
    assert_eq!(d.mesh_destinations[&n("10.4.0.2/32")].next_hop, None);
    assert_eq!(
        d.mesh_destinations[&n("10.2.3.0/24")].next_hop,
        Some(NextHop::WireGuard)
    );
    assert_eq!(
        d.masquerade_destinations
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        nets("172.16.0.0/24")
    );
    // b is in eu too: it masquerades eu's allowed-location IPs even though a carries them.
    let tb = topo(
        &cross_fixture().0,
        &p,
        Granularity::Cross,
        "b",
        "10.4.0.0/16",
    );
    let pb = from_topology(&tb, &settings(Encapsulation::Never, true));
    assert_eq!(pb.datapath.masquerade_destinations.len(), 1);
    assert_eq!(
        pb.addresses,
        nets("10.4.0.2/16"),
        "every cross node has its own WireGuard IP"
    );
}

#[test]
fn cross_plan_from_c_encapsulated() {
    let (n, p) = cross_fixture();
    let t = topo(&n, &p, Granularity::Cross, "c", "10.4.0.0/16");
    let plan = from_topology(&t, &settings(Encapsulation::Always, true));
    assert_eq!(
        routes(&plan),
        set(&[
            "route 10.2.4.0/24 via 192.168.2.2 dev tunl0 src 192.168.2.1 onlink",
            "route 10.4.0.4/32 via 192.168.2.2 dev tunl0 src 192.168.2.1 onlink",
            "route 192.168.2.2/32 via 192.168.2.2 dev tunl0 src 192.168.2.1 table 1107 onlink",
            "route 10.2.1.0/24 via 10.4.0.1 dev kilo0 src 192.168.2.1 onlink",
            "route 192.168.1.1/32 via 10.4.0.1 dev kilo0 src 192.168.2.1 onlink",
            "route 172.16.0.0/24 via 10.4.0.1 dev kilo0 src 192.168.2.1 onlink",
            "route 10.2.2.0/24 via 10.4.0.2 dev kilo0 src 192.168.2.1 onlink",
            "route 192.168.1.2/32 via 10.4.0.2 dev kilo0 src 192.168.2.1 onlink",
            "route 10.5.0.0/24 dev kilo0 src 192.168.2.1",
        ])
    );
    assert_eq!(
        rules(&plan),
        set(&[
            "ip rule from 10.2.3.0/24 to 192.168.2.2/32 lookup 1107",
            "ip rule to 192.168.2.2/32 iif kilo0 lookup 1107",
        ])
    );
    assert!(
        plan.datapath.masquerade_destinations.is_empty(),
        "172.16.0.0/24 is eu's"
    );
    assert_eq!(
        ipip_sources(&t, &settings(Encapsulation::Always, true)),
        nets("192.168.2.1/32,192.168.2.2/32")
    );
    // The datapath's IPIP: every tunl0 route's destination, wrapped toward its gateway; d may
    // send IPIP; c serves its own pods and address, and (leading itself in cross) what it
    // routes into kilo0.
    let ipip = &plan.ipip;
    let keys = |m: &BTreeMap<IpNet, DatapathEntry>| m.keys().copied().collect::<Vec<_>>();
    assert_eq!(
        keys(&ipip.encapsulate),
        nets("10.2.4.0/24,10.4.0.4/32,192.168.2.2/32")
    );
    let hop = NextHop::Ipip {
        local: "192.168.2.1".parse().unwrap(),
        remote: "192.168.2.2".parse().unwrap(),
    };
    assert!(ipip.encapsulate.values().all(|e| e.next_hop == Some(hop)));
    assert_eq!(keys(&ipip.sources), nets("192.168.2.2/32"));
    for served in [
        "10.2.3.0/24",
        "192.168.2.1/32",
        "10.2.1.0/24",
        "10.5.0.0/24",
    ] {
        assert!(
            ipip.decapsulate.contains_key(&served.parse().unwrap()),
            "{served}"
        );
    }
    assert!(
        !ipip
            .decapsulate
            .contains_key(&"10.2.4.0/24".parse().unwrap())
    );
    // Kilo's other encapsulators leave it to the CNI's device.
    let flannel = Settings {
        compatibility: Compatibility::Flannel,
        ..settings(Encapsulation::Always, true)
    };
    assert_eq!(from_topology(&t, &flannel).ipip, IpipPlan::default());
    // crosssubnet: d is inside c's /24, so no encapsulation (but d may still send IPIP).
    let plan = from_topology(&t, &settings(Encapsulation::CrossSubnet, true));
    let r = routes(&plan);
    assert!(r.contains("route 10.2.4.0/24 via 192.168.2.2 dev eth0 onlink"));
    assert!(r.contains("route 10.4.0.4/32 via 192.168.2.2 dev eth0 onlink"));
    assert!(plan.rules.is_empty());
    assert!(plan.ipip.encapsulate.is_empty());
    assert_eq!(keys(&plan.ipip.sources), nets("192.168.2.2/32"));
    assert_eq!(
        from_topology(&t, &settings(Encapsulation::Never, true)).ipip,
        IpipPlan::default()
    );
    // --local=false: nothing inside the location.
    let plan = from_topology(&t, &settings(Encapsulation::Always, false));
    assert!(!routes(&plan).iter().any(|r| r.contains("192.168.2.2 dev")));
}

#[test]
fn dual_stack_plan_leader() {
    let t = dual_topo("a");
    let plan = from_topology(&t, &settings(Encapsulation::Always, true));
    assert_eq!(plan.addresses, nets("fd04::1/64"));
    assert_eq!(
        routes(&plan),
        set(&[
            "route 10.2.2.0/24 via 192.168.0.2 dev tunl0 src 192.168.0.1 onlink",
            "route fd10:2:2::/64 via fd00:1::2 dev eth0 onlink",
            "route 192.168.0.2/32 via 192.168.0.2 dev tunl0 src 192.168.0.1 table 1107 onlink",
            "route fd10:2:3::/64 via fd04::2 dev kilo0 src fd00:1::1 onlink",
            "route fd00:2::1/128 via fd04::2 dev kilo0 src fd00:1::1 onlink",
        ])
    );
    assert_eq!(
        rules(&plan),
        set(&[
            "ip rule from 10.2.1.0/24 to 192.168.0.2/32 lookup 1107",
            "ip rule to 192.168.0.2/32 iif kilo0 lookup 1107",
        ])
    );
    assert_eq!(
        plan.wireguard.peers[0].allowed_ips,
        nets("fd10:2:3::/64,fd00:2::1/128,fd04::2/128")
    );
}

#[test]
fn dual_stack_plan_non_leader() {
    let t = dual_topo("b");
    let plan = from_topology(&t, &settings(Encapsulation::Always, true));
    assert!(plan.addresses.is_empty() && plan.wireguard.peers.is_empty());
    assert_eq!(
        routes(&plan),
        set(&[
            "route fd04::1/128 via fd00:1::1 dev eth0 onlink",
            "route 10.2.1.0/24 via 192.168.0.1 dev tunl0 src 192.168.0.2 onlink",
            "route fd10:2:1::/64 via fd00:1::1 dev eth0 onlink",
            "route 192.168.0.1/32 via 192.168.0.1 dev tunl0 src 192.168.0.2 table 1107 onlink",
            "route fd04::2/128 via fd00:1::1 dev eth0 onlink",
            "route fd10:2:3::/64 via fd00:1::1 dev eth0 onlink",
            "route fd00:2::1/128 via fd00:1::1 dev eth0 onlink",
        ])
    );
    assert_eq!(
        rules(&plan),
        set(&["ip rule from 10.2.2.0/24 to 192.168.0.1/32 lookup 1107"])
    );
    let hop = plan.datapath.mesh_destinations[&"fd10:2:3::/64".parse::<IpNet>().unwrap()].next_hop;
    assert_eq!(
        hop,
        Some(NextHop::Gateway {
            address: "fd00:1::1".parse().unwrap(),
            device: Device::Private
        })
    );
}

#[test]
fn dual_stack_plan_ipv6_only_leader() {
    let t = dual_topo("c");
    let plan = from_topology(&t, &settings(Encapsulation::Always, true));
    assert_eq!(
        routes(&plan),
        set(&[
            "route 10.2.1.0/24 dev kilo0",
            "route fd10:2:1::/64 via fd04::1 dev kilo0 src fd00:2::1 onlink",
            "route 192.168.0.1/32 dev kilo0",
            "route fd00:1::1/128 via fd04::1 dev kilo0 src fd00:2::1 onlink",
            "route 10.2.2.0/24 dev kilo0",
            "route fd10:2:2::/64 via fd04::1 dev kilo0 src fd00:2::1 onlink",
            "route 192.168.0.2/32 dev kilo0",
            "route fd00:1::2/128 via fd04::1 dev kilo0 src fd00:2::1 onlink",
        ])
    );
}

/// Kilo's `Conf.Equal` returned "equal" as soon as one peer had no endpoint on both sides,
/// skipping every later peer. Plans compare every field of every peer.
#[test]
fn wireguard_plans_compare_every_peer() {
    let p = |ips: &str, k: u8| WireGuardPeer {
        public_key: key(k),
        preshared_key: None,
        endpoint: None,
        allowed_ips: nets(ips),
        persistent_keepalive: 0,
    };
    let a = WireGuardPlan {
        listen_port: 51820,
        peers: vec![p("10.0.0.0/24", 1), p("10.1.0.0/24", 2)],
    };
    let mut b = a.clone();
    b.peers[1].allowed_ips = nets("10.1.1.0/24");
    assert_ne!(a, b);
    b.peers[1] = a.peers[1].clone();
    b.peers[1].persistent_keepalive = 25;
    assert_ne!(a, b);
}

// ---------------------------------------------------------------------------------------
// Properties over random clusters.

#[derive(Debug, Clone)]
struct Cluster {
    nodes: Vec<crate::mesh::Node>,
    peers: Vec<crate::mesh::MeshPeer>,
    granularity: Granularity,
    host: usize,
    enc: Encapsulation,
    local: bool,
}

fn cluster() -> impl Strategy<Value = Cluster> {
    let node_s = (
        0..3u8,
        proptest::option::weighted(0.8, 1..6u8),
        0..4u8,
        any::<bool>(),
        any::<bool>(),
    );
    let peer_s = proptest::collection::vec((0..6u8, 0..4u8, 20..25u8), 1..3);
    (
        proptest::collection::vec(node_s, 1..9),
        proptest::collection::vec(peer_s, 0..4),
        prop_oneof![
            Just(Granularity::Location),
            Just(Granularity::Full),
            Just(Granularity::Cross)
        ],
        any::<prop::sample::Index>(),
        prop_oneof![
            Just(Encapsulation::Never),
            Just(Encapsulation::CrossSubnet),
            Just(Encapsulation::Always)
        ],
        any::<bool>(),
    )
        .prop_map(|(ns, ps, granularity, host, enc, local)| {
            let nodes: Vec<_> = ns
                .iter()
                .enumerate()
                .map(|(i, (loc, internal, pod_dup, public, leader))| {
                    // Internal IPs come from a small pool, so nodes share them (like Kilo's fixture);
                    // a node sometimes reuses another's pod CIDR.
                    let internal = internal
                        .map(|x| format!("192.168.{}.{x}/24", x % 2))
                        .unwrap_or_default();
                    let pod = if *pod_dup == 0 {
                        "10.2.0.0/24".to_string()
                    } else {
                        format!("10.2.{}.0/24", i + 1)
                    };
                    let ep = if *public {
                        format!("1.1.1.{}:51820", i + 1)
                    } else {
                        format!("10.1.0.{}:51820", i + 1)
                    };
                    let mut n = node(
                        &format!("n{i}"),
                        &format!("l{loc}"),
                        &internal,
                        &pod,
                        &ep,
                        i as u8 + 1,
                    );
                    n.leader = *leader;
                    n
                })
                .collect();
            let peers = ps
                .iter()
                .enumerate()
                .map(|(i, ips)| {
                    let ips: Vec<String> = ips
                        .iter()
                        .map(|(a, b, len)| format!("10.5.{a}.{b}/{len}"))
                        .collect();
                    peer(&format!("p{i}"), &ips.join(","), 100 + i as u8)
                })
                .collect();
            let host = host.index(ns.len());
            Cluster {
                nodes,
                peers,
                granularity,
                host,
                enc,
                local,
            }
        })
}

fn group_of(g: Granularity, n: &crate::mesh::Node) -> String {
    match g {
        Granularity::Full => format!("node:{}", n.name),
        _ if n.internal_ips.is_empty() => format!("node:{}", n.name),
        _ => format!("location:{}", n.location),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The plan never routes one CIDR to two places, and no WireGuard CIDR is on two peers.
    #[test]
    fn one_destination_one_place(c in cluster()) {
        let t = topo(&c.nodes, &c.peers, c.granularity, &c.nodes[c.host].name, "10.4.0.0/16");
        let plan = from_topology(&t, &settings(c.enc, c.local));
        let mut seen = BTreeSet::new();
        for r in &plan.routes {
            prop_assert!(seen.insert((r.table, r.dst)), "{} routed twice", r.dst);
            prop_assert_eq!(r.dst, r.dst.trunc());
        }
        let mut wg = BTreeSet::new();
        let mut keys = BTreeSet::new();
        for p in &plan.wireguard.peers {
            prop_assert!(keys.insert(p.public_key));
            for ip in &p.allowed_ips {
                prop_assert!(wg.insert(*ip), "{} on two WireGuard peers", ip);
            }
        }
        let sorted: Vec<_> = { let mut v = plan.routes.clone(); v.sort(); v };
        prop_assert_eq!(&sorted, &plan.routes);
    }

    /// Every allowed IP of every ready node of another location and of every peer appears
    /// exactly once in a leader's WireGuard config, and nothing else does; non-leaders have none.
    #[test]
    fn every_allowed_ip_exactly_once(c in cluster()) {
        let host = &c.nodes[c.host];
        let t = topo(&c.nodes, &c.peers, c.granularity, &host.name, "10.4.0.0/16");
        let plan = from_topology(&t, &settings(c.enc, c.local));
        let mut count: BTreeMap<IpNet, usize> = BTreeMap::new();
        for p in &plan.wireguard.peers {
            for ip in &p.allowed_ips {
                *count.entry(*ip).or_default() += 1;
            }
        }
        if !t.leader {
            prop_assert!(count.is_empty());
            return Ok(());
        }
        let mine = group_of(c.granularity, host);
        let mut want = BTreeSet::new();
        for n in c.nodes.iter().filter(|n| group_of(c.granularity, n) != mine) {
            want.extend(n.pod_cidrs.iter().map(IpNet::trunc));
            want.extend(n.internal_ips.iter().map(|i| IpNet::from(i.addr())));
        }
        for s in t.segments.iter().filter(|s| s.group != t.group) {
            want.insert(IpNet::from(s.wireguard_ip));
        }
        for p in &c.peers {
            want.extend(p.allowed_ips.iter().map(IpNet::trunc));
        }
        let got: BTreeSet<IpNet> = count.keys().copied().collect();
        prop_assert_eq!(&got, &want);
        prop_assert!(count.values().all(|n| *n == 1));
    }

    /// Datapath: next hops only for remote destinations and peers, never for the local
    /// location or services; WireGuard on leaders, the leader's private IP elsewhere.
    #[test]
    fn next_hops(c in cluster()) {
        let host = &c.nodes[c.host];
        let t: Topology = topo(&c.nodes, &c.peers, c.granularity, &host.name, "10.4.0.0/16");
        let plan = from_topology(&t, &Settings { service_cidrs: nets("10.96.0.0/12"), ..settings(c.enc, c.local) });
        let local: BTreeSet<String> = c.nodes.iter().filter(|n| group_of(c.granularity, n) == group_of(c.granularity, host)).map(|n| n.name.clone()).collect();
        for (k, e) in &plan.datapath.mesh_destinations {
            match e.kind {
                EntryKind::Service => prop_assert_eq!(e.next_hop, None),
                EntryKind::Node if local.contains(&e.owner) => prop_assert_eq!(e.next_hop, None, "{}", k),
                _ => {}
            }
            if let Some(h) = e.next_hop {
                prop_assert_eq!(matches!(h, NextHop::WireGuard), t.leader);
            }
        }
    }
}

/// Nodes a (location 1, keepalive 0) and b (location 2, keepalive 25), as Kilo annotates them.
fn two_locations() -> crate::mesh::Snapshot {
    use crate::mesh::{KubeNode, Snapshot, annotations};
    let kn = |name: &str, loc: &str, ip: &str, pod: &str, ep: &str, k: u8, ka: &str| KubeNode {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            annotations: Some(
                [
                    (annotations::ENDPOINT, ep.to_string()),
                    (annotations::INTERNAL_IP, ip.to_string()),
                    (annotations::KEY, key(k).to_string()),
                    (annotations::LOCATION, loc.to_string()),
                    (annotations::PERSISTENT_KEEPALIVE, ka.to_string()),
                ]
                .into_iter()
                .map(|(a, b)| (a.to_string(), b))
                .collect(),
            ),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::core::v1::NodeSpec {
            pod_cidr: Some(pod.into()),
            ..Default::default()
        }),
        status: None,
    };
    let mut snap = Snapshot::default();
    snap.nodes.insert(
        "a".into(),
        kn(
            "a",
            "1",
            "192.168.0.1/32",
            "10.2.1.0/24",
            "1.1.1.1:51820",
            1,
            "0",
        ),
    );
    snap.nodes.insert(
        "b".into(),
        kn(
            "b",
            "2",
            "192.168.0.2/32",
            "10.2.2.0/24",
            "1.1.1.2:51820",
            2,
            "25",
        ),
    );
    snap
}

/// The agent's live-observed endpoints replace the local node's annotation (Kilo's
/// `discoverNATEndpoints`), for NAT-ed segments only.
#[test]
fn discovered_endpoints_from_settings() {
    let snap = two_locations();
    let s = Settings {
        hostname: "a".into(),
        ..Settings::default()
    };
    let ep = |p: &Planned| {
        p.plan.as_ref().unwrap().wireguard.peers[0]
            .endpoint
            .as_ref()
            .unwrap()
            .to_string()
    };
    assert_eq!(ep(&plan_for(&snap, &s)), "1.1.1.2:51820");
    let seen = [(key(2), "5.5.5.5:4000".parse().unwrap())]
        .into_iter()
        .collect();
    let s = Settings {
        discovered_endpoints: Some(seen),
        ..s
    };
    assert_eq!(ep(&plan_for(&snap, &s)), "5.5.5.5:4000");
}

/// The agent counts its own node as kg's before the snapshot shows its heartbeat, so its
/// first plans do not blame its own node for keeping Kilo's leader; a plan for any node (as
/// `kgctl` makes) goes by the heartbeats alone.
#[test]
fn the_agent_counts_its_own_node_as_kg() {
    let mut snap = two_locations();
    snap.kg_nodes = set(&["b"]);
    let blocked = |runs_kg| {
        let s = Settings {
            hostname: "a".into(),
            runs_kg,
            ..Settings::default()
        };
        let t = topology_for(&snap, &s).topology.unwrap();
        t.local_segment().unwrap().failover_blocked.clone()
    };
    assert_eq!(blocked(false).as_deref(), Some("node a runs Kilo"));
    assert_eq!(blocked(true), None);
}
