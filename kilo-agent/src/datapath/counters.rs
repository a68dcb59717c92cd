//! The program's counters as userspace sees them: the `KILO_COUNTERS` array (see kilo-common's
//! `MAP_COUNTERS`) mapped into memory, each CPU's region summed per slot, so reading a counter
//! is a few memory reads, not a system call, and recycling an entry's slot zeroes it in place;
//! and [`Counters`], every counter labelled with its entry.
use std::{collections::BTreeMap, os::fd::AsFd as _};

use aya::maps::{Map, MapData};
use ipnet::IpNet;
use kilo_common::{Counter, DECISION_SLOTS, Decision, EntryValue, MAP_COUNTERS, NO_COUNTER};

use super::{
    DatapathError, Role, Trie, keys,
    maps::DatapathMaps,
    plans::{Plans, role_of},
};
use crate::{plan::EntryKind, sys::mmap::Mapped};

/// The counters array, mapped.
pub struct CounterArray {
    /// Keeps the map (and so the mapping's object) alive.
    _map: MapData,
    mem: Mapped<Counter>,
    /// Counters per CPU region.
    stride: usize,
    cpus: usize,
}

impl CounterArray {
    /// Maps the object's counters array (`map`), whose regions are `stride` counters long.
    pub fn new(map: Option<Map>, stride: u32) -> Result<Self, DatapathError> {
        let error = |reason: String| DatapathError::Config(format!("{MAP_COUNTERS}: {reason}"));
        let Some(Map::Array(map)) = map else {
            return Err(error("not an array in the object".into()));
        };
        let entries = map
            .info()
            .map_err(|e| DatapathError::map(MAP_COUNTERS, e))?
            .max_entries() as usize;
        let stride = stride as usize;
        if stride <= DECISION_SLOTS as usize || !entries.is_multiple_of(stride) {
            return Err(error(format!(
                "{entries} counters are not whole regions of {stride}"
            )));
        }
        let mem =
            Mapped::new(map.fd().as_fd(), entries).map_err(|e| error(format!("mmap: {e}")))?;
        Ok(CounterArray {
            _map: map,
            mem,
            stride,
            cpus: entries / stride,
        })
    }

    /// Entry counter slots per CPU.
    pub fn entry_slots(&self) -> u32 {
        (self.stride - DECISION_SLOTS as usize) as u32
    }

    /// A slot's index on each CPU (`index` within a region).
    fn each_cpu(&self, index: usize) -> impl Iterator<Item = usize> + use<> {
        let stride = self.stride;
        (0..self.cpus).map(move |cpu| cpu * stride + index)
    }

    fn sum(&self, index: usize) -> Counter {
        self.each_cpu(index).fold(Counter::default(), |a, i| {
            let c = self.mem.read(i);
            Counter {
                packets: a.packets + c.packets,
                bytes: a.bytes + c.bytes,
            }
        })
    }

    fn entry_index(&self, slot: u32) -> Result<usize, DatapathError> {
        if slot >= self.entry_slots() {
            return Err(DatapathError::Config(format!(
                "{MAP_COUNTERS}: no entry counter slot {slot} (there are {})",
                self.entry_slots()
            )));
        }
        Ok(DECISION_SLOTS as usize + slot as usize)
    }

    /// An entry counter slot summed over the CPUs.
    pub fn entry(&self, slot: u32) -> Result<Counter, DatapathError> {
        Ok(self.sum(self.entry_index(slot)?))
    }

    /// Zeroes an entry counter slot on every CPU (before the slot is given to a new entry).
    pub fn reset_entry(&mut self, slot: u32) -> Result<(), DatapathError> {
        for i in self.each_cpu(self.entry_index(slot)?) {
            self.mem.write(i, Counter::default());
        }
        Ok(())
    }

    /// The decision counters, summed over the CPUs, in [`Decision`] order.
    pub fn decisions(&self) -> Vec<Counter> {
        (0..Decision::COUNT as usize).map(|d| self.sum(d)).collect()
    }
}

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
                kind: keys::kind_from_code(value.kind),
                counter,
            });
        }
    }
    Ok(out)
}
