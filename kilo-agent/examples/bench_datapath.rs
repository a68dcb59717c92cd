//! Datapath benchmarks (root): per-packet cost of the TC program with BPF_PROG_TEST_RUN at
//! 10, 1,000 and 100,000 entries beside the empty program (kilo-ebpf's bench object), and the
//! cost of `sync`: 10,000 entries from empty, 1-entry changes into 10,000 (time and map
//! writes), and the CPU time of an idle resync at 10,000 entries (the record compared with the
//! plan; every `READ_BACK_EVERY`-th also reads the tries back).
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
    datapath::{Datapath, DatapathConfig, Framing, NoResolver, READ_BACK_EVERY},
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

/// Syncs `plan` and prints the time and the writes.
fn timed(dp: &mut Datapath, label: &str, plan: &DatapathPlan) {
    let t = Instant::now();
    let w = dp.sync(plan, &NoResolver).unwrap();
    println!(
        "{label:<27} {:>8.1} ms, {w}",
        t.elapsed().as_secs_f64() * 1e3
    );
}

/// CPU time of the calling thread.
fn cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec for the kernel to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn main() {
    let repeat = arg::<u32>("--repeat", 1_000_000);
    let rounds = arg::<u32>("--rounds", 7);
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

    let mut results: BTreeMap<(usize, &str), f64> = BTreeMap::new();
    let empty = support::noop();
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
        noop.push(ns(support::noop_program(&empty), &masq, repeat, rounds));
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
    for (name, _) in cases {
        let a = results[&(10, name)];
        let b = results[&(1_000, name)];
        let c = results[&(100_000, name)];
        println!(
            "{name:<18} {a:>10.1} {b:>10.1} {c:>10.1} {:>10.2} {:>+12.1}",
            c / a,
            b - noop
        );
    }
    println!("(over empty: at 1,000 entries)");

    // sync: 10,000 entries from empty, then 1-entry changes into 10,000.
    println!();
    let mut dp = open(131_072);
    let p = plan(10_000);
    timed(&mut dp, "sync 10,000 from empty:", &p);
    timed(&mut dp, "sync again, no change:", &p);
    // Idle resyncs: CPU time, with and without the periodic read-back.
    let mut idle = Vec::new();
    for _ in 0..READ_BACK_EVERY * 10 {
        let t = cpu_time();
        assert!(dp.sync(&p, &NoResolver).unwrap().is_empty());
        idle.push((cpu_time() - t).as_secs_f64() * 1e3);
    }
    idle.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mean = idle.iter().sum::<f64>() / idle.len() as f64;
    println!(
        "idle resync at 10,000:      {:>8.3} ms CPU median, {:>6.3} ms mean (a read-back every {READ_BACK_EVERY}: {:.3} ms)",
        idle[idle.len() / 2],
        mean,
        idle[idle.len() - 1]
    );
    let mut added = p.clone();
    added.mesh_destinations.insert(
        "10.255.255.0/24".parse().unwrap(),
        entry(EntryKind::Peer, 0),
    );
    timed(&mut dp, "1 entry added into 10,000:", &added);
    let mut replaced = added.clone();
    let first = *replaced.mesh_destinations.keys().next().unwrap();
    replaced.mesh_destinations.remove(&first);
    replaced.mesh_destinations.insert(
        "10.255.254.0/24".parse().unwrap(),
        entry(EntryKind::Peer, 1),
    );
    timed(&mut dp, "1 entry replaced in 10,001:", &replaced);
    let mut changed = replaced.clone();
    changed.mesh_destinations.values_mut().next().unwrap().kind = EntryKind::Peer;
    timed(&mut dp, "1 entry changed in 10,001:", &changed);
}
