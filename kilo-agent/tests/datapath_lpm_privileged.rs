//! The real program against Kilo's rule: random plans (IPv4 and IPv6, nested prefixes, all three
//! roles) synced into the LPM tries, random packets through BPF_PROG_TEST_RUN, and the decision,
//! mark and counted entries compared with a brute-force evaluation (masquerade iff the source is
//! a NAT source or the destination a masquerade destination, and the destination is not a mesh
//! destination; only the rule that decides counts the packet, its longest match: a mesh
//! destination, else a masquerade destination, else a NAT source). And the same program run
//! while another thread syncs between two topologies: no packet whose decision both share is
//! decided otherwise.
use kilo_testkit as support;

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use ipnet::IpNet;
use kilo_agent::{
    datapath::{Datapath, DatapathConfig, Decision, Framing, NoResolver, Role},
    plan::{DatapathEntry, DatapathPlan, EntryKind},
};
use proptest::prelude::*;
use rand::{Rng, SeedableRng, rngs::StdRng};
use support::packets::{frame, run};

const MARK: u32 = kilo_common::DEFAULT_MARK;

fn entry(kind: EntryKind) -> DatapathEntry {
    DatapathEntry {
        kind,
        owner: format!("{kind:?}"),
        next_hop: None,
    }
}

/// A random address near one of `anchors` (same family, some low bits changed) or anywhere.
fn address(rng: &mut StdRng, anchors: &[IpAddr], v6: bool) -> IpAddr {
    let same: Vec<&IpAddr> = anchors.iter().filter(|a| a.is_ipv6() == v6).collect();
    if same.is_empty() || rng.random_ratio(1, 5) {
        return if v6 {
            IpAddr::V6(Ipv6Addr::from(rng.random::<u128>()))
        } else {
            IpAddr::V4(Ipv4Addr::from(rng.random::<u32>()))
        };
    }
    let a = *same[rng.random_range(0..same.len())];
    let flip = rng.random_range(0..=if v6 { 128 } else { 32 });
    match a {
        IpAddr::V4(a) => {
            let low = (1u64 << flip) - 1;
            IpAddr::V4(Ipv4Addr::from(
                u32::from(a) ^ (rng.random::<u32>() & low as u32),
            ))
        }
        IpAddr::V6(a) => {
            let low = if flip == 128 {
                u128::MAX
            } else {
                (1u128 << flip) - 1
            };
            IpAddr::V6(Ipv6Addr::from(u128::from(a) ^ (rng.random::<u128>() & low)))
        }
    }
}

/// A CIDR of `a` with a random length (a few lengths, so entries nest).
fn cidr(rng: &mut StdRng, a: IpAddr) -> IpNet {
    let len = match a {
        IpAddr::V4(_) => [0, 8, 12, 16, 20, 24, 28, 31, 32][rng.random_range(0..9)],
        IpAddr::V6(_) => [0, 16, 32, 48, 56, 64, 96, 127, 128][rng.random_range(0..9)],
    };
    IpNet::new(a, len).unwrap().trunc()
}

/// A random plan around a few anchors, and the anchors.
fn random_plan(rng: &mut StdRng) -> (DatapathPlan, Vec<IpAddr>) {
    let mut anchors = Vec::new();
    for _ in 0..rng.random_range(1..5) {
        let v6 = rng.random_bool(0.5);
        anchors.push(address(rng, &[], v6));
    }
    let mut plan = DatapathPlan::default();
    let roles = [
        (&mut plan.mesh_destinations, EntryKind::Node, 0..8),
        (&mut plan.nat_sources, EntryKind::LocalPods, 0..4),
        (
            &mut plan.masquerade_destinations,
            EntryKind::AllowedLocation,
            0..4,
        ),
    ];
    for (map, kind, n) in roles {
        for _ in 0..rng.random_range(n) {
            let v6 = rng.random_bool(0.5);
            let a = address(rng, &anchors, v6);
            // Rarely the whole family: /0 must still not match the other one.
            map.insert(cidr(rng, a), entry(kind));
        }
    }
    (plan, anchors)
}

fn longest(map: &BTreeMap<IpNet, DatapathEntry>, a: IpAddr) -> Option<IpNet> {
    map.keys()
        .filter(|n| n.contains(&a))
        .max_by_key(|n| n.prefix_len())
        .copied()
}

/// Kilo's rule by brute force: the decision and the entry that counts the packet (the rule
/// that decides: Kilo's `RETURN` for a mesh destination, else a jump to `MASQUERADE`).
fn kilo(plan: &DatapathPlan, src: IpAddr, dst: IpAddr) -> (Decision, Vec<(Role, IpNet)>) {
    if let Some(m) = longest(&plan.mesh_destinations, dst) {
        return (Decision::Mesh, vec![(Role::Mesh, m)]);
    }
    if let Some(m) = longest(&plan.masquerade_destinations, dst) {
        return (Decision::Masquerade, vec![(Role::MasqueradeDestination, m)]);
    }
    match longest(&plan.nat_sources, src) {
        Some(n) => (Decision::Masquerade, vec![(Role::NatSource, n)]),
        None => (Decision::Pass, Vec::new()),
    }
}

/// Runs one packet and returns its mark, the decision counter that moved and the entries that
/// counted it.
fn decide(dp: &Datapath, src: IpAddr, dst: IpAddr) -> (u32, Vec<Decision>, Vec<(Role, IpNet)>) {
    let before = dp.counters().unwrap();
    let r = run(dp.program(Framing::L2), &frame(&[], src, dst), MARK, 0, 1);
    let after = dp.counters().unwrap();
    let decisions = Decision::ALL
        .into_iter()
        .filter(|d| after.decision(*d).packets != before.decision(*d).packets)
        .collect();
    let mut entries: Vec<(Role, IpNet)> = after
        .entries
        .iter()
        .filter(|e| before.entry(e.role, &e.net).unwrap_or_default() != e.counter)
        .map(|e| (e.role, e.net))
        .collect();
    entries.sort();
    (r.mark, decisions, entries)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_program_decides_as_kilos_rule_on_random_plans(seeds in proptest::collection::vec(any::<u64>(), 4)) {
        if !support::require_root("the_program_decides_as_kilos_rule_on_random_plans") {
            return Ok(());
        }
        // One load, several plans synced into it in turn (so syncs also remove and replace).
        let mut dp = Datapath::open(DatapathConfig { pin_dir: None, ..Default::default() })
            .expect("load the datapath");
        for seed in seeds {
            let mut rng = StdRng::seed_from_u64(seed);
            let (plan, anchors) = random_plan(&mut rng);
            dp.apply(&plan, &NoResolver).expect("apply");
            for _ in 0..24 {
                let v6 = rng.random_bool(0.5);
                let (src, dst) = (address(&mut rng, &anchors, v6), address(&mut rng, &anchors, v6));
                let (decision, mut hits) = kilo(&plan, src, dst);
                hits.sort();
                let mark = if decision == Decision::Masquerade { MARK } else { 0 };
                prop_assert_eq!(
                    decide(&dp, src, dst),
                    (mark, vec![decision], hits),
                    "{} -> {} in {:?}", src, dst, plan
                );
            }
        }
    }
}

fn plan_of(mesh: &[&str], nat: &[&str], masq: &[&str]) -> DatapathPlan {
    let m = |list: &[&str], kind| {
        list.iter()
            .map(|n| (n.parse().unwrap(), entry(kind)))
            .collect()
    };
    DatapathPlan {
        mesh_destinations: m(mesh, EntryKind::Node),
        nat_sources: m(nat, EntryKind::LocalPods),
        masquerade_destinations: m(masq, EntryKind::AllowedLocation),
    }
}

/// One thread runs the program on packets whose decision topologies A and B share while
/// another syncs A -> B -> A ... into the same (pinned) maps: every run decides as both would.
#[test]
fn syncing_between_two_topologies_never_changes_a_shared_decision() {
    if !support::require_root("syncing_between_two_topologies_never_changes_a_shared_decision") {
        return;
    }
    // B splits a mesh /16 into /17s, adds prefix lengths and NAT sources, and moves an
    // allowed-location /24 into a /16.
    let a = plan_of(
        &["10.1.0.0/16", "10.4.0.1/32", "fd00:1::/48"],
        &["10.244.1.0/24", "fd00:244:1::/64"],
        &["192.168.50.0/24"],
    );
    let b = plan_of(
        &[
            "10.1.0.0/17",
            "10.1.128.0/17",
            "10.4.0.0/24",
            "10.3.3.0/28",
            "fd00:1::/49",
            "fd00:1:0:8000::/49",
        ],
        &[
            "10.244.1.0/25",
            "10.244.1.128/25",
            "10.245.0.0/16",
            "fd00:244:1::/64",
            "fd00:245::/48",
        ],
        &["192.168.0.0/16"],
    );
    let packets: Vec<(IpAddr, IpAddr)> = [
        ("10.244.1.5", "10.1.5.5"),
        ("10.244.1.200", "10.1.200.1"),
        ("10.244.1.5", "8.8.8.8"),
        ("10.244.1.130", "1.1.1.1"),
        ("172.16.0.1", "8.8.8.8"),
        ("172.16.0.1", "192.168.50.9"),
        ("10.244.1.5", "10.4.0.1"),
        ("fd00:244:1::5", "fd00:1:0:9000::1"),
        ("fd00:244:1::5", "2001:db8::1"),
        ("fd00:99::1", "2001:db8::1"),
    ]
    .iter()
    .map(|(s, d)| (s.parse().unwrap(), d.parse().unwrap()))
    .collect();
    let want: Vec<u32> = packets
        .iter()
        .map(|(s, d)| {
            let (da, _) = kilo(&a, *s, *d);
            assert_eq!(da, kilo(&b, *s, *d).0, "{s} -> {d} differs between A and B");
            if da == Decision::Masquerade { MARK } else { 0 }
        })
        .collect();
    let fs = support::bpffs::BpfFs::new();
    let config = DatapathConfig {
        pin_dir: Some(fs.pin_dir("kilo")),
        ..Default::default()
    };
    let mut writer = Datapath::open(config.clone()).unwrap();
    writer.apply(&a, &NoResolver).unwrap();
    // A second load on the same pins: its program reads the maps the writer changes.
    let reader = Datapath::open(config).unwrap();
    let frames: Vec<Vec<u8>> = packets.iter().map(|(s, d)| frame(&[], *s, *d)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let runner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut runs, mut wrong) = (0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                for (i, f) in frames.iter().enumerate() {
                    let mark = run(reader.program(Framing::L2), f, MARK, 0, 1).mark;
                    runs += 1;
                    if mark != want[i] && wrong.len() < 10 {
                        wrong.push((i, mark));
                    }
                }
            }
            (runs, wrong, reader)
        })
    };
    let mut syncs = 0;
    for _ in 0..200 {
        for p in [&b, &a] {
            let w = writer.apply(p, &NoResolver).unwrap();
            assert!(!w.is_empty());
            syncs += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (runs, wrong, reader) = runner.join().unwrap();
    eprintln!("{runs} runs during {syncs} syncs between A and B");
    assert!(runs > 0);
    assert!(
        wrong.is_empty(),
        "wrong decisions (packet, mark): {wrong:?}"
    );
    drop(reader);
    writer.clean_up().unwrap();
}
