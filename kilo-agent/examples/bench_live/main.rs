//! The datapath live, in a pod -> router -> receiver chain of network namespaces: the program's
//! own cost for mesh and masquerade traffic (the router's softirq time per packet against the
//! empty program and against the lookups alone), the fast path against netfilter, and new
//! connections per second against NAT-everything and against Kilo's own iptables rules
//! (nf_tables and legacy) at N = 10 to 100,000 mesh entries, paired per round, the targets
//! judged on confidence intervals.
//!
//! `cargo xtask bench live [--quick] [-- --help]` (root; without root it says so and exits 0).
//! The method is written once, in the report (the `method` and `statistics` lines and the
//! tables' notes); the modules: [`lab`] (namespaces, counters), [`clock`] (the NET_RX softirq
//! clock), [`sender`], [`router`] (the router's cases and plan), [`kilo`] (Kilo's rules),
//! [`part1`] (one established flow) and [`part2`] (new connections).
use kilo_testkit::{self as support, report};

use std::{net::Ipv4Addr, thread, time::Duration};

use clap::Parser;

mod clock;
mod kilo;
mod lab;
mod part1;
mod part2;
mod router;
mod sender;

use clock::NetRxClock;
use lab::{Lab, STOP, conntrack_count, dev_packets, enter, flush_conntrack, stop_on_signals};
use router::Router;
use sender::{Flows, send};

const SENDER_CPU: usize = 0;
const RPS_CPU: usize = 1;
const POD: Ipv4Addr = Ipv4Addr::new(10, 10, 1, 2);
const SPORT: u16 = 4000;
const MESH_DST: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 2);
const INET_DST: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const DPORT: u16 = 9000;

/// (name, RPS mask of the router's pod-facing veth, sender pacing in ns).
type Mode = (&'static str, u32, u64);

const MODES: [Mode; 2] = [
    ("same-CPU", 0, 0),
    ("cross-CPU (RPS)", 1 << RPS_CPU, 10_000),
];

/// The live datapath benchmark (`cargo xtask bench live`); sizes default by `--quick`.
#[derive(Parser)]
struct Args {
    /// Small sizes and few rounds (a few minutes).
    #[arg(long, env = "KILO_BENCH_QUICK")]
    quick: bool,
    /// Frames of one flow per part-1 run [default: 50,000; quick: 10,000].
    #[arg(long)]
    packets: Option<u64>,
    /// New flows per part-2 run [default: 20,000; quick: 5,000].
    #[arg(long)]
    flows: Option<u32>,
    /// Part-1 rounds of every case [default: 7; quick: 2].
    #[arg(long)]
    rounds: Option<usize>,
    /// Part-1 rounds at most, added until the own-cost intervals are narrow [default: 31].
    #[arg(long)]
    max_rounds: Option<usize>,
    /// Part-2 rounds at each N [default: 11; quick: 2].
    #[arg(long)]
    flow_rounds: Option<usize>,
    /// Part-2 rounds at most, added until every target's interval decides [default: 61].
    #[arg(long)]
    max_flow_rounds: Option<usize>,
    /// One part only (1 or 2).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=2))]
    only: Option<u8>,
    /// Part 1 without BPF_ENABLE_STATS (whose clock reads add to every program run).
    #[arg(long)]
    no_prog_stats: bool,
}

/// One run's figures.
struct Sample {
    /// NET_RX ns per packet the router received.
    ns: f64,
    /// Packets the router received, and forwarded (out0 tx).
    rx: u64,
    fwd: u64,
    sent: u64,
    /// The attached program's own run time per run (BPF_ENABLE_STATS).
    prog_ns: Option<f64>,
    /// The router's conntrack entries after the run.
    conntrack: u64,
}

/// One run in `lab`: conntrack flushed, `flows` sent, the router's NET_RX time per packet it
/// received; `router`, when it is the lab's, for its program's run time. The calling thread is
/// left in the lab's router namespace.
fn measure(
    lab: &Lab,
    clock: &NetRxClock,
    router: Option<&Router>,
    flows: Flows,
    packets: u64,
    gap_ns: u64,
) -> Sample {
    assert!(
        !STOP.load(std::sync::atomic::Ordering::Relaxed),
        "interrupted: deleting the namespaces"
    );
    enter(&lab.rtr);
    flush_conntrack();
    thread::sleep(Duration::from_millis(30));
    if let Flows::One(dst) = flows {
        // Warm up: sets up the flow (conntrack, NAT binding) under this run's rules.
        send(&lab.pod, lab.macs, Flows::One(dst), 2_000, 0);
        thread::sleep(Duration::from_millis(20));
    }
    let stats = || router.and_then(Router::prog_stats);
    let (rx0, _) = dev_packets("pod0");
    let (_, fwd0) = dev_packets("out0");
    let p0 = stats();
    let (t0, _) = clock.read();
    let sent = send(&lab.pod, lab.macs, flows, packets, gap_ns);
    // Let a cross-CPU backlog drain.
    thread::sleep(Duration::from_millis(30));
    let (t1, _) = clock.read();
    let p1 = stats();
    let (rx1, _) = dev_packets("pod0");
    let (_, fwd1) = dev_packets("out0");
    let rx = rx1 - rx0;
    Sample {
        ns: (t1 - t0) as f64 / rx.max(1) as f64,
        rx,
        fwd: fwd1 - fwd0,
        sent,
        prog_ns: p0
            .zip(p1)
            .filter(|((_, n0), (_, n1))| n1 > n0)
            .map(|((t0, n0), (t1, n1))| (t1 - t0) as f64 / (n1 - n0) as f64),
        conntrack: conntrack_count(),
    }
}

fn main() {
    let args = Args::parse();
    if !support::require_root("bench_live") {
        return;
    }
    let quick = args.quick || report::quick();
    let packets = args.packets.unwrap_or(if quick { 10_000 } else { 50_000 });
    let flows = args.flows.unwrap_or(if quick { 5_000 } else { 20_000 });
    let rounds = args.rounds.unwrap_or(if quick { 2 } else { 7 });
    let max_rounds = args.max_rounds.unwrap_or(if quick { 2 } else { 31 });
    let flow_rounds = args
        .flow_rounds
        .unwrap_or(if quick { 2 } else { 11 })
        .max(1);
    let max_flow_rounds = args.max_flow_rounds.unwrap_or(if quick { 2 } else { 61 });
    let ns_list: &[usize] = if quick {
        &[10, 1_000]
    } else {
        &[10, 100, 1_000, 10_000, 100_000]
    };
    report::meta(
        "method",
        "pod -> router -> receiver network namespaces joined by veth pairs. A thread pinned to \
         CPU 0 in the pod namespace sends raw Ethernet/IPv4/UDP frames (AF_PACKET, qdisc \
         bypassed) to the router; everything the router does with a frame (TC ingress hook, \
         routing, conntrack and NAT, forwarding) and the receiver's drop at its ingress run in \
         the NET_RX softirq, which two raw-tracepoint programs time on every CPU \
         (softirq_entry/exit with bpf_ktime_get_ns: the kernel measured on has no IRQ time \
         accounting). ns per packet = NET_RX ns / frames the router received. Same-CPU: RPS \
         off, the softirq runs on the sender's CPU right after each frame; cross-CPU: RPS steers \
         the router's ingress to CPU 1 and frames are paced 10 us apart, so each is processed \
         alone on the other CPU, cache misses included. Conntrack is flushed before every run. \
         The empty program and the lookups alone are kilo-ebpf's bench object (`kilo_noop`, and \
         `kilo_lookups` in copies of our tries), which the agent never loads.",
    );
    report::meta(
        "statistics",
        "cases interleaved round by round; a cell is the median and range over the rounds; \
         differences and ratios are taken per round (paired), with a distribution-free 95% \
         confidence interval of their median (order statistics)",
    );
    report::meta(
        "live runs",
        &format!(
            "{packets} frames of one UDP flow per part-1 run, at least {rounds} rounds; {flows} \
             new flows (and {packets} packets of an established one) per part-2 run, at least \
             {flow_rounds} rounds"
        ),
    );
    let modes: &[Mode] = if thread::available_parallelism().map_or(1, |n| n.get()) > RPS_CPU {
        &MODES
    } else {
        &MODES[..1]
    };

    stop_on_signals();
    let lab = Lab::new("");
    enter(&lab.rtr);
    let clock = NetRxClock::new().expect("NET_RX clock (raw tracepoints)");
    // Programs' own run time and count while this fd is open (for every case alike).
    let mut stats = (!args.no_prog_stats)
        .then(|| aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS"));
    let mut router = Router::new(&lab.rtr);
    router.apply_plan(1_000);
    router.lookups = Some(support::lookups(&mut router.dp));

    let mut checks = Vec::new();
    if args.only != Some(2) {
        checks.extend(part1::run(
            &lab,
            &clock,
            &mut router,
            modes,
            packets,
            (rounds, max_rounds),
        ));
    }
    // Part 2 compares with NAT-all without a program, so it runs without BPF stats: their clock
    // reads would be charged to ours alone.
    drop(stats.take());
    if args.only != Some(1) {
        checks.extend(part2::run(
            &lab,
            &clock,
            &mut router,
            modes,
            ns_list,
            (flows, packets),
            (flow_rounds, max_flow_rounds),
        ));
    }
    println!();
    if checks.is_empty() {
        println!("checks: every run took the expected decision and conntrack state");
    } else {
        checks.dedup();
        println!("checks FAILED ({}):", checks.len());
        for c in &checks {
            println!("  {c}");
        }
    }
}
