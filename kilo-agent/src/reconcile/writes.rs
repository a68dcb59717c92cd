//! What a reconcile wrote, by kind, so metrics, tests and benchmarks can count it.
use std::{collections::BTreeMap, fmt, ops::AddAssign};

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
