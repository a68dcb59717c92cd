//! The program's maps as the diff sees them ([`DatapathMaps`]), and the kernel's
//! ([`KernelMaps`]): the tries (read back with one batch lookup per 1,024 entries), the config
//! array and the counters ([`CounterArray`]: the `KILO_COUNTERS` array mapped into memory, each
//! CPU's region summed per slot, so reading a counter is a few memory reads, not a system call,
//! and recycling an entry's slot zeroes it in place). The in-memory ones for tests are in
//! `fake.rs`.
use std::os::fd::AsFd as _;

use aya::{
    Ebpf,
    maps::{
        Array, IterableMap as _, Map, MapData, MapError,
        lpm_trie::{Key, LpmTrie},
    },
};
use ipnet::IpNet;
use kilo_common::{
    Config, Counter, DECISION_SLOTS, Decision, EntryValue, LpmData, MAP_CONFIG, MAP_COUNTERS,
    counter_stride,
};

use super::{DatapathConfig, DatapathError, Trie, encode};
use crate::sys::{bpf, mmap::Mapped};

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

type TrieMap = LpmTrie<MapData, LpmData, EntryValue>;

/// The program's maps, opened from the loaded object: the tries, the config and the counters.
pub struct KernelMaps {
    /// In [`Trie::ALL`]'s order.
    tries: [TrieMap; 5],
    config: Array<MapData, Config>,
    counters: CounterArray,
    capacity: usize,
}

impl KernelMaps {
    pub(super) fn take(ebpf: &mut Ebpf, config: &DatapathConfig) -> Result<Self, DatapathError> {
        fn take<T: TryFrom<aya::maps::Map, Error = MapError>>(
            ebpf: &mut Ebpf,
            name: &'static str,
        ) -> Result<T, DatapathError> {
            let map = ebpf
                .take_map(name)
                .ok_or_else(|| DatapathError::Config(format!("object has no map {name}")))?;
            T::try_from(map).map_err(|e| DatapathError::map(name, e))
        }
        let [a, b, c, d, e] = Trie::ALL.map(|t| take(ebpf, t.map_name()));
        Ok(KernelMaps {
            tries: [a?, b?, c?, d?, e?],
            config: take(ebpf, MAP_CONFIG)?,
            counters: CounterArray::new(
                ebpf.take_map(MAP_COUNTERS),
                counter_stride(config.counter_slots),
            )?,
            capacity: config.max_entries as usize,
        })
    }
}

fn errno(e: &MapError) -> Option<i32> {
    match e {
        MapError::SyscallError(s) => s.io_error.raw_os_error(),
        _ => None,
    }
}

impl DatapathMaps for KernelMaps {
    fn entries(&self, trie: Trie) -> Result<Vec<(IpNet, EntryValue)>, DatapathError> {
        let name = trie.map_name();
        let trie = &self.tries[trie as usize];
        let items = match bpf::lookup_batch::<Key<LpmData>, EntryValue>(trie.map().fd().as_fd()) {
            Ok(items) => items,
            // Kernels without batch lookups on LPM tries: two system calls per entry.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::EOPNOTSUPP | 524)
                ) =>
            {
                let mut items = Vec::new();
                for item in trie.iter() {
                    match item {
                        Ok(kv) => items.push(kv),
                        // Deleted between get_next_key and lookup: skip.
                        Err(MapError::KeyNotFound) => {}
                        Err(e) => return Err(DatapathError::map(name, e)),
                    }
                }
                items
            }
            Err(io_error) => {
                let call = "bpf_map_lookup_batch";
                let e = MapError::SyscallError(aya::sys::SyscallError { call, io_error });
                return Err(DatapathError::map(name, e));
            }
        };
        items
            .into_iter()
            .map(|(key, value)| {
                let net = encode::net_from_key(&key).ok_or(DatapathError::BadKey {
                    name,
                    prefix_len: key.prefix_len(),
                    family: key.data().family,
                })?;
                Ok((net, value))
            })
            .collect()
    }

    fn insert(&mut self, trie: Trie, net: IpNet, value: &EntryValue) -> Result<(), DatapathError> {
        let capacity = self.capacity;
        let name = trie.map_name();
        self.tries[trie as usize]
            .insert(&encode::entry_key(&net), value, 0)
            .map_err(|e| match errno(&e) {
                Some(libc::ENOSPC) | Some(libc::E2BIG) | Some(libc::ENOMEM) => {
                    DatapathError::Full { name, capacity }
                }
                _ => DatapathError::map(name, e),
            })
    }

    fn remove(&mut self, trie: Trie, net: IpNet) -> Result<(), DatapathError> {
        let name = trie.map_name();
        match self.tries[trie as usize].remove(&encode::entry_key(&net)) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) if errno(&e) == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(DatapathError::map(name, e)),
        }
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn counter_slots(&self) -> u32 {
        self.counters.entry_slots()
    }

    fn entry_counter(&self, slot: u32) -> Result<Counter, DatapathError> {
        self.counters.entry(slot)
    }

    fn reset_entry_counter(&mut self, slot: u32) -> Result<(), DatapathError> {
        self.counters.reset_entry(slot)
    }

    fn decision_counters(&self) -> Result<Vec<Counter>, DatapathError> {
        Ok(self.counters.decisions())
    }

    fn config(&self) -> Result<Config, DatapathError> {
        self.config
            .get(&0, 0)
            .map_err(|e| DatapathError::map(MAP_CONFIG, e))
    }

    fn set_config(&mut self, config: &Config) -> Result<(), DatapathError> {
        self.config
            .set(0, config, 0)
            .map_err(|e| DatapathError::map(MAP_CONFIG, e))
    }
}

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
