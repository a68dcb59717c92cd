//! Datapath benchmarks (root): per-packet cost of the TC program with BPF_PROG_TEST_RUN at
//! 10, 1,000 and 100,000 map entries against the empty program and against the lean reference
//! (the datapath issue's cost model: parse, kernel LPM tries, mark; its IPv4 cases only), with
//! hot and with cold caches, and the cost of `sync` (10,000 entries from empty; a 1-entry
//! change into 10,000: time and map writes).
//!
//! `cargo run --release -p kilo-agent --example bench_datapath [-- --repeat N --rounds R]`
#[path = "../tests/support/mod.rs"]
mod support;

use support::{arg, packets};

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr},
    time::Instant,
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use kilo_agent::{
    datapath::{Datapath, DatapathConfig, Framing, NoResolver, OBJECT},
    plan::{DatapathEntry, DatapathPlan, EntryKind},
};
use packets::{frame, time, v4, v6};

fn entry(kind: EntryKind, i: usize) -> DatapathEntry {
    DatapathEntry {
        kind,
        owner: format!("node-{i}"),
        next_hop: None,
    }
}

/// `n` mesh destinations shaped like a cluster: per node a pod /24 in 10.0.0.0/8 and an
/// internal /32 in 172.16.0.0/12 (half each), plus a few IPv6 /64s; one NAT source per family.
fn plan(n: usize) -> DatapathPlan {
    let mut mesh = BTreeMap::new();
    let mut i = 0;
    while mesh.len() < n {
        let k = i / 3;
        let net = match i % 3 {
            0 => IpNet::V4(
                Ipv4Net::new(Ipv4Addr::from(0x0a00_0000u32 + ((k as u32) << 8)), 24).unwrap(),
            ),
            1 => IpNet::V4(Ipv4Net::new(Ipv4Addr::from(0xac10_0000u32 + k as u32), 32).unwrap()),
            _ => IpNet::V6(
                Ipv6Net::new(
                    Ipv6Addr::from((0xfd00_u128 << 112) | ((k as u128) << 64)),
                    64,
                )
                .unwrap(),
            ),
        };
        mesh.insert(net, entry(EntryKind::Node, i));
        i += 1;
    }
    DatapathPlan {
        mesh_destinations: mesh,
        nat_sources: BTreeMap::from([
            (
                "10.244.1.0/24".parse().unwrap(),
                entry(EntryKind::LocalPods, 0),
            ),
            (
                "fd00:244:1::/64".parse().unwrap(),
                entry(EntryKind::LocalPods, 0),
            ),
        ]),
        masquerade_destinations: BTreeMap::from([(
            "192.168.50.0/24".parse().unwrap(),
            entry(EntryKind::AllowedLocation, 0),
        )]),
    }
}

/// The median over `rounds` of the kernel's average ns per run.
fn ns(prog: &aya::programs::SchedClassifier, pkt: &[u8], repeat: u32, rounds: u32) -> f64 {
    let mut v: Vec<f64> = (0..rounds).map(|_| time(prog, pkt, repeat)).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn open(slots: u32) -> Datapath {
    Datapath::open(DatapathConfig {
        pin_dir: None,
        counter_slots: slots,
        max_entries: 1 << 18,
        ..Default::default()
    })
    .expect("load the datapath (needs root)")
}

/// An instance of the object with the lean reference loaded and filled from `plan`.
fn lean(plan: &DatapathPlan) -> aya::Ebpf {
    let mut ebpf = aya::Ebpf::load(OBJECT).expect("load the object");
    support::lean::load(&mut ebpf, plan);
    ebpf
}

/// The lean reference program of `ebpf`.
fn lean_prog(ebpf: &aya::Ebpf) -> &aya::programs::SchedClassifier {
    ebpf.program(kilo_common::PROG_LEAN)
        .unwrap()
        .try_into()
        .unwrap()
}

/// Per-packet cost with cold caches, the way a packet finds them after an idle spell or other
/// work (as on a lightly loaded router, or one whose softirq runs on another CPU than the
/// sender): before each single run a buffer is written, `--thrash-kib` of cache lines, either
/// contiguous (evicts this core's L1 and part of L2) or one line per 4 KiB page (the same
/// lines spread over as many pages: evicts the TLBs too, and a TLB miss in a VM is a
/// two-dimensional page walk). The program's own map lines (config, index chunks, counters;
/// vmalloc'd 4 KiB pages, except small maps) then cost what they cost live; the packet and the
/// skb are hot, as the stack has just touched them. `iters` runs per case, ours, the empty
/// program and the lean reference interleaved; interquartile means of each and of the per-run
/// differences (paired).
fn cold(iters: u32) {
    if iters == 0 {
        return;
    }
    let kib = arg::<usize>("--thrash-kib", 64);
    let mut dp = open(131_072);
    let p = plan(1_000);
    dp.sync(&p, &NoResolver).expect("sync");
    let reference = lean(&p);
    let masq = frame(&[], v4("10.244.1.5"), v4("8.8.8.8"));
    let mesh_hit = frame(&[], v4("10.244.1.5"), v4("10.0.3.7"));
    println!();
    println!(
        "# cold caches: {iters} single runs per case (1,000 entries), each after writing \
         {kib} KiB of cache lines"
    );
    println!(
        "{:<18} {:<16} {:>8} {:>8} {:>8} {:>12} {:>12} {:>14}",
        "ns/packet",
        "lines written",
        "ours",
        "empty",
        "lean ref",
        "ours - empty",
        "lean - empty",
        "ours - lean"
    );
    for (label, stride) in [("contiguous", 64usize), ("one per page", 4096)] {
        let lines = (kib << 10) / 64;
        let span = lines * stride;
        let mut buf = vec![0u8; span];
        // SAFETY: advice on memory this function owns (4 KiB pages, for the TLB case).
        unsafe { libc::madvise(buf.as_mut_ptr().cast(), span, libc::MADV_NOHUGEPAGE) };
        let mut thrash = |i: u32| {
            for off in (0..span).step_by(stride) {
                // SAFETY: in bounds; volatile so that the writes happen.
                unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(off), i as u8) };
            }
        };
        for (name, pkt) in [("masquerade (v4)", &masq), ("mesh hit (v4)", &mesh_hit)] {
            // ours, empty, lean; ours - empty, lean - empty, ours - lean
            let mut v: [Vec<f64>; 6] = Default::default();
            for i in 0..iters {
                thrash(i);
                let x = time(dp.program(Framing::L2), pkt, 1);
                thrash(i);
                let y = time(dp.noop_program(), pkt, 1);
                thrash(i);
                let z = time(lean_prog(&reference), pkt, 1);
                for (s, t) in v.iter_mut().zip([x, y, z, x - y, z - y, x - z]) {
                    s.push(t);
                }
            }
            let [a, b, c, d, e, f] = v.map(|mut s| iq_mean(&mut s));
            println!(
                "{name:<18} {label:<16} {a:>8.1} {b:>8.1} {c:>8.1} {d:>+12.1} {e:>+12.1} {f:>+14.1}"
            );
        }
    }
}

/// The mean of the middle half: the clock ticks in steps of about 10 ns here, which this
/// resolves finer than a median, and it leaves out the runs an interrupt spoilt.
fn iq_mean(v: &mut [f64]) -> f64 {
    v.sort_by(|p, q| p.partial_cmp(q).unwrap());
    let kept = &v[v.len() / 4..v.len() * 3 / 4];
    kept.iter().sum::<f64>() / kept.len() as f64
}

fn main() {
    let repeat = arg::<u32>("--repeat", 1_000_000);
    let rounds = arg::<u32>("--rounds", 7);
    if std::env::args().any(|a| a == "--cold-only") {
        cold(arg::<u32>("--cold", 2_000));
        return;
    }
    println!(
        "# datapath benchmark (BPF_PROG_TEST_RUN, repeat {repeat}, median of {rounds} rounds)"
    );

    // Packets: a pod to the internet, IPv4 and IPv6 (masquerade path: the destination misses
    // the mesh, the source is a NAT source, the destination not a masquerade destination), a
    // pod to a node in the mesh (/32 miss, /24 hit), an IPv6 pod to a mesh /64 (one probe), a
    // host to the internet (no match: every length of every table), and a non-IP frame (parse
    // and counters only).
    let masq = frame(&[], v4("10.244.1.5"), v4("8.8.8.8"));
    let masq6 = frame(&[], v6("fd00:244:1::5"), v6("2001:db8::1"));
    let mesh_hit = frame(&[], v4("10.244.1.5"), v4("10.0.3.7"));
    let mesh6 = frame(&[], v6("fd00::5"), v6("fd00:0:0:2::9"));
    let pass = frame(&[], v4("172.16.200.1"), v4("8.8.8.8"));
    let pass6 = frame(&[], v6("fd99::1"), v6("2001:db8::1"));
    let mut arp = packets::eth(&[], packets::ETH_P_ARP);
    arp.extend_from_slice(&[0u8; 28]);
    let cases: [(&str, &[u8]); 7] = [
        ("masquerade (v4)", &masq),
        ("masquerade (v6)", &masq6),
        ("mesh hit (v4)", &mesh_hit),
        ("mesh hit (v6)", &mesh6),
        ("no match (v4)", &pass),
        ("no match (v6)", &pass6),
        ("not IP (ARP)", &arp),
    ];

    // The lean reference's cases: IPv4 on untagged Ethernet is all it parses.
    let lean_cases: [(&str, &[u8]); 3] = [
        ("lean: masq (v4)", &masq),
        ("lean: mesh (v4)", &mesh_hit),
        ("lean: no match", &pass),
    ];

    let mut results: BTreeMap<(usize, &str), f64> = BTreeMap::new();
    let mut noop = Vec::new();
    for n in [10usize, 1_000, 100_000] {
        let mut dp = open(131_072);
        let p = plan(n);
        let t = Instant::now();
        let w = dp.sync(&p, &NoResolver).expect("sync");
        let fill = t.elapsed();
        let prog = dp.program(Framing::L2);
        for (name, pkt) in cases {
            results.insert((n, name), ns(prog, pkt, repeat, rounds));
        }
        noop.push(ns(dp.noop_program(), &masq, repeat, rounds));
        let reference = lean(&p);
        for (name, pkt) in lean_cases {
            results.insert((n, name), ns(lean_prog(&reference), pkt, repeat, rounds));
        }
        println!(
            "entries {n:>7}: filled in {:>8.1} ms ({} map writes)",
            fill.as_secs_f64() * 1e3,
            w.total()
        );
    }
    noop.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let noop = noop[noop.len() / 2];
    println!();
    println!(
        "{:<18} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "ns/packet", "n=10", "n=1000", "n=100000", "100k/10", "over empty"
    );
    println!("{:<18} {:>10.1}", "empty program", noop);
    let mut worst_ratio: f64 = 0.0;
    for (i, (name, _)) in cases.iter().chain(&lean_cases).enumerate() {
        let a = results[&(10, *name)];
        let b = results[&(1_000, *name)];
        let c = results[&(100_000, *name)];
        if i < cases.len() {
            worst_ratio = worst_ratio.max(c / a);
        }
        println!(
            "{name:<18} {a:>10.1} {b:>10.1} {c:>10.1} {:>10.2} {:>+12.1}",
            c / a,
            c - noop
        );
    }
    println!(
        "worst 100k/10 ratio of ours: {worst_ratio:.2} (target <= 1.5: {})",
        if worst_ratio <= 1.5 { "met" } else { "NOT met" }
    );

    cold(arg::<u32>("--cold", 2_000));

    // sync: 10,000 entries from empty, then 1-entry changes into 10,000.
    println!();
    let mut dp = open(131_072);
    // Syncs `plan` and prints the time and the writes.
    let mut timed = |label: &str, plan: &DatapathPlan| {
        let t = Instant::now();
        let w = dp.sync(plan, &NoResolver).unwrap();
        println!(
            "{label:<27} {:>8.1} ms, {w}",
            t.elapsed().as_secs_f64() * 1e3
        );
    };
    let p = plan(10_000);
    timed("sync 10,000 from empty:", &p);
    timed("sync again, no change:", &p);
    let mut added = p.clone();
    added.mesh_destinations.insert(
        "10.255.255.0/24".parse().unwrap(),
        entry(EntryKind::Peer, 0),
    );
    timed("1 entry added into 10,000:", &added);
    let mut replaced = added.clone();
    let first = *replaced.mesh_destinations.keys().next().unwrap();
    replaced.mesh_destinations.remove(&first);
    replaced.mesh_destinations.insert(
        "10.255.254.0/24".parse().unwrap(),
        entry(EntryKind::Peer, 1),
    );
    timed("1 entry replaced in 10,001:", &replaced);
    let mut changed = replaced.clone();
    changed.mesh_destinations.values_mut().next().unwrap().kind = EntryKind::Peer;
    timed("1 entry changed in 10,001:", &changed);
}
