//! Records for the reliability table: when `KILO_RELIABILITY_OUT` names a directory, each
//! scenario appends one JSON object per line to `<dir>/<test name>.jsonl`; without it nothing
//! is written.
use std::io::Write as _;

/// One scenario's outcome.
pub struct Record<'a> {
    /// What was done to the node.
    pub fault: &'a str,
    /// How many times it was provoked.
    pub tries: u32,
    /// What was lost while it lasted ("nothing", "new peers not applied", ...).
    pub lost: &'a str,
    /// How long the fault lasted, when it is the test's to say.
    pub outage_ms: Option<f64>,
    /// What kg did about it.
    pub result: &'a str,
    pub notes: &'a str,
}

/// Appends `r` to `<KILO_RELIABILITY_OUT>/<test>.jsonl`.
pub fn record(test: &str, r: &Record) {
    let Some(dir) = std::env::var_os("KILO_RELIABILITY_OUT") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let path = dir.join(format!("{test}.jsonl"));
    let line = serde_json::json!({
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
    writeln!(f, "{line}").expect("writing a reliability record");
}
