//! `cargo xtask soak [--no-run] [--out DIR] [-- ARGS]`: runs the reliability tests' long versions
//! (`KILO_SOAK=1`) and renders what they found into `DIR/RELIABILITY.md` (DIR defaults to the
//! repository root). `--no-run` renders again from the last records.
//!
//! A reliability test is any `kilo-agent/tests/*.rs` that uses `support::reliability`: it
//! appends one JSON object per line to `$KILO_RELIABILITY_OUT/<test>.jsonl`
//! (`target/reliability/` here), as kilo-testkit's `reliability` writes it:
//! `{"fault": str, "tries": u32, "lost": str, "outage_ms": number|null, "result": str, "notes": str}`.
//! Files render in name order, records in the order written.
use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::{bench, cargo, root_dir};

/// The test files that record reliability figures.
fn tests() -> Result<Vec<String>> {
    let dir = root_dir().join("kilo-agent/tests");
    let mut names = Vec::new();
    for e in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = e?.path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if path.extension().is_some_and(|x| x == "rs") && text.contains("reliability::") {
            names.push(path.file_stem().unwrap().to_string_lossy().into_owned());
        }
    }
    names.sort();
    Ok(names)
}

pub fn soak(args: &[String]) -> Result<()> {
    let (mut no_run, mut out, mut rest) = (false, root_dir(), Vec::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--no-run" => no_run = true,
            "--out" => out = it.next().context("--out DIR")?.into(),
            "--" => rest = it.by_ref().cloned().collect(),
            s => bail!("unknown argument {s}"),
        }
    }
    let records = root_dir().join("target/reliability");
    let mut start = bench::Start::now();
    let mut failed = None;
    let date = records.join("date");
    if no_run {
        // The date of the run that wrote the records.
        start.date = std::fs::read_to_string(&date).unwrap_or(start.date);
    } else {
        let _ = std::fs::remove_dir_all(&records);
        std::fs::create_dir_all(&records)?;
        std::fs::write(&date, &start.date)?;
        let mut test = cargo();
        test.arg("test");
        for t in tests()? {
            test.args(["--test", &t]);
        }
        test.env("KILO_SOAK", "1")
            .env("KILO_RELIABILITY_OUT", &records)
            // One at a time: the outages are measured on an otherwise quiet machine.
            .args(["--", "--test-threads=1", "--nocapture"])
            .args(&rest);
        eprintln!("+ {test:?}");
        let status = test.status().context("running cargo test")?;
        if !status.success() {
            failed = Some(status);
        }
    }
    let md = render(&read(&records)?, &start)?;
    std::fs::write(out.join("RELIABILITY.md"), md)?;
    eprintln!("report: {}", out.join("RELIABILITY.md").display());
    if let Some(status) = failed {
        bail!("reliability tests failed: {status}");
    }
    Ok(())
}

/// Every record, by file name then in order: (test, record).
fn read(dir: &Path) -> Result<Vec<(String, Value)>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let test = f.file_stem().unwrap().to_string_lossy().into_owned();
        for line in std::fs::read_to_string(&f)?.lines() {
            let v: Value =
                serde_json::from_str(line).with_context(|| format!("{}: {line}", f.display()))?;
            out.push((test.clone(), v));
        }
    }
    Ok(out)
}

fn outage(ms: Option<f64>) -> String {
    match ms {
        None => "–".into(),
        Some(ms) if ms >= 1000.0 => format!("{} s", bench::num(ms / 1000.0)),
        Some(ms) => format!("{} ms", bench::num(ms)),
    }
}

/// A table cell: no line breaks or pipes.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

fn render(records: &[(String, Value)], start: &bench::Start) -> Result<String> {
    let mut md = String::new();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    writeln!(md, "# Reliability\n")?;
    writeln!(
        md,
        "Faults injected into the mesh while traffic flows, as `cargo xtask soak` ran them \
         (`KILO_SOAK=1`: the long versions of the reliability tests, one at a time; \
         TESTING.md says what each proves). Where traffic flows, *lost* counts pings (one every \
         100 ms) unanswered of those sent and *outage* is the longest time without a reply; \
         elsewhere they say what the fault cost and how long it lasted.\n"
    )?;
    writeln!(md, "- date: {}", start.date)?;
    writeln!(md, "- machine: {}", bench::machine())?;
    writeln!(md, "- kernel: Linux {}", kernel.trim())?;
    writeln!(md, "- {}\n", bench::versions())?;
    writeln!(md, "| fault | tries | lost | outage | result | notes |")?;
    writeln!(md, "|---|---|---|---|---|---|")?;
    for (test, r) in records {
        let s = |k: &str| cell(r[k].as_str().unwrap_or_default());
        writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} (`{test}`) |",
            s("fault"),
            r["tries"].as_u64().unwrap_or(0),
            s("lost"),
            outage(r["outage_ms"].as_f64()),
            s("result"),
            s("notes"),
        )?;
    }
    if records.is_empty() {
        writeln!(md, "\nNo records: no reliability test ran.")?;
    }
    Ok(md)
}
