//! The TC program on crafted packets with BPF_PROG_TEST_RUN: verdict, mark and counters for
//! IPv4/IPv6, Ethernet (with VLAN tags) and raw-IP framing, hits and misses, longest prefix,
//! NAT sources, allowed-location IPs, truncated and malformed packets, and the fast path.
use kilo_testkit as support;

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;
use kilo_agent::writes::Write;
use kilo_agent::{
    datapath::{
        Counter, Counters, Datapath, DatapathConfig, DatapathMaps, Decision, Framing, NoResolver,
        Role, Trie,
    },
    plan::{DatapathEntry, DatapathPlan, EntryKind},
};
use kilo_common::{
    ENTRY_MASQUERADE, ENTRY_NEIGH, ENTRY_REDIRECT, ENTRY_SERVICE, EntryValue, FAMILY_V4,
};
use support::{
    bpffs::BpfFs,
    netns::NetNs,
    packets::{self, ETH_P_8021AD, ETH_P_8021Q, ETH_P_ARP, ETH_P_IP, eth, frame, ip, run, v4, v6},
};

const OK: u32 = 0;
const REDIRECT: u32 = 7;
const MARK: u32 = kilo_common::DEFAULT_MARK;

fn entry(kind: EntryKind, owner: String) -> DatapathEntry {
    DatapathEntry {
        kind,
        owner,
        next_hop: None,
    }
}

fn entries(list: &[(&str, EntryKind)]) -> BTreeMap<IpNet, DatapathEntry> {
    list.iter()
        .map(|(net, kind)| {
            (
                net.parse().unwrap(),
                entry(*kind, format!("owner-of-{net}")),
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
    dp.apply(&plan(), &NoResolver).expect("apply");
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

/// What one run must show: the packet arrives with `mark_in` and leaves with `verdict` and
/// `mark`; `decision` counts it (one packet, its bytes) and exactly `entries` count it.
#[derive(Debug, Clone)]
struct Want {
    mark_in: u32,
    verdict: u32,
    mark: u32,
    decision: Decision,
    entries: Vec<(Role, &'static str)>,
}

impl Want {
    /// The packet arrives carrying `mark_in` and must leave with `mark`.
    fn marks(self, mark_in: u32, mark: u32) -> Self {
        Want {
            mark_in,
            mark,
            ..self
        }
    }
}

fn want(verdict: u32, mark: u32, decision: Decision, entries: &[(Role, &'static str)]) -> Want {
    Want {
        mark_in: 0,
        verdict,
        mark,
        decision,
        entries: entries.to_vec(),
    }
}

/// Masqueraded (our mark set), counted by `entries`.
fn masq(entries: &[(Role, &'static str)]) -> Want {
    want(OK, MARK, Decision::Masquerade, entries)
}

/// Left alone as mesh traffic, counted by the mesh entry `net`.
fn mesh(net: &'static str) -> Want {
    want(OK, 0, Decision::Mesh, &[(Role::Mesh, net)])
}

/// Redirected by the fast path, counted by the mesh entry `net`.
fn redirected(net: &'static str) -> Want {
    want(REDIRECT, 0, Decision::Redirect, &[(Role::Mesh, net)])
}

/// Left alone and counted by no entry (`Pass`, `Malformed`, `NotIp`).
fn untouched(decision: Decision) -> Want {
    want(OK, 0, decision, &[])
}

const NAT4: (Role, &str) = (Role::NatSource, "10.244.1.0/24");
const NAT6: (Role, &str) = (Role::NatSource, "fd00:244:1::/64");
const ALLOWED4: (Role, &str) = (Role::MasqueradeDestination, "192.168.50.0/24");
const ALLOWED6: (Role, &str) = (Role::MasqueradeDestination, "fd00:50::/64");

fn addr(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// An untagged Ethernet frame from `src` to `dst`.
fn eth_ip(src: &str, dst: &str) -> Vec<u8> {
    frame(&[], addr(src), addr(dst))
}

/// A raw IP packet (TTL 64, 10 bytes of payload) from `src` to `dst`.
fn raw_ip(src: &str, dst: &str) -> Vec<u8> {
    ip(addr(src), addr(dst), 64, 10)
}

/// Runs one packet and checks verdict, mark, the one decision counter that moved (packets and
/// bytes) and exactly which entries counted it.
#[track_caller]
fn check(dp: &mut Datapath, framing: Framing, pkt: &[u8], want: Want) -> packets::Run {
    let before = dp.counters().unwrap();
    let r = run(dp.program(framing), pkt, want.mark_in, 0, 1);
    let after = dp.counters().unwrap();
    let (d, e) = delta(&before, &after);
    assert_eq!(
        (r.verdict, r.mark),
        (want.verdict, want.mark),
        "verdict/mark for {pkt:02x?} (decisions {d:?}, entries {e:?}, out {:02x?})",
        r.data
    );
    let bytes = pkt.len() as u64;
    assert_eq!(
        d,
        BTreeMap::from([(want.decision, Counter { packets: 1, bytes })]),
        "decision counters for {pkt:02x?}"
    );
    let we: BTreeMap<(Role, IpNet), u64> = want
        .entries
        .iter()
        .map(|(r, n)| ((*r, n.parse().unwrap()), 1))
        .collect();
    assert_eq!(e, we, "entry counters for {pkt:02x?}");
    r
}

/// Table rows of `(src, dst, want)`, each made a packet by `build`.
fn addressed(
    build: fn(&str, &str) -> Vec<u8>,
    rows: Vec<(&str, &str, Want)>,
) -> Vec<(Vec<u8>, Want)> {
    rows.into_iter()
        .map(|(src, dst, want)| (build(src, dst), want))
        .collect()
}

/// [`check`] on each packet of a table, in order.
#[track_caller]
fn check_each(dp: &mut Datapath, framing: Framing, cases: Vec<(Vec<u8>, Want)>) {
    for (pkt, want) in cases {
        check(dp, framing, &pkt, want);
    }
}

#[test]
fn ipv4_ethernet_decisions() {
    if !support::require_root("ipv4_ethernet_decisions") {
        return;
    }
    {
        let mut dp = open();
        use Decision::*;
        let rows = vec![
            // NAT source to the internet: masqueraded.
            ("10.244.1.5", "8.8.8.8", masq(&[NAT4])),
            // NAT source to a mesh destination: left alone; the longest prefix (/16, not /8)
            // counts it.
            ("10.244.1.5", "10.1.5.5", mesh("10.1.0.0/16")),
            ("10.244.1.5", "10.7.0.1", mesh("10.0.0.0/8")),
            // Not a NAT source, not a masquerade destination: left alone.
            ("172.16.0.1", "8.8.8.8", untouched(Pass)),
            // Allowed-location IPs are masqueraded from anywhere...
            ("172.16.0.1", "192.168.50.9", masq(&[ALLOWED4])),
            // ...and only the entry that decides counts a NAT source sending there (as only
            // the first matching POSTROUTING rule counts it in Kilo's chains).
            ("10.244.1.5", "192.168.50.9", masq(&[ALLOWED4])),
            // ...unless they are also a mesh destination.
            ("172.16.0.1", "10.1.2.3", mesh("10.1.0.0/16")),
            // Other mark bits (kube-proxy's 0x4000) are kept, ours added...
            (
                "10.244.1.5",
                "8.8.8.8",
                masq(&[NAT4]).marks(0x4000, 0x4000 | MARK),
            ),
            // ...and left untouched when we do not masquerade.
            (
                "172.16.0.1",
                "8.8.8.8",
                untouched(Pass).marks(0x4000, 0x4000),
            ),
            // Our bit arriving from upstream is cleared on every packet we do not masquerade
            // (a mesh destination is never masqueraded), and others' bits are kept.
            (
                "10.244.1.5",
                "10.1.5.5",
                mesh("10.1.0.0/16").marks(0x4000 | MARK, 0x4000),
            ),
            ("172.16.0.1", "8.8.8.8", untouched(Pass).marks(MARK, 0)),
        ];
        check_each(&mut dp, Framing::L2, addressed(eth_ip, rows));
        // The packet is never rewritten.
        let pkt = eth_ip("10.244.1.5", "8.8.8.8");
        let r = run(dp.program(Framing::L2), &pkt, 0, 0, 1);
        assert_eq!(r.data, pkt);
    }
}

#[test]
fn ipv6_ethernet_decisions() {
    if !support::require_root("ipv6_ethernet_decisions") {
        return;
    }
    {
        let mut dp = open();
        use Decision::*;
        let rows = vec![
            ("fd00:244:1::5", "2001:db8::1", masq(&[NAT6])),
            ("fd00:244:1:0:ffff::1", "2001:db8::1", masq(&[NAT6])),
            ("fd00:244:2::5", "2001:db8::1", untouched(Pass)),
            ("fd00:244:1::5", "fd00:1:2::9", mesh("fd00:1:2::/64")),
            ("fd00:244:1::5", "fd00:1:0:3::9", mesh("fd00:1::/48")),
            ("fd00:99::1", "2001:db8::1", untouched(Pass)),
            ("fd00:99::1", "fd00:50::7", masq(&[ALLOWED6])),
            ("fd00:244:1::5", "fd00:50::7", masq(&[ALLOWED6])),
            // An IPv4-mapped address does not match IPv4 entries (the family is part of the
            // key).
            ("::ffff:10.244.1.5", "2001:db8::1", untouched(Pass)),
        ];
        check_each(&mut dp, Framing::L2, addressed(eth_ip, rows));
    }
}

#[test]
fn vlan_tags_are_skipped() {
    if !support::require_root("vlan_tags_are_skipped") {
        return;
    }
    {
        let mut dp = open();
        let q = [(ETH_P_8021Q, 7)];
        let qinq = [(ETH_P_8021AD, 100), (ETH_P_8021Q, 7)];
        // A tag with nothing after it is truncated.
        let mut cut = eth(&[], ETH_P_8021Q);
        cut.extend_from_slice(&[0, 7]);
        let cases = vec![
            (frame(&q, v4("10.244.1.5"), v4("8.8.8.8")), masq(&[NAT4])),
            (
                frame(&qinq, v4("10.244.1.5"), v4("10.1.5.5")),
                mesh("10.1.0.0/16"),
            ),
            (
                frame(&qinq, v6("fd00:244:1::5"), v6("2001:db8::1")),
                masq(&[NAT6]),
            ),
            (cut, untouched(Decision::Malformed)),
        ];
        check_each(&mut dp, Framing::L2, cases);
    }
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
        let want = untouched(Malformed).marks(0x20, 0x20);
        let r = check(&mut dp, l2, &tagged4[..cut], want);
        assert_eq!(r.data, tagged4[..cut], "left untouched");
    }
    let with_first_ip_byte = |pkt: &[u8], b| {
        let mut bad = pkt.to_vec();
        bad[14] = b;
        bad
    };
    let mut arp = eth(&[], ETH_P_ARP);
    arp.extend_from_slice(&[0u8; 28]);
    let mut cases: Vec<_> = [18, 40, 57]
        .map(|cut| (tagged6[..cut].to_vec(), untouched(Malformed)))
        .into();
    cases.extend([
        // A bare header with no payload is complete: decided normally.
        (tagged4[..38].to_vec(), masq(&[NAT4])),
        (full4[..34].to_vec(), masq(&[NAT4])),
        // Wrong version nibble for the ethertype, and an IHL below 5.
        (with_first_ip_byte(&full4, 0x65), untouched(Malformed)),
        (with_first_ip_byte(&full4, 0x44), untouched(Malformed)),
        (with_first_ip_byte(&full6, 0x45), untouched(Malformed)),
        // Not IP at all.
        (arp, untouched(NotIp)),
    ]);
    check_each(&mut dp, l2, cases);
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
    {
        let mut dp = open();
        use Decision::*;
        let m4 = raw_ip("10.244.1.5", "8.8.8.8");
        let r = check(&mut dp, Framing::L3, &m4, masq(&[NAT4]));
        assert_eq!(r.data, m4, "the packet is left as it was");
        let full6 = raw_ip("fd00:244:1::5", "2001:db8::1");
        let mut bad_ihl = m4.clone();
        bad_ihl[0] = 0x43;
        let rows = vec![
            ("10.244.1.5", "10.1.9.9", mesh("10.1.0.0/16")),
            ("172.16.0.1", "192.168.50.1", masq(&[ALLOWED4])),
            ("fd00:244:1::5", "2001:db8::1", masq(&[NAT6])),
            ("fd00:244:1::5", "fd00:1:2::1", mesh("fd00:1:2::/64")),
            ("172.16.0.1", "8.8.8.8", untouched(Pass)),
        ];
        let mut cases = addressed(raw_ip, rows);
        cases.extend([
            // Truncated raw IP: inside the IPv4 and the IPv6 header; a bad IHL.
            (m4[..19].to_vec(), untouched(Malformed)),
            (full6[..39].to_vec(), untouched(Malformed)),
            (bad_ihl, untouched(Malformed)),
            // Not IP (version nibble 1).
            (vec![0x10; 28], untouched(NotIp)),
        ]);
        check_each(&mut dp, Framing::L3, cases);
        // The Ethernet program on the same bytes would misparse: framing matters.
        let r = run(dp.program(Framing::L2), &m4, 0, 0, 1);
        assert_eq!(r.mark, 0);
    }
}

/// The destination entry for `net`, as the datapath holds it.
fn mesh_entry(dp: &mut Datapath, net: IpNet) -> EntryValue {
    dp.maps()
        .entries(Trie::Destination)
        .unwrap()
        .into_iter()
        .find(|(n, _)| *n == net)
        .unwrap()
        .1
}

/// The networks of the mesh destinations in the destination trie.
fn mesh_nets(dp: &mut Datapath) -> Vec<IpNet> {
    dp.maps()
        .entries(Trie::Destination)
        .unwrap()
        .into_iter()
        .filter(|(_, v)| v.flags & ENTRY_MASQUERADE == 0)
        .map(|(n, _)| n)
        .collect()
}

#[test]
fn fast_path_redirects_mesh_but_never_services() {
    if !support::require_root("fast_path_redirects_mesh_but_never_services") {
        return;
    }
    {
        let mut dp = open();
        let l2 = Framing::L2;
        // Give an entry an egress (a raw write, as a resolver would), keeping its counter slot.
        let give_egress = |dp: &mut Datapath, net: &str, flags| {
            let net: IpNet = net.parse().unwrap();
            let value = EntryValue {
                counter: mesh_entry(dp, net).counter,
                flags,
                kind: 3,
                ifindex: 1,
                nh_family: FAMILY_V4,
                nh_addr: [10, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            };
            dp.maps().insert(Trie::Destination, net, &value).unwrap();
        };
        // The /16 peer entry and the service.
        give_egress(&mut dp, "10.1.0.0/16", ENTRY_REDIRECT | ENTRY_NEIGH);
        give_egress(&mut dp, "10.96.0.0/12", ENTRY_REDIRECT | ENTRY_SERVICE);
        let to_peer = eth_ip("10.244.1.5", "10.1.5.5");
        // Off by default: left to the stack.
        check(&mut dp, l2, &to_peer, mesh("10.1.0.0/16"));
        assert!(!dp.set_fast_path(true).unwrap().is_empty());
        assert!(dp.set_fast_path(true).unwrap().is_empty());
        let r = check(&mut dp, l2, &to_peer, redirected("10.1.0.0/16"));
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
        let to_service = eth_ip("10.244.1.5", "10.96.0.10");
        check(&mut dp, l2, &to_service, mesh("10.96.0.0/12"));
        // A packet whose TTL would expire goes to the stack (which sends the ICMP error).
        let mut ttl1 = eth(&[], ETH_P_IP);
        ttl1.extend(ip(v4("10.244.1.5"), v4("10.1.5.5"), 1, 10));
        let r = check(&mut dp, l2, &ttl1, mesh("10.1.0.0/16"));
        assert_eq!(r.data, ttl1);
        let rows = vec![
            // Entries without an egress are not redirected; masquerading is unaffected.
            ("10.244.1.5", "10.7.0.1", mesh("10.0.0.0/8")),
            ("10.244.1.5", "8.8.8.8", masq(&[NAT4])),
        ];
        check_each(&mut dp, l2, addressed(eth_ip, rows));
        // IPv6 hop limit.
        give_egress(&mut dp, "fd00:1:2::/64", ENTRY_REDIRECT);
        let p6 = eth_ip("fd00:244:1::5", "fd00:1:2::9");
        let r = check(&mut dp, l2, &p6, redirected("fd00:1:2::/64"));
        assert_eq!(r.data[14 + 7], 63);
        // Turning it off again.
        dp.set_fast_path(false).unwrap();
        check(&mut dp, l2, &to_peer, mesh("10.1.0.0/16"));
    }
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

/// The counters array holds a region per CPU: a packet is counted in the region of the CPU
/// that ran the program (read here straight from the pinned map, by the layout kilo-common
/// documents), and the agent's reading sums the regions.
#[test]
fn counters_land_in_the_region_of_the_cpu_that_ran() {
    if !support::require_root("counters_land_in_the_region_of_the_cpu_that_ran") {
        return;
    }
    use aya::maps::{Array, Map, MapData};
    use kilo_common::{DECISION_SLOTS, MAP_COUNTERS, counter_stride};
    let fs = BpfFs::new();
    let dir = fs.pin_dir("kilo");
    let slots = 100;
    let mut dp = Datapath::open(DatapathConfig {
        pin_dir: Some(dir.clone()),
        counter_slots: slots,
        ..Default::default()
    })
    .unwrap();
    dp.apply(&plan(), &NoResolver).unwrap();
    let net: IpNet = "10.244.1.0/24".parse().unwrap();
    let slot = dp
        .maps()
        .entries(Trie::NatSource)
        .unwrap()
        .into_iter()
        .find(|(n, _)| *n == net)
        .unwrap()
        .1
        .counter;
    let pkt = frame(&[], v4("10.244.1.5"), v4("8.8.8.8"));
    let cpus = support::online_cpus();
    let runs: Vec<(usize, u32)> = cpus
        .iter()
        .take(2)
        .zip([3, 5])
        .map(|(c, n)| (*c, n))
        .collect();
    for &(cpu, n) in &runs {
        let pkt = pkt.clone();
        dp = std::thread::spawn(move || {
            support::pin_to_cpu(cpu);
            run(dp.program(Framing::L2), &pkt, 0, 0, n);
            dp
        })
        .join()
        .unwrap();
    }
    let data = MapData::from_pin(dir.join("maps").join(MAP_COUNTERS)).unwrap();
    let array: Array<_, Counter> = Array::try_from(Map::Array(data)).unwrap();
    let stride = counter_stride(slots);
    let packets = |i: u32| array.get(&i, 0).unwrap().packets;
    for &(cpu, n) in &runs {
        let base = cpu as u32 * stride;
        assert_eq!(
            packets(base + Decision::Masquerade as u32),
            u64::from(n),
            "CPU {cpu}"
        );
        assert_eq!(
            packets(base + DECISION_SLOTS + slot),
            u64::from(n),
            "CPU {cpu}"
        );
        assert_eq!(packets(base + Decision::Pass as u32), 0, "CPU {cpu}");
    }
    let total: u32 = runs.iter().map(|r| r.1).sum();
    let counters = dp.counters().unwrap();
    assert_eq!(
        counters.decision(Decision::Masquerade).packets,
        u64::from(total)
    );
    assert_eq!(
        counters.entry(Role::NatSource, &net).unwrap().packets,
        u64::from(total)
    );
    dp.clean_up().unwrap();
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
    dp.apply(&old, &NoResolver).unwrap();
    // A whole new mesh of 8 entries: with the 8 old destinations still in, the trie overflows.
    let mut new = old.clone();
    new.mesh_destinations = (0..8u8)
        .map(|i| {
            (
                IpNet::V4(ipnet::Ipv4Net::new([10, 50, i, 0].into(), 24).unwrap()),
                entry(EntryKind::Node, format!("node-{i}")),
            )
        })
        .collect();
    let err = dp.apply(&new, &NoResolver).unwrap_err().to_string();
    // The entry named is one of the new plan's: a new one, or (on kernels before the LPM trie
    // took in-place updates when full, such as 5.10) an existing one whose value changed.
    let named = (new.mesh_destinations.iter())
        .chain(&new.masquerade_destinations)
        .any(|(net, e)| err.contains(&format!("entry {net} (owner {:?})", e.owner)));
    assert!(err.contains("full") && named, "{err}");
    let have = mesh_nets(&mut dp);
    for net in old.mesh_destinations.keys() {
        assert!(have.contains(net), "{net} lost: {have:?}");
    }
    // The old topology still decides: a pod to a mesh node is left alone.
    let before = dp.counters().unwrap();
    let r = run(
        dp.program(Framing::L2),
        &eth_ip("10.244.1.5", "10.1.5.5"),
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

/// A `log::Log` that keeps the records.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<(log::Level, String)>>>);

impl Captured {
    fn take(&self) -> Vec<(log::Level, String)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl log::Log for Captured {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        let entry = (record.level(), record.args().to_string());
        self.0.lock().unwrap().push(entry);
    }
    fn flush(&self) {}
}

#[test]
fn program_logs_reach_userspace_only_at_the_level_asked() {
    if !support::require_root("program_logs_reach_userspace_only_at_the_level_asked") {
        return;
    }
    let mut bad_ihl = eth_ip("10.244.1.5", "8.8.8.8");
    bad_ihl[14] = 0x44;
    let to_mesh = eth_ip("172.16.0.1", "10.1.5.5");
    let mut dp = open();
    let captured = Captured::default();
    let mut logger = dp.logger(captured.clone()).unwrap();
    // Off by default, and at info: nothing logged.
    run(dp.program(Framing::L2), &bad_ihl, 0, 0, 1);
    dp.set_log_level(3).unwrap();
    run(dp.program(Framing::L2), &bad_ihl, 0, 0, 1);
    logger.flush();
    assert!(captured.take().is_empty());
    // Debug, switched on at run time (one config write): the malformed packet is logged, the
    // well-formed one is not.
    assert_eq!(dp.set_log_level(4).unwrap().get(Write::MapConfig), 1);
    run(dp.program(Framing::L2), &bad_ihl, 0, 0, 1);
    run(dp.program(Framing::L2), &to_mesh, 0, 0, 1);
    logger.flush();
    let got = captured.take();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, log::Level::Debug);
    let size = format!("{} bytes", bad_ihl.len());
    assert!(
        got[0].1.contains("malformed") && got[0].1.contains(&size),
        "{got:?}"
    );
    // Forwarded as records arrive.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let forwarder = tokio::spawn(kilo_agent::datapath::logs::forward(logger));
        run(dp.program(Framing::L2), &bad_ihl, 0, 0, 1);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while captured.0.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        forwarder.abort();
    });
    let got = captured.take();
    assert!(
        got.iter()
            .any(|(l, m)| *l == log::Level::Debug && m.contains("malformed")),
        "{got:?}"
    );
}

#[test]
fn pins_of_another_layout_are_replaced_and_links_follow_the_maps() {
    if !support::require_root("pins_of_another_layout_are_replaced_and_links_follow_the_maps") {
        return;
    }
    let fs = BpfFs::new();
    let dir = fs.pin_dir("kilo");
    let ns = NetNs::new("dpmig");
    ns.sh("ip link add veth0 type veth peer name veth1");
    // TCX links are pinned; netlink filters stay on the device and are replaced at each attach.
    let attach = support::kernel_attach_mode();
    let netlink = attach == kilo_agent::datapath::AttachMode::Netlink;
    let config = DatapathConfig {
        pin_dir: Some(dir.clone()),
        attach,
        ..Default::default()
    };
    ns.run(move || {
        // A first generation, attached and pinned.
        let mut first = Datapath::open(config.clone()).unwrap();
        first.attach("veth0").unwrap();
        first.apply(&plan(), &NoResolver).unwrap();
        drop(first);
        // An upgrade changed a map's layout: its pin is of another value size.
        let pin = dir.join("maps").join(kilo_common::MAP_CONFIG);
        std::fs::remove_file(&pin).unwrap();
        support::netns::sh(&format!(
            "bpftool map create {} type array key 4 value 8 entries 1 name KILO_CONFIG",
            pin.display()
        ));
        let mut second = Datapath::open(config.clone()).expect("pins of another layout replaced");
        // The pinned link still runs the first generation's program on the old maps: it moves
        // to the program of the new ones, which the first apply fills.
        let w = second.attach("veth0").unwrap();
        assert_eq!(w.get(Write::LinkUpdate), 1, "{w}");
        let w = second.apply(&plan(), &NoResolver).unwrap();
        assert_eq!(w.get(Write::MapInsert), 10, "{w}");
        let r = run(
            second.program(Framing::L2),
            &eth_ip("10.244.1.5", "8.8.8.8"),
            0,
            0,
            1,
        );
        assert_eq!(r.mark, MARK);
        // The agent has seen that route realms hold.
        assert_eq!(
            second.set_route_realm(true).unwrap().get(Write::MapConfig),
            1
        );
        drop(second);
        // An older version pinned a map this one no longer has: its pin goes.
        let stale = dir.join("maps").join("KILO_DECISIONS");
        support::netns::sh(&format!(
            "bpftool map create {} type percpu_array key 4 value 16 entries 6 name KILO_DECISIONS",
            stale.display()
        ));
        // A restart on the new pins adopts everything, the realm bit too: nothing to write.
        let (mut third, w) = Datapath::open_counted(config.clone()).unwrap();
        assert!(w.is_empty(), "{w}");
        assert!(third.config().route_realm, "the realm bit is kept");
        assert!(!stale.exists(), "the stale pin is removed");
        let w = third.attach("veth0").unwrap();
        assert!(
            w.is_empty() || netlink && w.get(Write::LinkAttach) == 0,
            "{w}"
        );
        assert!(third.apply(&plan(), &NoResolver).unwrap().is_empty());
        drop(third);
        // An upgrade changed what the maps mean, not their definitions: the pinned config's
        // layout version says so, and the pins are replaced rather than adopted.
        use aya::maps::{Array, Map, MapData};
        let data = MapData::from_pin(dir.join("maps").join(kilo_common::MAP_CONFIG)).unwrap();
        let mut pinned: Array<_, kilo_common::Config> = Array::try_from(Map::Array(data)).unwrap();
        let mut c = pinned.get(&0, 0).unwrap();
        c.layout = kilo_common::LAYOUT + 1;
        pinned.set(0, &c, 0).unwrap();
        drop(pinned);
        let mut fourth = Datapath::open(config).unwrap();
        assert!(!fourth.synced(), "fresh maps");
        let w = fourth.apply(&plan(), &NoResolver).unwrap();
        assert_eq!(w.get(Write::MapInsert), 10, "{w}");
        fourth.clean_up().unwrap();
    });
}

#[test]
fn netlink_clean_up_removes_the_clsact_qdisc_it_added_unless_shared() {
    if !support::require_root("netlink_clean_up_removes_the_clsact_qdisc_it_added_unless_shared") {
        return;
    }
    use aya::programs::{
        SchedClassifier,
        tc::{NlOptions, TcAttach, TcAttachType, TcHandle},
    };
    let fs = BpfFs::new();
    let ns = NetNs::new("dpqd");
    ns.sh("ip link add veth0 type veth peer name veth1 && ip link add veth2 type veth peer name veth3");
    let config = DatapathConfig {
        pin_dir: Some(fs.pin_dir("kilo")),
        attach: kilo_agent::datapath::AttachMode::Netlink,
        ..Default::default()
    };
    let (writes, qdiscs) = ns.run(move || {
        let mut dp = Datapath::open(config).unwrap();
        dp.attach("veth0").unwrap();
        dp.attach("veth2").unwrap();
        // Someone else filters through veth2's clsact (at egress).
        let mut other = support::noop();
        let p: &mut SchedClassifier = other
            .program_mut(kilo_common::PROG_NOOP)
            .unwrap()
            .try_into()
            .unwrap();
        let options = NlOptions {
            priority: 7,
            handle: TcHandle::new(0, 1),
            classid: None,
        };
        let egress = TcAttach::Netlink {
            parent: TcAttachType::Egress.into(),
            options,
        };
        let id = p
            .attach(kilo_agent::datapath::ifindex("veth2").unwrap(), egress)
            .unwrap();
        let writes = dp.clean_up().unwrap();
        let qdiscs =
            ["veth0", "veth2"].map(|d| support::netns::sh(&format!("tc qdisc show dev {d}")));
        p.detach(id).unwrap();
        (writes, qdiscs)
    });
    assert_eq!(writes.get(Write::QdiscDelete), 1, "{writes}");
    assert_eq!(writes.get(Write::LinkDetach), 2, "{writes}");
    // Ours alone on veth0: gone with our filter; shared on veth2: kept.
    assert!(!qdiscs[0].contains("clsact"), "{qdiscs:?}");
    assert!(qdiscs[1].contains("clsact"), "{qdiscs:?}");
}
