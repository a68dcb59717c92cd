//! In-memory stand-ins for fast tests: [`FakeMaps`] (the tries, counters and config as
//! plain collections) and [`FakeDatapath`] (the [`DatapathOps`] the reconciler drives, over
//! `FakeMaps` with the same [`Tries`] as the kernel's: its record, read back every
//! [`READ_BACK_EVERY`](crate::writes::READ_BACK_EVERY) syncs).
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, MutexGuard},
};

use ipnet::IpNet;
use kilo_common::{Config, Counter, Decision, EntryValue};

use super::{
    DatapathError, DatapathOps, DatapathOpsError, DatapathStats, DatapathStatsSource, Trie,
    encode::NoResolver,
    maps::DatapathMaps,
    plans::Plans,
    reconciler::{failed, stats},
    tries::Tries,
};
use crate::{
    plan::{DatapathPlan, IpipPlan},
    writes::{Write, Writes},
};

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

/// An in-memory datapath: the real map diff ([`Tries`], with its record) over [`FakeMaps`],
/// so it writes (and counts) what the kernel's maps would; its stats source reads the record
/// and those maps, as the kernel's does. Clones share the maps.
#[derive(Debug, Clone, Default)]
pub struct FakeDatapath(Arc<Mutex<FakeShared>>);

#[derive(Debug)]
struct FakeShared {
    maps: FakeMaps,
    tries: Tries,
    /// The last plan synced (for the owner labels).
    plan: DatapathPlan,
    ipip: IpipPlan,
    /// The last [`DatapathOps::route_realm`].
    route_realm: bool,
}

impl Default for FakeShared {
    fn default() -> Self {
        FakeShared {
            maps: FakeMaps::new(kilo_common::DEFAULT_MAX_ENTRIES as usize, 1 << 12),
            tries: Tries::default(),
            plan: DatapathPlan::default(),
            ipip: IpipPlan::default(),
            route_realm: false,
        }
    }
}

impl FakeDatapath {
    fn lock(&self) -> MutexGuard<'_, FakeShared> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the maps (to inspect, or to set counters through [`FakeDatapath::set_maps`]).
    pub fn maps(&self) -> FakeMaps {
        self.lock().maps.clone()
    }

    pub fn set_maps(&self, maps: FakeMaps) {
        self.lock().maps = maps;
    }

    /// Entries in all the maps.
    pub fn len(&self) -> usize {
        self.lock().maps.tries.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the last [`DatapathOps::route_realm`] said.
    pub fn route_realm(&self) -> bool {
        self.lock().route_realm
    }
}

impl DatapathOps for FakeDatapath {
    fn apply(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
        _: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathOpsError> {
        let mut guard = self.lock();
        let shared = &mut *guard;
        let writes = shared
            .tries
            .apply(&mut shared.maps, Plans { nat: plan, ipip }, &NoResolver)
            .map_err(failed);
        if shared.plan != *plan {
            shared.plan = plan.clone();
        }
        if shared.ipip != *ipip {
            shared.ipip = ipip.clone();
        }
        writes
    }
    fn clean_up(&mut self) -> Result<Writes, DatapathOpsError> {
        let mut guard = self.lock();
        let shared = &mut *guard;
        shared.plan = DatapathPlan::default();
        shared.ipip = IpipPlan::default();
        shared
            .tries
            .apply(&mut shared.maps, &DatapathPlan::default(), &NoResolver)
            .map_err(failed)
    }
    fn route_realm(&mut self, hold: bool) -> Result<Writes, DatapathOpsError> {
        let mut shared = self.lock();
        let mut writes = Writes::default();
        if shared.route_realm != hold {
            shared.route_realm = hold;
            writes.add(Write::MapConfig, 1);
        }
        Ok(writes)
    }
    fn stats_source(&self) -> Option<Arc<dyn DatapathStatsSource>> {
        Some(Arc::new(self.clone()))
    }
}

impl DatapathStatsSource for FakeDatapath {
    fn read(&self) -> Result<DatapathStats, DatapathOpsError> {
        let shared = self.lock();
        let counters = shared.tries.counters(&shared.maps).map_err(failed)?;
        Ok(stats(
            &counters,
            Plans {
                nat: &shared.plan,
                ipip: &shared.ipip,
            },
        ))
    }
}
