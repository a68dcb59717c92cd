//! Part 1: one established flow through the router at 1,000 mesh entries, every case of
//! [`CASES`] interleaved round by round; the program's own cost (ours against the empty program,
//! split into the lookups alone and the rest) and the fast path against netfilter.
use std::{collections::BTreeMap, net::Ipv4Addr};

use kilo_agent::datapath::Decision;
use kilo_testkit::{
    report,
    stats::{interval_text, median, narrower, paired},
};

use crate::{
    INET_DST, MESH_DST, Mode,
    clock::NetRxClock,
    lab::Lab,
    measure,
    router::{Nf, Prog, Router},
    sender::Flows,
};

pub struct Case {
    name: &'static str,
    prog: Prog,
    nf: Nf,
    dst: Ipv4Addr,
    /// The decision our program must take (checked on its counters).
    decision: Option<Decision>,
}

pub const CASES: [Case; 14] = [
    Case {
        name: "sink: dropped at router ingress",
        prog: Prog::Sink,
        nf: Nf::Off,
        dst: MESH_DST,
        decision: None,
    },
    Case {
        name: "forward, no program",
        prog: Prog::None,
        nf: Nf::Off,
        dst: MESH_DST,
        decision: None,
    },
    Case {
        name: "forward, empty program",
        prog: Prog::Empty,
        nf: Nf::Off,
        dst: MESH_DST,
        decision: None,
    },
    Case {
        name: "forward, lookups only",
        prog: Prog::Lookups,
        nf: Nf::Off,
        dst: MESH_DST,
        decision: None,
    },
    Case {
        name: "forward, ours (mesh hit)",
        prog: Prog::Ours,
        nf: Nf::Off,
        dst: MESH_DST,
        decision: Some(Decision::Mesh),
    },
    Case {
        name: "mesh + conntrack, no program",
        prog: Prog::None,
        nf: Nf::Kilo,
        dst: MESH_DST,
        decision: None,
    },
    Case {
        name: "mesh + conntrack, empty program",
        prog: Prog::Empty,
        nf: Nf::Kilo,
        dst: MESH_DST,
        decision: None,
    },
    Case {
        name: "mesh + conntrack, lookups only",
        prog: Prog::Lookups,
        nf: Nf::Kilo,
        dst: MESH_DST,
        decision: None,
    },
    Case {
        name: "mesh + conntrack, ours",
        prog: Prog::Ours,
        nf: Nf::Kilo,
        dst: MESH_DST,
        decision: Some(Decision::Mesh),
    },
    Case {
        name: "mesh, ours fast path",
        prog: Prog::OursFast,
        nf: Nf::Kilo,
        dst: MESH_DST,
        decision: Some(Decision::Redirect),
    },
    Case {
        name: "NAT all, no program",
        prog: Prog::None,
        nf: Nf::NatAll,
        dst: INET_DST,
        decision: None,
    },
    Case {
        name: "NAT all, empty program",
        prog: Prog::Empty,
        nf: Nf::NatAll,
        dst: INET_DST,
        decision: None,
    },
    Case {
        name: "NAT all, lookups only",
        prog: Prog::Lookups,
        nf: Nf::NatAll,
        dst: INET_DST,
        decision: None,
    },
    Case {
        name: "masquerade, ours (mark + rule)",
        prog: Prog::Ours,
        nf: Nf::Kilo,
        dst: INET_DST,
        decision: Some(Decision::Masquerade),
    },
];

pub type Samples = BTreeMap<(usize, usize), Vec<f64>>;

/// What part 1 collects, per (case, mode): NET_RX ns per packet, the program's own run time,
/// (received, forwarded, sent) frames; and the checks that failed.
#[derive(Default)]
pub struct Part1 {
    p1: Samples,
    prog: Samples,
    loss: BTreeMap<(usize, usize), (u64, u64, u64)>,
    checks: Vec<String>,
}

impl Part1 {
    /// One round: every mode, `cases` (indices into [`CASES`]) in order.
    pub fn round(
        &mut self,
        lab: &Lab,
        clock: &NetRxClock,
        router: &mut Router,
        modes: &[Mode],
        packets: u64,
        cases: &[usize],
    ) {
        for (m, (_, mask, gap)) in modes.iter().enumerate() {
            lab.rps(*mask);
            for &c in cases {
                let case = &CASES[c];
                router.set(case.prog, case.nf);
                let before = router.dp.counters().unwrap();
                let s = measure(
                    lab,
                    clock,
                    Some(router),
                    Flows::One(case.dst),
                    packets,
                    *gap,
                );
                let after = router.dp.counters().unwrap();
                if let Some(d) = case.decision {
                    let moved = after.decision(d).packets - before.decision(d).packets;
                    if moved < s.rx {
                        self.checks.push(format!(
                            "{}: only {moved} of {} packets took {d:?}",
                            case.name, s.rx
                        ));
                    }
                }
                let ct = s.conntrack;
                let want_ct = case.nf != Nf::Off && case.prog != Prog::OursFast;
                if (ct > 0) != want_ct && case.prog != Prog::Sink {
                    self.checks.push(format!(
                        "{}: {ct} conntrack entries (expected {})",
                        case.name,
                        if want_ct { "some" } else { "none" }
                    ));
                }
                self.p1.entry((c, m)).or_default().push(s.ns);
                if let Some(ns) = s.prog_ns {
                    self.prog.entry((c, m)).or_default().push(ns);
                }
                let l = self.loss.entry((c, m)).or_default();
                l.0 += s.rx;
                l.1 += s.fwd;
                l.2 += s.sent;
            }
        }
    }

    /// Whether the interval of every ours - empty difference is narrower than
    /// [`OWN_COST_WIDTH_NS`].
    pub fn narrow(&self, modes: &[Mode]) -> bool {
        own_cost(&self.p1, modes)
            .iter()
            .all(|(_, _, d)| narrower(d, OWN_COST_WIDTH_NS))
    }
}

/// The program's own cost is measured on these (label, ours, the empty program) pairs of cases;
/// the last case of each is the lookups alone under the same rules, which splits the difference.
pub const OWN_COST: [(&str, &str, &str, &str); 3] = [
    (
        "mesh hit",
        "forward, ours (mesh hit)",
        "forward, empty program",
        "forward, lookups only",
    ),
    (
        "mesh + conntrack",
        "mesh + conntrack, ours",
        "mesh + conntrack, empty program",
        "mesh + conntrack, lookups only",
    ),
    (
        "masquerade",
        "masquerade, ours (mark + rule)",
        "NAT all, empty program",
        "NAT all, lookups only",
    ),
];

/// How narrow the interval of each ours - empty difference must be before part 1's rounds
/// stop (at most `--max-rounds`), ns per packet.
pub const OWN_COST_WIDTH_NS: f64 = 45.0;

/// (label, mode, ours - empty per round) of every [`OWN_COST`] pair in every mode.
fn own_cost<'a>(samples: &Samples, modes: &'a [Mode]) -> Vec<(&'static str, &'a str, Vec<f64>)> {
    differences(samples, modes, |(label, ours, empty, _)| {
        (label, ours, empty)
    })
}

/// The split of every [`OWN_COST`] difference: (label, mode, lookups only - empty, ours -
/// lookups only) per round.
fn own_cost_split<'a>(
    samples: &Samples,
    modes: &'a [Mode],
) -> Vec<(&'static str, &'a str, Vec<f64>, Vec<f64>)> {
    let floor = differences(samples, modes, |(label, _, empty, lookups)| {
        (label, lookups, empty)
    });
    let rest = differences(samples, modes, |(label, ours, _, lookups)| {
        (label, ours, lookups)
    });
    floor
        .into_iter()
        .zip(rest)
        .map(|((label, mode, f), (_, _, r))| (label, mode, f, r))
        .collect()
}

/// (label, mode, a - b per round) of the (label, a, b) `pick` takes from each [`OWN_COST`] row.
fn differences<'a>(
    samples: &Samples,
    modes: &'a [Mode],
    pick: impl Fn(
        (&'static str, &'static str, &'static str, &'static str),
    ) -> (&'static str, &'static str, &'static str),
) -> Vec<(&'static str, &'a str, Vec<f64>)> {
    let mut out = Vec::new();
    for row in OWN_COST {
        let (label, a, b) = pick(row);
        for (m, (mode, _, _)) in modes.iter().enumerate() {
            let (Some(x), Some(y)) = (samples.get(&(case(a), m)), samples.get(&(case(b), m)))
            else {
                continue;
            };
            out.push((label, *mode, paired(x, y, false)));
        }
    }
    out
}

pub fn case(name: &str) -> usize {
    CASES.iter().position(|c| c.name == name).unwrap()
}

/// Part 1 into the report: NET_RX ns per packet, the program's own run time, and the
/// differences and ratios the targets are judged on.
pub fn report_part1(p1: &Samples, prog: &Samples, modes: &[Mode]) {
    let id = "softirq";
    report::table(
        id,
        "Live, one flow: the NET_RX softirq time per packet the router received",
        "ns",
    );
    for (c, k) in CASES.iter().enumerate() {
        for (m, (mode, _, _)) in modes.iter().enumerate() {
            report::cell(id, k.name, mode, &p1[&(c, m)]);
        }
    }
    report::note(
        id,
        "The sink row is the cost of one veth delivery + softirq + drop, about the receiver's \
         share.",
    );
    if !prog.is_empty() {
        let id = "prog";
        report::table(
            id,
            "Live: the attached program's own run time (BPF stats)",
            "ns per run",
        );
        for name in OWN_COST
            .iter()
            .flat_map(|(_, ours, empty, lookups)| [*empty, *lookups, *ours])
        {
            for (m, (mode, _, _)) in modes.iter().enumerate() {
                if let Some(v) = prog.get(&(case(name), m)) {
                    report::cell(id, name, mode, v);
                }
            }
        }
        for (label, mode, d) in own_cost(prog, modes) {
            report::cell(id, &format!("ours - empty, {label}"), mode, &d);
        }
        report::note(
            id,
            "BPF_ENABLE_STATS: the kernel's run_time_ns / run_cnt of the attached program \
             (includes the stats' own two clock reads, the same for both). The differences are \
             per round (paired). 1,000 mesh entries. In the cross-CPU mode this difference also \
             counts the first touch of the packet's cache lines, which the empty program never \
             makes and the stack makes right after; the router's softirq time below \
             counts it once.",
        );
    }
    // The program's own cost on the router's whole softirq time per packet: a figure (the
    // target is judged with BPF_PROG_TEST_RUN, in the datapath benchmark).
    let id = "own-cost";
    report::table(
        id,
        "Live: the program's own cost, ours - empty per round (router's softirq time)",
        "ns per packet",
    );
    for (label, mode, d) in &own_cost(p1, modes) {
        report::cell(id, label, mode, d);
        report::text(
            id,
            &format!("{label}: 95% interval of the median"),
            mode,
            &interval_text(d, 1),
        );
    }
    report::note(
        id,
        "Per round, the NET_RX softirq time per packet with ours minus that with the empty \
         program in the same mode and round (the masquerade case against the empty program \
         under NAT-all). Rounds are added until every interval is narrower than 45 ns or the limit is reached. A \
         figure: the program's own cost is judged with BPF_PROG_TEST_RUN (the datapath \
         benchmark), where the clock reads are not shared with the rest of the stack.",
    );
    let split_id = "own-cost-split";
    report::table(
        split_id,
        "Live: the program's own cost split, the lookups alone and the rest (router's softirq \
         time)",
        "ns per packet",
    );
    for (label, mode, floor, rest) in own_cost_split(p1, modes) {
        for (row, v) in [
            (
                format!("{label}: the lookups alone (lookups only - empty)"),
                floor,
            ),
            (format!("{label}: the rest (ours - lookups only)"), rest),
        ] {
            report::cell(split_id, &row, mode, &v);
            report::text(
                split_id,
                &format!("{row}: 95% interval of the median"),
                mode,
                &interval_text(&v, 1),
            );
        }
    }
    report::note(
        split_id,
        "The same rounds, with a third program under the same rules: kilo-ebpf's bench object \
         making only the LPM-trie lookups ours makes (the destination; on a miss, the source), in \
         copies of our tries, with no config, counter or mark. \"The lookups alone\" is the floor \
         the design's LPM tries set; \"the rest\" is what the program adds to them (parse \
         dispatch, config, counters, the mark, and for the masquerade case our nftables rule's \
         mark match against NAT-all's unconditional rule).",
    );
    let id = "fast-path";
    report::table(
        id,
        "Live: the fast path against netfilter (router's softirq time)",
        "ratio",
    );
    let (fast, nf, sink) = (
        case("mesh, ours fast path"),
        case("mesh + conntrack, no program"),
        0,
    );
    let mut worst = f64::MIN;
    for (m, (mode, _, _)) in modes.iter().enumerate() {
        let whole = paired(&p1[&(fast, m)], &p1[&(nf, m)], true);
        let f: Vec<f64> = paired(&p1[&(fast, m)], &p1[&(sink, m)], false);
        let n: Vec<f64> = paired(&p1[&(nf, m)], &p1[&(sink, m)], false);
        worst = worst.max(median(&whole));
        report::cell(id, "fast path / netfilter without a program", mode, &whole);
        report::cell(
            id,
            "the same, router only (minus the sink)",
            mode,
            &paired(&f, &n, true),
        );
    }
    report::note(
        id,
        "Mesh traffic, per round: ours with the fast path (redirect to the egress, no routing, \
         conntrack or netfilter) against forwarding through conntrack and our NAT table with no \
         program. Below 1: the fast path is cheaper.",
    );
    report::target(
        "live: with the fast path, mesh traffic cheaper for the router than netfilter without any program",
        &format!("fast path / netfilter = {worst:.2} at worst"),
        report::State::of(worst < 1.0),
    );
}

/// Runs part 1: `rounds` of every case, then more of the judged ones until the intervals are
/// narrow enough (at most `max_rounds`); reports it and returns the checks that failed.
pub fn run(
    lab: &Lab,
    clock: &NetRxClock,
    router: &mut Router,
    modes: &[Mode],
    packets: u64,
    (rounds, max_rounds): (usize, usize),
) -> Vec<String> {
    let mut part1 = Part1::default();
    let all: Vec<usize> = (0..CASES.len()).collect();
    for round in 0..rounds {
        part1.round(lab, clock, router, modes, packets, &all);
        eprintln!("part 1: round {} of {rounds} done", round + 1);
    }
    let judged: Vec<usize> = OWN_COST
        .iter()
        .flat_map(|(_, a, b, c)| [case(a), case(b), case(c)])
        .collect();
    let mut done = rounds;
    while done < max_rounds && !part1.narrow(modes) {
        part1.round(lab, clock, router, modes, packets, &judged);
        done += 1;
        eprintln!("part 1: round {done} (the program's own cost only)");
    }
    report::meta(
        "part 1 rounds",
        &format!(
            "{rounds} of every case, {done} of those the program's own cost is measured on (more \
             until the interval is narrower than {OWN_COST_WIDTH_NS} ns, at most {max_rounds})"
        ),
    );
    let Part1 {
        p1,
        prog,
        loss,
        checks,
    } = part1;
    for (m, (name, _, _)) in modes.iter().enumerate() {
        let shares: Vec<f64> = (0..CASES.len())
            .map(|c| {
                let (rx, _, sent) = loss[&(c, m)];
                100.0 * rx as f64 / sent.max(1) as f64
            })
            .collect();
        let lo = shares.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = shares.iter().copied().fold(0.0, f64::max);
        report::note(
            "softirq",
            &format!(
                "{name}: the router received {lo:.0}-{hi:.0}% of the frames sent (below 100%: \
                 its backlog was full, its CPU saturated)."
            ),
        );
    }
    report_part1(&p1, &prog, modes);
    checks
}
