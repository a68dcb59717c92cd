//! Round trips of the parsers: CIDRs, keys and endpoints, as annotations and Peer fields.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use proptest::prelude::*;

use super::*;

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<u32>().prop_map(|a| IpAddr::V4(Ipv4Addr::from(a))),
        // An IPv4-mapped address reads back as IPv4, as in Go.
        any::<u128>().prop_map(|a| IpAddr::V6(Ipv6Addr::from(a)).to_canonical()),
    ]
}

/// Leading or trailing whitespace, which Kilo never trims.
fn space() -> impl Strategy<Value = (String, String)> {
    prop_oneof![
        "[ \t\u{a0}]{1,2}".prop_map(|s| (s, String::new())),
        "[ \t\u{a0}]{1,2}".prop_map(|s| (String::new(), s)),
    ]
}

fn cidr() -> impl Strategy<Value = IpNet> {
    (ip(), any::<u8>()).prop_map(|(ip, p)| {
        let max = if ip.is_ipv4() { 32 } else { 128 };
        IpNet::new(ip, p % (max + 1)).unwrap()
    })
}

fn dns() -> impl Strategy<Value = String> {
    proptest::collection::vec("[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", 1..4).prop_map(|l| l.join("."))
}

proptest! {
    #[test]
    fn cidr_round_trip(n in cidr()) {
        let parsed = parse_cidr(&n.to_string()).unwrap();
        prop_assert_eq!(parsed, n, "host bits are kept");
    }

    #[test]
    fn key_round_trip(b in any::<[u8; 32]>()) {
        let k = Key(b);
        prop_assert_eq!(k.to_string().parse::<Key>().unwrap(), k);
    }

    #[test]
    fn ip_endpoint_round_trip(ip in ip(), port in 1..=u16::MAX) {
        let e = Endpoint { host: Host::Ip(ip), port };
        prop_assert_eq!(e.to_string().parse::<Endpoint>().unwrap(), e);
    }

    #[test]
    fn dns_endpoint_round_trip(name in dns(), port in 1..=u16::MAX) {
        // A name made of digits and dots only would be an IPv4 address.
        prop_assume!(name.parse::<IpAddr>().is_err());
        let e = Endpoint { host: Host::Dns(name), port };
        prop_assert_eq!(e.to_string().parse::<Endpoint>().unwrap(), e);
    }

    /// Whitespace around a valid value makes it invalid, as in Kilo: nothing is trimmed.
    #[test]
    fn whitespace_is_never_trimmed(n in cidr(), key in any::<[u8; 32]>(), ip in ip(),
                                   port in 1..=u16::MAX, (pre, post) in space()) {
        let wrap = |v: String| format!("{pre}{v}{post}");
        prop_assert!(parse_cidr(&wrap(n.to_string())).is_err());
        prop_assert!(wrap(Key(key).to_string()).parse::<Key>().is_err());
        let e = Endpoint { host: Host::Ip(ip), port };
        prop_assert!(wrap(e.to_string()).parse::<Endpoint>().is_err());
    }

    /// A peer built from random valid values survives CRD → mesh → CRD.
    #[test]
    fn peer_round_trip(ips in proptest::collection::vec(cidr(), 1..4), key in any::<[u8; 32]>(),
                       ep in proptest::option::of((ip(), 1..=u16::MAX)), ka in 0..=u16::MAX) {
        prop_assume!(key != [0; 32]);
        let p = MeshPeer {
            name: "p".into(),
            allowed_ips: ips,
            public_key: Key(key),
            endpoint: ep.map(|(ip, port)| Endpoint { host: Host::Ip(ip), port }),
            persistent_keepalive: ka,
            preshared_key: None,
        };
        prop_assert_eq!(MeshPeer::from_crd(&p.to_crd()).unwrap(), (p, vec![]));
    }

    /// Node annotations written from typed values parse back to them.
    #[test]
    fn node_annotations_round_trip(internal in cidr(), wg in cidr(), alips in proptest::collection::vec(cidr(), 0..3),
                                   key in any::<[u8; 32]>(), ep in (ip(), 1..=u16::MAX), ka in 0..=u16::MAX) {
        let ep = Endpoint { host: Host::Ip(ep.0), port: ep.1 };
        let alip_text: Vec<String> = alips.iter().map(ToString::to_string).collect();
        let ann = [
            (annotations::INTERNAL_IP, internal.to_string()),
            (annotations::WIREGUARD_IP, wg.to_string()),
            (annotations::ALLOWED_LOCATION_IPS, alip_text.join(",")),
            (annotations::KEY, Key(key).to_string()),
            (annotations::ENDPOINT, ep.to_string()),
            (annotations::PERSISTENT_KEEPALIVE, ka.to_string()),
        ];
        let kn = KubeNode {
            metadata: kube::api::ObjectMeta {
                name: Some("n".into()),
                annotations: Some(ann.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()),
                ..Default::default()
            },
            ..Default::default()
        };
        let (n, errs) = Node::from_kube(&kn, DEFAULT_TOPOLOGY_LABEL);
        prop_assert!(errs.is_empty(), "{:?}", errs);
        prop_assert_eq!(n.internal_ips, vec![internal]);
        prop_assert_eq!(n.wireguard_ip, Some(wg));
        prop_assert_eq!(n.allowed_location_ips, alips);
        prop_assert_eq!(n.key, Some(Key(key)));
        prop_assert_eq!(n.endpoint, Some(ep));
        prop_assert_eq!(n.persistent_keepalive, ka);
    }
}
