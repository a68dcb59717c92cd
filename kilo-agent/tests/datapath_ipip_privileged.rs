//! The IPIP programs on crafted packets with BPF_PROG_TEST_RUN: `kilo_encap` wraps IPv4 TCP,
//! UDP and ICMP to a destination to encapsulate (outer header fields and checksum, inner packet
//! intact) and leaves everything else byte for byte; `kilo_decap` unwraps IPIP from a location
//! node to a destination it serves and drops (and counts) IPIP from a stranger or to anything
//! else; both count what they did. Route realms are off (a test run gives a packet no route),
//! but for the test that turns them on.
use kilo_testkit as support;

use std::{collections::BTreeMap, net::Ipv4Addr};

use ipnet::IpNet;
use kilo_agent::writes::Write;
use kilo_agent::{
    datapath::{Counters, Datapath, DatapathConfig, Decision, NoResolver, Plans, Role},
    plan::{DatapathEntry, DatapathPlan, EntryKind, IpipPlan, NextHop},
};
use kilo_common::{PROG_DECAP, PROG_ENCAP};
use support::packets::{ETH_P_ARP, ETH_P_IP, checksum, eth, frame, run, v4, v6};

const OK: u32 = 0;
const SHOT: u32 = 2;
const ME: &str = "192.168.50.1";
const NEIGHBOUR: &str = "192.168.50.2";

fn entry(owner: &str, next_hop: Option<NextHop>) -> DatapathEntry {
    DatapathEntry {
        kind: EntryKind::Node,
        owner: owner.into(),
        next_hop,
    }
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ipip() -> IpipPlan {
    let hop = Some(NextHop::Ipip {
        local: ME.parse().unwrap(),
        remote: NEIGHBOUR.parse().unwrap(),
    });
    IpipPlan {
        encapsulate: BTreeMap::from([
            (net("10.42.2.0/24"), entry("n2", hop)),
            (net("192.168.50.2/32"), entry("n2", hop)),
        ]),
        sources: BTreeMap::from([(net("192.168.50.2/32"), entry("n2", None))]),
        decapsulate: BTreeMap::from([
            (net("10.42.1.0/24"), entry("n1", None)),
            (net("192.168.50.1/32"), entry("n1", None)),
        ]),
    }
}

fn open() -> Datapath {
    let mut dp = Datapath::open(DatapathConfig {
        pin_dir: None,
        ..Default::default()
    })
    .expect("load the datapath");
    let nat = DatapathPlan::default();
    let ipip = ipip();
    dp.apply(
        Plans {
            nat: &nat,
            ipip: &ipip,
        },
        &NoResolver,
    )
    .expect("apply");
    dp
}

/// An IPv4 header (TOS 0x10, DF, TTL 61) for `payload` of protocol `proto`, checksum valid.
fn ipv4(src: &str, dst: &str, proto: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0x45, 0x10, 0, 0, 0x12, 0x34, 0x40, 0, 61, proto, 0, 0];
    h[2..4].copy_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
    h.extend_from_slice(&src.parse::<Ipv4Addr>().unwrap().octets());
    h.extend_from_slice(&dst.parse::<Ipv4Addr>().unwrap().octets());
    let c = checksum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h.extend_from_slice(payload);
    h
}

fn with_eth(ip: Vec<u8>) -> Vec<u8> {
    let mut f = eth(&[], ETH_P_IP);
    f.extend(ip);
    f
}

/// A TCP SYN, a UDP datagram and an ICMP echo request from `src` to `dst`.
fn l4_packets(src: &str, dst: &str) -> Vec<(&'static str, Vec<u8>)> {
    let tcp = [
        0x9c, 0x40, 0x00, 0x50, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0,
    ];
    let udp = [0x30, 0x39, 0x00, 0x35, 0, 12, 0, 0, b'k', b'i', b'l', b'o'];
    let icmp = [8, 0, 0xf7, 0xff, 0, 0, 0, 0];
    vec![
        ("tcp", ipv4(src, dst, 6, &tcp)),
        ("udp", ipv4(src, dst, 17, &udp)),
        ("icmp", ipv4(src, dst, 1, &icmp)),
    ]
}

/// The decisions and the entries whose packet counters moved.
type Moved = (Vec<Decision>, Vec<(Role, IpNet)>);

/// Which decisions and entries moved between two counter readings (packets).
fn moved(before: &Counters, after: &Counters) -> Moved {
    let d = Decision::ALL
        .into_iter()
        .filter(|d| after.decision(*d).packets > before.decision(*d).packets)
        .collect();
    let e = after
        .entries
        .iter()
        .filter(|e| e.counter.packets > before.entry(e.role, &e.net).unwrap_or_default().packets)
        .map(|e| (e.role, e.net))
        .collect();
    (d, e)
}

/// Runs `prog` on `pkt` and says which decisions and entries it counted.
fn counted(
    dp: &Datapath,
    prog: &aya::programs::SchedClassifier,
    pkt: &[u8],
) -> (support::packets::Run, Moved) {
    let before = dp.counters().unwrap();
    let r = run(prog, pkt, 0, 0, 1);
    (r, moved(&before, &dp.counters().unwrap()))
}

/// Asserts that `prog` passes every packet byte for byte and counts none.
fn passes_untouched(dp: &Datapath, prog: &aya::programs::SchedClassifier, pkts: Vec<Vec<u8>>) {
    let before = dp.counters().unwrap();
    for pkt in pkts {
        let r = run(prog, &pkt, 0, 0, 1);
        assert_eq!((r.verdict, &r.data), (OK, &pkt), "{pkt:02x?}");
    }
    assert_eq!(dp.counters().unwrap(), before, "nothing counted");
}

fn arp() -> Vec<u8> {
    let mut arp = eth(&[], ETH_P_ARP);
    arp.extend_from_slice(&[0; 28]);
    arp
}

#[test]
fn encapsulates_tcp_udp_and_icmp_to_the_next_hop() {
    if !support::require_root("encapsulates_tcp_udp_and_icmp_to_the_next_hop") {
        return;
    }
    let dp = open();
    let prog = dp.program_named(PROG_ENCAP);
    for dst in ["10.42.2.7", NEIGHBOUR] {
        for (what, inner) in l4_packets("10.42.1.5", dst) {
            let pkt = with_eth(inner.clone());
            let (r, moved) = counted(&dp, prog, &pkt);
            assert_eq!(r.verdict, OK, "{what} to {dst}");
            assert_eq!(r.data.len(), pkt.len() + 20, "{what}: {:02x?}", r.data);
            assert_eq!(r.data[..14], pkt[..14], "{what}: Ethernet header kept");
            let outer = &r.data[14..34];
            assert_eq!(outer[0], 0x45, "{what}: version 4, 20 bytes");
            assert_eq!(outer[1], 0x10, "{what}: TOS copied");
            let len = u16::from_be_bytes([outer[2], outer[3]]) as usize;
            assert_eq!(len, inner.len() + 20, "{what}: total length");
            assert_eq!(outer[6] & 0x40, 0x40, "{what}: DF copied");
            assert_eq!(outer[8], 61, "{what}: TTL copied");
            assert_eq!(outer[9], 4, "{what}: protocol 4 (IPIP)");
            assert_eq!(checksum(outer), 0, "{what}: header checksum");
            assert_eq!(outer[12..16], [192, 168, 50, 1], "{what}: from this node");
            assert_eq!(outer[16..20], [192, 168, 50, 2], "{what}: to the next hop");
            assert_eq!(r.data[34..], inner[..], "{what}: inner packet intact");
            let key = if dst == NEIGHBOUR {
                "192.168.50.2/32"
            } else {
                "10.42.2.0/24"
            };
            assert_eq!(
                moved,
                (
                    vec![Decision::Encapsulated],
                    vec![(Role::Encapsulate, net(key))]
                ),
                "{what} to {dst}"
            );
        }
    }
}

/// Outer headers get IDs of their own (RFC 6864): without DF an underlay may fragment them, and
/// fragments of two datagrams sharing an ID would be reassembled into garbage.
#[test]
fn consecutive_outer_headers_have_distinct_ids() {
    if !support::require_root("consecutive_outer_headers_have_distinct_ids") {
        return;
    }
    let dp = open();
    let prog = dp.program_named(PROG_ENCAP);
    let mut inner = l4_packets("10.42.1.5", "10.42.2.7").remove(1).1;
    inner[6] = 0; // no DF: the underlay may fragment the outer datagram
    inner[10..12].fill(0);
    let c = checksum(&inner[..20]);
    inner[10..12].copy_from_slice(&c.to_be_bytes());
    let ids: Vec<u16> = (0..4)
        .map(|_| {
            let r = run(prog, &with_eth(inner.clone()), 0, 0, 1);
            assert_eq!(r.verdict, OK);
            let outer = &r.data[14..34];
            assert_eq!(outer[6] & 0x40, 0, "DF stays clear");
            assert_eq!(checksum(outer), 0, "header checksum");
            u16::from_be_bytes([outer[4], outer[5]])
        })
        .collect();
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "outer IDs {ids:?}");
}

#[test]
fn encapsulation_leaves_everything_else_byte_for_byte() {
    if !support::require_root("encapsulation_leaves_everything_else_byte_for_byte") {
        return;
    }
    let dp = open();
    let prog = dp.program_named(PROG_ENCAP);
    let others = vec![
        // Not a destination to encapsulate.
        with_eth(ipv4("10.42.1.5", "10.42.3.7", 6, &[0; 20])),
        with_eth(ipv4(ME, "8.8.8.8", 17, &[0; 12])),
        // IPIP already (our own, seen again after a redirect): never wrapped twice.
        with_eth(ipv4(
            ME,
            NEIGHBOUR,
            4,
            &ipv4("10.42.1.5", "10.42.2.7", 1, &[0; 8]),
        )),
        // IPv6 and ARP.
        frame(&[], v6("fd00::1"), v6("fd00::2")),
        arp(),
    ];
    passes_untouched(&dp, prog, others);
}

/// With route realms on (what kg sets once the kernel keeps them), only a packet whose route
/// carries `KILO_REALM` is looked up. BPF_PROG_TEST_RUN gives a packet no route, so a packet to
/// a destination to encapsulate passes as other traffic: untouched and uncounted. (Real
/// traffic with realms on: `mesh_ipip_privileged.rs`.)
#[test]
fn with_route_realms_on_a_packet_without_our_realm_passes_untouched() {
    if !support::require_root("with_route_realms_on_a_packet_without_our_realm_passes_untouched") {
        return;
    }
    let mut dp = open();
    assert_eq!(dp.set_route_realm(true).unwrap().get(Write::MapConfig), 1);
    assert!(dp.set_route_realm(true).unwrap().is_empty(), "unchanged");
    let pkts = ["10.42.2.7", NEIGHBOUR]
        .into_iter()
        .flat_map(|dst| l4_packets("10.42.1.5", dst))
        .map(|(_, p)| with_eth(p))
        .collect();
    passes_untouched(&dp, dp.program_named(PROG_ENCAP), pkts);
    // Off again: the full lookup wraps them.
    dp.set_route_realm(false).unwrap();
    let pkt = with_eth(l4_packets("10.42.1.5", "10.42.2.7").remove(0).1);
    let (r, moved) = counted(&dp, dp.program_named(PROG_ENCAP), &pkt);
    assert_eq!((r.verdict, r.data.len()), (OK, pkt.len() + 20));
    assert_eq!(moved.0, vec![Decision::Encapsulated]);
}

#[test]
fn decapsulates_ipip_from_the_location_to_what_this_node_serves() {
    if !support::require_root("decapsulates_ipip_from_the_location_to_what_this_node_serves") {
        return;
    }
    let dp = open();
    let prog = dp.program_named(PROG_DECAP);
    for dst in ["10.42.1.9", ME] {
        for (what, inner) in l4_packets("10.42.2.7", dst) {
            let pkt = with_eth(ipv4(NEIGHBOUR, ME, 4, &inner));
            let (r, moved) = counted(&dp, prog, &pkt);
            assert_eq!(r.verdict, OK, "{what} to {dst}");
            assert_eq!(r.data[..14], pkt[..14], "{what}: Ethernet header kept");
            assert_eq!(r.data[14..], inner[..], "{what}: exactly the inner packet");
            let served = if dst == ME {
                "192.168.50.1/32"
            } else {
                "10.42.1.0/24"
            };
            assert_eq!(
                moved,
                (
                    vec![Decision::Decapsulated],
                    vec![
                        (Role::IpipSource, net("192.168.50.2/32")),
                        (Role::Decapsulate, net(served)),
                    ]
                ),
                "{what} to {dst}"
            );
        }
    }
}

#[test]
fn ipip_from_a_stranger_or_to_elsewhere_is_refused_and_counted() {
    if !support::require_root("ipip_from_a_stranger_or_to_elsewhere_is_refused_and_counted") {
        return;
    }
    let dp = open();
    let prog = dp.program_named(PROG_DECAP);
    let inner = ipv4("10.42.2.7", "10.42.1.9", 1, &[8, 0, 0xf7, 0xff, 0, 0, 0, 0]);
    let refused = vec![
        // From outside the location.
        with_eth(ipv4("192.168.50.99", ME, 4, &inner)),
        with_eth(ipv4("203.0.113.5", ME, 4, &inner)),
        // From a location node, to a destination this node does not serve.
        with_eth(ipv4(
            NEIGHBOUR,
            ME,
            4,
            &ipv4("10.42.2.7", "10.42.3.9", 1, &[0; 8]),
        )),
        // From a location node, but fragmented.
        {
            let mut p = ipv4(NEIGHBOUR, ME, 4, &inner);
            p[6] = 0x20; // MF
            with_eth(p)
        },
    ];
    for pkt in refused {
        let (r, moved) = counted(&dp, prog, &pkt);
        assert_eq!(r.verdict, SHOT, "{pkt:02x?}");
        assert_eq!(moved.0, vec![Decision::IpipRefused]);
    }
}

#[test]
fn decapsulation_leaves_every_other_packet_byte_for_byte() {
    if !support::require_root("decapsulation_leaves_every_other_packet_byte_for_byte") {
        return;
    }
    let dp = open();
    let prog = dp.program_named(PROG_DECAP);
    let mut others: Vec<Vec<u8>> = l4_packets("203.0.113.5", ME)
        .into_iter()
        .map(|(_, p)| with_eth(p))
        .collect();
    others.extend([
        frame(&[], v4(NEIGHBOUR), v4(ME)),
        frame(&[], v6("fd00::1"), v6("fd00::2")),
        arp(),
    ]);
    passes_untouched(&dp, prog, others);
}

/// A packet the kernel cannot wrap is dropped, never sent bare onto the underlay. Here: a GSO
/// packet without a GSO type, which only BPF_PROG_TEST_RUN makes (it cannot set the type, so
/// real GSO packets, TCP super-packets from a local socket, are wrapped in
/// `mesh_ipip_privileged.rs`, where a TCP transfer crosses the encapsulation intact).
#[test]
fn a_packet_that_cannot_be_wrapped_is_dropped_not_sent_bare() {
    if !support::require_root("a_packet_that_cannot_be_wrapped_is_dropped_not_sent_bare") {
        return;
    }
    let dp = open();
    let prog = dp.program_named(PROG_ENCAP);
    let mut tcp = vec![
        0x9c, 0x40, 0x00, 0x50, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x10, 0xff, 0xff, 0, 0, 0, 0,
    ];
    tcp.extend(std::iter::repeat_n(0x5a, 2800));
    let pkt = with_eth(ipv4("10.42.1.5", "10.42.2.7", 6, &tcp));
    let before = dp.counters().unwrap();
    let r = support::packets::run_gso(prog, &pkt, 1400, 2);
    let after = dp.counters().unwrap();
    assert_eq!(r.verdict, SHOT);
    assert_eq!(moved(&before, &after).0, vec![Decision::Malformed]);
}
