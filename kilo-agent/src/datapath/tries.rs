//! The map diff: make the tries equal to a [`DatapathPlan`] and an [`IpipPlan`] ([`Plans`]),
//! writing only the difference (one write per changed entry, none when nothing changed), found
//! in one ordered pass per trie over the plan and [`Tries`]'s record of what the maps hold;
//! behind the [`DatapathMaps`] trait so it runs against the kernel or in memory.
//!
//! The destination trie holds the mesh destinations and the masquerade destinations (flagged
//! `ENTRY_MASQUERADE`); a masquerade destination inside a mesh destination
//! ([`DatapathPlan::covering_mesh`]) holds that mesh destination's value and counter slot
//! (flagged `ENTRY_COVERED`), so a packet to it counts where Kilo's `RETURN` rule would.
//!
//! Order: new and changed entries go in destinations (in CIDR order, so a mesh destination
//! before the masquerade destinations it covers) first, stale ones go NAT sources first,
//! destinations last; accepted IPIP sources and served destinations go in before destinations
//! to encapsulate and out after them. So while a topology grows or shrinks a packet is never
//! marked that neither topology would mark, and a failure part-way (a full trie) leaves
//! everything the old topology had plus some of the new.
//!
//! The record is read back from the maps at the first apply, after a failed write, and every
//! [`READ_BACK_EVERY`](crate::writes::READ_BACK_EVERY) syncs (which repairs entries someone else changed in our pinned maps; the
//! kernel sends no notification about map contents). Per-entry counter slots are stored in the
//! entry values, so they survive syncs and adoption by a new agent (a covered entry holds none
//! of its own); the record also knows which slots are held, and a slot freed by an apply's deletes is handed out from the next apply on,
//! zeroed (only if non-zero) first. The metrics read the entries from the record too
//! ([`Tries::counters`]): no system call per entry.
use std::collections::BTreeMap;

use ipnet::IpNet;
use kilo_common::{Counter, ENTRY_COVERED, EntryValue, NO_COUNTER};

use super::{
    DatapathError, Trie,
    counters::counters_of,
    encode::Resolver,
    maps::DatapathMaps,
    plans::{Plans, Want},
};
use crate::writes::{ReadBack, Write, Writes};

pub use super::counters::{Counters, EntryCounter};

/// The order new and changed entries are written in (see the module doc).
const UPSERT_ORDER: [Trie; 5] = [
    Trie::Destination,
    Trie::NatSource,
    Trie::IpipSource,
    Trie::Decapsulate,
    Trie::Encapsulate,
];
/// The order stale entries are deleted in.
const DELETE_ORDER: [Trie; 5] = [
    Trie::Encapsulate,
    Trie::IpipSource,
    Trie::Decapsulate,
    Trie::NatSource,
    Trie::Destination,
];

/// What the maps hold, per trie, and which counter slots their entries hold.
#[derive(Debug)]
struct Record {
    tries: BTreeMap<Trie, BTreeMap<IpNet, EntryValue>>,
    /// Bit `s % 64` of word `s / 64` set: slot `s` is held.
    used: Vec<u64>,
}

impl Record {
    fn new(tries: BTreeMap<Trie, BTreeMap<IpNet, EntryValue>>, slots: u32) -> Self {
        let mut record = Record {
            tries: BTreeMap::new(),
            used: vec![0; slots.div_ceil(64) as usize],
        };
        for v in tries.values().flat_map(|t| t.values()) {
            record.hold_own(v, true);
        }
        record.tries = tries;
        record
    }

    /// Marks a slot held or free (slots out of range, like [`NO_COUNTER`], are ignored).
    fn hold(&mut self, slot: u32, held: bool) {
        if let Some(w) = self.used.get_mut(slot as usize / 64) {
            let bit = 1 << (slot % 64);
            *w = if held { *w | bit } else { *w & !bit };
        }
    }

    /// Marks the slot of `v` held or free, unless it is a covered entry's (another's slot).
    fn hold_own(&mut self, v: &EntryValue, held: bool) {
        if v.flags & ENTRY_COVERED == 0 {
            self.hold(v.counter, held);
        }
    }

    /// The lowest free slot below `slots`, now held.
    fn take_slot(&mut self, slots: u32) -> Option<u32> {
        let (i, w) = self
            .used
            .iter()
            .enumerate()
            .find(|(_, w)| **w != u64::MAX)?;
        let slot = (i * 64) as u32 + w.trailing_ones();
        (slot < slots).then(|| {
            self.hold(slot, true);
            slot
        })
    }
}

/// The diff with its record of what the maps hold (see the module doc).
#[derive(Debug, Default)]
pub struct Tries {
    /// `None` until the maps are read back (first apply, after a failure).
    record: Option<Record>,
    read_back: ReadBack,
}

impl Tries {
    /// Makes the maps equal to `plan`, writing only the difference. Writes are counted as
    /// `map_insert`, `map_update`, `map_delete` and `counter_reset`.
    pub fn apply<'a, M: DatapathMaps + ?Sized>(
        &mut self,
        maps: &mut M,
        plan: impl Into<Plans<'a>>,
        resolver: &dyn Resolver,
    ) -> Result<Writes, DatapathError> {
        let plan = plan.into();
        let due = self.read_back.due(self.record.is_some());
        let record = match self.record.take() {
            Some(r) if !due => r,
            _ => read_back(maps)?,
        };
        let slots = maps.counter_slots();
        let changes: BTreeMap<Trie, Vec<Change>> = Trie::ALL
            .into_iter()
            .map(|t| {
                (
                    t,
                    changes(plan.wants(t), &record.tries[&t], slots, resolver),
                )
            })
            .collect();
        let mut diff = Diff {
            maps,
            record,
            writes: Writes::default(),
            exhausted: false,
        };
        let done = diff.apply(&changes, resolver);
        // A failed write leaves the kernel unknown: read it back next time.
        if done.is_ok() {
            self.record = Some(diff.record);
        }
        done.map(|()| diff.writes)
    }

    /// Every counter, with the entries taken from the record (no system call per entry); from
    /// the maps themselves while there is no record (before the first apply, after a failure).
    pub fn counters<M: DatapathMaps + ?Sized>(&self, maps: &M) -> Result<Counters, DatapathError> {
        match &self.record {
            Some(record) => counters_of(maps, &record.tries),
            None => read_counters(maps),
        }
    }
}

fn read_back<M: DatapathMaps + ?Sized>(maps: &M) -> Result<Record, DatapathError> {
    let tries = Trie::ALL
        .into_iter()
        .map(|trie| Ok((trie, maps.entries(trie)?.into_iter().collect())))
        .collect::<Result<_, DatapathError>>()?;
    Ok(Record::new(tries, maps.counter_slots()))
}

/// One entry to write or delete.
enum Change<'a> {
    /// A new entry, or one whose value (or counter slot) must change: (CIDR, what it should
    /// hold, value the maps hold).
    Put(IpNet, Want<'a>, Option<EntryValue>),
    Delete(IpNet),
}

/// What differs between what a trie should hold and the record's: one ordered pass over both,
/// no lookups (but a covered entry's) and no allocation when nothing differs (a plan CIDR with
/// host bits set makes a second pass over the plan keyed as the maps key it).
fn changes<'a>(
    want: impl Iterator<Item = (IpNet, Want<'a>)> + Clone,
    have: &BTreeMap<IpNet, EntryValue>,
    slots: u32,
    resolver: &dyn Resolver,
) -> Vec<Change<'a>> {
    // The idle case, as cheap as a comparison gets: equal keys and values, in one zip.
    let mut held = have.iter();
    let same = want.clone().all(|(net, w)| {
        held.next()
            .is_some_and(|(hn, hv)| net == *hn && w.held_by(hv, have, slots, resolver))
    });
    if same && held.next().is_none() {
        return Vec::new();
    }
    merge(want.clone(), have, slots, resolver).unwrap_or_else(|| {
        let keyed: BTreeMap<IpNet, Want> = want.map(|(n, w)| (n.trunc(), w)).collect();
        merge(keyed.into_iter(), have, slots, resolver).expect("keys without host bits")
    })
}

/// The changes, or `None` at the first CIDR with host bits set.
fn merge<'a>(
    want: impl Iterator<Item = (IpNet, Want<'a>)>,
    have: &BTreeMap<IpNet, EntryValue>,
    slots: u32,
    resolver: &dyn Resolver,
) -> Option<Vec<Change<'a>>> {
    let mut out = Vec::new();
    let mut rest = have.iter();
    let mut next = rest.next();
    for (net, w) in want {
        let old = match next {
            Some((h, v)) if *h == net => {
                next = rest.next();
                Some(*v)
            }
            // Keys in the record have no host bits: only a key it lacks needs the check.
            _ if net.addr() != net.network() => return None,
            _ => {
                while let Some((h, _)) = next.filter(|(h, _)| **h < net) {
                    out.push(Change::Delete(*h));
                    next = rest.next();
                }
                let old = next.filter(|(h, _)| **h == net).map(|(_, v)| *v);
                if old.is_some() {
                    next = rest.next();
                }
                old
            }
        };
        if !old.is_some_and(|v| w.held_by(&v, have, slots, resolver)) {
            out.push(Change::Put(net, w, old));
        }
    }
    out.extend(
        next.into_iter()
            .chain(rest)
            .map(|(stale, _)| Change::Delete(*stale)),
    );
    Some(out)
}

struct Diff<'a, M: ?Sized> {
    maps: &'a mut M,
    record: Record,
    writes: Writes,
    /// Whether an entry found no free counter slot in this apply (warned once).
    exhausted: bool,
}

impl<M: DatapathMaps + ?Sized> Diff<'_, M> {
    fn apply(
        &mut self,
        changes: &BTreeMap<Trie, Vec<Change>>,
        resolver: &dyn Resolver,
    ) -> Result<(), DatapathError> {
        for trie in UPSERT_ORDER {
            for change in &changes[&trie] {
                if let Change::Put(net, want, old) = change {
                    self.put(trie, *net, want, *old, resolver)?;
                }
            }
        }
        for trie in DELETE_ORDER {
            for change in &changes[&trie] {
                if let Change::Delete(net) = change {
                    self.delete(trie, *net)?;
                }
            }
        }
        Ok(())
    }

    fn free_slot(&mut self) -> Option<u32> {
        let slots = self.maps.counter_slots();
        let slot = self.record.take_slot(slots);
        if slot.is_none() && !self.exhausted {
            self.exhausted = true;
            tracing::warn!(
                slots,
                "datapath: per-entry counter slots exhausted; new entries are not counted"
            );
        }
        slot
    }

    /// Writes one new or changed entry, keeping its counter slot or giving it a free one (a
    /// covered entry takes the slot of the mesh destination covering it, written before it).
    fn put(
        &mut self,
        trie: Trie,
        net: IpNet,
        want: &Want,
        old: Option<EntryValue>,
        resolver: &dyn Resolver,
    ) -> Result<(), DatapathError> {
        let slots = self.maps.counter_slots();
        let own = old
            .filter(|v| v.flags & ENTRY_COVERED == 0)
            .map(|v| v.counter)
            .filter(|c| *c < slots);
        let (counter, fresh) = match (want.covered, own) {
            (Some((outer, _)), _) => {
                let outer = self.record.tries[&trie].get(&outer);
                (outer.map_or(NO_COUNTER, |v| v.counter), false)
            }
            (None, Some(c)) => (c, false),
            (None, None) => self.free_slot().map_or((NO_COUNTER, false), |c| (c, true)),
        };
        let value = want.value(counter, resolver);
        if old == Some(value) {
            return Ok(());
        }
        let wrap = |source| DatapathError::Entry {
            role: want.role,
            net,
            owner: want.entry.owner.clone(),
            source: Box::new(source),
        };
        if fresh && self.maps.entry_counter(counter).map_err(wrap)? != Counter::default() {
            self.maps.reset_entry_counter(counter).map_err(wrap)?;
            self.writes.add(Write::CounterReset, 1);
        }
        self.maps.insert(trie, net, &value).map_err(wrap)?;
        self.record
            .tries
            .get_mut(&trie)
            .expect("all tries")
            .insert(net, value);
        // Now covered: the slot it held is free.
        if let (Some(c), Some(_)) = (own, want.covered) {
            self.record.hold(c, false);
        }
        let kind = if old.is_some() {
            Write::MapUpdate
        } else {
            Write::MapInsert
        };
        self.writes.add(kind, 1);
        Ok(())
    }

    fn delete(&mut self, trie: Trie, net: IpNet) -> Result<(), DatapathError> {
        self.maps
            .remove(trie, net)
            .map_err(|source| DatapathError::Stale {
                trie,
                net,
                source: Box::new(source),
            })?;
        let gone = self
            .record
            .tries
            .get_mut(&trie)
            .expect("all tries")
            .remove(&net);
        if let Some(v) = gone {
            self.record.hold_own(&v, false);
        }
        self.writes.add(Write::MapDelete, 1);
        Ok(())
    }
}

/// Reads every counter (sums over CPUs), reading the entries back from the maps.
fn read_counters<M: DatapathMaps + ?Sized>(maps: &M) -> Result<Counters, DatapathError> {
    counters_of(maps, &read_back(maps)?.tries)
}

#[cfg(test)]
mod tests;
