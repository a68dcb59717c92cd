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

/// Where a target stands after a run. Only [`State::Met`] is a pass: a figure that was not
/// measured, or not at the size the target names, never reads as one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Met,
    NotMet,
    /// A figure the target needs could not be read (a failed /proc read, a missing metric).
    NotMeasured,
    /// Measured, but not at the size the target names (a `--quick` run), or with an interval
    /// too wide to decide.
    NotJudged,
}

impl State {
    /// Met or not met, from a comparison of figures that were all measured.
    pub fn of(met: bool) -> State {
        if met { State::Met } else { State::NotMet }
    }

    /// [`State::of`] for a target named for a size a `--quick` run does not reach.
    pub fn at_full_size(met: bool) -> State {
        if quick() {
            State::NotJudged
        } else {
            State::of(met)
        }
    }

    /// A target judged on a confidence interval `(lo, hi)` of a figure and a threshold `ok`
    /// (`|v| v <= 45.0`): met when both ends pass, not met when neither does, not judged when
    /// the interval straddles the threshold or could not be formed (NaN: too few rounds).
    pub fn interval(lo: f64, hi: f64, ok: impl Fn(f64) -> bool) -> State {
        match (lo.is_finite() && hi.is_finite(), ok(lo), ok(hi)) {
            (false, _, _) => State::NotJudged,
            (true, true, true) => State::Met,
            (true, false, false) => State::NotMet,
            _ => State::NotJudged,
        }
    }

    /// [`State::interval`] once the rounds are spent: where the interval straddles the
    /// threshold, the median decides (the figure beside it gives the interval); with too few
    /// rounds for an interval (a `--quick` run), not judged.
    pub fn judged(med: f64, lo: f64, hi: f64, ok: impl Fn(f64) -> bool) -> State {
        match State::interval(lo, hi, &ok) {
            State::NotJudged if med.is_finite() && lo.is_finite() => State::of(ok(med)),
            s => s,
        }
    }

    /// The state of several parts of one target: not met if any part is, else not measured
    /// or not judged if any part is (in that order), else met; no part at all is not measured.
    pub fn all(parts: impl IntoIterator<Item = State>) -> State {
        let parts: Vec<State> = parts.into_iter().collect();
        if parts.is_empty() {
            return State::NotMeasured;
        }
        [State::NotMet, State::NotMeasured, State::NotJudged]
            .into_iter()
            .find(|s| parts.contains(s))
            .unwrap_or(State::Met)
    }

    /// The name the records carry (`cargo xtask bench` renders each distinctly).
    pub fn name(self) -> &'static str {
        match self {
            State::Met => "met",
            State::NotMet => "not met",
            State::NotMeasured => "not measured",
            State::NotJudged => "not judged",
        }
    }
}

/// A target of the issues, the figure measured against it and where it stands.
pub fn target(what: &str, figure: &str, state: State) {
    emit(json!({"type": "target", "target": what, "figure": figure, "state": state.name()}));
}

/// A fact about the run (a tool's version, a parameter).
pub fn meta(key: &str, value: &str) {
    emit(json!({"type": "meta", "key": key, "value": value}));
}

#[cfg(test)]
mod tests {
    use super::State;

    #[test]
    fn judged_on_the_interval_then_the_median() {
        let ok = |v: f64| v <= 15.0;
        assert_eq!(State::judged(10.0, 8.0, 12.0, ok), State::Met);
        assert_eq!(State::judged(20.0, 18.0, 22.0, ok), State::NotMet);
        assert_eq!(State::judged(14.0, 10.0, 18.0, ok), State::Met);
        assert_eq!(State::judged(16.0, 10.0, 18.0, ok), State::NotMet);
        assert_eq!(
            State::judged(14.0, f64::NAN, f64::NAN, ok),
            State::NotJudged
        );
    }
}
