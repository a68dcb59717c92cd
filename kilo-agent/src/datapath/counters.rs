//! [`Counters`]: every counter the maps hold (per decision, per entry), labelled with its entry,
//! and how full the tries and the counter slots are.
use std::collections::BTreeMap;

use ipnet::IpNet;
use kilo_common::{Counter, Decision, EntryValue, NO_COUNTER};

use super::{
    DatapathError, Role, Trie, encode,
    maps::DatapathMaps,
    plans::{Plans, role_of},
};
use crate::plan::EntryKind;

/// Traffic counters: per decision and per map entry (but covered ones, whose traffic their
/// mesh destination counts); and how full the tries and the counter slots are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub decisions: BTreeMap<Decision, Counter>,
    pub entries: Vec<EntryCounter>,
    /// Entries the tries hold per role (covered masquerade destinations included).
    pub fill: BTreeMap<Role, usize>,
    /// Entries each trie can hold.
    pub capacity: usize,
    /// Per-entry counter slots, and how many entries hold one.
    pub slots: u32,
    pub slots_used: u32,
}

impl Counters {
    pub fn decision(&self, d: Decision) -> Counter {
        self.decisions.get(&d).copied().unwrap_or_default()
    }

    /// Every entry's counter with the owner and kind the plan gives it (entries the plan does
    /// not know, e.g. left over from an adopted topology, get the owner "").
    pub fn labelled<'a>(
        &'a self,
        plan: impl Into<Plans<'a>>,
    ) -> impl Iterator<Item = (&'a EntryCounter, &'a str)> + 'a {
        let plan = plan.into();
        self.entries.iter().map(move |e| {
            let owner = plan
                .role(e.role)
                .get(&e.net)
                .map(|d| d.owner.as_str())
                .unwrap_or("");
            (e, owner)
        })
    }

    pub fn entry(&self, role: Role, net: &IpNet) -> Option<Counter> {
        self.entries
            .iter()
            .find(|e| e.role == role && &e.net == net)
            .map(|e| e.counter)
    }
}

/// One entry's traffic; label it with the plan's owner via `(role, net)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryCounter {
    pub role: Role,
    pub net: IpNet,
    pub kind: Option<EntryKind>,
    /// Summed over CPUs; zero for an entry without a counter slot.
    pub counter: Counter,
}

/// Every counter, for the entries of `tries` (what the maps hold).
pub(super) fn counters_of<M: DatapathMaps + ?Sized>(
    maps: &M,
    tries: &BTreeMap<Trie, BTreeMap<IpNet, EntryValue>>,
) -> Result<Counters, DatapathError> {
    let mut out = Counters {
        capacity: maps.capacity(),
        slots: maps.counter_slots(),
        ..Counters::default()
    };
    let decisions = maps.decision_counters()?;
    for d in Decision::ALL {
        out.decisions
            .insert(d, decisions.get(d as usize).copied().unwrap_or_default());
    }
    for (trie, entries) in tries {
        for (net, value) in entries {
            let role = role_of(*trie, value);
            *out.fill
                .entry(role.unwrap_or(Role::MasqueradeDestination))
                .or_default() += 1;
            let Some(role) = role else {
                continue;
            };
            let counter = if value.counter == NO_COUNTER {
                Counter::default()
            } else {
                out.slots_used += 1;
                maps.entry_counter(value.counter)?
            };
            out.entries.push(EntryCounter {
                role,
                net: *net,
                kind: encode::kind_from_code(value.kind),
                counter,
            });
        }
    }
    Ok(out)
}
