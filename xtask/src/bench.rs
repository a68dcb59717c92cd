//! `cargo xtask bench [WHAT] [--quick] [--debug] [--no-run] [--out DIR] [-- ARGS]`: runs the benchmark
//! examples (`kilo-agent/examples/bench_<what>.rs`, every one by default, and `e2e`: the figures
//! `cargo xtask e2e --bench` measures on a real cluster, not with `--quick`) and renders what they
//! measured into `DIR/BENCHMARKS.md` (DIR defaults to the repository root), SVG plots in
//! `DIR/docs/bench/`, and the summary table between the `bench-summary` markers of
//! `DIR/README.md` when there is one. With WHAT, only that benchmark runs and, without `--out`,
//! its section is printed instead. `--quick` runs every part at small sizes (a minute or two);
//! `--debug` runs debug builds (what the test suite does, to spare a release build);
//! `--no-run` renders again from the last results (`target/bench/<what>.jsonl`), e.g. after
//! running one benchmark alone.
//!
//! # Result format
//! Any `bench_<what>` example takes part: it appends one JSON object per line to the file that
//! the `KILO_BENCH_JSON` environment variable names (`tests/support/report.rs` writes them), and
//! takes `--quick` (also `KILO_BENCH_QUICK=1`). `KILO_BENCH_KG` names the `kg` binary of the
//! same build. Records, by `"type"`:
//! - `{"type":"table","table":ID,"title":T,"unit":U}` declares a table (title, unit, order);
//! - `{"type":"cell","table":ID,"row":R,"col":C,"values":[..]}`: the samples of a cell's
//!   repetitions, shown as the median and, with several, the range `(min–max)`; `"text":S`
//!   instead of `"values"` for a cell that is not a number;
//! - `{"type":"note","table":ID,"text":S}`: a line under the table;
//! - `{"type":"plot","table":ID,"x":S,"y":S,"log_x":B,"log_y":B}`: an SVG of the table, one
//!   series per row, the columns as x (numbers; `,` and `_` ignored);
//! - `{"type":"target","target":S,"figure":S,"state":S}`: a row of the report's targets table;
//!   the state is `met`, `not met`, `not measured` (a figure the target needs could not be
//!   read) or `not judged` (not measured at the size the target names, as in a `--quick` run,
//!   or an interval too wide to decide); anything else, or no state, renders as not measured,
//!   so only `met` reads as a pass;
//! - `{"type":"meta","key":K,"value":V}`: a fact listed under the benchmark's heading.
//!
//! Rows and columns keep the order they first appear in. A benchmark's section starts with the
//! first paragraph of its example's `//!` doc.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::{cargo, output, root_dir, run};

#[path = "../../kilo-agent/tests/support/median.rs"]
#[allow(dead_code)]
mod median;
pub use median::median;

/// The options of `cargo xtask bench`.
#[derive(Debug, Default)]
struct Options {
    what: Option<String>,
    quick: bool,
    debug: bool,
    no_run: bool,
    out: Option<PathBuf>,
    rest: Vec<String>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--debug" => o.debug = true,
            "--no-run" => o.no_run = true,
            "--out" => o.out = Some(it.next().context("--out DIR")?.into()),
            "--" => o.rest = it.by_ref().cloned().collect(),
            s if s.starts_with('-') => bail!("unknown option {s}"),
            s if o.what.is_none() => o.what = Some(s.to_owned()),
            s => bail!("one benchmark at a time ({s}?)"),
        }
    }
    Ok(o)
}

/// The names `what` of the `bench_<what>.rs` examples.
fn benchmarks() -> Result<Vec<String>> {
    let examples = root_dir().join("kilo-agent/examples");
    let mut all: Vec<String> = std::fs::read_dir(&examples)
        .with_context(|| format!("reading {}", examples.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("bench_")
                .and_then(|n| n.strip_suffix(".rs"))
                .map(str::to_owned)
        })
        .collect();
    // The e2e cluster's figures (`cargo xtask e2e --bench`): root only, not in `--quick`.
    all.push(E2E.into());
    all.sort();
    Ok(all)
}

/// The benchmark measured on the e2e cluster rather than by an example.
const E2E: &str = "e2e";

/// What one benchmark produced.
struct Ran {
    what: String,
    seconds: f64,
    ok: bool,
    records: Vec<Value>,
}

pub fn bench(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let all = benchmarks()?;
    let chosen = match &o.what {
        Some(w) if all.contains(w) => vec![w.clone()],
        Some(w) => bail!("no benchmark {w:?}; have {all:?}"),
        None if o.quick => all.into_iter().filter(|w| w != E2E).collect(),
        None => all,
    };
    let profile = if o.debug { "debug" } else { "release" };
    if !o.no_run {
        let mut build = cargo();
        // The default members, as `cargo test` builds them: the same features, no rebuild.
        build.args(["build", "--examples", "--bins"]);
        if !o.debug {
            build.arg("--release");
        }
        run(&mut build)?;
    }
    let bin = root_dir().join("target").join(profile);
    let results = root_dir().join("target/bench");
    std::fs::create_dir_all(&results)?;
    let started = Start::now();
    let mut ran = Vec::new();
    for what in &chosen {
        let json = results.join(format!("{what}.jsonl"));
        if o.no_run {
            let records = read_records(&json)?;
            if records.is_empty() && what == E2E {
                continue;
            }
            // The benchmark's last run, as it recorded itself (see `record_run`).
            let run = records.iter().rev().find(|r| str_of(r, "type") == "run");
            ran.push(Ran {
                what: what.clone(),
                seconds: run.and_then(|r| r["seconds"].as_f64()).unwrap_or(0.0),
                ok: run.map_or(!records.is_empty(), |r| r["ok"].as_bool() == Some(true)),
                records,
            });
            continue;
        }
        let _ = std::fs::remove_file(&json);
        if what == E2E {
            let t = Instant::now();
            let done = crate::e2e::e2e(false, false, Some(&json));
            if let Err(e) = &done {
                eprintln!("e2e: {e:#}");
            }
            let (seconds, ok) = (t.elapsed().as_secs_f64(), done.is_ok());
            record_run(&json, seconds, ok)?;
            ran.push(Ran {
                what: what.clone(),
                seconds,
                ok,
                records: read_records(&json)?,
            });
            continue;
        }
        let mut cmd = Command::new(bin.join("examples").join(format!("bench_{what}")));
        cmd.current_dir(root_dir())
            .env("KILO_BENCH_JSON", &json)
            .env("KILO_BENCH_KG", bin.join("kg"))
            .args(&o.rest);
        if o.quick {
            cmd.arg("--quick").env("KILO_BENCH_QUICK", "1");
        }
        eprintln!("+ {cmd:?}");
        let t = Instant::now();
        let status = cmd
            .status()
            .with_context(|| format!("starting bench_{what}"))?;
        let seconds = t.elapsed().as_secs_f64();
        eprintln!("bench_{what}: {status} after {seconds:.0} s");
        record_run(&json, seconds, status.success())?;
        let records = read_records(&json)?;
        ran.push(Ran {
            what: what.clone(),
            seconds,
            ok: status.success(),
            records,
        });
    }
    match (&o.out, &o.what) {
        (None, Some(_)) => {
            // One benchmark: its section on stdout (plots under target/bench), no report.
            print!("{}", render(&results, &started, o.quick, o.no_run, &ran)?);
        }
        (out, _) => {
            let out = out.clone().unwrap_or_else(root_dir);
            std::fs::create_dir_all(&out)?;
            let report = render(&out, &started, o.quick, o.no_run, &ran)?;
            std::fs::write(out.join("BENCHMARKS.md"), report)?;
            update_readme(&out, &started, o.quick, &ran)?;
            eprintln!("report: {}", out.join("BENCHMARKS.md").display());
        }
    }
    let failed: Vec<&str> = ran
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.what.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("benchmarks failed: {failed:?}");
    }
    Ok(())
}

/// Appends to a benchmark's results how long it ran and whether it succeeded, so that
/// `--no-run` renders them again as they were.
fn record_run(json: &Path, seconds: f64, ok: bool) -> Result<()> {
    use std::io::Write as _;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(json)
        .with_context(|| format!("opening {}", json.display()))?;
    writeln!(
        f,
        "{}",
        serde_json::json!({"type": "run", "seconds": seconds, "ok": ok})
    )?;
    Ok(())
}

/// The records a benchmark wrote (none if it wrote no file).
fn read_records(json: &Path) -> Result<Vec<Value>> {
    std::fs::read_to_string(json)
        .unwrap_or_default()
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<Vec<Value>, _>>()
        .with_context(|| format!("{}", json.display()))
}

/// What is known of the run before it starts.
pub struct Start {
    pub date: String,
    load: String,
}

impl Start {
    pub fn now() -> Start {
        Start {
            date: output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]))
                .unwrap_or_default()
                .trim()
                .to_owned(),
            load: read("/proc/loadavg")
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

pub fn machine() -> String {
    let cpu = read("/proc/cpuinfo");
    let model = cpu
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map_or("?", |(_, m)| m.trim())
        .to_owned();
    let cpus = cpu.lines().filter(|l| l.starts_with("processor")).count();
    let mem_kb: f64 = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:")?.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    format!("{model}, {cpus} CPUs, {:.0} GiB", mem_kb / 1024.0 / 1024.0)
}

pub fn versions() -> String {
    let rustc = output(
        Command::new("rustc")
            .env("RUSTUP_TOOLCHAIN", crate::pins::STABLE)
            .arg("--version"),
    )
    .unwrap_or_default();
    let commit = output(
        Command::new("git")
            .current_dir(root_dir())
            .args(["describe", "--always", "--dirty"]),
    )
    .unwrap_or_default();
    format!(
        "kilo-rs {} ({}), {}",
        env!("CARGO_PKG_VERSION"),
        commit.trim(),
        rustc.trim()
    )
}

/// A table as its records describe it.
#[derive(Default)]
struct Table {
    title: String,
    unit: String,
    rows: Vec<String>,
    cols: Vec<String>,
    cells: BTreeMap<(String, String), Cell>,
    notes: Vec<String>,
    plot: Option<Value>,
}

enum Cell {
    Values(Vec<f64>),
    Text(String),
}

fn str_of<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or_default()
}

fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_owned());
    }
}

/// A benchmark's tables in order, its facts (key, value) and its target records.
type Parsed = (Vec<(String, Table)>, Vec<(String, String)>, Vec<Value>);

/// The tables of one benchmark, in order, with its facts and targets.
fn tables(records: &[Value]) -> Parsed {
    let mut tables: Vec<(String, Table)> = Vec::new();
    let mut meta = Vec::new();
    let mut targets = Vec::new();
    let get = |tables: &mut Vec<(String, Table)>, id: &str| -> usize {
        match tables.iter().position(|(t, _)| t == id) {
            Some(i) => i,
            None => {
                tables.push((
                    id.to_owned(),
                    Table {
                        title: id.to_owned(),
                        ..Table::default()
                    },
                ));
                tables.len() - 1
            }
        }
    };
    for r in records {
        match str_of(r, "type") {
            "table" => {
                let i = get(&mut tables, str_of(r, "table"));
                tables[i].1.title = str_of(r, "title").to_owned();
                tables[i].1.unit = str_of(r, "unit").to_owned();
            }
            "cell" => {
                let i = get(&mut tables, str_of(r, "table"));
                let t = &mut tables[i].1;
                let (row, col) = (str_of(r, "row"), str_of(r, "col"));
                push_unique(&mut t.rows, row);
                push_unique(&mut t.cols, col);
                let cell = match r["values"].as_array() {
                    Some(v) => Cell::Values(v.iter().filter_map(Value::as_f64).collect()),
                    None => Cell::Text(str_of(r, "text").to_owned()),
                };
                t.cells.insert((row.to_owned(), col.to_owned()), cell);
            }
            "note" => {
                let i = get(&mut tables, str_of(r, "table"));
                tables[i].1.notes.push(str_of(r, "text").to_owned());
            }
            "plot" => {
                let i = get(&mut tables, str_of(r, "table"));
                tables[i].1.plot = Some(r.clone());
            }
            "meta" => meta.push((str_of(r, "key").to_owned(), str_of(r, "value").to_owned())),
            "target" => targets.push(r.clone()),
            _ => {}
        }
    }
    (tables, meta, targets)
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// A number with as many digits as it deserves.
pub fn num(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        "–".into()
    } else if a >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// An axis label: whole numbers without decimals.
fn axis(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        num(v)
    }
}

fn cell_text(c: Option<&Cell>) -> String {
    match c {
        None => String::new(),
        Some(Cell::Text(t)) => t.clone(),
        Some(Cell::Values(v)) if v.len() > 1 => {
            let s = sorted(v);
            format!("{} ({}–{})", num(median(v)), num(s[0]), num(s[s.len() - 1]))
        }
        Some(Cell::Values(v)) => v.first().map_or(String::new(), |x| num(*x)),
    }
}

/// The first paragraph of an example's `//!` doc (for the e2e figures, the `--bench` paragraph
/// of `xtask/src/e2e.rs`).
fn intro(what: &str) -> String {
    let path = match what {
        E2E => root_dir().join("xtask/src/e2e.rs"),
        _ => root_dir().join(format!("kilo-agent/examples/bench_{what}.rs")),
    };
    let src = read(&path.to_string_lossy());
    let src = match what {
        E2E => src
            .lines()
            .skip_while(|l| !l.starts_with("//! `--bench FILE`"))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => src,
    };
    src.lines()
        .map_while(|l| l.strip_prefix("//!"))
        .map(str::trim)
        .take_while(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

fn render(out: &Path, start: &Start, quick: bool, no_run: bool, ran: &[Ran]) -> Result<String> {
    let mut md = String::new();
    let mode = match (quick, no_run) {
        (true, _) => {
            "quick (`cargo xtask bench --quick`: small sizes, few repetitions; a check that the \
             machinery works, not figures to quote)"
        }
        (false, false) => "full (`cargo xtask bench`)",
        (false, true) => {
            "full, rendered again with `--no-run` from each benchmark's last run (`cargo xtask \
             bench WHAT` runs one); the date and load averages are the rendering's"
        }
    };
    let _ = writeln!(md, "# Benchmarks\n");
    let _ = writeln!(
        md,
        "Written by `cargo xtask bench`. Every figure of kg and of the tools beside it \
         (iptables, ipset, nftables, the empty program) was measured in this one run on this \
         one machine; figures labelled Kilo's reference figures were not: they are constants \
         from earlier measurements of Kilo (its execs per change from \
         /work/shared/reference/kilo.md §3.6, where Kilo 0.7.0's code was run; its agent's \
         memory, CPU and burst from a live run of three Kilo agents; the latency of one change \
         as issue 36 gives it), each named where it appears. Every comparison is also given as a \
         ratio. Cells are the median of the repetitions, with their range (min–max) in \
         parentheses. A target reads yes only when its figures were measured and meet it; \
         otherwise **no**, not measured (a figure could not be read) or not judged (the run did \
         not reach the size the target names, or the interval is too wide to decide). No \
         figure here is asserted by a test: the test suite only checks that `--quick` runs and \
         writes this report.\n"
    );
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(md, "| date | {} |", start.date);
    let _ = writeln!(md, "| mode | {mode} |");
    let _ = writeln!(md, "| machine | {} |", machine());
    let _ = writeln!(
        md,
        "| kernel | {} |",
        read("/proc/sys/kernel/osrelease").trim()
    );
    let _ = writeln!(md, "| versions | {} |", versions());
    let _ = writeln!(md, "| load average at the start | {} |", start.load);
    let _ = writeln!(
        md,
        "| load average at the end | {} |",
        read("/proc/loadavg")
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let _ = writeln!(
        md,
        "| run time | {} |\n",
        ran.iter()
            .map(|r| format!("{} {:.0} s", r.what, r.seconds))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let parsed: Vec<_> = ran.iter().map(|r| tables(&r.records)).collect();
    let _ = writeln!(md, "## Targets\n");
    let _ = writeln!(md, "{}", targets_table(&parsed, true, quick));
    let plots = out.join("docs/bench");
    for (r, (tables, meta, _)) in ran.iter().zip(&parsed) {
        let source = match r.what.as_str() {
            E2E => "cargo xtask e2e --bench".to_owned(),
            what => format!("bench_{what}"),
        };
        let _ = writeln!(md, "## {} (`{source}`, {:.0} s)\n", r.what, r.seconds);
        let _ = writeln!(md, "{}\n", intro(&r.what));
        if !r.ok {
            let _ = writeln!(
                md,
                "**This benchmark failed**; what it wrote before is below.\n"
            );
        }
        if r.records.is_empty() {
            let _ = writeln!(
                md,
                "No results (it needs root, or it failed before measuring).\n"
            );
        }
        for (k, v) in meta {
            let _ = writeln!(md, "- {k}: {v}");
        }
        if !meta.is_empty() {
            md.push('\n');
        }
        for (id, t) in tables {
            let unit = if t.unit.is_empty() {
                String::new()
            } else {
                format!(" ({})", t.unit)
            };
            let _ = writeln!(md, "### {}{unit}\n", t.title);
            let _ = writeln!(md, "| | {} |", t.cols.join(" | "));
            let _ = writeln!(md, "|---|{}", "---:|".repeat(t.cols.len()));
            for row in &t.rows {
                let cells: Vec<String> = t
                    .cols
                    .iter()
                    .map(|c| cell_text(t.cells.get(&(row.clone(), c.clone()))))
                    .collect();
                let _ = writeln!(md, "| {row} | {} |", cells.join(" | "));
            }
            md.push('\n');
            for n in &t.notes {
                let _ = writeln!(md, "{n}\n");
            }
            if let Some(p) = &t.plot {
                std::fs::create_dir_all(&plots)?;
                let name = format!("{}-{}.svg", r.what, slug(id));
                match plot(&plots.join(&name), t, p) {
                    Ok(()) => {
                        let _ = writeln!(md, "![{}](docs/bench/{name})\n", t.title);
                    }
                    Err(e) => {
                        let _ = writeln!(md, "(no plot: {e})\n");
                    }
                }
            }
        }
    }
    Ok(md)
}

/// How a target's state reads in a table: only `met` is a pass.
fn verdict(target: &Value, quick: bool) -> &'static str {
    match str_of(target, "state") {
        "met" => "yes",
        "not met" => "**no**",
        "not judged" if quick => "not judged (quick)",
        "not judged" => "not judged",
        _ => "not measured",
    }
}

/// The targets and where each stands; with `figures`, what was measured too (the README's
/// summary leaves the figures to BENCHMARKS.md).
fn targets_table(parsed: &[Parsed], figures: bool, quick: bool) -> String {
    let mut md = String::from(if figures {
        "| target | measured | met |\n|---|---|---|\n"
    } else {
        "| target | met |\n|---|---|\n"
    });
    for (_, _, targets) in parsed {
        for t in targets {
            let figure = if figures {
                format!(" {} |", str_of(t, "figure"))
            } else {
                String::new()
            };
            let _ = writeln!(
                md,
                "| {} |{figure} {} |",
                str_of(t, "target"),
                verdict(t, quick)
            );
        }
    }
    md
}

/// Replaces the table between `<!-- bench-summary -->` and `<!-- /bench-summary -->` in
/// `out/README.md`, if both are there.
fn update_readme(out: &Path, start: &Start, quick: bool, ran: &[Ran]) -> Result<()> {
    let path = out.join("README.md");
    let Ok(readme) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let (begin, end) = ("<!-- bench-summary -->", "<!-- /bench-summary -->");
    let (Some(a), Some(b)) = (readme.find(begin), readme.find(end)) else {
        return Ok(());
    };
    let parsed: Vec<_> = ran.iter().map(|r| tables(&r.records)).collect();
    let mode = if quick {
        "quick run (small sizes: not figures to quote)"
    } else {
        "run"
    };
    let text = format!(
        "{}{begin}\nThe targets, from the {mode} of {} (figures in [BENCHMARKS.md](BENCHMARKS.md)):\n\n{}{}",
        &readme[..a],
        start.date,
        targets_table(&parsed, false, quick),
        &readme[b..]
    );
    std::fs::write(&path, text)?;
    Ok(())
}

/// A column as a number: `1,000`, `N=1000`.
fn parse_x(s: &str) -> Option<f64> {
    let s = s.rsplit('=').next().unwrap_or(s);
    s.replace([',', '_'], "").trim().parse().ok()
}

/// An SVG line plot of `t`: a series per row, the columns as x.
fn plot(path: &Path, t: &Table, spec: &Value) -> Result<()> {
    use plotters::prelude::*;
    let xs: Vec<(String, f64)> = t
        .cols
        .iter()
        .filter_map(|c| Some((c.clone(), parse_x(c)?)))
        .collect();
    let series: Vec<(String, Vec<(f64, f64)>)> = t
        .rows
        .iter()
        .map(|row| {
            let pts = xs
                .iter()
                .filter_map(|(c, x)| match t.cells.get(&(row.clone(), c.clone())) {
                    Some(Cell::Values(v)) if !v.is_empty() => Some((*x, median(v))),
                    _ => None,
                })
                .collect();
            (row.clone(), pts)
        })
        .filter(|(_, p): &(String, Vec<(f64, f64)>)| !p.is_empty())
        .collect();
    let all = || series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all() {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if series.is_empty() {
        bail!("nothing numeric to plot");
    }
    let (log_x, log_y) = (
        spec["log_x"].as_bool() == Some(true),
        spec["log_y"].as_bool() == Some(true),
    );
    let pad = |lo: f64, hi: f64, log: bool| {
        if log {
            (lo.max(1e-9) / 1.5, hi.max(1e-9) * 1.5)
        } else {
            let d = (hi - lo).max(hi.abs() * 0.1).max(1e-9);
            ((lo - d * 0.05).min(0.0_f64.max(lo - d)), hi + d * 0.1)
        }
    };
    let (x0, x1) = pad(x0, x1, log_x);
    let (y0, y1) = pad(y0, y1, log_y);
    let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    // The chart on the left, its legend beside it (never over a line).
    let (chart, legend) = root.split_horizontally(620);
    let color = |i: usize| Palette99::pick(i).to_rgba();
    for (i, (name, _)) in series.iter().enumerate() {
        let y = 40 + 22 * i as i32;
        legend.draw(&PathElement::new(
            vec![(4, y), (28, y)],
            color(i).stroke_width(3),
        ))?;
        legend.draw(&Text::new(
            name.clone(),
            (34, y - 7),
            ("sans-serif", 13).into_font(),
        ))?;
    }
    let mut b = ChartBuilder::on(&chart);
    b.caption(&t.title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64);
    let y_desc = format!("{} ({})", str_of(spec, "y"), t.unit);
    // One chart per combination of axis kinds (plotters types them apart).
    macro_rules! draw {
        ($x:expr, $y:expr) => {{
            let mut c = b.build_cartesian_2d($x, $y)?;
            c.configure_mesh()
                .x_desc(str_of(spec, "x"))
                .y_desc(y_desc.as_str())
                .x_labels(6)
                .x_label_formatter(&|v| axis(*v))
                .y_label_formatter(&|v| axis(*v))
                .draw()?;
            for (i, (_, pts)) in series.iter().enumerate() {
                c.draw_series(LineSeries::new(
                    pts.iter().copied(),
                    color(i).stroke_width(2),
                ))?;
                c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color(i).filled())))?;
            }
        }};
    }
    match (log_x, log_y) {
        (true, true) => draw!((x0..x1).log_scale(), (y0..y1).log_scale()),
        (true, false) => draw!((x0..x1).log_scale(), y0..y1),
        (false, true) => draw!(x0..x1, (y0..y1).log_scale()),
        (false, false) => draw!(x0..x1, y0..y1),
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_and_numbers() {
        let o = parse(&[
            "live".into(),
            "--quick".into(),
            "--".into(),
            "--rounds".into(),
        ])
        .unwrap();
        assert_eq!(o.what.as_deref(), Some("live"));
        assert!(o.quick && !o.debug);
        assert_eq!(o.rest, ["--rounds"]);
        assert!(parse(&["--bogus".into()]).is_err());
        assert_eq!(num(1234.5), "1234");
        assert_eq!(num(12.34), "12.3");
        assert_eq!(num(0.01234), "0.012");
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0]), 2.5);
        assert_eq!(num(2.0), "2");
        assert_eq!(parse_x("N=1,000"), Some(1000.0));
    }

    /// Records become a table with medians and ranges, and a plot with one series per row.
    #[test]
    fn renders_tables_and_plots() {
        let records: Vec<Value> = [
            r#"{"type":"table","table":"t","title":"Per packet","unit":"ns"}"#,
            r#"{"type":"cell","table":"t","row":"ours","col":"10","values":[3,1,2]}"#,
            r#"{"type":"cell","table":"t","row":"ours","col":"1,000","values":[4]}"#,
            r#"{"type":"cell","table":"t","row":"empty","col":"10","text":"n/a"}"#,
            r#"{"type":"plot","table":"t","x":"entries","y":"time","log_x":true,"log_y":false}"#,
            r#"{"type":"target","target":"fast","figure":"2 ns","state":"met"}"#,
        ]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
        let (tables, _, targets) = tables(&records);
        let t = &tables[0].1;
        assert_eq!((t.rows.len(), t.cols.len(), targets.len()), (2, 2, 1));
        assert_eq!(
            cell_text(t.cells.get(&("ours".into(), "10".into()))),
            "2 (1–3)"
        );
        let path = std::env::temp_dir().join(format!("xtask-plot-{}.svg", std::process::id()));
        plot(&path, t, tables[0].1.plot.as_ref().unwrap()).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("\nours\n"), "{svg}");
    }

    /// Each state renders apart, and a target without a state, or with the old boolean, never
    /// reads as a pass.
    #[test]
    fn target_states_render_apart() {
        let records: Vec<Value> = [
            r#"{"type":"target","target":"a","figure":"1","state":"met"}"#,
            r#"{"type":"target","target":"b","figure":"2","state":"not met"}"#,
            r#"{"type":"target","target":"c","figure":"3","state":"not measured"}"#,
            r#"{"type":"target","target":"d","figure":"4","state":"not judged"}"#,
            r#"{"type":"target","target":"e","figure":"5"}"#,
            r#"{"type":"target","target":"f","figure":"6","met":true}"#,
        ]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
        let parsed = vec![tables(&records)];
        let full = targets_table(&parsed, true, false);
        for row in [
            "| a | 1 | yes |",
            "| b | 2 | **no** |",
            "| c | 3 | not measured |",
            "| d | 4 | not judged |",
            "| e | 5 | not measured |",
            "| f | 6 | not measured |",
        ] {
            assert!(full.contains(row), "{row} in\n{full}");
        }
        let summary = targets_table(&parsed, false, true);
        assert!(summary.contains("| d | not judged (quick) |"), "{summary}");
        assert_eq!(summary.matches("| yes |").count(), 1, "{summary}");
    }
}
