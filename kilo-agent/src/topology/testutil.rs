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
        },
    )
    .unwrap()
}
