//! Control plane, side by side in one run: keeping N CIDRs (N = 10, 100, 1,000, 10,000) in the
//! kernel with Kilo's iptables chain (an `iptables -C` per rule, as Kilo checked before its
//! rule cache, stopped at 1,000; or `iptables -S` compared as text and `iptables-restore`), an
//! ipset, an nftables set, and ours (the datapath's sync into its LPM trie, in-process): wall
//! time and processes started to apply from empty, to verify with nothing changed, and to
//! apply a 1-entry change.
//!
//! Run as root: `cargo xtask bench control [--quick]`. Everything runs in a network namespace
//! of its own, as PID 1 of a PID namespace of its own: the PIDs allocated there during an
//! operation are the processes it started (the benchmark starts no thread while measuring).
//! What each mechanism does:
//! - iptables -C: from empty, `-N` then per rule `-C` (missing) and `-A`; verify, `-C` per
//!   rule; change, `-C` and `-A` for the new rule (Kilo's `AppendUnique`).
//! - iptables -S/restore: from empty, one `iptables-restore --noflush`; verify, one `-S` of the
//!   chain compared with the expected text; change, `-S` then a restore of the whole chain.
//! - ipset: from empty, one `ipset restore` (create + adds); verify, one `ipset save` compared
//!   as a set; change, one `ipset add`. (The one iptables rule that would match the set is
//!   static and left out.)
//! - nftables set (interval): from empty, one `nft -f -`; verify, one `nft list set` compared
//!   as a set; change, one `nft add element`.
//! - ours: `Datapath::apply` of a plan with N mesh destinations; idle, it compares the plan with
//!   its record of what it wrote, and every `READ_BACK_EVERY`-th sync reads the trie back (both
//!   shown); a change is one map write after one ordered pass over the plan. The maps exist
//!   from the agent's start and the plans are built beforehand (planning, not the datapath's
//!   work), neither timed here.
use kilo_testkit as support;

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    net::Ipv4Addr,
    process::{Command, Stdio},
    time::Instant,
};

use ipnet::{IpNet, Ipv4Net};
use kilo_agent::{
    datapath::{Datapath, DatapathConfig, NoResolver},
    plan::{DatapathEntry, DatapathPlan, EntryKind},
    writes::{READ_BACK_EVERY, Writes},
};
use support::{median::median, report};

const CHILD: &str = "KILO_BENCH_CONTROL_CHILD";
const CHAIN: &str = "KILO-NAT";
const COMMENT: &str = "Kilo: do not NAT packets destined for known IPs";
const SET: &str = "kilo-nat";
const NFT_TABLE: &str = "kilobench";

/// The CIDRs: distinct /24s in 10.0.0.0/8.
fn cidrs(n: usize) -> Vec<Ipv4Net> {
    (0..n as u32)
        .map(|i| Ipv4Net::new(Ipv4Addr::from(0x0a00_0000 + (i << 8)), 24).unwrap())
        .collect()
}

/// The one entry a change adds.
fn extra() -> Ipv4Net {
    "10.250.0.0/24".parse().unwrap()
}

/// PIDs allocated so far in this PID namespace.
fn last_pid() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/ns_last_pid")
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Runs a tool (no shell: one process), feeding `stdin`; returns (success, stdout).
fn tool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", args[0]));
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn must(args: &[&str], stdin: Option<&str>) -> String {
    let (ok, out) = tool(args, stdin);
    assert!(ok, "{args:?} failed");
    out
}

/// One way of keeping the CIDRs in the kernel.
trait Mechanism {
    fn name(&self) -> &'static str;
    /// Largest N it runs at.
    fn max_n(&self) -> usize {
        usize::MAX
    }
    /// Prepares, before the timing, what the operations on `cidrs` (and `cidrs` plus `extra()`)
    /// are given: ours, the plans (the planner's work, not the datapath's).
    fn prepare(&mut self, _: &[Ipv4Net]) {}
    fn apply_empty(&mut self, cidrs: &[Ipv4Net]);
    /// Whether the kernel holds exactly `cidrs`.
    fn verify(&mut self, cidrs: &[Ipv4Net]) -> bool;
    /// Adds `extra()` to a kernel holding `cidrs`.
    fn change(&mut self, cidrs: &[Ipv4Net]);
    /// Back to nothing (not timed).
    fn clear(&mut self);
}

fn rule_args(cidr: &str) -> Vec<String> {
    [
        "-d",
        cidr,
        "-m",
        "comment",
        "--comment",
        COMMENT,
        "-j",
        "RETURN",
    ]
    .map(String::from)
    .to_vec()
}

/// The line `iptables -S` prints for a rule.
fn rule_text(cidr: &Ipv4Net) -> String {
    format!("-A {CHAIN} -d {cidr} -m comment --comment \"{COMMENT}\" -j RETURN")
}

struct IptablesCheck;

impl IptablesCheck {
    fn rule(op: &str, cidr: &Ipv4Net) -> bool {
        let cidr = cidr.to_string();
        let mut args = vec!["iptables", "-w", "-t", "nat", op, CHAIN];
        let rest = rule_args(&cidr);
        args.extend(rest.iter().map(String::as_str));
        tool(&args, None).0
    }

    fn append_unique(cidr: &Ipv4Net) {
        if !Self::rule("-C", cidr) {
            assert!(Self::rule("-A", cidr), "iptables -A {cidr}");
        }
    }
}

impl Mechanism for IptablesCheck {
    fn name(&self) -> &'static str {
        "iptables -C per rule (Kilo before its cache)"
    }
    fn max_n(&self) -> usize {
        1_000
    }
    fn apply_empty(&mut self, cidrs: &[Ipv4Net]) {
        must(&["iptables", "-w", "-t", "nat", "-N", CHAIN], None);
        for c in cidrs {
            Self::append_unique(c);
        }
    }
    fn verify(&mut self, cidrs: &[Ipv4Net]) -> bool {
        // Every rule is checked, as Kilo's resync did (no early exit).
        cidrs
            .iter()
            .map(|c| Self::rule("-C", c))
            .fold(true, |a, b| a & b)
    }
    fn change(&mut self, _: &[Ipv4Net]) {
        Self::append_unique(&extra());
    }
    fn clear(&mut self) {
        tool(&["iptables", "-w", "-t", "nat", "-F", CHAIN], None);
        tool(&["iptables", "-w", "-t", "nat", "-X", CHAIN], None);
    }
}

struct IptablesRestore;

impl IptablesRestore {
    fn restore(cidrs: &[Ipv4Net]) {
        let mut text = format!("*nat\n:{CHAIN} - [0:0]\n");
        for c in cidrs {
            text.push_str(&rule_text(c));
            text.push('\n');
        }
        text.push_str("COMMIT\n");
        must(&["iptables-restore", "-w", "--noflush"], Some(&text));
    }

    fn matches(cidrs: &[Ipv4Net]) -> bool {
        let (_, out) = tool(&["iptables", "-w", "-t", "nat", "-S", CHAIN], None);
        let want: Vec<String> = std::iter::once(format!("-N {CHAIN}"))
            .chain(cidrs.iter().map(rule_text))
            .collect();
        out.lines().eq(want.iter().map(String::as_str))
    }
}

impl Mechanism for IptablesRestore {
    fn name(&self) -> &'static str {
        "iptables -S text compare + iptables-restore"
    }
    fn apply_empty(&mut self, cidrs: &[Ipv4Net]) {
        Self::restore(cidrs);
    }
    fn verify(&mut self, cidrs: &[Ipv4Net]) -> bool {
        Self::matches(cidrs)
    }
    fn change(&mut self, cidrs: &[Ipv4Net]) {
        let mut all = cidrs.to_vec();
        all.push(extra());
        if !Self::matches(&all) {
            Self::restore(&all);
        }
    }
    fn clear(&mut self) {
        IptablesCheck.clear();
    }
}

/// The CIDRs in a tool's output (words that parse as IPv4 networks).
fn nets_in(text: &str) -> BTreeSet<Ipv4Net> {
    text.split(|c: char| c.is_whitespace() || c == ',' || c == '{' || c == '}')
        .filter_map(|w| w.parse().ok())
        .collect()
}

struct Ipset;

impl Mechanism for Ipset {
    fn name(&self) -> &'static str {
        "ipset (hash:net)"
    }
    fn apply_empty(&mut self, cidrs: &[Ipv4Net]) {
        let mut text = format!("create {SET} hash:net family inet maxelem 65536\n");
        for c in cidrs {
            text.push_str(&format!("add {SET} {c}\n"));
        }
        must(&["ipset", "restore"], Some(&text));
    }
    fn verify(&mut self, cidrs: &[Ipv4Net]) -> bool {
        let out = must(&["ipset", "save", SET], None);
        let have: BTreeSet<Ipv4Net> = out
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("add {SET} ")))
            .filter_map(|c| c.trim().parse().ok())
            .collect();
        have == cidrs.iter().copied().collect()
    }
    fn change(&mut self, _: &[Ipv4Net]) {
        must(&["ipset", "add", SET, &extra().to_string()], None);
    }
    fn clear(&mut self) {
        tool(&["ipset", "destroy", SET], None);
    }
}

struct NftSet;

impl Mechanism for NftSet {
    fn name(&self) -> &'static str {
        "nftables set (interval)"
    }
    fn apply_empty(&mut self, cidrs: &[Ipv4Net]) {
        let mut text = format!(
            "add table ip {NFT_TABLE}\nadd set ip {NFT_TABLE} kilo_nat {{ type ipv4_addr; flags interval; }}\n"
        );
        if !cidrs.is_empty() {
            let list: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
            text.push_str(&format!(
                "add element ip {NFT_TABLE} kilo_nat {{ {} }}\n",
                list.join(", ")
            ));
        }
        must(&["nft", "-f", "-"], Some(&text));
    }
    fn verify(&mut self, cidrs: &[Ipv4Net]) -> bool {
        let out = must(&["nft", "list", "set", "ip", NFT_TABLE, "kilo_nat"], None);
        nets_in(&out) == cidrs.iter().copied().collect()
    }
    fn change(&mut self, _: &[Ipv4Net]) {
        let e = format!("{{ {} }}", extra());
        must(
            &["nft", "add", "element", "ip", NFT_TABLE, "kilo_nat", &e],
            None,
        );
    }
    fn clear(&mut self) {
        tool(&["nft", "delete", "table", "ip", NFT_TABLE], None);
    }
}

/// Ours: the datapath's sync (its mesh-destination trie), given prepared plans by size.
struct Ours {
    dp: Datapath,
    plans: BTreeMap<usize, DatapathPlan>,
}

impl Ours {
    /// Syncs the prepared plan of `n` CIDRs.
    fn apply(&mut self, n: usize) -> Writes {
        let plan = self.plans.get(&n).expect("prepared");
        self.dp.apply(plan, &NoResolver).expect("apply")
    }
}

fn plan(cidrs: &[Ipv4Net]) -> DatapathPlan {
    DatapathPlan {
        mesh_destinations: cidrs
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    IpNet::V4(*c),
                    DatapathEntry {
                        kind: EntryKind::Node,
                        owner: format!("node-{i}"),
                        next_hop: None,
                    },
                )
            })
            .collect(),
        nat_sources: BTreeMap::new(),
        masquerade_destinations: BTreeMap::new(),
    }
}

impl Mechanism for Ours {
    fn name(&self) -> &'static str {
        "ours (datapath sync, in-process)"
    }
    fn prepare(&mut self, cidrs: &[Ipv4Net]) {
        let mut all = cidrs.to_vec();
        all.push(extra());
        self.plans = [cidrs, &all]
            .into_iter()
            .map(|c| (c.len(), plan(c)))
            .collect();
    }
    fn apply_empty(&mut self, cidrs: &[Ipv4Net]) {
        let w = self.apply(cidrs.len());
        assert_eq!(w.total(), cidrs.len() as u64, "{w}");
    }
    fn verify(&mut self, cidrs: &[Ipv4Net]) -> bool {
        // One idle sync (from the record; the read-backs are timed apart, see `idle_syncs`).
        self.apply(cidrs.len()).is_empty()
    }
    fn change(&mut self, cidrs: &[Ipv4Net]) {
        let w = self.apply(cidrs.len() + 1);
        assert_eq!(w.total(), 1, "a 1-entry change is one map write: {w}");
    }
    fn clear(&mut self) {
        self.dp.apply(&plan(&[]), &NoResolver).expect("apply");
    }
}

/// (ms, processes started) of `f`.
fn measure(f: impl FnOnce()) -> (f64, u64) {
    let p = last_pid();
    let t = Instant::now();
    f();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    (ms, last_pid() - p)
}

#[derive(Default)]
struct Figures {
    /// (mechanism, op, n) -> ms per repetition; processes per repetition.
    ms: BTreeMap<(usize, &'static str, usize), Vec<f64>>,
    procs: BTreeMap<(usize, &'static str, usize), Vec<u64>>,
}

const OPS: [(&str, &str); 3] = [
    ("apply", "apply from empty"),
    ("verify", "verify, nothing changed"),
    ("change", "apply a 1-entry change"),
];

fn child(quick: bool) {
    let sizes: &[usize] = if quick {
        &[10, 100]
    } else {
        &[10, 100, 1_000, 10_000]
    };
    let ours = Ours {
        dp: open(),
        plans: BTreeMap::new(),
    };
    let mut mechs: Vec<Box<dyn Mechanism>> = vec![
        Box::new(IptablesCheck),
        Box::new(IptablesRestore),
        Box::new(Ipset),
        Box::new(NftSet),
        Box::new(ours),
    ];
    let mut f = Figures::default();
    for &n in sizes {
        let c = cidrs(n);
        for (m, mech) in mechs.iter_mut().enumerate() {
            if n > mech.max_n() {
                continue;
            }
            // Fewer repetitions where one takes seconds.
            let reps = match (quick, m == 0 && n >= 1_000, n >= 10_000) {
                (true, _, _) => 2,
                (false, true, _) => 1,
                (false, false, true) => 3,
                _ => 5,
            };
            for _ in 0..reps {
                mech.clear();
                mech.prepare(&c);
                let mut rec = |op, (ms, p): (f64, u64)| {
                    f.ms.entry((m, op, n)).or_default().push(ms);
                    f.procs.entry((m, op, n)).or_default().push(p);
                };
                rec("apply", measure(|| mech.apply_empty(&c)));
                let mut ok = false;
                rec("verify", measure(|| ok = mech.verify(&c)));
                assert!(ok, "{} at {n}: verify found a difference", mech.name());
                rec("change", measure(|| mech.change(&c)));
                let mut all = c.clone();
                all.push(extra());
                assert!(
                    mech.verify(&all),
                    "{} at {n}: change not applied",
                    mech.name()
                );
            }
            mech.clear();
            eprintln!("{} at {n}: done", mech.name());
        }
    }
    let (record, readback) = idle_syncs(sizes, quick);
    report_all(&mechs, &f, sizes, &record, &readback, quick);
}

/// Ours, idle: whole cycles of `READ_BACK_EVERY` syncs with nothing changed at each N; (the
/// syncs from the record, the syncs with a full read-back), in ms.
fn idle_syncs(
    sizes: &[usize],
    quick: bool,
) -> (BTreeMap<usize, Vec<f64>>, BTreeMap<usize, Vec<f64>>) {
    let mut ours_record: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut ours_readback: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut dp = open();
    for &n in sizes {
        let p = plan(&cidrs(n));
        dp.apply(&p, &NoResolver).expect("apply");
        let mut times = Vec::new();
        for _ in 0..READ_BACK_EVERY * if quick { 2 } else { 5 } {
            let t = Instant::now();
            assert!(dp.apply(&p, &NoResolver).expect("apply").is_empty());
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        // Every READ_BACK_EVERY-th sync reads back: the slowest of each cycle.
        for cycle in times.chunks(READ_BACK_EVERY as usize) {
            let mut s = cycle.to_vec();
            s.sort_by(f64::total_cmp);
            ours_readback.entry(n).or_default().push(s[s.len() - 1]);
            ours_record
                .entry(n)
                .or_default()
                .extend_from_slice(&s[..s.len() - 1]);
        }
        dp.apply(&plan(&[]), &NoResolver).expect("apply");
    }
    (ours_record, ours_readback)
}

fn open() -> Datapath {
    Datapath::open(DatapathConfig {
        pin_dir: None,
        max_entries: 1 << 14,
        counter_slots: 1 << 14,
        ..Default::default()
    })
    .expect("load the datapath (needs root)")
}

fn col(n: usize) -> String {
    format!("N={n}")
}

fn report_all(
    mechs: &[Box<dyn Mechanism>],
    f: &Figures,
    sizes: &[usize],
    record: &BTreeMap<usize, Vec<f64>>,
    readback: &BTreeMap<usize, Vec<f64>>,
    quick: bool,
) {
    for (tool, args) in [
        ("iptables", &["--version"][..]),
        ("ipset", &["version"][..]),
        ("nft", &["--version"][..]),
    ] {
        let mut a = vec![tool];
        a.extend_from_slice(args);
        report::meta(tool, tool_version(&a).trim());
    }
    let ours_i = mechs.len() - 1;
    for (op, title) in OPS {
        let id = format!("{op}-ms");
        report::table(&id, &format!("Control plane: {title}"), "ms, wall");
        for (m, mech) in mechs.iter().enumerate() {
            for &n in sizes {
                match f.ms.get(&(m, op, n)) {
                    Some(v) => report::cell(&id, mech.name(), &col(n), v),
                    None => report::text(&id, mech.name(), &col(n), "not run"),
                }
            }
        }
        if op == "verify" {
            for &n in sizes {
                report::cell(&id, "ours: idle sync from its record", &col(n), &record[&n]);
                report::cell(
                    &id,
                    "ours: idle sync with a full read-back",
                    &col(n),
                    &readback[&n],
                );
            }
            report::note(
                &id,
                &format!(
                    "Ours: an idle sync compares the plan with the record of what it wrote (the \
                     \"ours\" row: the sync after the apply); every {READ_BACK_EVERY}th reads the \
                     whole trie back. The last two rows time them apart, over whole cycles."
                ),
            );
        }
        report::note(&id, "iptables -C is stopped at 1,000 (\"not run\" beyond).");
        report::plot(&id, "CIDRs", "time", true, true);
    }
    // Processes started: the same at every repetition; shown per operation.
    let id = "processes";
    report::table(
        id,
        "Control plane: processes started (apply / verify / change)",
        "processes",
    );
    for (m, mech) in mechs.iter().enumerate() {
        for &n in sizes {
            let p: Vec<String> = OPS
                .iter()
                .map(|(op, _)| {
                    f.procs
                        .get(&(m, op, n))
                        .map_or("–".into(), |v| v.iter().max().unwrap().to_string())
                })
                .collect();
            report::text(id, mech.name(), &col(n), &p.join(" / "));
        }
    }
    report::note(
        id,
        "Counted as the PIDs allocated in the benchmark's own PID namespace during the \
         operation (so threads would count too; the benchmark starts none).",
    );
    // Ratios: the cheapest of theirs / ours.
    let id = "ratios";
    report::table(id, "Control plane: the cheapest of theirs / ours", "times");
    let mut cheapest = Vec::new();
    let mut ratio = |op: &str, label: &str, ours: &BTreeMap<usize, f64>| -> BTreeMap<usize, f64> {
        let mut out = BTreeMap::new();
        for &n in sizes {
            let best = (0..ours_i)
                .filter_map(|m| Some((m, median(f.ms.get(&(m, op, n))?))))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap();
            let r = best.1 / ours[&n];
            report::cell(id, label, &col(n), &[r]);
            cheapest.push((label.to_string(), n, mechs[best.0].name().to_string()));
            out.insert(n, r);
        }
        out
    };
    let med = |op: &str| -> BTreeMap<usize, f64> {
        sizes
            .iter()
            .map(|&n| (n, median(&f.ms[&(ours_i, op, n)])))
            .collect()
    };
    let apply = ratio("apply", "apply from empty", &med("apply"));
    let per = |m: &BTreeMap<usize, Vec<f64>>| -> BTreeMap<usize, f64> {
        m.iter().map(|(n, v)| (*n, median(v))).collect()
    };
    let verify_record = ratio("verify", "verify: idle sync from the record", &per(record));
    let verify_read = ratio(
        "verify",
        "verify: idle sync with a full read-back",
        &per(readback),
    );
    // What an idle resync costs on average: every READ_BACK_EVERY-th reads back.
    let every = f64::from(READ_BACK_EVERY);
    let cycle: BTreeMap<usize, f64> = per(record)
        .into_iter()
        .map(|(n, r)| (n, (r * (every - 1.0) + per(readback)[&n]) / every))
        .collect();
    let verify_cycle = ratio(
        "verify",
        "verify: idle sync, mean over a read-back cycle",
        &cycle,
    );
    ratio(
        "change",
        "1-entry change (a figure: no target)",
        &med("change"),
    );
    report::note(
        id,
        &format!(
            "Cheapest of theirs: {}. A 1-entry change is one map write for ours; its cost is \
             the comparison of the whole plan with the record that finds it, which keeps the \
             plan the one description of a node: what an agent spends on a change end to end \
             is in the agent benchmark.",
            cheapest_summary(&cheapest)
        ),
    );
    report::plot(id, "CIDRs", "cheapest of theirs / ours", true, true);

    // Targets.
    let big: Vec<usize> = sizes.iter().copied().filter(|&n| n >= 1_000).collect();
    let judged = if big.is_empty() {
        vec![*sizes.last().unwrap()]
    } else {
        big
    };
    let at = |m: &BTreeMap<usize, f64>, ns: &[usize]| {
        ns.iter()
            .map(|n| format!("{}x at {n}", ratio_text(m[n])))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let q = if quick {
        " (quick run: at the sizes run)"
    } else {
        ""
    };
    let ours_procs: u64 = f
        .procs
        .iter()
        .filter(|((m, _, _), _)| *m == ours_i)
        .flat_map(|(_, v)| v)
        .sum();
    report::target(
        "control plane: ours starts 0 processes",
        &format!("{ours_procs} processes in every operation at every N"),
        report::State::of(ours_procs == 0),
    );
    report::target(
        "idle verification at 1,000 and 10,000 at least 10x cheaper than the cheapest of theirs",
        &format!(
            "on average over a read-back cycle (every {READ_BACK_EVERY}th resync reads the \
             trie back): {}; with a full read-back: {}; from the record: {}{q}",
            at(&verify_cycle, &judged),
            at(&verify_read, &judged),
            at(&verify_record, &judged)
        ),
        report::State::at_full_size(judged.iter().all(|n| verify_cycle[n] >= 10.0)),
    );
    let largest = *sizes.last().unwrap();
    report::target(
        "apply from empty faster than all of them at 10,000",
        &format!("{}{q}", at(&apply, &[largest])),
        report::State::at_full_size(apply[&largest] > 1.0),
    );
    // The text version.
    for (op, title) in OPS {
        println!("\n{title} (ms, median)");
        for (m, mech) in mechs.iter().enumerate() {
            print!("{:<48}", mech.name());
            for &n in sizes {
                match f.ms.get(&(m, op, n)) {
                    Some(v) => print!(" {:>10.3}", median(v)),
                    None => print!(" {:>10}", "-"),
                }
            }
            println!();
        }
    }
}

/// A ratio with two significant digits or more.
fn ratio_text(r: f64) -> String {
    if r >= 100.0 {
        format!("{r:.0}")
    } else if r >= 10.0 {
        format!("{r:.1}")
    } else {
        format!("{r:.2}")
    }
}

fn tool_version(args: &[&str]) -> String {
    let (_, out) = tool(args, None);
    out.lines().next().unwrap_or_default().to_owned()
}

fn main() {
    if std::env::var_os(CHILD).is_some() {
        child(report::quick());
        return;
    }
    if !support::require_root("bench_control") {
        return;
    }
    let ns = support::netns::NetNs::new("ctl");
    let status = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.name,
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
        ])
        .arg(std::env::current_exe().unwrap())
        .args(std::env::args().skip(1))
        .env(CHILD, "1")
        .status()
        .unwrap();
    drop(ns);
    if !status.success() {
        std::process::exit(1);
    }
}

/// Which of theirs was the cheapest in each cell of the ratios table, `(row, N, mechanism)`,
/// said once when one mechanism wins every cell, else per row with the sizes each won.
fn cheapest_summary(cells: &[(String, usize, String)]) -> String {
    let mut winners: Vec<&str> = cells.iter().map(|c| c.2.as_str()).collect();
    winners.dedup();
    if let [only] = winners[..] {
        return format!("{only}, in every cell above");
    }
    // The cells come row by row.
    cells
        .chunk_by(|a, b| a.0 == b.0)
        .map(|row| {
            let mut by_mech: Vec<(&str, Vec<String>)> = Vec::new();
            for (_, n, mech) in row {
                match by_mech.iter_mut().find(|m| m.0 == mech.as_str()) {
                    Some(m) => m.1.push(n.to_string()),
                    None => by_mech.push((mech, vec![n.to_string()])),
                }
            }
            let mechs: Vec<String> = by_mech
                .iter()
                .map(|(m, ns)| format!("{m} at {}", ns.join(", ")))
                .collect();
            format!("{}: {}", row[0].0, mechs.join("; "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}
