//! IPIP benchmark (root): what encapsulation inside a location costs, with the datapath's
//! programs against `--encapsulate=never`. Without root it says so and exits 0.
//!
//! `cargo xtask bench encap [--seconds S --rounds R --repeat N]`
//! (or `cargo run --release -p kilo-agent --example bench_encap -- ...`).
//!
//! Lab: pod1 -> n1 -> n2 -> pod2, each a network namespace joined by veths; n1 and n2 are two
//! nodes of one location on an underlay veth, with the routes kg gives them: `never`, plain;
//! `always`, out of eth0 with its MTU minus 20 and realm `KILO_REALM`, and kilo-ebpf's
//! `kilo_encap`/`kilo_decap` attached there (TCX), with the maps a plan of two nodes fills and
//! route realms on (as kg sets them on a kernel that keeps them).
//! Each round builds both labs in turn (never, then always); figures are medians over R rounds.
//! - Throughput: iperf3 TCP from pod1 to pod2 for S seconds.
//! - CPU per packet: iperf3 UDP (1400-byte datagrams, unpaced) for S seconds; the CPU time of
//!   the iperf3 sender and receiver (iperf3's own figures: veth forwarding runs in the softirq
//!   the sender's transmit raises, so both nodes' work is in it, whatever else the machine
//!   runs) divided by the datagrams pod2's interface received.
//! - The programs' cost on the private interface's other traffic: BPF_PROG_TEST_RUN of each
//!   program on a packet it leaves alone, against the empty classifier (the hook's floor is the
//!   same for both), the thread's CPU time over `repeat` runs (the kernel's own figure is whole
//!   nanoseconds), paired with the empty one round by round: `kilo_encap` with route realms
//!   on (a test-run packet has no route, so no realm: kg's case on kernels with
//!   CONFIG_IP_ROUTE_CLASSID) and off (the full lookup, on kernels without
//!   CONFIG_IP_ROUTE_CLASSID); and on a packet it wraps or unwraps, one run at a time (a
//!   repeated run would see its own output), median of 2,000, so with the clock reads' cost in
//!   (wrapped with realms off: a test run cannot carry the realm).
use kilo_testkit as support;

use std::{collections::BTreeMap, process::Command, time::Duration};

use aya::programs::SchedClassifier;

use kilo_agent::{
    datapath::{Datapath, DatapathConfig, Hook, NoResolver, Plans},
    plan::{DatapathEntry, DatapathPlan, EntryKind, IpipPlan, NextHop},
};
use kilo_common::{KILO_REALM, PROG_DECAP, PROG_ENCAP};
use support::{
    median::median,
    netns::{NetNs, veth},
    packets::{ETH_P_IP, eth, ip, time, v4},
    report,
};

struct Lab {
    pods: [NetNs; 2],
    _nodes: [NetNs; 2],
    /// The loaded datapaths (their TCX links go with them).
    _datapaths: Vec<Datapath>,
}

fn entry(next_hop: Option<NextHop>) -> DatapathEntry {
    DatapathEntry {
        kind: EntryKind::Node,
        owner: "bench".into(),
        next_hop,
    }
}

/// Node `i`'s (1 or 2) IPIP maps: the other's pods wrapped toward it, the other accepted,
/// its own pods served.
fn ipip(i: u8) -> IpipPlan {
    let o = 3 - i;
    let hop = NextHop::Ipip {
        local: format!("192.168.50.{i}").parse().unwrap(),
        remote: format!("192.168.50.{o}").parse().unwrap(),
    };
    let net = |s: String| s.parse().unwrap();
    IpipPlan {
        encapsulate: BTreeMap::from([(net(format!("10.42.{o}.0/24")), entry(Some(hop)))]),
        sources: BTreeMap::from([(net(format!("192.168.50.{o}/32")), entry(None))]),
        decapsulate: BTreeMap::from([(net(format!("10.42.{i}.0/24")), entry(None))]),
    }
}

impl Lab {
    fn new(encap: bool) -> Lab {
        let pods = [NetNs::new("bep"), NetNs::new("bep")];
        let nodes = [NetNs::new("ben"), NetNs::new("ben")];
        veth(&nodes[0], "eth0", &nodes[1], "eth0");
        let mut datapaths = Vec::new();
        for (k, (pod, node)) in pods.iter().zip(&nodes).enumerate() {
            let (i, o) = (k + 1, 2 - k);
            veth(pod, "eth0", node, "pod0");
            pod.sh(&format!(
                "ip addr add 10.42.{i}.2/24 dev eth0 && ip route add default via 10.42.{i}.1"
            ));
            let mtu = if encap {
                format!(" mtu 1480 realm {KILO_REALM}")
            } else {
                String::new()
            };
            node.sh(&format!(
                "sysctl -qw net.ipv4.ip_forward=1 && ip addr add 10.42.{i}.1/24 dev pod0 && \
                 ip addr add 192.168.50.{i}/24 dev eth0 && \
                 ip route add 10.42.{o}.0/24 via 192.168.50.{o} dev eth0 onlink{mtu}"
            ));
            if encap {
                let plan = ipip(i as u8);
                datapaths.push(node.run(|| {
                    let mut dp = Datapath::open(DatapathConfig {
                        pin_dir: None,
                        ..DatapathConfig::default()
                    })
                    .expect("load the datapath");
                    let nat = DatapathPlan::default();
                    dp.apply(
                        Plans {
                            nat: &nat,
                            ipip: &plan,
                        },
                        &NoResolver,
                    )
                    .expect("apply");
                    dp.set_route_realm(true).expect("route realms");
                    for hook in [Hook::Decap, Hook::Encap] {
                        dp.attach_hook("eth0", hook).expect("attach");
                    }
                    dp
                }));
            }
        }
        Lab {
            pods,
            _nodes: nodes,
            _datapaths: datapaths,
        }
    }

    /// Runs iperf3 from pod1 to pod2 (`args` added to the client), returning its JSON report.
    fn iperf(&self, seconds: u32, args: &str) -> serde_json::Value {
        let server = Command::new("ip")
            .args(["netns", "exec", &self.pods[1].name])
            .args(["iperf3", "-s", "-1"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("iperf3 server");
        std::thread::sleep(Duration::from_millis(300));
        let out = self.pods[0].sh(&format!("iperf3 -c 10.42.2.2 -t {seconds} -J {args}"));
        let mut server = server;
        let _ = server.wait();
        serde_json::from_str(&out).expect("iperf3 JSON")
    }

    fn rx_packets(&self) -> u64 {
        self.pods[1]
            .sh("cat /sys/class/net/eth0/statistics/rx_packets")
            .trim()
            .parse()
            .unwrap()
    }
}

struct Figures {
    gbits: f64,
    ns_per_packet: f64,
    udp_mpps: f64,
}

fn measure(encap: bool, seconds: u32) -> Figures {
    let lab = Lab::new(encap);
    lab.pods[0].sh("busybox ping -c2 -W2 10.42.2.2 >/dev/null");
    let tcp = lab.iperf(seconds, "");
    let gbits = tcp["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap()
        / 1e9;
    let rx = lab.rx_packets();
    let udp = lab.iperf(seconds, "-u -b 0 -l 1400");
    let packets = lab.rx_packets() - rx;
    let cpu = &udp["end"]["cpu_utilization_percent"];
    let percent = cpu["host_total"].as_f64().unwrap() + cpu["remote_total"].as_f64().unwrap();
    let spent = percent / 100.0 * f64::from(seconds) * 1e9;
    Figures {
        gbits,
        ns_per_packet: spent / packets as f64,
        udp_mpps: packets as f64 / f64::from(seconds) / 1e6,
    }
}

fn main() {
    if !support::require_root("bench_encap") {
        return;
    }
    let quick = report::quick();
    let seconds: u32 = support::arg("--seconds", if quick { 1 } else { 5 });
    let rounds: usize = support::arg("--rounds", if quick { 1 } else { 3 });
    let repeat: u32 = support::arg("--repeat", if quick { 20_000 } else { 1_000_000 });

    println!("# IPIP inside a location: datapath encapsulation vs --encapsulate=never\n");
    let runs: Vec<(Figures, Figures)> = (0..rounds)
        .map(|_| (measure(false, seconds), measure(true, seconds)))
        .collect();
    let med = |f: fn(&(Figures, Figures)) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
    let never = Figures {
        gbits: med(|r| r.0.gbits),
        ns_per_packet: med(|r| r.0.ns_per_packet),
        udp_mpps: med(|r| r.0.udp_mpps),
    };
    let always = Figures {
        gbits: med(|r| r.1.gbits),
        ns_per_packet: med(|r| r.1.ns_per_packet),
        udp_mpps: med(|r| r.1.udp_mpps),
    };
    println!(
        "pod1 -> n1 -> n2 -> pod2 (veths), {seconds} s per figure, median of {rounds} rounds\n"
    );
    println!("| figure | never | always (eBPF IPIP) | always / never |");
    println!("|---|---|---|---|");
    report::table(
        "encap_lab",
        "Same-location pod to pod, never against always (eBPF IPIP)",
        "as named",
    );
    report::meta(
        "encap: seconds per figure, rounds",
        &format!("{seconds}, {rounds}"),
    );
    let row = |name: &str, a: f64, b: f64, unit: &str| {
        println!("| {name} | {a:.2} {unit} | {b:.2} {unit} | {:.2} |", b / a);
        report::cell("encap_lab", &format!("{name} ({unit})"), "never", &[a]);
        report::cell("encap_lab", &format!("{name} ({unit})"), "always", &[b]);
        report::cell(
            "encap_lab",
            &format!("{name} ({unit})"),
            "always / never",
            &[b / a],
        );
    };
    row("TCP throughput", never.gbits, always.gbits, "Gbit/s");
    row("UDP 1400 B rate", never.udp_mpps, always.udp_mpps, "Mpps");
    row(
        "sender + receiver CPU per UDP packet",
        never.ns_per_packet,
        always.ns_per_packet,
        "ns",
    );

    // The programs alone (BPF_PROG_TEST_RUN, median of 5 runs of `repeat`).
    let mut dp = Datapath::open(DatapathConfig {
        pin_dir: None,
        ..DatapathConfig::default()
    })
    .expect("load the datapath");
    let nat = DatapathPlan::default();
    let plan = ipip(1);
    dp.apply(
        Plans {
            nat: &nat,
            ipip: &plan,
        },
        &NoResolver,
    )
    .expect("apply");
    let noop = support::noop();
    let empty = support::noop_program(&noop);
    let frame = |p: Vec<u8>| {
        let mut f = eth(&[], ETH_P_IP);
        f.extend(p);
        f
    };
    let other = frame(ip(v4("192.168.50.1"), v4("192.168.50.7"), 64, 64));
    let to_pod = frame(ip(v4("10.42.1.2"), v4("10.42.2.2"), 64, 64));
    let mut ipip_pkt = ip(v4("192.168.50.2"), v4("192.168.50.1"), 64, 0);
    ipip_pkt.truncate(20);
    ipip_pkt[9] = 4;
    ipip_pkt[2..4].copy_from_slice(&(20 + 92u16).to_be_bytes());
    ipip_pkt.extend(ip(v4("10.42.2.2"), v4("10.42.1.2"), 64, 64));
    let from_node = frame(ipip_pkt);
    // The calling thread's CPU time per run over `repeat` runs: finer than the kernel's own
    // figure (whole nanoseconds), and the call's fixed cost spread over them.
    let fine = |prog: &SchedClassifier, pkt: &[u8]| {
        let t = thread_cpu_ns();
        time(prog, pkt, repeat);
        (thread_cpu_ns() - t) / f64::from(repeat)
    };
    // (the empty classifier's time, this one's, the difference paired round by round): the
    // machine's speed drifts by more than the difference between rounds.
    let many = |prog: &SchedClassifier, pkt: &[u8]| {
        let (mut b, mut t, mut d) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..5 {
            let base = fine(empty, &other);
            let ns = fine(prog, pkt);
            b.push(base);
            t.push(ns);
            d.push(ns - base);
        }
        (median(&b), median(&t), median(&d))
    };
    let single = |prog: &SchedClassifier, pkt: &[u8]| {
        median(&(0..2000).map(|_| time(prog, pkt, 1)).collect::<Vec<_>>())
    };
    report::table(
        "encap_programs",
        "The IPIP programs alone (BPF_PROG_TEST_RUN), against the empty classifier",
        "ns per packet",
    );
    report::note(
        "encap_programs",
        &format!(
            "Other traffic: the thread's CPU time per run over {repeat} runs (the kernel's own \
             figure is whole nanoseconds), minus the empty classifier's measured just before, \
             median of 5 such pairs. Wrapped and unwrapped: one run at a time (a repeated run \
             would see its own output), the kernel's figure, median of 2,000."
        ),
    );
    println!("\nPrograms alone (BPF_PROG_TEST_RUN), ns per packet:\n");
    println!("| program, packet | runs | ns | empty, paired | minus empty |");
    println!("|---|---|---|---|---|");
    // Realms off first (the full lookup), then on, as kg runs it where the kernel has realms.
    for (name, prog, pkt, realms) in [
        (
            "kilo_encap, other traffic, route realms off (LPM-trie lookup)",
            PROG_ENCAP,
            &other,
            false,
        ),
        (
            "kilo_encap, other traffic (route without our realm)",
            PROG_ENCAP,
            &other,
            true,
        ),
        (
            "kilo_decap, other traffic (not IPIP)",
            PROG_DECAP,
            &other,
            true,
        ),
    ] {
        dp.set_route_realm(realms).expect("route realms");
        let (base, t, over) = many(dp.program_named(prog), pkt);
        println!("| {name} | {repeat} x 5 | {t:.1} | {base:.1} | {over:.1} |");
        report::cell("encap_programs", name, "minus empty (ns)", &[over]);
        if prog == PROG_DECAP {
            report::target(
                "IPIP: the decapsulation program's cost on other traffic, a few ns over the hook",
                &format!("+{over:.1} ns"),
                report::State::of(over < 10.0),
            );
        } else if realms {
            report::target(
                "IPIP: the encapsulation program's cost on other traffic, a few ns over the hook",
                &format!("+{over:.1} ns (route realm checked, no lookup)"),
                report::State::of(over < 10.0),
            );
        }
    }
    dp.set_route_realm(false).expect("route realms");
    let base1 = single(empty, &other);
    println!("| empty classifier, any | 1 x 2000 | {base1:.1} | | 0 |");
    for (name, prog, pkt) in [
        (
            "kilo_encap, pod to a location node (wrapped)",
            PROG_ENCAP,
            &to_pod,
        ),
        (
            "kilo_decap, IPIP from a location node (unwrapped)",
            PROG_DECAP,
            &from_node,
        ),
    ] {
        let t = single(dp.program_named(prog), pkt);
        println!("| {name} | 1 x 2000 | {t:.1} | | {:.1} |", t - base1);
        report::cell("encap_programs", name, "minus empty (ns)", &[t - base1]);
    }
}

/// The calling thread's CPU time, in nanoseconds.
fn thread_cpu_ns() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e9 + ts.tv_nsec as f64
}
