//! Part 2: new connections (one packet each) and packets of an established connection, at N mesh
//! entries, through ours, NAT-everything (without and behind the empty program) and Kilo's own
//! rules (nf_tables and legacy iptables), every case in every round.
use std::collections::BTreeMap;

use kilo_agent::datapath::Decision;
use kilo_testkit::{
    report,
    stats::{decides, interval_text, median_ci, paired},
};

use crate::{
    INET_DST, Mode,
    clock::NetRxClock,
    kilo::{Iptables, KiloRouter},
    lab::Lab,
    measure,
    router::{Nf, Prog, Router, plan},
    sender::Flows,
};

/// The largest N Kilo's rules are loaded at: beyond it one new connection walks so many rules
/// that a run takes minutes.
const KILO_MAX_N: usize = 10_000;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum FlowCase {
    /// NAT everything, no program.
    NatAll,
    /// NAT everything with the empty program attached: the target's reference, the TC hook's
    /// own share included.
    NatAllEmpty,
    /// Ours: the program and our one masquerade rule.
    Ours,
    /// Kilo's rules, no program.
    Kilo(Iptables),
}

impl FlowCase {
    /// The cases run at `n` mesh entries.
    fn at(n: usize) -> Vec<FlowCase> {
        let mut cases = vec![FlowCase::NatAll, FlowCase::NatAllEmpty, FlowCase::Ours];
        if n <= KILO_MAX_N {
            cases.extend(Iptables::ALL.map(FlowCase::Kilo));
        }
        cases
    }

    fn name(self) -> String {
        match self {
            FlowCase::NatAll => "NAT everything, no program".into(),
            FlowCase::NatAllEmpty => "NAT everything, the empty program attached".into(),
            FlowCase::Ours => "ours: mark + one masquerade rule".into(),
            FlowCase::Kilo(i) => format!("Kilo's rules ({} iptables)", i.name()),
        }
    }
}

/// Per (N index, mode index, case): NET_RX ns per packet, one value per round.
type Samples = BTreeMap<(usize, usize, FlowCase), Vec<f64>>;

/// What part 2 measures: new connections and established packets.
#[derive(Default)]
struct Part2 {
    new: Samples,
    established: Samples,
    checks: Vec<String>,
}

/// A ratio's threshold, per N: what the new connections' ratio against `reference` must reach.
struct Criterion {
    reference: FlowCase,
    min: fn(usize) -> f64,
}

/// ours / NAT-all behind the empty program, at least 0.95 at every N; Kilo's time / ours at least
/// 1 at every N, 2 at 1,000 and 10 at 10,000.
const CRITERIA: [Criterion; 3] = [
    Criterion {
        reference: FlowCase::NatAllEmpty,
        min: |_| 0.95,
    },
    Criterion {
        reference: FlowCase::Kilo(Iptables::Nft),
        min: kilo_min,
    },
    Criterion {
        reference: FlowCase::Kilo(Iptables::Legacy),
        min: kilo_min,
    },
];

fn kilo_min(n: usize) -> f64 {
    match n {
        1_000 => 2.0,
        10_000 => 10.0,
        _ => 1.0,
    }
}

/// Per round, how many times faster ours set up a new connection than `reference` did (the
/// reference's ns / ours).
fn ratio(p: &Samples, (i, m): (usize, usize), reference: FlowCase) -> Option<Vec<f64>> {
    Some(paired(
        p.get(&(i, m, reference))?,
        p.get(&(i, m, FlowCase::Ours))?,
        true,
    ))
}

/// Runs part 2 at each of `ns_list`: at least `rounds` rounds, then more until every criterion's
/// interval decides (at most `max_rounds`); reports it and returns the checks that failed.
pub fn run(
    lab: &Lab,
    clock: &NetRxClock,
    router: &mut Router,
    modes: &[Mode],
    ns_list: &[usize],
    (flows, packets): (u32, u64),
    (rounds, max_rounds): (usize, usize),
) -> Vec<String> {
    let kilo: Vec<KiloRouter> = Iptables::ALL.into_iter().map(KiloRouter::new).collect();
    let mut p = Part2::default();
    let mut rounds_done = Vec::new();
    for (i, &n) in ns_list.iter().enumerate() {
        let mesh = plan(n);
        router.set(Prog::None, Nf::Off);
        let writes = router.apply_plan(n);
        let cases = FlowCase::at(n);
        if n <= KILO_MAX_N {
            for k in &kilo {
                k.load(&mesh);
            }
        }
        let masq0: Vec<u64> = kilo.iter().map(KiloRouter::masqueraded).collect();
        let mut new_rx = BTreeMap::<Iptables, u64>::new();
        eprintln!("part 2: {n} entries ({writes} map writes)");
        let mut done = 0;
        let decided = |p: &Part2| {
            (0..modes.len()).all(|m| {
                CRITERIA.iter().all(|c| {
                    ratio(&p.new, (i, m), c.reference)
                        .is_none_or(|r| decides(&r, |v| v >= (c.min)(n)))
                })
            })
        };
        while done < rounds || (done < max_rounds && !decided(&p)) {
            for (m, (_, mask, gap)) in modes.iter().enumerate() {
                lab.rps(*mask);
                for k in &kilo {
                    k.lab.rps(*mask);
                }
                for &case in &cases {
                    let (on, stats) = match case {
                        FlowCase::Kilo(v) => (&kilo[v as usize].lab, None),
                        _ => {
                            let (prog, nf) = match case {
                                FlowCase::NatAll => (Prog::None, Nf::NatAll),
                                FlowCase::NatAllEmpty => (Prog::Empty, Nf::NatAll),
                                _ => (Prog::Ours, Nf::Kilo),
                            };
                            router.set(prog, nf);
                            (lab, Some(&*router))
                        }
                    };
                    let before = router.dp.counters().unwrap();
                    let s = measure(on, clock, stats, Flows::New(flows), 0, *gap);
                    if s.conntrack + s.conntrack / 100 < s.rx {
                        p.checks.push(format!(
                            "new flows (N={n}, {}): {} conntrack entries for {} packets",
                            case.name(),
                            s.conntrack,
                            s.rx
                        ));
                    }
                    if case == FlowCase::Ours {
                        let after = router.dp.counters().unwrap();
                        let d = Decision::Masquerade;
                        let moved = after.decision(d).packets - before.decision(d).packets;
                        if moved < s.rx {
                            p.checks.push(format!(
                                "new flows N={n}: only {moved} of {} masqueraded",
                                s.rx
                            ));
                        }
                    }
                    if let FlowCase::Kilo(v) = case {
                        *new_rx.entry(v).or_default() += s.rx;
                    }
                    p.new.entry((i, m, case)).or_default().push(s.ns);
                    let e = measure(on, clock, stats, Flows::One(INET_DST), packets, *gap);
                    p.established.entry((i, m, case)).or_default().push(e.ns);
                }
            }
            done += 1;
        }
        for (k, m0) in kilo.iter().zip(masq0) {
            let moved = k.masqueraded() - m0;
            let rx = new_rx.get(&k.iptables).copied().unwrap_or(0);
            if moved < rx {
                p.checks.push(format!(
                    "new flows N={n}: Kilo's MASQUERADE ({}) matched {moved} of {rx}",
                    k.iptables.name()
                ));
            }
        }
        rounds_done.push(done);
    }
    router.set(Prog::None, Nf::Off);
    report::meta(
        "part 2 rounds",
        &format!(
            "{} at N = {} (at least {rounds}, more until every target's interval decides, at most \
             {max_rounds})",
            join(&rounds_done),
            join(ns_list)
        ),
    );
    report_part2(&p, ns_list, modes);
    p.checks
}

fn join(v: &[usize]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Part 2 into the report.
fn report_part2(p: &Part2, ns_list: &[usize], modes: &[Mode]) {
    let id = "new-flows";
    report::table(
        id,
        "Live: new connections per second through the router, by mesh entries",
        "flows/s",
    );
    let rate = |v: &[f64]| v.iter().map(|ns| 1e9 / ns).collect::<Vec<f64>>();
    for (m, (mode, _, _)) in modes.iter().enumerate() {
        for (i, &n) in ns_list.iter().enumerate() {
            for c in FlowCase::at(n) {
                let row = format!("{} ({mode})", c.name());
                report::cell(id, &row, &n.to_string(), &rate(&p.new[&(i, m, c)]));
            }
        }
    }
    report::note(
        id,
        "One packet per new UDP flow (unique ports), conntrack flushed before each run; flows/s = \
         1e9 / NET_RX ns per new-flow packet (one core). BPF stats off. Kilo's rules: the IPv4 \
         nat rules Kilo 0.7 keeps for the same mesh (pkg/mesh/routes.go: a RETURN in KILO-NAT \
         per allowed IP, then MASQUERADE), loaded with iptables-restore into a router of their \
         own, up to 10,000 entries.",
    );
    report::plot(id, "mesh entries", "new flows per second", true, true);

    let targets = [
        (
            "new-flows-ratio",
            "Live: new connections, ours / NAT everything behind the empty program (paired per \
             round)",
            "live: new connections within 5% of NAT-everything behind the empty program at every \
             N",
            &CRITERIA[..1],
        ),
        (
            "kilo-rules",
            "Live: kg against Kilo's rules, new connections (Kilo's time / ours, paired per \
             round)",
            "live: new connections faster than Kilo's rules at every N (nf_tables and legacy \
             iptables), at least 2x at 1,000 entries and 10x at 10,000",
            &CRITERIA[1..],
        ),
    ];
    for (id, title, target, criteria) in targets {
        report::table(id, title, "ratio");
        let mut states = Vec::new();
        let mut parts = Vec::new();
        for (m, (mode, _, _)) in modes.iter().enumerate() {
            for c in criteria {
                for (i, &n) in ns_list.iter().enumerate() {
                    let Some(r) = ratio(&p.new, (i, m), c.reference) else {
                        continue;
                    };
                    let row = match c.reference {
                        FlowCase::Kilo(v) => format!("{} iptables, {mode}", v.name()),
                        _ => mode.to_string(),
                    };
                    let col = n.to_string();
                    report::cell(id, &row, &col, &r);
                    let interval = interval_text(&r, 3);
                    report::text(
                        id,
                        &format!("{row}: 95% interval of the median"),
                        &col,
                        &interval,
                    );
                    let (med, lo, hi) = median_ci(&r);
                    let min = (c.min)(n);
                    let state = report::State::judged(med, lo, hi, |v| v >= min);
                    let how = if !lo.is_finite() || decides(&r, |v| v >= min) {
                        ""
                    } else {
                        ", judged on the median"
                    };
                    states.push(state);
                    parts.push(format!("{row} N={n}: {med:.3} ({interval}{how})"));
                }
            }
        }
        if id == "new-flows-ratio" {
            for (m, (mode, _, _)) in modes.iter().enumerate() {
                for (i, &n) in ns_list.iter().enumerate() {
                    let col = n.to_string();
                    if let Some(r) = ratio(&p.new, (i, m), FlowCase::NatAll) {
                        report::cell(
                            id,
                            &format!("{mode}: ours / NAT everything, no program"),
                            &col,
                            &r,
                        );
                    }
                    let hook = paired(
                        &p.new[&(i, m, FlowCase::NatAll)],
                        &p.new[&(i, m, FlowCase::NatAllEmpty)],
                        true,
                    );
                    report::cell(
                        id,
                        &format!(
                            "{mode}: the TC hook alone (NAT everything, empty program / none)"
                        ),
                        &col,
                        &hook,
                    );
                }
            }
        }
        report::note(
            id,
            "Per round, the reference's NET_RX time per new connection over ours in the same \
             mode and round (above 1: ours is faster). Rounds are added until every interval lies wholly on one side \
             of its threshold or the limit is reached; an interval still astride then is judged \
             on its median, and says so.",
        );
        report::plot(id, "mesh entries", "ratio", true, false);
        report::target(
            target,
            &format!("median (95% interval): {}", parts.join("; ")),
            report::State::all(states),
        );
    }

    let id = "established";
    report::table(
        id,
        "Live: a packet of an established connection to the internet (router's softirq time)",
        "ns per packet",
    );
    for (m, (mode, _, _)) in modes.iter().enumerate() {
        for (i, &n) in ns_list.iter().enumerate() {
            for c in FlowCase::at(n) {
                let row = format!("{} ({mode})", c.name());
                report::cell(id, &row, &n.to_string(), &p.established[&(i, m, c)]);
            }
        }
    }
    let id = "established-paired";
    report::table(
        id,
        "Live: a packet of an established connection, ours - the others per round (router's \
         softirq time)",
        "ns per packet",
    );
    for (m, (mode, _, _)) in modes.iter().enumerate() {
        for (i, &n) in ns_list.iter().enumerate() {
            let col = n.to_string();
            let ours = &p.established[&(i, m, FlowCase::Ours)];
            for c in FlowCase::at(n) {
                if c == FlowCase::Ours {
                    continue;
                }
                let d = paired(ours, &p.established[&(i, m, c)], false);
                let row = format!("ours - {} ({mode})", c.name());
                report::cell(id, &row, &col, &d);
                report::text(
                    id,
                    &format!("{row}: 95% interval of the median"),
                    &col,
                    &interval_text(&d, 1),
                );
            }
        }
    }
    report::note(
        id,
        "Packets of one flow set up just before (conntrack holds it), in the same rounds as the \
         new connections: no nat rule runs, Kilo's nor ours, as netfilter consults a \
         connection's nat rules on its first packet only. What ours adds is the program at the \
         router's ingress, which runs on every packet and which Kilo's rules do not have.",
    );
}
