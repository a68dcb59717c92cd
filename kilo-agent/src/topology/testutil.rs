//! Builders for typed nodes and peers in unit tests.
use std::collections::BTreeMap;

use ipnet::IpNet;

use super::{Options, Topology};
use crate::mesh::{Granularity, Key, MeshPeer, Node};

pub fn key(b: u8) -> Key {
    let mut k = [0u8; 32];
    k[0] = b;
    k[31] = 1;
    Key(k)
}

pub fn nets(s: &str) -> Vec<IpNet> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| x.trim().parse().unwrap())
        .collect()
}

/// `internal` and `pods` are comma-separated CIDR lists ("" for none).
pub fn node(name: &str, location: &str, internal: &str, pods: &str, endpoint: &str, k: u8) -> Node {
    Node {
        name: name.into(),
        endpoint: (!endpoint.is_empty()).then(|| endpoint.parse().unwrap()),
        internal_ips: nets(internal),
        no_internal_ip: false,
        cni_compatibility_ip: None,
        key: Some(key(k)),
        last_seen: None,
        leader: false,
        location: location.into(),
        persistent_keepalive: 0,
        pod_cidrs: nets(pods),
        wireguard_ip: None,
        discovered_endpoints: BTreeMap::new(),
        allowed_location_ips: Vec::new(),
        granularity: None,
        demoted_by: None,
    }
}

pub fn peer(name: &str, ips: &str, k: u8) -> MeshPeer {
    MeshPeer {
        name: name.into(),
        allowed_ips: nets(ips),
        public_key: key(k),
        endpoint: None,
        persistent_keepalive: 0,
        preshared_key: None,
    }
}

pub fn by_name<T>(items: Vec<T>, name: impl Fn(&T) -> String) -> BTreeMap<String, T> {
    items.into_iter().map(|i| (name(&i), i)).collect()
}

pub fn topo(
    nodes: &[Node],
    peers: &[MeshPeer],
    g: Granularity,
    host: &str,
    subnet: &str,
) -> Topology {
    Topology::new(
        &by_name(nodes.to_vec(), |n| n.name.clone()),
        &by_name(peers.to_vec(), |p| p.name.clone()),
        &Options {
            granularity: g,
            hostname: host.into(),
            port: 51820,
            subnet: subnet.parse().unwrap(),
            service_cidrs: Vec::new(),
            persistent_keepalive: 0,
            kg_nodes: Default::default(),
        },
    )
    .unwrap()
}

/// Cross granularity: a and b in eu (b with allowed-location IPs), c and d in us, all with
/// public endpoints; a peer p.
pub fn cross_fixture() -> (Vec<Node>, Vec<MeshPeer>) {
    let a = node(
        "a",
        "eu",
        "192.168.1.1/24",
        "10.2.1.0/24",
        "1.1.1.1:51820",
        1,
    );
    let mut b = node(
        "b",
        "eu",
        "192.168.1.2/24",
        "10.2.2.0/24",
        "1.1.1.2:51820",
        2,
    );
    b.allowed_location_ips = nets("172.16.0.0/24");
    let c = node(
        "c",
        "us",
        "192.168.2.1/24",
        "10.2.3.0/24",
        "2.2.2.1:51820",
        3,
    );
    let d = node(
        "d",
        "us",
        "192.168.2.2/24",
        "10.2.4.0/24",
        "2.2.2.2:51820",
        4,
    );
    (vec![a, b, c, d], vec![peer("p", "10.5.0.0/24", 5)])
}

/// Dual-stack: a (public IPv6 endpoint) and b (private IPv4 endpoint) in location 1, c
/// (IPv6 only) in location 2.
pub fn dual_fixture() -> Vec<Node> {
    vec![
        node(
            "a",
            "1",
            "192.168.0.1/24,fd00:1::1/64",
            "10.2.1.0/24,fd10:2:1::/64",
            "[2001:db8::1]:51820",
            1,
        ),
        node(
            "b",
            "1",
            "192.168.0.2/24,fd00:1::2/64",
            "10.2.2.0/24,fd10:2:2::/64",
            "10.1.0.2:51820",
            2,
        ),
        node(
            "c",
            "2",
            "fd00:2::1/64",
            "fd10:2:3::/64",
            "[2001:db8::3]:51820",
            3,
        ),
    ]
}

/// The dual-stack fixture at location granularity in fd04::/64, seen from `host`.
pub fn dual_topo(host: &str) -> Topology {
    topo(
        &dual_fixture(),
        &[],
        Granularity::Location,
        host,
        "fd04::/64",
    )
}
