//! The map diff: make the tries equal to a [`DatapathPlan`] and an [`IpipPlan`] ([`Plans`]),
//! writing only the difference (one write per changed entry, none when nothing changed), found
//! in one ordered pass per trie over the plan and [`MapSync`]'s record of what the maps hold;
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
//! The record is read back from the maps at the first sync, after a failed write, and every
//! [`READ_BACK_EVERY`] syncs (which repairs entries someone else changed in our pinned maps; the
//! kernel sends no notification about map contents). Per-entry counter slots are stored in the
//! entry values, so they survive syncs and adoption by a new agent (a covered entry holds none
//! of its own); the record also knows which slots are held, and a slot freed by a sync's deletes is handed out from the next sync on,
//! zeroed (only if non-zero) first. The metrics read the entries from the record too
//! ([`MapSync::counters`]): no system call per entry.
use std::collections::BTreeMap;

use ipnet::IpNet;
use kilo_common::{
    Config, Counter, Decision, ENTRY_COVERED, ENTRY_MASQUERADE, EntryValue, NO_COUNTER,
};

use super::{DatapathError, Role, Trie, keys};
use crate::{
    effects::Writes,
    plan::{DatapathEntry, DatapathPlan, Device, EntryKind, IpipPlan},
};

/// Maps a plan's devices to interface indices (for the fast path's egress).
pub trait Resolver {
    fn ifindex(&self, device: Device) -> Option<u32>;
}

impl<F: Fn(Device) -> Option<u32>> Resolver for F {
    fn ifindex(&self, device: Device) -> Option<u32> {
        self(device)
    }
}

/// Resolves nothing: no entry gets a fast-path egress.
pub struct NoResolver;

impl Resolver for NoResolver {
    fn ifindex(&self, _: Device) -> Option<u32> {
        None
    }
}

/// The datapath's maps, as the diff sees them.
pub trait DatapathMaps {
    /// Every entry of one trie.
    fn entries(&self, trie: Trie) -> Result<Vec<(IpNet, EntryValue)>, DatapathError>;
    /// Inserts or overwrites (atomically) one entry.
    fn insert(&mut self, trie: Trie, net: IpNet, value: &EntryValue) -> Result<(), DatapathError>;
    fn remove(&mut self, trie: Trie, net: IpNet) -> Result<(), DatapathError>;
    /// Entries each trie can hold.
    fn capacity(&self) -> usize;
    /// Number of per-entry counter slots.
    fn counter_slots(&self) -> u32;
    /// A per-entry counter, summed over CPUs.
    fn entry_counter(&self, slot: u32) -> Result<Counter, DatapathError>;
    fn reset_entry_counter(&mut self, slot: u32) -> Result<(), DatapathError>;
    /// Per-decision counters, summed over CPUs, indexed by `Decision as usize`.
    fn decision_counters(&self) -> Result<Vec<Counter>, DatapathError>;
    fn config(&self) -> Result<Config, DatapathError>;
    fn set_config(&mut self, config: &Config) -> Result<(), DatapathError>;
}

/// Everything the maps hold: the NAT roles' plan and the IPIP roles'. A [`DatapathPlan`]
/// alone means no IPIP.
#[derive(Debug, Clone, Copy)]
pub struct Plans<'a> {
    pub nat: &'a DatapathPlan,
    pub ipip: &'a IpipPlan,
}

static NONE: BTreeMap<IpNet, DatapathEntry> = BTreeMap::new();
static NO_IPIP: IpipPlan = IpipPlan {
    encapsulate: BTreeMap::new(),
    sources: BTreeMap::new(),
    decapsulate: BTreeMap::new(),
};

impl<'a> From<&'a DatapathPlan> for Plans<'a> {
    fn from(nat: &'a DatapathPlan) -> Self {
        Plans {
            nat,
            ipip: &NO_IPIP,
        }
    }
}

impl<'a> Plans<'a> {
    /// The entries of one role.
    pub fn role(self, role: Role) -> &'a BTreeMap<IpNet, DatapathEntry> {
        match role {
            Role::Mesh => &self.nat.mesh_destinations,
            Role::NatSource => &self.nat.nat_sources,
            Role::MasqueradeDestination => &self.nat.masquerade_destinations,
            Role::Encapsulate => &self.ipip.encapsulate,
            Role::IpipSource => &self.ipip.sources,
            Role::Decapsulate => &self.ipip.decapsulate,
        }
    }

    /// What one trie should hold, in CIDR order: each role's entries; in the destination trie
    /// the mesh destinations and the masquerade destinations (a CIDR in both is a mesh
    /// destination), the latter marked covered when inside a mesh destination.
    pub(crate) fn wants(self, trie: Trie) -> impl Iterator<Item = (IpNet, Want<'a>)> + Clone {
        let (first, second) = roles(trie);
        let nat = self.nat;
        let mut a = self.role(first).iter().peekable();
        let mut b = second.map_or(&NONE, |r| self.role(r)).iter().peekable();
        std::iter::from_fn(move || {
            let take_a = match (a.peek(), b.peek()) {
                (Some((x, _)), Some((y, _))) => x <= y,
                (x, _) => x.is_some(),
            };
            if take_a {
                let (net, entry) = a.next()?;
                if b.peek().is_some_and(|(y, _)| *y == net) {
                    b.next();
                }
                let want = Want {
                    role: first,
                    entry,
                    covered: None,
                };
                return Some((*net, want));
            }
            let (net, entry) = b.next()?;
            let want = Want {
                role: second.expect("entries only with a second role"),
                entry,
                covered: nat.covering_mesh(net),
            };
            Some((*net, want))
        })
    }
}

/// The roles whose entries a trie holds: one, or (the destination trie) two.
const fn roles(trie: Trie) -> (Role, Option<Role>) {
    match trie {
        Trie::Destination => (Role::Mesh, Some(Role::MasqueradeDestination)),
        Trie::NatSource => (Role::NatSource, None),
        Trie::Encapsulate => (Role::Encapsulate, None),
        Trie::IpipSource => (Role::IpipSource, None),
        Trie::Decapsulate => (Role::Decapsulate, None),
    }
}

/// The role of an entry a trie holds (`None` for a covered one: it stands for the mesh
/// destination whose value it holds).
fn role_of(trie: Trie, value: &EntryValue) -> Option<Role> {
    if value.flags & ENTRY_COVERED != 0 {
        return None;
    }
    let (first, second) = roles(trie);
    Some(match second {
        Some(r) if value.flags & ENTRY_MASQUERADE != 0 => r,
        _ => first,
    })
}

/// What one trie entry should hold: its role and plan entry and, for a covered masquerade
/// destination, the mesh destination whose value it takes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Want<'a> {
    pub role: Role,
    pub entry: &'a DatapathEntry,
    covered: Option<(IpNet, &'a DatapathEntry)>,
}

impl Want<'_> {
    /// The map value with counter slot `counter`.
    fn value(&self, counter: u32, resolver: &dyn Resolver) -> EntryValue {
        let (entry, flags) = match self.covered {
            Some((_, mesh)) => (mesh, ENTRY_COVERED),
            None if self.role == Role::MasqueradeDestination => (self.entry, ENTRY_MASQUERADE),
            None => (self.entry, 0),
        };
        let mut value = keys::entry_value(entry, counter, resolver);
        value.flags |= flags;
        value
    }

    /// Whether `v` is this entry's value as it should be, in a trie holding `have`: with a
    /// counter slot of its own, or (covered) the slot of the mesh destination covering it,
    /// which must be as it should be too.
    fn held_by(
        &self,
        v: &EntryValue,
        have: &BTreeMap<IpNet, EntryValue>,
        slots: u32,
        resolver: &dyn Resolver,
    ) -> bool {
        let slot_ok = match self.covered {
            None => true,
            Some((outer, mesh)) => have.get(&outer).is_some_and(|o| {
                o.counter == v.counter && keys::entry_value(mesh, o.counter, resolver) == *o
            }),
        };
        slot_ok && v.counter < slots && self.value(v.counter, resolver) == *v
    }
}

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

pub use crate::effects::READ_BACK_EVERY;

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
pub struct MapSync {
    /// `None` until the maps are read back (first sync, after a failure).
    record: Option<Record>,
    /// Syncs since the last read-back.
    since_read: u32,
}

impl MapSync {
    /// Makes the maps equal to `plan`, writing only the difference. Writes are counted as
    /// `map_insert`, `map_update`, `map_delete` and `counter_reset`.
    pub fn sync<'a, M: DatapathMaps + ?Sized>(
        &mut self,
        maps: &mut M,
        plan: impl Into<Plans<'a>>,
        resolver: &dyn Resolver,
    ) -> Result<Writes, DatapathError> {
        let plan = plan.into();
        self.since_read += 1;
        let record = match self.record.take() {
            Some(r) if self.since_read < READ_BACK_EVERY => r,
            _ => {
                self.since_read = 0;
                read_back(maps)?
            }
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
    /// the maps themselves while there is no record (before the first sync, after a failure).
    pub fn counters<M: DatapathMaps + ?Sized>(&self, maps: &M) -> Result<Counters, DatapathError> {
        match &self.record {
            Some(record) => counters_of(maps, record),
            None => read_counters(maps),
        }
    }
}

/// Makes the maps equal to `plan` after reading them all back (see [`MapSync::sync`]).
pub fn sync_maps<'a, M: DatapathMaps + ?Sized>(
    maps: &mut M,
    plan: impl Into<Plans<'a>>,
    resolver: &dyn Resolver,
) -> Result<Writes, DatapathError> {
    MapSync::default().sync(maps, plan, resolver)
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
    /// Whether an entry found no free counter slot in this sync (warned once).
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
            self.writes.add("counter_reset", 1);
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
            "map_update"
        } else {
            "map_insert"
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
        self.writes.add("map_delete", 1);
        Ok(())
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

/// Reads every counter (sums over CPUs), reading the entries back from the maps.
pub fn read_counters<M: DatapathMaps + ?Sized>(maps: &M) -> Result<Counters, DatapathError> {
    counters_of(maps, &read_back(maps)?)
}

/// Every counter, for the entries of `record`.
fn counters_of<M: DatapathMaps + ?Sized>(
    maps: &M,
    record: &Record,
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
    for (trie, entries) in &record.tries {
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

/// In-memory maps for fast tests of the diff, with a per-trie capacity like the kernel's.
/// Every insert and remove is logged in `log`, in order.
#[derive(Debug, Clone)]
pub struct FakeMaps {
    pub tries: BTreeMap<Trie, BTreeMap<IpNet, EntryValue>>,
    pub capacity: usize,
    pub counters: Vec<Counter>,
    pub decisions: Vec<Counter>,
    pub config: Config,
    /// `(trie, net, inserted)` per write.
    pub log: Vec<(Trie, IpNet, bool)>,
}

impl FakeMaps {
    pub fn new(capacity: usize, counter_slots: u32) -> Self {
        FakeMaps {
            tries: Trie::ALL.iter().map(|t| (*t, BTreeMap::new())).collect(),
            capacity,
            counters: vec![Counter::default(); counter_slots as usize],
            decisions: vec![Counter::default(); Decision::COUNT as usize],
            config: Config::DEFAULT,
            log: Vec::new(),
        }
    }
}

impl DatapathMaps for FakeMaps {
    fn entries(&self, trie: Trie) -> Result<Vec<(IpNet, EntryValue)>, DatapathError> {
        Ok(self.tries[&trie].iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn insert(&mut self, trie: Trie, net: IpNet, value: &EntryValue) -> Result<(), DatapathError> {
        let entries = self.tries.get_mut(&trie).expect("all tries");
        if !entries.contains_key(&net) && entries.len() >= self.capacity {
            return Err(DatapathError::Full {
                name: trie.map_name(),
                capacity: self.capacity,
            });
        }
        entries.insert(net, *value);
        self.log.push((trie, net, true));
        Ok(())
    }

    fn remove(&mut self, trie: Trie, net: IpNet) -> Result<(), DatapathError> {
        self.tries.get_mut(&trie).expect("all tries").remove(&net);
        self.log.push((trie, net, false));
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn counter_slots(&self) -> u32 {
        self.counters.len() as u32
    }

    fn entry_counter(&self, slot: u32) -> Result<Counter, DatapathError> {
        Ok(self
            .counters
            .get(slot as usize)
            .copied()
            .unwrap_or_default())
    }

    fn reset_entry_counter(&mut self, slot: u32) -> Result<(), DatapathError> {
        if let Some(c) = self.counters.get_mut(slot as usize) {
            *c = Counter::default();
        }
        Ok(())
    }

    fn decision_counters(&self) -> Result<Vec<Counter>, DatapathError> {
        Ok(self.decisions.clone())
    }

    fn config(&self) -> Result<Config, DatapathError> {
        Ok(self.config)
    }

    fn set_config(&mut self, config: &Config) -> Result<(), DatapathError> {
        self.config = *config;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::plan::NextHop;

    fn entry(kind: EntryKind, owner: &str) -> DatapathEntry {
        DatapathEntry {
            kind,
            owner: owner.into(),
            next_hop: None,
        }
    }

    fn plan(mesh: &[&str], nat: &[&str], masq: &[&str]) -> DatapathPlan {
        let m = |v: &[&str], k| {
            v.iter()
                .map(|s| (s.parse().unwrap(), entry(k, s)))
                .collect()
        };
        DatapathPlan {
            mesh_destinations: m(mesh, EntryKind::Node),
            nat_sources: m(nat, EntryKind::LocalPods),
            masquerade_destinations: m(masq, EntryKind::AllowedLocation),
        }
    }

    fn slot(maps: &FakeMaps, trie: Trie, net: &str) -> u32 {
        maps.tries[&trie][&net.parse::<IpNet>().unwrap()].counter
    }

    /// Nested CIDRs, so that masquerade destinations fall inside mesh destinations (and the
    /// other way round).
    const NESTED: [&str; 10] = [
        "10.0.0.0/8",
        "10.1.0.0/16",
        "10.1.2.0/24",
        "10.2.0.0/16",
        "10.2.0.0/24",
        "192.168.0.0/16",
        "192.168.1.0/24",
        "172.16.0.0/12",
        "172.16.5.0/24",
        "0.0.0.0/0",
    ];

    proptest::proptest! {
        /// Syncs from one record (no read-back in between) keep the tries equal to the plan,
        /// give no two entries one slot of their own and a newly given slot a zeroed counter,
        /// and a covered entry the slot of the mesh destination covering it; an entry is left
        /// without a slot only while all are held (slots freed by a sync's deletes are handed
        /// out from the next sync on).
        #[test]
        fn syncs_from_the_record_keep_slots_distinct_and_zeroed(
            plans in proptest::collection::vec(
                [(); 3].map(|()| proptest::collection::btree_set(0usize..10, 0..6)),
                1..10,
            ),
        ) {
            let mut maps = FakeMaps::new(100, 8);
            let mut sync = MapSync::default();
            let mut before = BTreeSet::new();
            for sets in plans {
                let [mesh, nat, masq] = sets.map(|s| s.iter().map(|i| NESTED[*i]).collect::<Vec<_>>());
                let p = plan(&mesh, &nat, &masq);
                let wants: Vec<(Trie, IpNet, bool)> = Trie::ALL
                    .iter()
                    .flat_map(|t| Plans::from(&p).wants(*t).map(move |(n, w)| (*t, n, w.covered.is_some())))
                    .collect();
                let want: BTreeSet<(Trie, IpNet)> = wants.iter().map(|(t, n, _)| (*t, *n)).collect();
                let own = wants.iter().filter(|w| !w.2).count();
                for _ in 0..2 {
                    sync.sync(&mut maps, &p, &NoResolver).unwrap();
                    let held: BTreeSet<(Trie, IpNet, u32, bool)> = Trie::ALL
                        .iter()
                        .flat_map(|t| maps.tries[t].iter().map(move |(n, v)| {
                            (*t, *n, v.counter, v.flags & ENTRY_COVERED != 0)
                        }))
                        .collect();
                    let have: BTreeSet<(Trie, IpNet)> = held.iter().map(|h| (h.0, h.1)).collect();
                    proptest::prop_assert_eq!(&have, &want);
                    let slots: Vec<u32> = held.iter().filter(|h| !h.3).map(|h| h.2).filter(|c| *c != NO_COUNTER).collect();
                    let distinct: BTreeSet<u32> = slots.iter().copied().collect();
                    proptest::prop_assert_eq!(distinct.len(), slots.len(), "{:?}", held);
                    for (_, net, c, _) in held.iter().filter(|h| h.3) {
                        let (outer, _) = p.covering_mesh(net).unwrap();
                        proptest::prop_assert_eq!(*c, slot(&maps, Trie::Destination, &outer.to_string()));
                    }
                    for h in held.difference(&before).filter(|h| h.2 != NO_COUNTER && !h.3) {
                        proptest::prop_assert_eq!(maps.counters[h.2 as usize], Counter::default());
                    }
                    // Traffic on every slot before the next sync.
                    maps.counters.fill(Counter { packets: 1, bytes: 1 });
                    before = held;
                }
                let counted = before.iter().filter(|h| h.2 != NO_COUNTER && !h.3).count();
                proptest::prop_assert_eq!(counted, own.min(8), "{:?}", before);
            }
        }
    }

    #[test]
    fn first_sync_inserts_second_writes_nothing() {
        let mut maps = FakeMaps::new(100, 100);
        let p = plan(
            &["10.0.0.0/24", "fd00::/64"],
            &["10.0.1.0/24"],
            &["192.168.0.0/16"],
        );
        let w = sync_maps(&mut maps, &p, &NoResolver).unwrap();
        assert_eq!(w.get("map_insert"), 4);
        assert_eq!(w.total(), 4);
        assert!(sync_maps(&mut maps, &p, &NoResolver).unwrap().is_empty());
        // Distinct slots across roles.
        let slots: BTreeSet<u32> = maps
            .tries
            .values()
            .flat_map(|t| t.values().map(|v| v.counter))
            .collect();
        assert_eq!(slots.len(), 4);
    }

    #[test]
    fn one_change_is_one_write_and_slots_are_stable() {
        let mut maps = FakeMaps::new(100, 100);
        let p1 = plan(&["10.0.0.0/24", "10.0.2.0/24"], &[], &[]);
        sync_maps(&mut maps, &p1, &NoResolver).unwrap();
        let keep = slot(&maps, Trie::Destination, "10.0.2.0/24");
        let p2 = plan(&["10.0.2.0/24", "10.0.3.0/24"], &[], &[]);
        let w = sync_maps(&mut maps, &p2, &NoResolver).unwrap();
        assert_eq!(
            (w.get("map_insert"), w.get("map_delete"), w.total()),
            (1, 1, 2)
        );
        assert_eq!(slot(&maps, Trie::Destination, "10.0.2.0/24"), keep);
        // The new entry did not take the slot of the one deleted in the same sync.
        assert_ne!(slot(&maps, Trie::Destination, "10.0.3.0/24"), keep);
    }

    /// Inserts go destinations first, deletes go destinations last: in between, no packet is
    /// marked that neither topology marks.
    #[test]
    fn destinations_go_in_first_and_out_last() {
        let mut maps = FakeMaps::new(100, 100);
        let full = plan(&["10.1.0.0/16"], &["10.244.0.0/24"], &["192.168.0.0/24"]);
        sync_maps(&mut maps, &full, &NoResolver).unwrap();
        let first: IpNet = "10.1.0.0/16".parse().unwrap();
        assert_eq!(
            maps.log[0],
            (Trie::Destination, first, true),
            "{:?}",
            maps.log
        );
        maps.log.clear();
        sync_maps(&mut maps, &plan(&[], &[], &[]), &NoResolver).unwrap();
        assert_eq!(maps.log.len(), 3);
        assert_eq!(maps.log[0].0, Trie::NatSource, "{:?}", maps.log);
        assert_eq!(maps.log[2].0, Trie::Destination, "{:?}", maps.log);
        assert!(maps.log.iter().all(|(_, _, inserted)| !inserted));
    }

    /// One trie for both kinds of destination: a masquerade destination is flagged; one inside
    /// a mesh destination (not one around it) holds that mesh destination's value and counter
    /// slot, and is no counter of its own; a CIDR in both is a mesh destination. Covered and
    /// uncovered again as the mesh destination comes and goes, with slots kept distinct.
    #[test]
    fn masquerade_destinations_inside_mesh_destinations_are_covered() {
        let mut maps = FakeMaps::new(100, 100);
        let mut sync = MapSync::default();
        let masq = ["10.1.0.0/16", "192.168.0.0/16", "172.16.0.0/12"];
        let mut p = plan(
            &["10.0.0.0/8", "192.168.1.0/24", "172.16.0.0/12"],
            &[],
            &masq,
        );
        p.mesh_destinations
            .get_mut(&"10.0.0.0/8".parse().unwrap())
            .unwrap()
            .next_hop = Some(NextHop::WireGuard);
        let resolver = |_| Some(7);
        sync.sync(&mut maps, &p, &resolver).unwrap();
        let dst =
            |maps: &FakeMaps, net: &str| maps.tries[&Trie::Destination][&net.parse().unwrap()];
        assert_eq!(maps.tries[&Trie::Destination].len(), 5);
        let outer = dst(&maps, "10.0.0.0/8");
        let covered = dst(&maps, "10.1.0.0/16");
        assert_eq!(covered.flags, outer.flags | ENTRY_COVERED);
        assert_eq!((covered.counter, covered.ifindex), (outer.counter, 7));
        assert_eq!(dst(&maps, "192.168.0.0/16").flags, ENTRY_MASQUERADE);
        assert_eq!(dst(&maps, "192.168.1.0/24").flags, 0);
        assert_eq!(dst(&maps, "172.16.0.0/12").flags, 0);
        assert!(sync.sync(&mut maps, &p, &resolver).unwrap().is_empty());
        let c = sync.counters(&maps).unwrap();
        let roles: Vec<(Role, String)> = c
            .entries
            .iter()
            .map(|e| (e.role, e.net.to_string()))
            .collect();
        assert_eq!(c.entries.len(), 4, "{roles:?}");
        assert_eq!(c.slots_used, 4);
        assert_eq!(c.fill[&Role::Mesh], 3);
        assert_eq!(c.fill[&Role::MasqueradeDestination], 2);
        assert!(
            c.entry(Role::MasqueradeDestination, &"10.1.0.0/16".parse().unwrap())
                .is_none()
        );
        let distinct = |maps: &FakeMaps| {
            let own: Vec<u32> = maps.tries[&Trie::Destination]
                .values()
                .filter(|v| v.flags & ENTRY_COVERED == 0)
                .map(|v| v.counter)
                .collect();
            own.iter().collect::<BTreeSet<_>>().len() == own.len()
        };
        // The mesh destination goes: the masquerade destination masquerades, on a slot of its
        // own (zeroed), taken before the mesh destination's is freed.
        maps.counters.fill(Counter {
            packets: 1,
            bytes: 1,
        });
        let mut without = p.clone();
        without
            .mesh_destinations
            .remove(&"10.0.0.0/8".parse().unwrap());
        let w = sync.sync(&mut maps, &without, &resolver).unwrap();
        assert_eq!((w.get("map_update"), w.get("map_delete")), (1, 1), "{w}");
        let now = dst(&maps, "10.1.0.0/16");
        assert_eq!(now.flags, ENTRY_MASQUERADE);
        assert_ne!(now.counter, outer.counter);
        assert_eq!(maps.counters[now.counter as usize], Counter::default());
        assert!(distinct(&maps));
        // And comes back: covered again, its own slot freed for the next entry.
        sync.sync(&mut maps, &p, &resolver).unwrap();
        let again = dst(&maps, "10.1.0.0/16");
        assert_eq!(again.counter, dst(&maps, "10.0.0.0/8").counter);
        assert!(again.flags & ENTRY_COVERED != 0 && distinct(&maps));
        let mut more = p.clone();
        more.nat_sources.insert(
            "10.244.0.0/24".parse().unwrap(),
            entry(EntryKind::LocalPods, "n"),
        );
        sync.sync(&mut maps, &more, &resolver).unwrap();
        assert_eq!(slot(&maps, Trie::NatSource, "10.244.0.0/24"), now.counter);
    }

    /// The metrics take the entries from the record (a scrape reads no entry back) and their
    /// traffic from the counters; without a record they read the maps.
    #[test]
    fn counters_come_from_the_record_and_the_counter_slots() {
        let mut maps = FakeMaps::new(100, 4);
        let p = plan(&["10.1.0.0/16", "10.2.0.0/16"], &["10.244.0.0/24"], &[]);
        let mut sync = MapSync::default();
        let before = sync.counters(&maps).unwrap();
        assert!(before.entries.is_empty() && before.capacity == 100 && before.slots == 4);
        sync.sync(&mut maps, &p, &NoResolver).unwrap();
        let s = slot(&maps, Trie::Destination, "10.2.0.0/16") as usize;
        maps.counters[s] = Counter {
            packets: 3,
            bytes: 300,
        };
        // Gone from the maps behind the agent's back: still in the record.
        maps.tries.get_mut(&Trie::NatSource).unwrap().clear();
        let c = sync.counters(&maps).unwrap();
        assert_eq!(c.entries.len(), 3, "{c:?}");
        assert_eq!((c.slots_used, c.slots, c.capacity), (3, 4, 100));
        let net = "10.2.0.0/16".parse().unwrap();
        assert_eq!(c.entry(Role::Mesh, &net).unwrap().packets, 3);
        assert_eq!(read_counters(&maps).unwrap().entries.len(), 2);
    }

    /// An idle sync compares the plan with the record; a change behind the agent's back is
    /// repaired at the next read-back.
    #[test]
    fn idle_syncs_trust_the_record_until_the_next_read_back() {
        let mut maps = FakeMaps::new(100, 100);
        let p = plan(&["10.1.0.0/16"], &["10.244.0.0/24"], &[]);
        let mut sync = MapSync::default();
        assert_eq!(sync.sync(&mut maps, &p, &NoResolver).unwrap().total(), 2);
        maps.tries.get_mut(&Trie::Destination).unwrap().clear();
        let mut repaired_at = None;
        for i in 1..=READ_BACK_EVERY {
            let w = sync.sync(&mut maps, &p, &NoResolver).unwrap();
            if !w.is_empty() {
                assert_eq!(w.get("map_insert"), 1, "{w}");
                repaired_at = Some(i);
                break;
            }
        }
        assert_eq!(repaired_at, Some(READ_BACK_EVERY));
        assert!(maps.tries[&Trie::Destination].contains_key(&"10.1.0.0/16".parse().unwrap()));
    }

    #[test]
    fn a_failed_write_reads_back_at_the_next_sync() {
        let mut maps = FakeMaps::new(1, 100);
        let mut sync = MapSync::default();
        let p = plan(&["10.1.0.0/16", "10.2.0.0/16"], &[], &[]);
        assert!(sync.sync(&mut maps, &p, &NoResolver).is_err());
        maps.capacity = 2;
        maps.tries.get_mut(&Trie::Destination).unwrap().clear();
        let w = sync.sync(&mut maps, &p, &NoResolver).unwrap();
        assert_eq!(w.get("map_insert"), 2, "{w}");
    }

    #[test]
    fn changed_value_is_an_update_and_reused_slots_are_zeroed() {
        let mut maps = FakeMaps::new(100, 2);
        let p1 = plan(&["10.0.0.0/24"], &[], &[]);
        sync_maps(&mut maps, &p1, &NoResolver).unwrap();
        let s = slot(&maps, Trie::Destination, "10.0.0.0/24") as usize;
        maps.counters[s] = Counter {
            packets: 3,
            bytes: 300,
        };
        // Same CIDR, next hop now resolvable: an update, counter kept.
        let mut p2 = p1.clone();
        p2.mesh_destinations.values_mut().next().unwrap().next_hop = Some(NextHop::WireGuard);
        let w = sync_maps(&mut maps, &p2, &|_| Some(9)).unwrap();
        assert_eq!((w.get("map_update"), w.total()), (1, 1));
        assert_eq!(maps.counters[s].packets, 3);
        // Remove it, then add two new entries: one reuses the slot, which is zeroed first.
        sync_maps(&mut maps, &plan(&[], &[], &[]), &NoResolver).unwrap();
        let w = sync_maps(
            &mut maps,
            &plan(&["10.9.0.0/16", "10.8.0.0/16"], &[], &[]),
            &NoResolver,
        )
        .unwrap();
        assert_eq!(w.get("counter_reset"), 1);
        assert!(maps.counters.iter().all(|c| *c == Counter::default()));
    }

    #[test]
    fn full_map_fails_naming_the_entry_and_keeps_the_old_topology() {
        let mut maps = FakeMaps::new(3, 100);
        let old = plan(&["10.0.0.0/24", "10.0.1.0/24"], &[], &[]);
        sync_maps(&mut maps, &old, &NoResolver).unwrap();
        let new = plan(&["10.1.0.0/24", "10.1.1.0/24", "10.1.2.0/24"], &[], &[]);
        let err = sync_maps(&mut maps, &new, &NoResolver).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("10.1.1.0/24") && msg.contains("mesh_destination"),
            "{msg}"
        );
        assert!(msg.contains("full"), "{msg}");
        for net in old.mesh_destinations.keys() {
            assert!(
                maps.tries[&Trie::Destination].contains_key(net),
                "{net} lost"
            );
        }
    }

    #[test]
    fn exhausted_slots_still_insert_entries_without_counters() {
        let mut maps = FakeMaps::new(100, 1);
        let p = plan(&["10.0.0.0/24", "10.0.1.0/24"], &[], &[]);
        sync_maps(&mut maps, &p, &NoResolver).unwrap();
        let slots: Vec<u32> = maps.tries[&Trie::Destination]
            .values()
            .map(|v| v.counter)
            .collect();
        assert!(
            slots.contains(&NO_COUNTER) && slots.contains(&0),
            "{slots:?}"
        );
        assert!(sync_maps(&mut maps, &p, &NoResolver).unwrap().is_empty());
        let c = read_counters(&maps).unwrap();
        assert_eq!(c.entries.len(), 2);
        let owners: Vec<&str> = c.labelled(&p).map(|(_, o)| o).collect();
        assert_eq!(owners, ["10.0.0.0/24", "10.0.1.0/24"]);
    }

    #[test]
    fn host_bits_in_the_plan_are_cleared() {
        let mut maps = FakeMaps::new(100, 10);
        let p = plan(&["10.0.0.7/24"], &[], &[]);
        sync_maps(&mut maps, &p, &NoResolver).unwrap();
        assert!(maps.tries[&Trie::Destination].contains_key(&"10.0.0.0/24".parse().unwrap()));
        assert!(sync_maps(&mut maps, &p, &NoResolver).unwrap().is_empty());
    }
}
