//! The TC program on crafted packets with BPF_PROG_TEST_RUN: verdict, mark and counters for
//! IPv4/IPv6, Ethernet (with VLAN tags) and raw-IP framing, hits and misses, longest prefix,
//! NAT sources, allowed-location IPs, truncated and malformed packets, and the fast path.
mod support;

use std::collections::BTreeMap;

use ipnet::IpNet;
use kilo_agent::{
    datapath::{
        Counter, Counters, Datapath, DatapathConfig, DatapathMaps, Decision, Framing, NoResolver,
        Role,
    },
    plan::{DatapathEntry, DatapathPlan, EntryKind},
};
use kilo_common::{ENTRY_NEIGH, ENTRY_REDIRECT, ENTRY_SERVICE, EntryValue, FAMILY_V4};
use support::{
    netns::NetNs,
    packets::{self, ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IP, eth, frame, ip, run, v4, v6},
};

const OK: u32 = 0;
const REDIRECT: u32 = 7;
const MARK: u32 = kilo_common::DEFAULT_MARK;

fn entries(list: &[(&str, EntryKind)]) -> BTreeMap<IpNet, DatapathEntry> {
    list.iter()
        .map(|(net, kind)| {
            (
                net.parse().unwrap(),
                DatapathEntry {
                    kind: *kind,
                    owner: format!("owner-of-{net}"),
                    next_hop: None,
                },
            )
        })
        .collect()
}

fn plan() -> DatapathPlan {
    use EntryKind::*;
    DatapathPlan {
        mesh_destinations: entries(&[
            ("10.0.0.0/8", Node),
            ("10.1.0.0/16", Peer),
            ("10.96.0.0/12", Service),
            ("fd00:1::/48", Node),
            ("fd00:1:2::/64", Peer),
        ]),
        nat_sources: entries(&[("10.244.1.0/24", LocalPods), ("fd00:244:1::/64", LocalPods)]),
        masquerade_destinations: entries(&[
            ("192.168.50.0/24", AllowedLocation),
            // Inside a mesh destination: the mesh wins.
            ("10.1.2.0/24", AllowedLocation),
            ("fd00:50::/64", AllowedLocation),
        ]),
    }
}

fn open() -> Datapath {
    let mut dp = Datapath::open(DatapathConfig {
        pin_dir: None,
        ..Default::default()
    })
    .expect("load the datapath");
    dp.sync(&plan(), &NoResolver).expect("sync");
    dp
}

fn delta(
    before: &Counters,
    after: &Counters,
) -> (BTreeMap<Decision, Counter>, BTreeMap<(Role, IpNet), u64>) {
    let d = Decision::ALL
        .iter()
        .map(|d| {
            let (a, b) = (before.decision(*d), after.decision(*d));
            (
                *d,
                Counter {
                    packets: b.packets - a.packets,
                    bytes: b.bytes - a.bytes,
                },
            )
        })
        .filter(|(_, c)| c.packets > 0)
        .collect();
    let e = after
        .entries
        .iter()
        .map(|e| {
            let a = before.entry(e.role, &e.net).unwrap_or_default();
            ((e.role, e.net), e.counter.packets - a.packets)
        })
        .filter(|(_, p)| *p > 0)
        .collect();
    (d, e)
}

/// Runs one packet and checks verdict, mark, the one decision counter that moved (packets and
/// bytes) and exactly which entries counted it.
#[track_caller]
fn check(
    dp: &mut Datapath,
    framing: Framing,
    ifindex: u32,
    pkt: &[u8],
    mark_in: u32,
    want: (u32, u32, Decision),
    want_entries: &[(Role, &str)],
) -> packets::Run {
    let before = dp.counters().unwrap();
    let r = run(dp.program(framing), pkt, mark_in, ifindex, 1);
    let after = dp.counters().unwrap();
    let (d, e) = delta(&before, &after);
    assert_eq!(
        (r.verdict, r.mark),
        (want.0, want.1),
        "verdict/mark for {pkt:02x?} (decisions {d:?}, entries {e:?}, out {:02x?})",
        r.data
    );
    let bytes = pkt.len() as u64;
    assert_eq!(
        d,
        BTreeMap::from([(want.2, Counter { packets: 1, bytes })]),
        "decision counters"
    );
    let we: BTreeMap<(Role, IpNet), u64> = want_entries
        .iter()
        .map(|(r, n)| ((*r, n.parse().unwrap()), 1))
        .collect();
    assert_eq!(e, we, "entry counters");
    r
}

#[test]
fn ipv4_ethernet_decisions() {
    if !support::require_root("ipv4_ethernet_decisions") {
        return;
    }
    let mut dp = open();
    use Decision::*;
    let l2 = Framing::L2;
    // NAT source to the internet: masqueraded.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("10.244.1.5"), v4("8.8.8.8")),
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "10.244.1.0/24")],
    );
    // NAT source to a mesh destination: left alone; the longest prefix (/16, not /8) counts it.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("10.244.1.5"), v4("10.1.5.5")),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("10.244.1.5"), v4("10.7.0.1")),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.0.0.0/8")],
    );
    // Not a NAT source, not a masquerade destination: left alone.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("172.16.0.1"), v4("8.8.8.8")),
        0,
        (OK, 0, Pass),
        &[],
    );
    // Allowed-location IPs are masqueraded from anywhere...
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("172.16.0.1"), v4("192.168.50.9")),
        0,
        (OK, MARK, Masquerade),
        &[(Role::MasqueradeDestination, "192.168.50.0/24")],
    );
    // ...and both entries count a NAT source sending there.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("10.244.1.5"), v4("192.168.50.9")),
        0,
        (OK, MARK, Masquerade),
        &[
            (Role::NatSource, "10.244.1.0/24"),
            (Role::MasqueradeDestination, "192.168.50.0/24"),
        ],
    );
    // ...unless they are also a mesh destination.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("172.16.0.1"), v4("10.1.2.3")),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
    // Other mark bits (kube-proxy's 0x4000) are kept, ours added.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("10.244.1.5"), v4("8.8.8.8")),
        0x4000,
        (OK, 0x4000 | MARK, Masquerade),
        &[(Role::NatSource, "10.244.1.0/24")],
    );
    // ...and left untouched when we do not masquerade.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("172.16.0.1"), v4("8.8.8.8")),
        0x4000,
        (OK, 0x4000, Pass),
        &[],
    );
    // The packet is never rewritten.
    let pkt = frame(&[], v4("10.244.1.5"), v4("8.8.8.8"));
    let r = run(dp.program(l2), &pkt, 0, 0, 1);
    assert_eq!(r.data, pkt);
}

#[test]
fn ipv6_ethernet_decisions() {
    if !support::require_root("ipv6_ethernet_decisions") {
        return;
    }
    let mut dp = open();
    use Decision::*;
    let l2 = Framing::L2;
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v6("fd00:244:1::5"), v6("2001:db8::1")),
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "fd00:244:1::/64")],
    );
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v6("fd00:244:1::5"), v6("fd00:1:2::9")),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "fd00:1:2::/64")],
    );
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v6("fd00:244:1::5"), v6("fd00:1:0:3::9")),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "fd00:1::/48")],
    );
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v6("fd00:99::1"), v6("2001:db8::1")),
        0,
        (OK, 0, Pass),
        &[],
    );
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v6("fd00:99::1"), v6("fd00:50::7")),
        0,
        (OK, MARK, Masquerade),
        &[(Role::MasqueradeDestination, "fd00:50::/64")],
    );
    // An IPv4-mapped address does not match IPv4 entries (the family is part of the key).
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v6("::ffff:10.244.1.5"), v6("2001:db8::1")),
        0,
        (OK, 0, Pass),
        &[],
    );
}

#[test]
fn vlan_tags_are_skipped() {
    if !support::require_root("vlan_tags_are_skipped") {
        return;
    }
    let mut dp = open();
    use Decision::*;
    let l2 = Framing::L2;
    let q = [(ETH_P_8021Q, 7)];
    let qinq = [(ETH_P_8021AD, 100), (ETH_P_8021Q, 7)];
    check(
        &mut dp,
        l2,
        0,
        &frame(&q, v4("10.244.1.5"), v4("8.8.8.8")),
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "10.244.1.0/24")],
    );
    check(
        &mut dp,
        l2,
        0,
        &frame(&qinq, v4("10.244.1.5"), v4("10.1.5.5")),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
    check(
        &mut dp,
        l2,
        0,
        &frame(&qinq, v6("fd00:244:1::5"), v6("2001:db8::1")),
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "fd00:244:1::/64")],
    );
    // A tag with nothing after it is truncated.
    let mut p = eth(&[], ETH_P_8021Q);
    p.extend_from_slice(&[0, 7]);
    check(&mut dp, l2, 0, &p, 0, (OK, 0, Malformed), &[]);
}

#[test]
fn truncated_and_malformed_packets_pass_untouched() {
    if !support::require_root("truncated_and_malformed_packets_pass_untouched") {
        return;
    }
    let mut dp = open();
    use Decision::*;
    let l2 = Framing::L2;
    let full4 = frame(&[], v4("10.244.1.5"), v4("8.8.8.8"));
    let full6 = frame(&[], v6("fd00:244:1::5"), v6("2001:db8::1"));
    // The kernel's test runner refuses an untagged IP frame shorter than its IP header, so cut
    // tagged frames (the program parses the tag, then finds the IP header cut short).
    let q = [(ETH_P_8021Q, 7)];
    let tagged4 = frame(&q, v4("10.244.1.5"), v4("8.8.8.8"));
    let tagged6 = frame(&q, v6("fd00:244:1::5"), v6("2001:db8::1"));
    for cut in [18, 19, 30, 37] {
        let r = check(
            &mut dp,
            l2,
            0,
            &tagged4[..cut],
            0x20,
            (OK, 0x20, Malformed),
            &[],
        );
        assert_eq!(r.data, tagged4[..cut], "left untouched");
    }
    for cut in [18, 40, 57] {
        check(&mut dp, l2, 0, &tagged6[..cut], 0, (OK, 0, Malformed), &[]);
    }
    // A bare header with no payload is complete: decided normally.
    check(
        &mut dp,
        l2,
        0,
        &tagged4[..38],
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "10.244.1.0/24")],
    );
    check(
        &mut dp,
        l2,
        0,
        &full4[..34],
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "10.244.1.0/24")],
    );
    // Wrong version nibble for the ethertype, and an IHL below 5.
    let mut bad = full4.clone();
    bad[14] = 0x65;
    check(&mut dp, l2, 0, &bad, 0, (OK, 0, Malformed), &[]);
    let mut bad = full4.clone();
    bad[14] = 0x44;
    check(&mut dp, l2, 0, &bad, 0, (OK, 0, Malformed), &[]);
    let mut bad = full6.clone();
    bad[14] = 0x45;
    check(&mut dp, l2, 0, &bad, 0, (OK, 0, Malformed), &[]);
    // Not IP at all.
    let mut arp = eth(&[], ETH_P_ARP);
    arp.extend_from_slice(&[0u8; 28]);
    check(&mut dp, l2, 0, &arp, 0, (OK, 0, NotIp), &[]);
}

#[test]
fn raw_ip_framing_on_a_device_without_mac_header() {
    if !support::require_root("raw_ip_framing_on_a_device_without_mac_header") {
        return;
    }
    // The loader picks the program by the device's hardware type.
    let ns = NetNs::new("dpl3");
    ns.sh("ip tuntap add dev tun0 mode tun && ip link add veth0 type veth peer name veth1");
    ns.run(|| {
        assert_eq!(kilo_agent::datapath::framing("tun0").unwrap(), Framing::L3);
        assert_eq!(kilo_agent::datapath::framing("veth0").unwrap(), Framing::L2);
        assert!(kilo_agent::datapath::framing("nope0").is_err());
    });
    // BPF_PROG_TEST_RUN always hands a TC program the data from its first byte, like a TC hook
    // on a raw-IP device (WireGuard, TUN) does: the packets below start at the IP header.
    // (The kernel requires at least 14 bytes of input.)
    let mut dp = open();
    use Decision::*;
    let l3 = Framing::L3;
    let m4 = ip(v4("10.244.1.5"), v4("8.8.8.8"), 64, 10);
    let r = check(
        &mut dp,
        l3,
        0,
        &m4,
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "10.244.1.0/24")],
    );
    assert_eq!(r.data, m4, "the packet is left as it was");
    check(
        &mut dp,
        l3,
        0,
        &ip(v4("10.244.1.5"), v4("10.1.9.9"), 64, 10),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
    check(
        &mut dp,
        l3,
        0,
        &ip(v4("172.16.0.1"), v4("192.168.50.1"), 64, 10),
        0,
        (OK, MARK, Masquerade),
        &[(Role::MasqueradeDestination, "192.168.50.0/24")],
    );
    check(
        &mut dp,
        l3,
        0,
        &ip(v6("fd00:244:1::5"), v6("2001:db8::1"), 64, 10),
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "fd00:244:1::/64")],
    );
    check(
        &mut dp,
        l3,
        0,
        &ip(v6("fd00:244:1::5"), v6("fd00:1:2::1"), 64, 10),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "fd00:1:2::/64")],
    );
    check(
        &mut dp,
        l3,
        0,
        &ip(v4("172.16.0.1"), v4("8.8.8.8"), 64, 10),
        0,
        (OK, 0, Pass),
        &[],
    );
    // Truncated raw IP: inside the IPv4 and the IPv6 header; a bad IHL.
    let full6 = ip(v6("fd00:244:1::5"), v6("2001:db8::1"), 64, 10);
    check(&mut dp, l3, 0, &m4[..19], 0, (OK, 0, Malformed), &[]);
    check(&mut dp, l3, 0, &full6[..39], 0, (OK, 0, Malformed), &[]);
    let mut bad = m4.clone();
    bad[0] = 0x43;
    check(&mut dp, l3, 0, &bad, 0, (OK, 0, Malformed), &[]);
    // Not IP (version nibble 1).
    check(&mut dp, l3, 0, &[0x10; 28], 0, (OK, 0, NotIp), &[]);
    // The Ethernet program on the same bytes would misparse: framing matters.
    let r = run(dp.program(Framing::L2), &m4, 0, 0, 1);
    assert_eq!(r.mark, 0);
}

#[test]
fn fast_path_redirects_mesh_but_never_services() {
    if !support::require_root("fast_path_redirects_mesh_but_never_services") {
        return;
    }
    let mut dp = open();
    use Decision::*;
    let l2 = Framing::L2;
    // Give the /16 peer entry and the service an egress (raw writes, as a resolver would).
    let redirect = |counter, flags| EntryValue {
        counter,
        flags,
        kind: 3,
        ifindex: 1,
        nh_family: FAMILY_V4,
        nh_addr: [10, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    };
    let peer: IpNet = "10.1.0.0/16".parse().unwrap();
    let svc: IpNet = "10.96.0.0/12".parse().unwrap();
    let slot = |dp: &mut Datapath, net| {
        dp.maps()
            .entries(Role::Mesh)
            .unwrap()
            .into_iter()
            .find(|(n, _)| *n == net)
            .unwrap()
            .1
            .counter
    };
    let (ps, ss) = (slot(&mut dp, peer), slot(&mut dp, svc));
    dp.maps()
        .insert(
            Role::Mesh,
            peer,
            &redirect(ps, ENTRY_REDIRECT | ENTRY_NEIGH),
        )
        .unwrap();
    dp.maps()
        .insert(
            Role::Mesh,
            svc,
            &redirect(ss, ENTRY_REDIRECT | ENTRY_SERVICE),
        )
        .unwrap();
    let to_peer = frame(&[], v4("10.244.1.5"), v4("10.1.5.5"));
    // Off by default: left to the stack.
    check(
        &mut dp,
        l2,
        0,
        &to_peer,
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
    assert!(!dp.set_fast_path(true).unwrap().is_empty());
    assert!(dp.set_fast_path(true).unwrap().is_empty());
    let r = check(
        &mut dp,
        l2,
        0,
        &to_peer,
        0,
        (REDIRECT, 0, Redirect),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
    // Forwarded like a router: TTL 64 -> 63 with a valid header checksum, nothing else changed.
    assert_eq!(r.data[14 + 8], 63);
    assert_eq!(
        packets::checksum(&r.data[14..34]),
        0,
        "IPv4 header checksum"
    );
    assert_eq!(r.data[..22], to_peer[..22]);
    assert_eq!(r.data[26..], to_peer[26..]);
    // Services are never redirected, even with an egress in their entry.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("10.244.1.5"), v4("10.96.0.10")),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.96.0.0/12")],
    );
    // A packet whose TTL would expire goes to the stack (which sends the ICMP error).
    let mut ttl1 = eth(&[], ETH_P_IP);
    ttl1.extend(ip(v4("10.244.1.5"), v4("10.1.5.5"), 1, 10));
    let r = check(
        &mut dp,
        l2,
        0,
        &ttl1,
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
    assert_eq!(r.data, ttl1);
    // Entries without an egress are not redirected; masquerading is unaffected.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("10.244.1.5"), v4("10.7.0.1")),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.0.0.0/8")],
    );
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v4("10.244.1.5"), v4("8.8.8.8")),
        0,
        (OK, MARK, Masquerade),
        &[(Role::NatSource, "10.244.1.0/24")],
    );
    // IPv6 hop limit.
    let six: IpNet = "fd00:1:2::/64".parse().unwrap();
    let s6 = slot(&mut dp, six);
    dp.maps()
        .insert(Role::Mesh, six, &redirect(s6, ENTRY_REDIRECT))
        .unwrap();
    let p6 = frame(&[], v6("fd00:244:1::5"), v6("fd00:1:2::9"));
    let r = check(
        &mut dp,
        l2,
        0,
        &p6,
        0,
        (REDIRECT, 0, Redirect),
        &[(Role::Mesh, "fd00:1:2::/64")],
    );
    assert_eq!(r.data[14 + 7], 63);
    // Turning it off again.
    dp.set_fast_path(false).unwrap();
    check(
        &mut dp,
        l2,
        0,
        &to_peer,
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
}

#[test]
fn counters_sum_bytes_over_repeats() {
    if !support::require_root("counters_sum_bytes_over_repeats") {
        return;
    }
    let dp = open();
    let pkt = frame(&[], v4("10.244.1.5"), v4("8.8.8.8"));
    let before = dp.counters().unwrap();
    run(dp.program(Framing::L2), &pkt, 0, 0, 1000);
    let after = dp.counters().unwrap();
    let d = after.decision(Decision::Masquerade);
    let b = before.decision(Decision::Masquerade);
    assert_eq!(d.packets - b.packets, 1000);
    assert_eq!(d.bytes - b.bytes, 1000 * pkt.len() as u64);
    let net: IpNet = "10.244.1.0/24".parse().unwrap();
    let e = after.entry(Role::NatSource, &net).unwrap();
    assert_eq!(
        e.packets - before.entry(Role::NatSource, &net).unwrap().packets,
        1000
    );
    let labelled = after.entries.iter().find(|e| e.net == net).unwrap();
    assert_eq!(labelled.kind, Some(EntryKind::LocalPods));
}

#[test]
fn prefix_lengths_follow_the_entries() {
    if !support::require_root("prefix_lengths_follow_the_entries") {
        return;
    }
    use Decision::*;
    let l2 = Framing::L2;
    let mut dp = open();
    let to = |d: &str| frame(&[], v4("172.16.0.1"), v4(d));
    // /16 and /8 present: the /16 wins.
    check(
        &mut dp,
        l2,
        0,
        &to("10.1.5.5"),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.0.0/16")],
    );
    // Drop the /16 (the only /16 in the mesh table): the /8 takes over, one delete and one
    // index write.
    let mut p = plan();
    p.mesh_destinations
        .remove(&"10.1.0.0/16".parse::<IpNet>().unwrap());
    let w = dp.sync(&p, &NoResolver).unwrap();
    assert_eq!(
        (w.get("map_delete"), w.get("map_index"), w.total()),
        (1, 1, 2),
        "{w}"
    );
    check(
        &mut dp,
        l2,
        0,
        &to("10.1.5.5"),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.0.0.0/8")],
    );
    // A /32 inside it and a default route: the most specific still wins, the rest falls to /0.
    let mut p2 = p.clone();
    for net in ["10.1.5.5/32", "0.0.0.0/0"] {
        p2.mesh_destinations.insert(
            net.parse().unwrap(),
            DatapathEntry {
                kind: EntryKind::Peer,
                owner: "p".into(),
                next_hop: None,
            },
        );
    }
    let w = dp.sync(&p2, &NoResolver).unwrap();
    assert_eq!((w.get("map_insert"), w.get("map_index")), (2, 2), "{w}");
    check(
        &mut dp,
        l2,
        0,
        &to("10.1.5.5"),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.1.5.5/32")],
    );
    check(
        &mut dp,
        l2,
        0,
        &to("10.1.5.6"),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "10.0.0.0/8")],
    );
    check(
        &mut dp,
        l2,
        0,
        &to("8.8.8.8"),
        0,
        (OK, 0, Mesh),
        &[(Role::Mesh, "0.0.0.0/0")],
    );
    // IPv6 is unaffected by IPv4 lengths.
    check(
        &mut dp,
        l2,
        0,
        &frame(&[], v6("fd00:99::1"), v6("2001:db8::1")),
        0,
        (OK, 0, Pass),
        &[],
    );
    // Another entry of an existing length: no index write.
    let mut p3 = p2.clone();
    p3.mesh_destinations.insert(
        "10.2.0.0/16".parse().unwrap(),
        DatapathEntry {
            kind: EntryKind::Peer,
            owner: "p".into(),
            next_hop: None,
        },
    );
    p3.mesh_destinations.insert(
        "10.3.0.0/16".parse().unwrap(),
        DatapathEntry {
            kind: EntryKind::Peer,
            owner: "p".into(),
            next_hop: None,
        },
    );
    let w = dp.sync(&p3, &NoResolver).unwrap();
    assert_eq!((w.get("map_insert"), w.get("map_index")), (2, 1), "{w}");
    let p4 = {
        let mut p = p3.clone();
        p.mesh_destinations
            .remove(&"10.3.0.0/16".parse::<IpNet>().unwrap());
        p
    };
    let w = dp.sync(&p4, &NoResolver).unwrap();
    assert_eq!((w.get("map_delete"), w.get("map_index")), (1, 0), "{w}");
}

#[test]
fn too_many_prefix_lengths_fail_naming_the_entry_and_keep_the_rest() {
    if !support::require_root("too_many_prefix_lengths_fail_naming_the_entry_and_keep_the_rest") {
        return;
    }
    let mut dp = open();
    let before: Vec<IpNet> = dp
        .maps()
        .entries(Role::Mesh)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    // 33 IPv4 lengths (/0 ../32) on top of the /8 and /16 already there: one too many.
    let mut p = plan();
    for len in 0..=32u8 {
        let net = IpNet::V4(ipnet::Ipv4Net::new([11, 0, 0, 0].into(), len).unwrap()).trunc();
        p.mesh_destinations.insert(
            net,
            DatapathEntry {
                kind: EntryKind::Peer,
                owner: format!("peer-{len}"),
                next_hop: None,
            },
        );
    }
    let err = dp.sync(&p, &NoResolver).unwrap_err().to_string();
    assert!(
        err.contains("prefix lengths") && err.contains("owner"),
        "{err}"
    );
    let after: Vec<IpNet> = dp
        .maps()
        .entries(Role::Mesh)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for net in before {
        assert!(after.contains(&net), "{net} lost");
    }
    // Still deciding (the IPv4 entries inserted before the failure, /0 among them, are in
    // force: they are the new topology; IPv6 is untouched).
    let r = run(
        dp.program(Framing::L2),
        &frame(&[], v6("fd00:244:1::5"), v6("2001:db8::1")),
        0,
        0,
        1,
    );
    assert_eq!(r.mark, MARK);
}

#[test]
fn a_full_table_fails_naming_the_entry_and_keeps_the_old_topology() {
    if !support::require_root("a_full_table_fails_naming_the_entry_and_keeps_the_old_topology") {
        return;
    }
    let mut dp = Datapath::open(DatapathConfig {
        pin_dir: None,
        max_entries: 8,
        ..Default::default()
    })
    .unwrap();
    let old = plan();
    dp.sync(&old, &NoResolver).unwrap();
    // A whole new mesh of 8 entries: with the 5 old ones still in, the table overflows.
    let mut new = old.clone();
    new.mesh_destinations = (0..8u8)
        .map(|i| {
            (
                IpNet::V4(ipnet::Ipv4Net::new([10, 50, i, 0].into(), 24).unwrap()),
                DatapathEntry {
                    kind: EntryKind::Node,
                    owner: format!("node-{i}"),
                    next_hop: None,
                },
            )
        })
        .collect();
    let err = dp.sync(&new, &NoResolver).unwrap_err().to_string();
    assert!(
        err.contains("full") && err.contains("10.50.") && err.contains("node-"),
        "{err}"
    );
    let have: Vec<IpNet> = dp
        .maps()
        .entries(Role::Mesh)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for net in old.mesh_destinations.keys() {
        assert!(have.contains(net), "{net} lost: {have:?}");
    }
    // The old topology still decides: a pod to a mesh node is left alone.
    let before = dp.counters().unwrap();
    let r = run(
        dp.program(Framing::L2),
        &frame(&[], v4("10.244.1.5"), v4("10.1.5.5")),
        0,
        0,
        1,
    );
    assert_eq!(r.mark, 0);
    let after = dp.counters().unwrap();
    assert_eq!(
        after.decision(Decision::Mesh).packets,
        before.decision(Decision::Mesh).packets + 1
    );
}
