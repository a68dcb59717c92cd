//! `cargo xtask bench [WHAT] [--quick] [--debug] [--no-run] [--out DIR] [-- ARGS]`: runs the benchmark
//! examples (`kilo-agent/examples/bench_<what>.rs` or `bench_<what>/main.rs`, every one by default, and `e2e`: the figures
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
//! the `KILO_BENCH_JSON` environment variable names (kilo-testkit's `report` writes them), and
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

mod report;
pub use report::num;
use report::*;

use crate::{cargo, output, root_dir, run};

pub use kilo_common::median::median;

/// The options of `cargo xtask bench`.
#[derive(Debug, Default)]
struct BenchArgs {
    what: Option<String>,
    quick: bool,
    debug: bool,
    no_run: bool,
    out: Option<PathBuf>,
    rest: Vec<String>,
}

fn parse(args: &[String]) -> Result<BenchArgs> {
    let mut o = BenchArgs::default();
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
            // `bench_<what>.rs`, or a directory `bench_<what>/` with its `main.rs`.
            let what = name.strip_prefix("bench_")?;
            let what = what.strip_suffix(".rs").unwrap_or(what);
            (e.path().is_file() || e.path().join("main.rs").is_file()).then(|| what.to_owned())
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
