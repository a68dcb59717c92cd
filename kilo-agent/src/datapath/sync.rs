//! The map diff: make the three tables equal to a [`DatapathPlan`] writing only the
//! difference, behind the [`DatapathMaps`] trait so it runs against the kernel or in memory.
//!
//! Order keeps the previous topology until the new one is in: new and changed entries are
//! written first, stale ones deleted last, so a failure part-way (a full map) leaves the maps
//! holding everything they held before plus some of the new entries. Per-entry counter slots
//! are stored in the entry values, so they survive syncs and adoption by a new agent; a slot is
//! reused only once its entry is gone, and zeroed (only if non-zero) before reuse.
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use kilo_common::{Config, Counter, Decision, EntryValue, NO_COUNTER};

use super::{DatapathError, Role, keys};
use crate::{
    plan::{DatapathEntry, DatapathPlan, Device, EntryKind},
    reconcile::Writes,
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
    fn entries(&self, role: Role) -> Result<Vec<(IpNet, EntryValue)>, DatapathError>;
    /// Every entry of the three tables, by [`Role::index`].
    fn all_entries(&self) -> Result<[Vec<(IpNet, EntryValue)>; 3], DatapathError> {
        Ok([
            self.entries(Role::Mesh)?,
            self.entries(Role::NatSource)?,
            self.entries(Role::MasqueradeDestination)?,
        ])
    }
    /// Inserts or overwrites (atomically) one entry.
    fn insert(&mut self, role: Role, net: IpNet, value: &EntryValue) -> Result<(), DatapathError>;
    fn remove(&mut self, role: Role, net: IpNet) -> Result<(), DatapathError>;
    /// Number of per-entry counter slots.
    fn counter_slots(&self) -> u32;
    /// A per-entry counter, summed over CPUs.
    fn entry_counter(&self, slot: u32) -> Result<Counter, DatapathError>;
    fn reset_entry_counter(&mut self, slot: u32) -> Result<(), DatapathError>;
    /// Per-decision counters, summed over CPUs, indexed by `Decision as usize`.
    fn decision_counters(&self) -> Result<Vec<Counter>, DatapathError>;
    fn config(&self) -> Result<Config, DatapathError>;
    fn set_config(&mut self, config: &Config) -> Result<(), DatapathError>;
    /// Writes made to auxiliary structures (the prefix-lengths index) since the last call.
    fn take_index_writes(&mut self) -> u64 {
        0
    }
    /// Writes made to the IPv4 pre-filter since the last call.
    fn take_filter_writes(&mut self) -> u64 {
        0
    }
    /// Writes made to the config's copy of the NAT sources since the last call.
    fn take_config_writes(&mut self) -> u64 {
        0
    }
    /// Defers derived structures (the IPv4 direct index) until [`DatapathMaps::commit_index`]:
    /// a batch of changes is then published at once.
    fn hold_index(&mut self) {}
    /// Checks derived structures against the entries the tables hold (`current`, by
    /// [`Role::index`]), repairing them if someone else changed the tables; returns the writes.
    fn verify_index(
        &mut self,
        current: &[Vec<(IpNet, EntryValue)>; 3],
    ) -> Result<u64, DatapathError> {
        let _ = current;
        Ok(0)
    }
    /// Publishes the deferred changes and stops deferring; returns the writes made.
    fn commit_index(&mut self) -> Result<u64, DatapathError> {
        Ok(0)
    }
}

pub(super) fn plan_role(plan: &DatapathPlan, role: Role) -> &BTreeMap<IpNet, DatapathEntry> {
    match role {
        Role::Mesh => &plan.mesh_destinations,
        Role::NatSource => &plan.nat_sources,
        Role::MasqueradeDestination => &plan.masquerade_destinations,
    }
}

/// Makes the maps equal to `plan`, writing only the difference (see the module doc).
/// Writes are counted as `map_insert`, `map_update`, `map_delete`, `counter_reset`, and for
/// derived structures `map_table` (IPv4 direct index chunks), `map_index`, `map_filter` and
/// `map_config` (the config's NAT source lists).
pub fn sync_maps<M: DatapathMaps + ?Sized>(
    maps: &mut M,
    plan: &DatapathPlan,
    resolver: &dyn Resolver,
) -> Result<Writes, DatapathError> {
    let read = maps.all_entries()?;
    let mut writes = Writes::default();
    writes.add("map_table", maps.verify_index(&read)?);
    let mut current: BTreeMap<Role, BTreeMap<IpNet, EntryValue>> = BTreeMap::new();
    let mut used = BTreeSet::new();
    for (role, read) in Role::ALL.into_iter().zip(read) {
        let entries: BTreeMap<_, _> = read.into_iter().collect();
        used.extend(
            entries
                .values()
                .map(|v| v.counter)
                .filter(|&c| c != NO_COUNTER),
        );
        current.insert(role, entries);
    }
    let slots = maps.counter_slots();
    let mut free = (0..slots).filter(move |s| !used.contains(s));

    batched(maps, &mut writes, |maps, writes| {
        upsert(maps, plan, resolver, &current, &mut free, writes)
    })?;
    batched(maps, &mut writes, |maps, writes| {
        delete_stale(maps, plan, &current, writes)
    })?;
    take_derived_writes(maps, &mut writes);
    Ok(writes)
}

/// Adds the writes the maps made to derived structures since the last call.
fn take_derived_writes<M: DatapathMaps + ?Sized>(maps: &mut M, writes: &mut Writes) {
    writes.add("map_index", maps.take_index_writes());
    writes.add("map_filter", maps.take_filter_writes());
    writes.add("map_config", maps.take_config_writes());
}

/// Runs `step` with the derived structures held, then publishes what it changed, even after a
/// failure part-way (what went in must be findable).
fn batched<M: DatapathMaps + ?Sized>(
    maps: &mut M,
    writes: &mut Writes,
    step: impl FnOnce(&mut M, &mut Writes) -> Result<(), DatapathError>,
) -> Result<(), DatapathError> {
    maps.hold_index();
    let done = step(maps, writes);
    let committed = maps.commit_index();
    done?;
    writes.add("map_table", committed?);
    Ok(())
}

/// Writes the new and changed entries of `plan`.
fn upsert<M: DatapathMaps + ?Sized>(
    maps: &mut M,
    plan: &DatapathPlan,
    resolver: &dyn Resolver,
    current: &BTreeMap<Role, BTreeMap<IpNet, EntryValue>>,
    free: &mut impl Iterator<Item = u32>,
    writes: &mut Writes,
) -> Result<(), DatapathError> {
    let slots = maps.counter_slots();
    let mut warned_slots = false;
    for role in Role::ALL {
        let have = &current[&role];
        for (net, entry) in plan_role(plan, role) {
            let net = net.trunc();
            let old = have.get(&net);
            let (counter, fresh) = match old.map(|v| v.counter) {
                Some(c) if c != NO_COUNTER && c < slots => (c, false),
                _ => match free.next() {
                    Some(c) => (c, true),
                    None => {
                        if !warned_slots {
                            tracing::warn!(
                                slots,
                                "datapath: per-entry counter slots exhausted; new entries are not counted"
                            );
                            warned_slots = true;
                        }
                        (NO_COUNTER, false)
                    }
                },
            };
            let value = keys::entry_value(entry, counter, resolver);
            if old == Some(&value) {
                continue;
            }
            let wrap = |source| DatapathError::Entry {
                role,
                net,
                owner: entry.owner.clone(),
                source: Box::new(source),
            };
            if fresh && maps.entry_counter(counter).map_err(wrap)? != Counter::default() {
                maps.reset_entry_counter(counter).map_err(wrap)?;
                writes.add("counter_reset", 1);
            }
            let inserted = maps.insert(role, net, &value);
            take_derived_writes(maps, writes);
            inserted.map_err(wrap)?;
            writes.add(
                if old.is_some() {
                    "map_update"
                } else {
                    "map_insert"
                },
                1,
            );
        }
    }
    Ok(())
}

/// Deletes the entries `plan` no longer has.
fn delete_stale<M: DatapathMaps + ?Sized>(
    maps: &mut M,
    plan: &DatapathPlan,
    current: &BTreeMap<Role, BTreeMap<IpNet, EntryValue>>,
    writes: &mut Writes,
) -> Result<(), DatapathError> {
    for role in Role::ALL {
        let want = plan_role(plan, role);
        let want: BTreeSet<IpNet> = want.keys().map(IpNet::trunc).collect();
        for net in current[&role].keys() {
            if !want.contains(net) {
                maps.remove(role, *net)
                    .map_err(|source| DatapathError::Stale {
                        role,
                        net: *net,
                        source: Box::new(source),
                    })?;
                writes.add("map_delete", 1);
            }
        }
    }
    Ok(())
}

/// Traffic counters: per decision and per map entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub decisions: BTreeMap<Decision, Counter>,
    pub entries: Vec<EntryCounter>,
}

impl Counters {
    pub fn decision(&self, d: Decision) -> Counter {
        self.decisions.get(&d).copied().unwrap_or_default()
    }

    /// Every entry's counter with the owner and kind the plan gives it (entries the plan does
    /// not know, e.g. left over from an adopted topology, get the owner "").
    pub fn labelled<'a>(
        &'a self,
        plan: &'a DatapathPlan,
    ) -> impl Iterator<Item = (&'a EntryCounter, &'a str)> + 'a {
        self.entries.iter().map(move |e| {
            let owner = plan_role(plan, e.role)
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

/// Reads every counter (sums over CPUs).
pub fn read_counters<M: DatapathMaps + ?Sized>(maps: &M) -> Result<Counters, DatapathError> {
    let mut out = Counters::default();
    let decisions = maps.decision_counters()?;
    for d in Decision::ALL {
        out.decisions
            .insert(d, decisions.get(d as usize).copied().unwrap_or_default());
    }
    for role in Role::ALL {
        for (net, value) in maps.entries(role)? {
            let counter = if value.counter == NO_COUNTER {
                Counter::default()
            } else {
                maps.entry_counter(value.counter)?
            };
            out.entries.push(EntryCounter {
                role,
                net,
                kind: keys::kind_from_code(value.kind),
                counter,
            });
        }
    }
    Ok(out)
}

/// In-memory maps for fast tests of the diff, with a per-trie capacity like the kernel's.
#[derive(Debug, Clone)]
pub struct FakeMaps {
    pub tries: BTreeMap<Role, BTreeMap<IpNet, EntryValue>>,
    pub capacity: usize,
    pub counters: Vec<Counter>,
    pub decisions: Vec<Counter>,
    pub config: Config,
}

impl FakeMaps {
    pub fn new(capacity: usize, counter_slots: u32) -> Self {
        FakeMaps {
            tries: Role::ALL.iter().map(|r| (*r, BTreeMap::new())).collect(),
            capacity,
            counters: vec![Counter::default(); counter_slots as usize],
            decisions: vec![Counter::default(); Decision::COUNT as usize],
            config: Config::DEFAULT,
        }
    }
}

impl DatapathMaps for FakeMaps {
    fn entries(&self, role: Role) -> Result<Vec<(IpNet, EntryValue)>, DatapathError> {
        Ok(self.tries[&role].iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn insert(&mut self, role: Role, net: IpNet, value: &EntryValue) -> Result<(), DatapathError> {
        let trie = self.tries.get_mut(&role).expect("all roles");
        if !trie.contains_key(&net) && trie.len() >= self.capacity {
            return Err(DatapathError::Full {
                name: role.map_name(),
                capacity: self.capacity,
            });
        }
        trie.insert(net, *value);
        Ok(())
    }

    fn remove(&mut self, role: Role, net: IpNet) -> Result<(), DatapathError> {
        self.tries.get_mut(&role).expect("all roles").remove(&net);
        Ok(())
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

    fn slot(maps: &FakeMaps, role: Role, net: &str) -> u32 {
        maps.tries[&role][&net.parse::<IpNet>().unwrap()].counter
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
        let keep = slot(&maps, Role::Mesh, "10.0.2.0/24");
        let p2 = plan(&["10.0.2.0/24", "10.0.3.0/24"], &[], &[]);
        let w = sync_maps(&mut maps, &p2, &NoResolver).unwrap();
        assert_eq!(
            (w.get("map_insert"), w.get("map_delete"), w.total()),
            (1, 1, 2)
        );
        assert_eq!(slot(&maps, Role::Mesh, "10.0.2.0/24"), keep);
        // The new entry did not take the slot of the one deleted in the same sync.
        assert_ne!(slot(&maps, Role::Mesh, "10.0.3.0/24"), keep);
    }

    #[test]
    fn changed_value_is_an_update_and_reused_slots_are_zeroed() {
        let mut maps = FakeMaps::new(100, 2);
        let p1 = plan(&["10.0.0.0/24"], &[], &[]);
        sync_maps(&mut maps, &p1, &NoResolver).unwrap();
        let s = slot(&maps, Role::Mesh, "10.0.0.0/24") as usize;
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
            assert!(maps.tries[&Role::Mesh].contains_key(net), "{net} lost");
        }
    }

    #[test]
    fn exhausted_slots_still_insert_entries_without_counters() {
        let mut maps = FakeMaps::new(100, 1);
        let p = plan(&["10.0.0.0/24", "10.0.1.0/24"], &[], &[]);
        sync_maps(&mut maps, &p, &NoResolver).unwrap();
        let slots: Vec<u32> = maps.tries[&Role::Mesh]
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
        assert!(maps.tries[&Role::Mesh].contains_key(&"10.0.0.0/24".parse().unwrap()));
        assert!(sync_maps(&mut maps, &p, &NoResolver).unwrap().is_empty());
    }
}
