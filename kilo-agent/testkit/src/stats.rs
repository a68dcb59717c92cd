//! Paired statistics for the benchmarks: the per-round differences or ratios of two cases run in
//! the same rounds, and the confidence interval of their median as the reports give it.
pub use kilo_common::median::{median, median_ci};

/// Per round, `a - b` (or `a / b` with `ratio`).
pub fn paired(a: &[f64], b: &[f64], ratio: bool) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(x, y)| if ratio { x / y } else { x - y })
        .collect()
}

/// Whether the confidence interval of the median of `v` is narrower than `width`.
pub fn narrower(v: &[f64], width: f64) -> bool {
    let (_, lo, hi) = median_ci(v);
    hi - lo < width
}

/// Whether the confidence interval of the median of `v` decides `ok`: both ends pass, or
/// neither does.
pub fn decides(v: &[f64], ok: impl Fn(f64) -> bool) -> bool {
    let (_, lo, hi) = median_ci(v);
    lo.is_finite() && ok(lo) == ok(hi)
}

/// "from LO to HI" of the median's confidence interval, or why there is none.
pub fn interval_text(v: &[f64], digits: usize) -> String {
    let (_, lo, hi) = median_ci(v);
    if lo.is_finite() {
        format!("from {lo:.digits$} to {hi:.digits$}")
    } else {
        format!("none ({} rounds: too few)", v.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_rounds_and_decides_on_the_interval() {
        let a: Vec<f64> = (0..20).map(|i| 100.0 + f64::from(i)).collect();
        let b: Vec<f64> = (0..20).map(|i| 50.0 + f64::from(i)).collect();
        let d = paired(&a, &b, false);
        assert!(d.iter().all(|&x| x == 50.0));
        assert!(paired(&a, &b, true)[0] == 2.0);
        assert!(decides(&d, |x| x <= 60.0));
        assert!(decides(&d, |x| x <= 40.0));
        let spread: Vec<f64> = (0..20).map(f64::from).collect();
        assert!(!decides(&spread, |x| x <= 10.0));
        assert!(!narrower(&spread, 5.0));
        assert!(narrower(&d, 1.0));
        assert_eq!(interval_text(&d, 1), "from 50.0 to 50.0");
        assert!(interval_text(&d[..3], 1).starts_with("none"));
        assert!(!decides(&d[..3], |x| x <= 60.0));
    }
}
