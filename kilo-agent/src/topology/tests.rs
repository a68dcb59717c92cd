use super::{allowed_ips::intersect, testutil::*, *};
use crate::mesh::Granularity;

fn ip(s: &str) -> Option<IpAddr> {
    Some(s.parse().unwrap())
}

#[test]
fn is_public_like_kilo_with_ula_fixed() {
    for (a, public) in [
        ("10.1.2.3", false),
        ("172.16.0.1", false),
        ("172.31.255.1", false),
        ("172.15.0.1", true),
        ("172.32.0.1", true),
        ("192.168.7.7", false),
        ("8.8.8.8", true),
        ("fd00::1", false),
        ("2001:db8::1", true),
        // Deliberate difference: Kilo only checks fd00::/16, so these were "public".
        ("fd12::1", false),
        ("fc00::1", false),
        ("fe00::1", true),
        ("::ffff:10.1.2.3", false),
        ("::ffff:8.8.8.8", true),
    ] {
        assert_eq!(is_public(ip(a)), public, "{a}");
    }
    assert!(!is_public(None));
}

/// Kilo's TestFindLeader cases.
#[test]
fn find_leader_like_kilo() {
    let n = |name: &str, ep: &str, leader: bool| {
        let mut x = node(name, "", "", "10.2.0.0/24", ep, 1);
        x.leader = leader;
        x
    };
    let private1 = n("a", "192.168.0.1:51820", false);
    let private2 = n("b", "192.168.0.2:51820", false);
    let public1 = n("c", "1.1.1.1:51820", false);
    let public2 = n("d", "1.1.1.2:51820", false);
    let mut lp1 = private1.clone();
    lp1.leader = true;
    let mut lp2 = private2.clone();
    lp2.leader = true;
    let mut lpub2 = public2.clone();
    lpub2.leader = true;
    let cases: Vec<(&str, Vec<&Node>, usize)> = vec![
        ("one", vec![&private1], 0),
        ("non-leaders", vec![&private1, &private2], 0),
        ("leaders", vec![&private1, &lp2], 1),
        ("public", vec![&private1, &public1, &public2], 1),
        ("private leader beats public", vec![&public1, &lp2], 1),
        ("public leader first", vec![&lp1, &public1, &lpub2], 2),
        ("all", vec![&lp1, &lp2, &public1], 0),
    ];
    for (name, nodes, want) in cases {
        assert_eq!(find_leader(&nodes), want, "{name}");
    }
}

#[test]
fn allocator() {
    let s = |x: &str| x.parse::<IpNet>().unwrap();
    assert_eq!(nth_address(s("10.1.0.0/16"), 1), ip("10.1.0.1"));
    assert_eq!(nth_address(s("10.1.0.0/16"), 2), ip("10.1.0.2"));
    assert_eq!(nth_address(s("10.1.0.0/32"), 1), None);
    assert_eq!(nth_address(s("10.1.0.0/31"), 1), ip("10.1.0.1"));
    assert_eq!(nth_address(s("10.1.0.0/31"), 2), None);
    assert_eq!(nth_address(s("fd04::/64"), 3), ip("fd04::3"));
}

/// Deliberate difference: Kilo hands out an empty IP before failing; we fail at once.
#[test]
fn out_of_addresses_is_an_error() {
    let nodes = by_name(
        vec![
            node("a", "1", "192.168.0.1/32", "10.2.1.0/24", "1.1.1.1:1", 1),
            node("b", "2", "192.168.0.2/32", "10.2.2.0/24", "1.1.1.2:1", 2),
        ],
        |n| n.name.clone(),
    );
    let opts = Options {
        granularity: Granularity::Location,
        hostname: "a".into(),
        port: 51820,
        subnet: "10.4.0.0/31".parse().unwrap(),
        service_cidrs: vec![],
        persistent_keepalive: 0,
        kg_nodes: Default::default(),
    };
    assert!(matches!(
        Topology::new(&nodes, &BTreeMap::new(), &opts),
        Err(TopologyError::OutOfAddresses { .. })
    ));
}

/// Kilo's TestDeduplicatePeerIPs cases.
#[test]
fn dedup_peer_ips_like_kilo() {
    let p1 = peer("1", "10.0.0.1/32,10.0.0.2/32", 1);
    let p2 = peer("2", "10.0.0.2/32,10.0.0.3/32", 2);
    let got = dedup_peer_ips([p1.clone(), p2.clone()].iter());
    assert_eq!(got[0].allowed_ips, nets("10.0.0.1/32,10.0.0.2/32"));
    assert_eq!(got[1].allowed_ips, nets("10.0.0.3/32"));
    let got = dedup_peer_ips([p2.clone(), p1.clone()].iter());
    assert_eq!(got[1].allowed_ips, nets("10.0.0.1/32"));
    let all = peer("0", "10.0.0.1/32,10.0.0.2/32,10.0.0.3/32", 3);
    let got = dedup_peer_ips([all, p1, p2].iter());
    assert!(got[1].allowed_ips.is_empty() && got[2].allowed_ips.is_empty());
    let selfdup = peer("s", "10.0.0.1/32,10.0.0.1/32", 4);
    assert_eq!(
        dedup_peer_ips([selfdup].iter())[0].allowed_ips,
        nets("10.0.0.1/32")
    );
}

/// Kilo's TestFilterAllowedIPs: overlaps with other locations, with allowed IPs (including the
/// WireGuard IPs) and with peers are dropped.
#[test]
fn filter_allowed_location_ips() {
    let mut a = node("a", "1", "192.168.0.1/32", "10.2.1.0/24", "1.1.1.1:1", 1);
    a.allowed_location_ips = nets("192.168.178.0/24,10.4.0.2/32,172.16.0.0/16,10.9.0.0/16");
    let mut b = node("b", "2", "192.168.0.2/32", "10.2.2.0/24", "1.1.1.2:1", 2);
    b.allowed_location_ips = nets("192.168.178.3/32,10.2.2.128/25");
    let p = peer("p", "172.16.5.0/24", 9);
    let t = topo(&[a, b], &[p], Granularity::Location, "a", "10.4.0.0/16");
    // a: 192.168.178.0/24 overlaps b's 192.168.178.3/32; 10.4.0.2/32 is b's WireGuard IP,
    // but b's WireGuard IP is allocated after a is filtered (Kilo's order), so it stays;
    // 172.16.0.0/16 overlaps the peer.
    assert_eq!(
        t.segments[0].allowed_location_ips,
        nets("10.4.0.2/32,10.9.0.0/16")
    );
    // b: 192.168.178.3/32 overlaps a's filtered list? a kept no 192.168.178.0/24, so it stays;
    // 10.2.2.128/25 is inside b's own pod CIDR.
    assert_eq!(t.segments[1].allowed_location_ips, nets("192.168.178.3/32"));
}

#[test]
fn discovered_endpoints_only_for_nat_segments() {
    let mut a = node(
        "a",
        "1",
        "192.168.0.1/32",
        "10.2.1.0/24",
        "1.1.1.1:51820",
        1,
    );
    let mut b = node(
        "b",
        "2",
        "192.168.0.2/32",
        "10.2.2.0/24",
        "1.1.1.2:51820",
        2,
    );
    let c = node(
        "c",
        "3",
        "192.168.0.3/32",
        "10.2.3.0/24",
        "1.1.1.3:51820",
        3,
    );
    let seen: SocketAddr = "5.5.5.5:4000".parse().unwrap();
    a.discovered_endpoints.insert(key(2), seen);
    a.discovered_endpoints.insert(key(3), seen);
    b.persistent_keepalive = 25;
    let t = topo(&[a, b, c], &[], Granularity::Location, "a", "10.4.0.0/16");
    let conf = t.conf();
    assert_eq!(
        conf[0].endpoint.as_ref().unwrap().to_string(),
        "5.5.5.5:4000",
        "b is behind NAT"
    );
    assert_eq!(
        conf[1].endpoint.as_ref().unwrap().to_string(),
        "1.1.1.3:51820",
        "c is not"
    );
}

/// Cross granularity, checked by hand: a node per segment, WireGuard only across locations,
/// the location's allowed-location IPs on the node findLeader picks (a, first public).
#[test]
fn cross_topology() {
    let (nodes, peers) = cross_fixture();
    let t = topo(&nodes, &peers, Granularity::Cross, "a", "10.4.0.0/16");
    assert!(t.leader);
    assert_eq!(t.location, "node:a");
    assert_eq!(t.group, "location:eu");
    assert_eq!(t.wireguard_cidr.to_string(), "10.4.0.1/16");
    let locs: Vec<(&str, &str, String)> = t
        .segments
        .iter()
        .map(|s| {
            (
                s.location.as_str(),
                s.group.as_str(),
                s.wireguard_ip.to_string(),
            )
        })
        .collect();
    assert_eq!(
        locs,
        vec![
            ("node:a", "location:eu", "10.4.0.1".into()),
            ("node:b", "location:eu", "10.4.0.2".into()),
            ("node:c", "location:us", "10.4.0.3".into()),
            ("node:d", "location:us", "10.4.0.4".into()),
        ]
    );
    assert_eq!(t.segments[0].allowed_location_ips, nets("172.16.0.0/24"));
    assert!(t.segments[1].allowed_location_ips.is_empty());
    let conf: Vec<(Key, String)> = t
        .conf()
        .iter()
        .map(|p| {
            let ips: Vec<String> = p.allowed_ips.iter().map(ToString::to_string).collect();
            (p.public_key, ips.join(" "))
        })
        .collect();
    assert_eq!(
        conf,
        vec![
            (key(3), "10.2.3.0/24 192.168.2.1/32 10.4.0.3/32".to_string()),
            (key(4), "10.2.4.0/24 192.168.2.2/32 10.4.0.4/32".to_string()),
            (key(5), "10.5.0.0/24".to_string()),
        ]
    );
    // From c, a carries eu's allowed-location IPs; b is a direct peer too.
    let t = topo(&nodes, &peers, Granularity::Cross, "c", "10.4.0.0/16");
    let conf = t.conf();
    assert_eq!(conf.len(), 3);
    assert_eq!(conf[0].public_key, key(1));
    assert_eq!(
        conf[0].allowed_ips,
        nets("10.2.1.0/24,192.168.1.1/32,10.4.0.1/32,172.16.0.0/24")
    );
    assert_eq!(
        conf[1].allowed_ips,
        nets("10.2.2.0/24,192.168.1.2/32,10.4.0.2/32")
    );
    // A peer sees every node.
    assert_eq!(t.peer_conf("p").len(), 4);
}

#[test]
fn cross_node_without_internal_ip_is_its_own_location() {
    let (mut nodes, peers) = cross_fixture();
    nodes[1].internal_ips.clear();
    let t = topo(&nodes, &peers, Granularity::Cross, "a", "10.4.0.0/16");
    assert_eq!(t.segments[1].group, "node:b");
    assert_eq!(t.conf().len(), 4, "b, c, d and the peer");
}

/// Dual-stack, checked by hand: IPv6 pod CIDRs, internal IPs, endpoints and subnet.
#[test]
fn dual_stack_topology() {
    let t = dual_topo("a");
    assert!(t.leader, "a has the public (IPv6) endpoint");
    assert_eq!(t.wireguard_cidr.to_string(), "fd04::1/64");
    assert_eq!(
        t.segments[0].allowed_ips,
        nets(
            "10.2.1.0/24,fd10:2:1::/64,192.168.0.1/32,fd00:1::1/128,10.2.2.0/24,fd10:2:2::/64,192.168.0.2/32,fd00:1::2/128,fd04::1/128"
        )
    );
    let conf = t.conf();
    assert_eq!(conf.len(), 1);
    assert_eq!(
        conf[0].allowed_ips,
        nets("fd10:2:3::/64,fd00:2::1/128,fd04::2/128")
    );
    assert_eq!(
        conf[0].endpoint.as_ref().unwrap().to_string(),
        "[2001:db8::3]:51820"
    );
    let t = topo(
        &dual_fixture()[..2],
        &[],
        Granularity::Location,
        "b",
        "fd04::/64",
    );
    assert!(!t.leader);
    assert_eq!(t.wireguard_cidr.to_string(), "fd04::/64");
}

/// Kilo's filter, literally (scan everything), to check the indexed version against.
fn naive_filtered(t: &Topology, raw: &[Vec<IpNet>]) -> Vec<Vec<IpNet>> {
    let mut alips: Vec<Vec<IpNet>> = raw.to_vec();
    for k in 0..t.segments.len() {
        let kept = alips[k]
            .iter()
            .filter(|ip| {
                for (j, s) in t.segments.iter().enumerate() {
                    if s.group != t.segments[k].group && alips[j].iter().any(|i| intersect(ip, i)) {
                        return false;
                    }
                    let mut allowed = s.allowed_ips.clone();
                    if j > k {
                        allowed.pop(); // its WireGuard IP was not allocated yet
                    }
                    if allowed.iter().any(|i| i.contains(&ip.addr())) {
                        return false;
                    }
                }
                !t.peers
                    .iter()
                    .any(|p| p.allowed_ips.iter().any(|i| intersect(ip, i)))
            })
            .copied()
            .collect();
        alips[k] = kept;
    }
    alips
}

proptest::proptest! {
    #[test]
    fn indexed_filter_equals_kilos_scan(
        locs in proptest::collection::vec((0..4u8, proptest::collection::vec((0..4u8, 0..8u8, 20..33u8), 0..3)), 1..8),
        peer_ips in proptest::collection::vec((0..4u8, 0..8u8, 20..33u8), 0..4),
    ) {
        let net = |(a, b, l): (u8, u8, u8)| -> IpNet { format!("10.{a}.{b}.{}/{l}", b % 3).parse().unwrap() };
        let nodes: Vec<Node> = locs
            .iter()
            .enumerate()
            .map(|(i, (loc, al))| {
                let mut n = node(&format!("n{i}"), &format!("l{loc}"), &format!("10.{loc}.{i}.1/24"), &format!("10.{}.{i}.0/24", loc + 1), "1.1.1.1:1", i as u8 + 1);
                n.allowed_location_ips = al.iter().copied().map(net).collect();
                n
            })
            .collect();
        let ps: Vec<MeshPeer> = peer_ips.iter().enumerate().map(|(i, p)| { let mut x = peer(&format!("p{i}"), "", 50 + i as u8); x.allowed_ips = vec![net(*p)]; x }).collect();
        for g in [Granularity::Location, Granularity::Full] {
            let t = topo(&nodes, &ps, g, "n0", "10.0.0.0/16");
            let raw: Vec<Vec<IpNet>> = t.segments.iter().map(|s| {
                let members: Vec<&Node> = nodes.iter().filter(|n| s.nodes.iter().any(|m| m.name == n.name)).collect();
                merged_alips(&members)
            }).collect();
            let want = naive_filtered(&t, &raw);
            let got: Vec<Vec<IpNet>> = t.segments.iter().map(|s| s.allowed_location_ips.clone()).collect();
            proptest::prop_assert_eq!(got, want);
        }
    }
}

/// A demoted leader is skipped by Kilo's order only where every node of the location and every
/// other location's leader runs kg; the successor is the next in that order.
#[test]
fn failover_skips_the_demoted_leader_only_where_no_kilo_agent_disagrees() {
    let (a, b, c, d) = (
        node(
            "a",
            "eu",
            "192.168.1.1/24",
            "10.2.1.0/24",
            "1.1.1.1:51820",
            1,
        ),
        node(
            "b",
            "eu",
            "192.168.1.2/24",
            "10.2.2.0/24",
            "1.1.1.2:51820",
            2,
        ),
        node(
            "c",
            "eu",
            "192.168.1.3/24",
            "10.2.3.0/24",
            "1.1.1.3:51820",
            3,
        ),
        node(
            "d",
            "us",
            "192.168.2.1/24",
            "10.2.4.0/24",
            "2.2.2.1:51820",
            4,
        ),
    );
    let mut demoted = a.clone();
    demoted.demoted_by = Some("b".into());
    let topology = |nodes: &[&Node], kg: &[&str], host: &str| {
        let nodes = by_name(nodes.iter().map(|n| (*n).clone()).collect(), |n| {
            n.name.clone()
        });
        Topology::new(
            &nodes,
            &BTreeMap::new(),
            &Options {
                granularity: Granularity::Location,
                hostname: host.into(),
                port: 51820,
                subnet: "10.4.0.0/16".parse().unwrap(),
                service_cidrs: Vec::new(),
                persistent_keepalive: 0,
                kg_nodes: kg.iter().map(|s| s.to_string()).collect(),
            },
        )
        .unwrap()
    };
    let eu = |t: &Topology| {
        let s = t.segments[0].clone();
        (
            s.leader_name().to_string(),
            s.successor.map(|i| s.nodes[i].name.clone()),
            s.failover_blocked,
            s.key,
        )
    };
    let all = ["a", "b", "c", "d"];
    // Nothing demoted: Kilo's leader, and the next in line watches it.
    let t = topology(&[&a, &b, &c, &d], &all, "a");
    assert!(t.leader);
    assert_eq!(eu(&t), ("a".into(), Some("b".into()), None, key(1)));
    // a demoted: b leads with its key, c watches it; a is no leader, b is.
    let t = topology(&[&demoted, &b, &c, &d], &all, "a");
    assert!(!t.leader);
    assert_eq!(t.wireguard_cidr, "10.4.0.0/16".parse().unwrap());
    assert_eq!(eu(&t), ("b".into(), Some("c".into()), None, key(2)));
    let t = topology(&[&demoted, &b, &c, &d], &all, "b");
    assert!(t.leader);
    assert_eq!(t.wireguard_cidr, "10.4.0.1/16".parse().unwrap());
    // Seen from the other location: the same leader, endpoint and key.
    let t = topology(&[&demoted, &b, &c, &d], &all, "d");
    assert_eq!(eu(&t).0, "b");
    assert_eq!(t.segments[0].endpoint, b.endpoint);
    // A node of the location runs Kilo: Kilo's leader is kept and nobody watches it.
    let t = topology(&[&demoted, &b, &c, &d], &["a", "b", "d"], "b");
    assert!(!t.leader);
    assert_eq!(
        eu(&t),
        ("a".into(), None, Some("node c runs Kilo".into()), key(1))
    );
    // Another location's leader runs Kilo: the same.
    let t = topology(&[&demoted, &b, &c, &d], &["a", "b", "c"], "d");
    assert_eq!(
        eu(&t),
        (
            "a".into(),
            None,
            Some("the leader d of another location runs Kilo".into()),
            key(1)
        )
    );
    // Every node demoted: Kilo's order over all of them; no successor.
    let mut b2 = b.clone();
    b2.demoted_by = Some("a".into());
    let t = topology(&[&demoted, &b2, &d], &all, "d");
    assert_eq!(eu(&t), ("a".into(), None, None, key(1)));
    // Other granularities have no location leader to fail over.
    let t = topo(
        &[demoted.clone(), b.clone()],
        &[],
        Granularity::Full,
        "a",
        "10.4.0.0/16",
    );
    assert!(
        t.segments
            .iter()
            .all(|s| s.successor.is_none() && s.failover_blocked.is_none())
    );
}
