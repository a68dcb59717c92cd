//! The benchmarks' machine-readable results: one JSON object per line, appended to the file
//! that `KILO_BENCH_JSON` names (`cargo xtask bench` sets it and renders BENCHMARKS.md and the
//! plots from it; xtask's `bench` module documents the records). Without it nothing is written
//! and the benchmarks only print their own text.
//!
//! The reliability tests' records ([`reliability`]) go elsewhere: one line per test run to
//! `$KILO_RELIABILITY_OUT/<test>.jsonl`, which `cargo xtask soak` renders as RELIABILITY.md.
use std::io::Write as _;

use serde_json::{Value, json};

/// `--quick` on the command line (or `KILO_BENCH_QUICK=1`): every part at small sizes.
pub fn quick() -> bool {
    std::env::args().any(|a| a == "--quick")
        || std::env::var("KILO_BENCH_QUICK").is_ok_and(|v| v == "1")
}

fn emit(record: Value) {
    let Some(path) = std::env::var_os("KILO_BENCH_JSON") else {
        return;
    };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.to_string_lossy()));
    writeln!(f, "{record}").expect("writing a benchmark result");
}

/// Declares a table (its order in the report, title and unit).
pub fn table(id: &str, title: &str, unit: &str) {
    emit(json!({"type": "table", "table": id, "title": title, "unit": unit}));
}

/// One cell: the samples of its repetitions (the report shows the median and the range).
pub fn cell(table: &str, row: &str, col: &str, values: &[f64]) {
    emit(json!({"type": "cell", "table": table, "row": row, "col": col, "values": values}));
}

/// One cell of text (a verdict, "not run").
pub fn text(table: &str, row: &str, col: &str, text: &str) {
    emit(json!({"type": "cell", "table": table, "row": row, "col": col, "text": text}));
}

/// A line under a table (method, what a column means).
pub fn note(table: &str, text: &str) {
    emit(json!({"type": "note", "table": table, "text": text}));
}

/// Plots `table`: one series per row, columns as x (numbers).
pub fn plot(table: &str, x: &str, y: &str, log_x: bool, log_y: bool) {
    emit(json!({"type": "plot", "table": table, "x": x, "y": y, "log_x": log_x, "log_y": log_y}));
}

/// A target of the issues and the figure measured against it.
pub fn target(what: &str, figure: &str, met: bool) {
    emit(json!({"type": "target", "target": what, "figure": figure, "met": met}));
}

/// A fact about the run (a tool's version, a parameter).
pub fn meta(key: &str, value: &str) {
    emit(json!({"type": "meta", "key": key, "value": value}));
}

/// The median of `v` (the mean of the middle two of an even count; NaN when empty), as the
/// report computes it.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// What one reliability test found, for RELIABILITY.md.
#[derive(Debug, Clone, PartialEq)]
pub struct Reliability {
    /// The fault injected, in a few words.
    pub fault: String,
    /// How many times it was injected.
    pub tries: u32,
    /// Packets lost of those sent, e.g. `0/1200`.
    pub lost: String,
    /// The longest time without traffic, where the fault causes one.
    pub outage_ms: Option<f64>,
    /// `pass`, or what went wrong.
    pub result: String,
    /// Anything a reader needs to judge the figures (periods, seeds, scaling).
    pub notes: String,
}

/// Appends `r` as one JSON line to `$KILO_RELIABILITY_OUT/<test>.jsonl` (nothing without the
/// variable): `{"fault", "tries", "lost", "outage_ms" (number or null), "result", "notes"}`.
pub fn reliability(test: &str, r: &Reliability) {
    let Some(dir) = std::env::var_os("KILO_RELIABILITY_OUT") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let path = dir.join(format!("{test}.jsonl"));
    let record = json!({
        "fault": r.fault,
        "tries": r.tries,
        "lost": r.lost,
        "outage_ms": r.outage_ms,
        "result": r.result,
        "notes": r.notes,
    });
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    writeln!(f, "{record}").expect("writing a reliability record");
}

/// `KILO_SOAK=1`: the reliability tests' long versions (more repetitions).
pub fn soak() -> bool {
    std::env::var("KILO_SOAK").is_ok_and(|v| v == "1")
}
