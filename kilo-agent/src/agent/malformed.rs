//! Packets the datapath dropped as malformed. Legitimate traffic never is, so a count that grows
//! means the kernel refused what a program asked of it (as a kernel older than a helper's flag
//! does): warned about, at most once a period, beside `kilo_datapath_packets_total{decision=
//! "malformed"}` for alerts.

/// How often the count is looked at (its growth is warned about at most this often).
pub const PERIOD_MS: i64 = 30_000;

/// The count at the last look.
#[derive(Debug, Default)]
pub struct MalformedWatch {
    last: Option<(i64, u64)>,
}

impl MalformedWatch {
    /// Whether a look is due at `now` (ms).
    pub fn due(&self, now: i64) -> bool {
        self.last.is_none_or(|(at, _)| now - at >= PERIOD_MS)
    }

    /// Records the `total` seen at `now`; returns its growth since the last look, if it grew.
    /// The first look only records: what an earlier agent's pinned counters hold is not news.
    pub fn observe(&mut self, total: u64, now: i64) -> Option<u64> {
        let before = self.last.replace((now, total)).map(|(_, n)| n);
        before.and_then(|b| total.checked_sub(b)).filter(|&d| d > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_is_reported_once_a_period_and_the_first_count_is_not() {
        let mut w = MalformedWatch::default();
        assert!(w.due(0));
        assert_eq!(w.observe(7, 0), None);
        assert!(!w.due(PERIOD_MS - 1));
        assert!(w.due(PERIOD_MS));
        assert_eq!(w.observe(7, PERIOD_MS), None);
        assert_eq!(w.observe(12, 2 * PERIOD_MS), Some(5));
        // Counters cleared (maps replaced): no growth, and counting starts again from there.
        assert_eq!(w.observe(0, 3 * PERIOD_MS), None);
        assert_eq!(w.observe(2, 4 * PERIOD_MS), Some(2));
    }
}
