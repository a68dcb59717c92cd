//! What every reconciler reports: the writes it made to the kernel ([`Writes`]), and how often
//! the reconcilers read the kernel back instead of trusting their record ([`READ_BACK_EVERY`]).
use std::{collections::BTreeMap, fmt, ops::AddAssign};

/// Passes between full reads of what the agent keeps in the kernel (the datapath's maps, its
/// nftables table, links, addresses, routes and rules), which in between trust their record of
/// what they wrote: every 10 minutes at the default 30 s resync. A read-back of the maps costs
/// about a microsecond of kernel time per entry, so at 10,000 entries this keeps an idle
/// resync's average under a millisecond.
pub const READ_BACK_EVERY: u32 = 20;

/// Writes made to the kernel (or a backend), counted by kind (`map_insert`, `route_add`, ...).
/// A reconcile with nothing to do returns an empty `Writes`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Writes(BTreeMap<&'static str, u64>);

impl Writes {
    pub fn add(&mut self, kind: &'static str, n: u64) {
        if n > 0 {
            *self.0.entry(kind).or_default() += n;
        }
    }

    pub fn get(&self, kind: &str) -> u64 {
        self.0.get(kind).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.0.iter().map(|(k, v)| (*k, *v))
    }
}

impl AddAssign for Writes {
    fn add_assign(&mut self, rhs: Self) {
        for (k, v) in rhs.0 {
            self.add(k, v);
        }
    }
}

impl fmt::Display for Writes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no writes");
        }
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&parts.join(" "))
    }
}

/// Counts a reconciler's passes between full reads of the kernel: a pass reads it when the
/// reconciler's record cannot be trusted (none yet, a failed write, a change someone else
/// made) or when `every` passes went by since the last read; in between it trusts the record.
#[derive(Debug, Clone)]
pub struct ReadBack {
    every: u32,
    since: u32,
}

impl Default for ReadBack {
    fn default() -> Self {
        ReadBack::every(READ_BACK_EVERY)
    }
}

impl ReadBack {
    pub fn every(every: u32) -> Self {
        ReadBack { every, since: 0 }
    }

    /// Counts this pass; whether it must read the kernel (counting restarts then). `trusted`:
    /// whether the record may be trusted if no periodic read is due.
    pub fn due(&mut self, trusted: bool) -> bool {
        self.since += 1;
        if trusted && self.since < self.every {
            return false;
        }
        self.since = 0;
        true
    }
}
