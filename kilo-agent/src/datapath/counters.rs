//! The program's counters as userspace sees them: an mmap of the `KILO_COUNTERS` array (see
//! kilo-common's `MAP_COUNTERS`), each CPU's region summed per slot. Reading a counter is a
//! few memory reads, not a system call; recycling an entry's slot zeroes it in place.
use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    ptr,
};

use aya::maps::{Map, MapData};
use kilo_common::{Counter, DECISION_SLOTS, Decision, MAP_COUNTERS};
use memmap2::{MmapOptions, MmapRaw};

use super::DatapathError;

/// The counters array, mapped.
pub struct CounterArray {
    /// Keeps the map (and so the mapping's object) alive.
    _map: MapData,
    mem: MmapRaw,
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
        let mem = MmapOptions::new()
            .len(entries * size_of::<Counter>())
            .map_raw(map.fd().as_fd().as_raw_fd())
            .map_err(|e| error(format!("mmap: {e}")))?;
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

    /// A slot's pointer on each CPU (`index` within a region).
    fn each_cpu(&self, index: usize) -> impl Iterator<Item = *mut Counter> + '_ {
        let base = self.mem.as_mut_ptr().cast::<Counter>();
        // SAFETY: index < stride and cpu < cpus, so inside the mapping of cpus * stride.
        (0..self.cpus).map(move |cpu| unsafe { base.add(cpu * self.stride + index) })
    }

    fn sum(&self, index: usize) -> Counter {
        self.each_cpu(index).fold(Counter::default(), |a, p| {
            // SAFETY: inside the mapping, aligned; the program updates these words in place
            // (a torn read of one counter is impossible for aligned u64s on 64-bit targets).
            let c = unsafe { ptr::read_volatile(p) };
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
        for p in self.each_cpu(self.entry_index(slot)?) {
            // SAFETY: inside the mapping, aligned, mapped writable.
            unsafe { ptr::write_volatile(p, Counter::default()) };
        }
        Ok(())
    }

    /// The decision counters, summed over the CPUs, in [`Decision`] order.
    pub fn decisions(&self) -> Vec<Counter> {
        (0..Decision::COUNT as usize).map(|d| self.sum(d)).collect()
    }
}
