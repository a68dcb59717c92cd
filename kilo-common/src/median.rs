//! The one median of the benchmarks (kilo-testkit) and of `cargo xtask bench`'s report, and its
//! confidence interval. Here because xtask may depend on kilo-common (it builds on the stable
//! toolchain alone) but not on kilo-agent.

/// The median of `v` (the mean of the middle two of an even count; NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The median of `v` and a distribution-free confidence interval of at least 95% around it:
/// the order statistics the binomial distribution puts on either side (NaN when `v` has
/// fewer than 6 samples, too few for such an interval).
pub fn median_ci(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let m = median(v);
    // The largest k with P(Binomial(n, 1/2) < k) <= 2.5%: then [s[k-1], s[n-k]] covers the
    // median with probability >= 95%.
    let mut below = 0.0; // P(X < k), built up term by term
    let mut term = 0.5_f64.powi(n as i32); // P(X = 0)
    let mut k = 0;
    while k < n / 2 {
        if below + term > 0.025 {
            break;
        }
        below += term;
        term *= (n - k) as f64 / (k + 1) as f64;
        k += 1;
    }
    if k == 0 {
        return (m, f64::NAN, f64::NAN);
    }
    (m, s[k - 1], s[n - k])
}
