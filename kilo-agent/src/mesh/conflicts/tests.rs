use std::collections::BTreeMap;

use ipnet::IpNet;
use proptest::prelude::*;

use super::*;
use crate::{
    mesh::{Granularity, Snapshot, annotations},
    plan::{self, Settings},
    topology::testutil::{by_name, key, nets, node, peer, topo},
};

fn resolve(
    nodes: &[Node],
    peers: &[MeshPeer],
    services: &str,
) -> (
    BTreeMap<String, Node>,
    BTreeMap<String, MeshPeer>,
    Vec<ObjectError>,
) {
    let mut n = by_name(nodes.to_vec(), |n| n.name.clone());
    let mut p = by_name(peers.to_vec(), |p| p.name.clone());
    let subnet = "10.4.0.0/16".parse().unwrap();
    let errors = resolve_conflicts(&mut n, &mut p, &nets(services), subnet);
    (n, p, errors)
}

fn values<T: Clone>(m: &BTreeMap<String, T>) -> Vec<T> {
    m.values().cloned().collect()
}

fn abc() -> Vec<Node> {
    vec![
        node(
            "a",
            "1",
            "192.168.0.1/24",
            "10.2.1.0/24",
            "1.1.1.1:51820",
            1,
        ),
        node(
            "b",
            "2",
            "192.168.0.2/24",
            "10.2.2.0/24",
            "1.1.1.2:51820",
            2,
        ),
        node(
            "c",
            "2",
            "192.168.0.3/24",
            "10.2.3.0/24",
            "1.1.1.3:51820",
            3,
        ),
    ]
}

#[test]
fn valid_objects_are_untouched() {
    let peers = [peer("p", "10.5.0.0/24,10.0.0.0/8", 9)];
    let (n, p, errors) = resolve(&abc(), &peers, "10.96.0.0/12");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(values(&n), abc());
    assert_eq!(values(&p), peers);
}

#[test]
fn same_key_first_name_wins_and_the_clone_is_left_out() {
    let mut nodes = abc();
    nodes[2].key = Some(key(1)); // c is a clone of a
    let (n, p, errors) = resolve(&nodes, &[peer("p", "10.5.0.0/24", 9)], "");
    assert_eq!(n.keys().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    let e = &errors[0];
    assert_eq!(
        (e.kind, e.name.as_str(), e.field.as_str()),
        (ObjectKind::Node, "c", "annotation kilo.squat.ai/key")
    );
    assert_eq!(
        e.to_string(),
        "node \"c\": annotation kilo.squat.ai/key: same WireGuard key as node \"a\"; \
         node \"c\" left out of the mesh"
    );
    // The rest of the mesh is what it would be without c.
    for g in [Granularity::Location, Granularity::Full] {
        let got = topo(&values(&n), &values(&p), g, "b", "10.4.0.0/16");
        let want = topo(&abc()[..2], &values(&p), g, "b", "10.4.0.0/16");
        assert_eq!(got, want);
    }
}

#[test]
fn overlapping_pod_cidrs_first_name_wins() {
    let mut nodes = abc();
    nodes[1].pod_cidrs = nets("10.2.1.128/25"); // inside a's
    nodes[2].pod_cidrs = nets("10.2.0.0/16"); // contains a's
    let d = node(
        "d",
        "3",
        "192.168.0.4/24",
        "10.2.4.0/24",
        "1.1.1.4:51820",
        4,
    );
    nodes.push(d.clone());
    let (n, _, errors) = resolve(&nodes, &[], "");
    // b and c lose to a; d only overlaps c, which is out, so d stays.
    assert_eq!(n.keys().collect::<Vec<_>>(), ["a", "d"]);
    let got: Vec<_> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        got,
        [
            "node \"b\": spec.podCIDR: 10.2.1.128/25 overlaps pod CIDR 10.2.1.0/24 of node \"a\"; \
             node \"b\" left out of the mesh",
            "node \"c\": spec.podCIDR: 10.2.0.0/16 overlaps pod CIDR 10.2.1.0/24 of node \"a\"; \
             node \"c\" left out of the mesh",
        ]
    );
    let got = topo(&values(&n), &[], Granularity::Full, "d", "10.4.0.0/16");
    let want = topo(
        &[abc()[0].clone(), d],
        &[],
        Granularity::Full,
        "d",
        "10.4.0.0/16",
    );
    assert_eq!(got, want);
}

#[test]
fn nodes_and_service_cidrs_beat_peers() {
    let p = peer(
        "p",
        "10.2.1.0/25,192.168.0.2/32,10.96.0.10/32,10.2.3.0/24,10.0.0.0/8,10.5.0.0/24",
        9,
    );
    let (n, peers, errors) = resolve(&abc(), &[p], "10.96.0.0/12");
    assert_eq!(values(&n), abc());
    // Claims containing a node's range are kept: the longer prefix still wins everywhere.
    assert_eq!(peers["p"].allowed_ips, nets("10.0.0.0/8,10.5.0.0/24"));
    let got: Vec<_> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        got,
        [
            "peer \"p\": spec.allowedIPs[0]: 10.2.1.0/25 lies within pod CIDR 10.2.1.0/24 of \
             node \"a\"; dropped from the peer",
            "peer \"p\": spec.allowedIPs[1]: 192.168.0.2/32 lies within internal IP \
             192.168.0.2/32 of node \"b\"; dropped from the peer",
            "peer \"p\": spec.allowedIPs[2]: 10.96.0.10/32 lies within service CIDR 10.96.0.0/12; \
             dropped from the peer",
            "peer \"p\": spec.allowedIPs[3]: 10.2.3.0/24 lies within pod CIDR 10.2.3.0/24 of \
             node \"c\"; dropped from the peer",
        ]
    );
    // The same as if the peer had been written without the lost claims.
    let want = topo(
        &abc(),
        &[peer("p", "10.0.0.0/8,10.5.0.0/24", 9)],
        Granularity::Full,
        "a",
        "10.4.0.0/16",
    );
    assert_eq!(
        topo(
            &abc(),
            &values(&peers),
            Granularity::Full,
            "a",
            "10.4.0.0/16"
        ),
        want
    );
}

#[test]
fn the_wireguard_ips_nodes_may_get_beat_peers() {
    // Three ready nodes may get 10.4.0.1 to 10.4.0.3 (in any granularity); .4 and up are free.
    let p = peer("p", "10.4.0.3/32,10.4.0.4/32,10.4.0.0/16", 9);
    let (_, peers, errors) = resolve(&abc(), &[p], "");
    assert_eq!(peers["p"].allowed_ips, nets("10.4.0.4/32,10.4.0.0/16"));
    let got: Vec<_> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        got,
        [
            "peer \"p\": spec.allowedIPs[0]: 10.4.0.3/32 lies within WireGuard IP 10.4.0.3/32 (one \
          per ready node in 10.4.0.0/16); dropped from the peer"
        ]
    );
}

/// Between Peers nothing is a conflict: nested claims are kept (longest prefix wins), and
/// the same text twice is left to the topology's deduplication (`deduplicatePeerIPs`).
#[test]
fn between_peers_nested_and_equal_claims_are_kept() {
    let peers = [
        peer("gateway-office", "172.20.0.0/16", 1),
        peer("vpn-backup", "172.20.0.0/16,172.20.5.0/24", 2),
        peer("wide", "10.5.0.1/16,10.0.0.0/8", 3),
        // The same network as gateway-office's, but not the same text (Kilo keeps host bits
        // and compares `IPNet.String()`): kept.
        peer("with-host-bits", "172.20.0.1/16", 4),
    ];
    let (_, p, errors) = resolve(&abc(), &peers, "");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(values(&p), peers);
    let t = topo(&abc(), &values(&p), Granularity::Full, "a", "10.4.0.0/16");
    let ips: Vec<_> = t.peers.iter().map(|p| p.allowed_ips.clone()).collect();
    assert_eq!(
        ips,
        [
            nets("172.20.0.0/16"),
            nets("172.20.5.0/24"),
            nets("10.5.0.1/16,10.0.0.0/8"),
            nets("172.20.0.1/16"),
        ],
        "only the exact duplicate is dropped"
    );
}

#[test]
fn a_peer_cannot_take_a_node_range_in_the_plan() {
    // Without the conflict pass the peer's /25 would out-prefix node a's /24 in the plan.
    let mut nodes = abc();
    nodes[2].key = Some(key(1));
    let (n, p, _) = resolve(&nodes, &[peer("p", "10.2.1.0/25,10.5.0.0/24", 9)], "");
    let t = topo(
        &values(&n),
        &values(&p),
        Granularity::Full,
        "b",
        "10.4.0.0/16",
    );
    let plan = plan::from_topology(&t, &Settings::default());
    let p_ips: Vec<IpNet> = plan
        .wireguard
        .peers
        .iter()
        .filter(|w| w.public_key == key(9))
        .flat_map(|w| w.allowed_ips.clone())
        .collect();
    assert_eq!(p_ips, nets("10.5.0.0/24"));
}

/// A ready node in Kubernetes form.
fn kube_node(name: &str, k: u8, pods: &str) -> KubeNodeJson {
    serde_json::json!({
        "metadata": {"name": name, "annotations": {
            annotations::KEY: key(k).to_string(),
            annotations::ENDPOINT: format!("1.1.1.{k}:51820"),
            annotations::INTERNAL_IP: format!("192.168.0.{k}/24"),
        }},
        "spec": {"podCIDR": pods},
    })
}

type KubeNodeJson = serde_json::Value;

/// A snapshot where c is a clone of a (same key) and b's pod CIDR is a's.
pub(crate) fn cloned_snapshot() -> Snapshot {
    let mut nodes = BTreeMap::new();
    let mut c = kube_node("c", 3, "10.2.3.0/24");
    c["metadata"]["annotations"][annotations::KEY] = key(1).to_string().into();
    for (n, v) in [
        ("a", kube_node("a", 1, "10.2.1.0/24")),
        ("b", kube_node("b", 2, "10.2.1.0/24")),
        ("c", c),
    ] {
        nodes.insert(n.to_string(), serde_json::from_value(v).unwrap());
    }
    Snapshot {
        nodes,
        ..Snapshot::default()
    }
}

#[test]
fn plan_for_reports_the_losers_and_plans_the_rest() {
    let settings = |host: &str| Settings {
        hostname: host.into(),
        granularity: Granularity::Full,
        ..Settings::default()
    };
    let planned = plan::plan_for(&cloned_snapshot(), &settings("a"));
    let invalid: Vec<_> = planned
        .errors
        .iter()
        .map(|e| match e {
            plan::PlanError::Object(o) => (o.name.as_str(), o.field.as_str()),
            plan::PlanError::Topology(t) => panic!("{t}"),
        })
        .collect();
    assert_eq!(
        invalid,
        [("b", "spec.podCIDR"), ("c", "annotation kilo.squat.ai/key")]
    );
    assert_eq!(planned.ready_nodes, 1);
    assert!(planned.plan.is_some());
    // A loser plans nothing: it is not in the mesh.
    let planned = plan::plan_for(&cloned_snapshot(), &settings("c"));
    assert!(planned.plan.is_none());
}

fn arb_net() -> impl Strategy<Value = IpNet> {
    // A small space, so that claims collide often: 10.2.0.0/16 (pods), 10.96.0.0/16
    // (services), 192.168.0.0/24 (internal IPs), 10.4.0.0/16 (WireGuard IPs).
    (
        prop::sample::select(vec![[10, 2], [10, 96], [192, 168], [10, 4]]),
        0u8..4,
        0u8..4,
        prop::sample::select(vec![8u8, 16, 23, 24, 25, 32]),
    )
        .prop_map(|([a, b], c, d, len)| {
            IpNet::new([a, b, c, d * 64 + 1].into(), len)
                .unwrap()
                .trunc()
        })
}

proptest! {
    /// Whatever the nodes and peers claim, after the pass no two nodes share a key or pod
    /// addresses, and in the plan no Peer's allowed IP lies within a node's range, a service
    /// CIDR or a WireGuard IP.
    #[test]
    fn no_peer_takes_a_node_or_service_range(
        nodes in prop::collection::vec((0u8..4, arb_net()), 1..6),
        peers in prop::collection::vec(prop::collection::vec(arb_net(), 1..4), 0..4),
    ) {
        let nodes: Vec<Node> = nodes.iter().enumerate().map(|(i, (k, pods))| {
            let mut n = node(&format!("n{i}"), &format!("{i}"), &format!("192.168.0.{i}/24"),
                             "10.0.0.0/32", &format!("1.1.1.{i}:51820"), *k);
            n.pod_cidrs = vec![*pods];
            n
        }).collect();
        let peers: Vec<MeshPeer> = peers.iter().enumerate().map(|(i, ips)| MeshPeer {
            allowed_ips: ips.clone(),
            ..peer(&format!("p{i}"), "", 100 + i as u8)
        }).collect();
        let services = "10.96.0.0/20";
        let (n, p, _) = resolve(&nodes, &peers, services);
        let kept: Vec<&Node> = n.values().collect();
        for (i, a) in kept.iter().enumerate() {
            for b in &kept[i + 1..] {
                prop_assert_ne!(a.key, b.key);
                let (x, y) = (a.pod_cidrs[0], b.pod_cidrs[0]);
                prop_assert!(!x.contains(&y) && !y.contains(&x), "{} {}", x, y);
            }
        }
        let mut ranges: Vec<IpNet> = nets(services);
        for k in &kept {
            ranges.extend(k.pod_cidrs.iter().copied());
            ranges.extend(k.internal_ips.iter().map(|i| IpNet::from(i.addr())));
        }
        let host = kept[0].name.clone();
        let t = topo(&values(&n), &values(&p), Granularity::Full, &host, "10.4.0.0/16");
        ranges.extend(t.segments.iter().map(|s| IpNet::from(s.wireguard_ip)));
        let plan = plan::from_topology(&t, &Settings::default());
        let peer_keys: Vec<_> = p.values().map(|p| p.public_key).collect();
        for w in plan.wireguard.peers.iter().filter(|w| peer_keys.contains(&w.public_key)) {
            for ip in &w.allowed_ips {
                prop_assert!(!ranges.iter().any(|r| r.contains(ip)), "{} in {:?}", ip, ranges);
            }
        }
    }
}
