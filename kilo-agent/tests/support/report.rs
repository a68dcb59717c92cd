//! The benchmarks' machine-readable results: one JSON object per line, appended to the file
//! that `KILO_BENCH_JSON` names (`cargo xtask bench` sets it and renders BENCHMARKS.md and the
//! plots from it; xtask's `bench` module documents the records). Without it nothing is written
//! and the benchmarks only print their own text.
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
