//! The IPv4 direct index (pure): every role's longest-prefix match for every IPv4 address as
//! three levels of 256-slot chunks the program walks with plain array reads (layout and slot
//! encoding in kilo-common). Leaf-pushed: a leaf slot holds each role's match for the whole
//! range it covers, so a lookup never backtracks.
//!
//! [`DirectIndex`] keeps the IPv4 entries and a mirror of what the kernel holds, and turns
//! entry changes into chunk writes ([`DirectIndex::plan`]), ordered so that a packet always
//! sees a complete answer, old or new: children are written before the parents that point to
//! them, and a chunk is reused only once nothing in the mirror points to it. The two lower
//! levels draw from fixed pools; a region that needs a chunk when its pool is empty gets a
//! fallback leaf, which sends the program to the hash tables there (slower, still exact), and
//! is retried at the next plan that finds chunks free. A disabled index ([`DirectIndex::disabled`]) is all fallback.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use ipnet::Ipv4Net;
use kilo_common::{
    Chunk, ENTRY_REDIRECT, ENTRY_SERVICE, EntryValue, FIELD_BITS, FIELD_FALLBACK, NO_COUNTER,
    SLOT_FALLBACK, SLOT_POINTER,
};

/// A level of the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// 256 chunks, one per first octet; slots cover /16s.
    Root,
    /// Slots cover /24s.
    L2,
    /// Slots are single addresses.
    L3,
}

/// One chunk to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkWrite {
    pub level: Level,
    pub index: u32,
    pub chunk: Box<Chunk>,
}

/// The field of an entry of `role` (0 mesh, 1 NAT sources, 2 masquerade destinations): its
/// per-entry counter slot + 1, or FIELD_FALLBACK (look it up in the hash table) for an entry
/// without a slot and, with the fast path on, for a mesh entry it may redirect (its egress is in
/// the hash table's value), so that no other hit needs the program to read its config.
pub fn field(role: usize, value: &EntryValue, fast_path: bool) -> u32 {
    let redirects = role == 0
        && fast_path
        && value.flags & ENTRY_REDIRECT != 0
        && value.flags & ENTRY_SERVICE == 0;
    if redirects || value.counter == NO_COUNTER || value.counter >= FIELD_FALLBACK - 1 {
        FIELD_FALLBACK
    } else {
        value.counter + 1
    }
}

fn pointer(index: u32) -> u64 {
    SLOT_POINTER | u64::from(index)
}

fn target(slot: u64) -> Option<u32> {
    (slot & SLOT_POINTER != 0).then_some(slot as u32)
}

fn mask(addr: u32, len: u8) -> u32 {
    addr & u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0)
}

/// What one plan draws from and writes: the free pool chunks (L2, L3; popped lowest first)
/// and the planned pool chunk writes.
struct Pools {
    free: (Vec<u32>, Vec<u32>),
    l2: Vec<ChunkWrite>,
    l3: Vec<ChunkWrite>,
}

/// See the module doc.
#[derive(Debug, Clone)]
pub struct DirectIndex {
    /// Per role: (network address, prefix length) -> role field.
    entries: [HashMap<(u32, u8), u32>; 3],
    /// Per role: number of entries per prefix length.
    lengths: [BTreeMap<u8, usize>; 3],
    /// Entries (any role) longer than /16, per /16; longer than /24, per /24.
    deep16: HashMap<u32, usize>,
    deep24: HashMap<u32, usize>,
    /// What the kernel holds: all 256 root chunks, and the pool chunks written or read back.
    root: Vec<Chunk>,
    l2: HashMap<u32, Box<Chunk>>,
    l3: HashMap<u32, Box<Chunk>>,
    l2_capacity: u32,
    l3_capacity: u32,
    /// /16s to recompute at the next plan.
    dirty: BTreeSet<u32>,
    /// /16s (of an enabled index) holding a fallback leaf: retried when chunks are free.
    stuck: BTreeSet<u32>,
    enabled: bool,
}

impl DirectIndex {
    /// An index over empty (all-zero) kernel maps with pools of the given sizes.
    pub fn new(l2_capacity: u32, l3_capacity: u32) -> Self {
        DirectIndex {
            entries: Default::default(),
            lengths: Default::default(),
            deep16: HashMap::new(),
            deep24: HashMap::new(),
            root: vec![Chunk::EMPTY; 256],
            l2: HashMap::new(),
            l3: HashMap::new(),
            l2_capacity,
            l3_capacity,
            dirty: BTreeSet::new(),
            stuck: BTreeSet::new(),
            enabled: true,
        }
    }

    /// An index that sends every IPv4 lookup to the hash tables.
    pub fn disabled() -> Self {
        DirectIndex {
            enabled: false,
            dirty: (0..1 << 16).collect(),
            ..DirectIndex::new(0, 0)
        }
    }

    /// A new index of the same kind (pool sizes, enabled or not), over empty maps.
    pub fn fresh(&self) -> Self {
        if self.enabled {
            DirectIndex::new(self.l2_capacity, self.l3_capacity)
        } else {
            DirectIndex::disabled()
        }
    }

    /// Takes what the kernel holds (adoption): the 256 root chunks and a reader of pool chunks,
    /// called for every chunk a root or L2 slot points to. Every /16 with a non-zero root slot
    /// is rechecked at the next plan.
    pub fn adopt<E>(
        &mut self,
        root: Vec<Chunk>,
        mut read: impl FnMut(Level, u32) -> Result<Chunk, E>,
    ) -> Result<(), E> {
        assert_eq!(root.len(), 256, "256 root chunks");
        self.root = root;
        self.l2.clear();
        self.l3.clear();
        for (a0, chunk) in self.root.iter().enumerate() {
            for (a1, slot) in chunk.slots.iter().enumerate() {
                if *slot != 0 || !self.enabled {
                    self.dirty.insert(((a0 as u32) << 8) | a1 as u32);
                }
                if let Some(c2) = target(*slot).filter(|c| *c < self.l2_capacity) {
                    let l2 = read(Level::L2, c2)?;
                    for s in l2.slots {
                        if let Some(c3) = target(s).filter(|c| *c < self.l3_capacity) {
                            self.l3.insert(c3, Box::new(read(Level::L3, c3)?));
                        }
                    }
                    self.l2.insert(c2, Box::new(l2));
                }
            }
        }
        Ok(())
    }

    /// Sets (`Some(field)`) or removes (`None`) the entry of `role` (0 mesh, 1 NAT sources, 2
    /// masquerade destinations) for `net`.
    pub fn set(&mut self, role: usize, net: Ipv4Net, value: Option<u32>) {
        let len = net.prefix_len();
        let addr = mask(u32::from(net.network()), len);
        let key = (addr, len);
        let old = self.entries[role].get(&key).copied();
        let delta: isize = match (old, value) {
            (None, Some(f)) => {
                self.entries[role].insert(key, f);
                1
            }
            (Some(o), Some(f)) if o != f => {
                self.entries[role].insert(key, f);
                0
            }
            (Some(_), None) => {
                self.entries[role].remove(&key);
                -1
            }
            _ => return,
        };
        if delta != 0 {
            let bump = |m: &mut BTreeMap<u8, usize>| {
                let n = m.entry(len).or_default();
                *n = n.saturating_add_signed(delta);
                if *n == 0 {
                    m.remove(&len);
                }
            };
            bump(&mut self.lengths[role]);
            let bump = |m: &mut HashMap<u32, usize>, k| {
                let n = m.entry(k).or_default();
                *n = n.saturating_add_signed(delta);
                if *n == 0 {
                    m.remove(&k);
                }
            };
            if len > 16 {
                bump(&mut self.deep16, addr >> 16);
            }
            if len > 24 {
                bump(&mut self.deep24, addr >> 8);
            }
        }
        let last = addr | !mask(u32::MAX, len);
        self.dirty.extend((addr >> 16)..=(last >> 16));
    }

    /// Whether the index holds exactly these entries (network, field) of `role`.
    pub fn holds(&self, role: usize, entries: impl IntoIterator<Item = (Ipv4Net, u32)>) -> bool {
        let mut n = 0;
        for (net, f) in entries {
            n += 1;
            let len = net.prefix_len();
            let key = (mask(u32::from(net.network()), len), len);
            if self.entries[role].get(&key) != Some(&f) {
                return false;
            }
        }
        n == self.entries[role].len()
    }

    /// The leaf for the range at `addr` of prefix length `max` (no entry there is longer).
    fn leaf(&self, addr: u32, max: u8) -> u64 {
        let mut out = 0u64;
        for role in 0..3 {
            for len in self.lengths[role].range(..=max).rev().map(|(l, _)| *l) {
                if let Some(f) = self.entries[role].get(&(mask(addr, len), len)) {
                    out |= u64::from(*f) << (FIELD_BITS * role as u32);
                    break;
                }
            }
        }
        out
    }

    /// Pool chunks nothing in the mirror points to.
    fn free(&self) -> (Vec<u32>, Vec<u32>) {
        let used2: BTreeSet<u32> = self
            .root
            .iter()
            .flat_map(|c| c.slots.iter().filter_map(|s| target(*s)))
            .collect();
        let used3: BTreeSet<u32> = used2
            .iter()
            .filter_map(|c| self.l2.get(c))
            .flat_map(|c| c.slots.iter().filter_map(|s| target(*s)))
            .collect();
        // Popped from the end: lowest indices first.
        let free =
            |cap: u32, used: &BTreeSet<u32>| (0..cap).rev().filter(|c| !used.contains(c)).collect();
        (
            free(self.l2_capacity, &used2),
            free(self.l3_capacity, &used3),
        )
    }

    /// The chunk writes that make the kernel hold the current entries: L3 chunks, then L2,
    /// then root. Apply them in order, calling [`DirectIndex::applied`] after each; then
    /// [`DirectIndex::done`]. Empty when nothing changed.
    pub fn plan(&mut self) -> Vec<ChunkWrite> {
        if self.dirty.is_empty() && self.stuck.is_empty() {
            return Vec::new();
        }
        let mut pools = Pools {
            free: self.free(),
            l2: Vec::new(),
            l3: Vec::new(),
        };
        // Regions left on a fallback leaf get another chance when chunks are free.
        if !pools.free.0.is_empty() || !pools.free.1.is_empty() {
            self.dirty.extend(self.stuck.iter().copied());
        }
        let mut root: BTreeMap<u32, Chunk> = BTreeMap::new();
        let mut stuck = BTreeSet::new();
        for &h in &self.dirty {
            let (a0, a1) = (h >> 8, (h & 0xff) as usize);
            let old = self.root[a0 as usize].slots[a1];
            let (new, fallback) = self.region16(h, old, &mut pools);
            if fallback && self.enabled {
                stuck.insert(h);
            }
            if new != old {
                root.entry(a0)
                    .or_insert_with(|| self.root[a0 as usize])
                    .slots[a1] = new;
            }
        }
        for h in &self.dirty {
            self.stuck.remove(h);
        }
        self.stuck.extend(stuck);
        let root = root.into_iter().map(|(index, chunk)| ChunkWrite {
            level: Level::Root,
            index,
            chunk: Box::new(chunk),
        });
        pools.l3.into_iter().chain(pools.l2).chain(root).collect()
    }

    /// The root slot of /16 `h` (currently `old`), planning the chunks below it; and whether
    /// a fallback leaf is in it.
    fn region16(&self, h: u32, old: u64, pools: &mut Pools) -> (u64, bool) {
        if !self.enabled {
            return (SLOT_FALLBACK, true);
        }
        if !self.deep16.contains_key(&h) {
            return (self.leaf(h << 16, 16), false);
        }
        let Some(c2) = target(old).or_else(|| pools.free.0.pop()) else {
            return (SLOT_FALLBACK, true);
        };
        let old2 = target(old).and_then(|_| self.l2.get(&c2));
        let mut chunk = Chunk::EMPTY;
        for (b, slot) in chunk.slots.iter_mut().enumerate() {
            let s24 = (h << 8) | b as u32;
            *slot = if self.deep24.contains_key(&s24) {
                self.region24(s24, old2.and_then(|c| target(c.slots[b])), pools)
            } else {
                self.leaf(s24 << 8, 24)
            };
        }
        let fallback = chunk.slots.contains(&SLOT_FALLBACK);
        if old2.is_none_or(|c| **c != chunk) {
            pools.l2.push(ChunkWrite {
                level: Level::L2,
                index: c2,
                chunk: Box::new(chunk),
            });
        }
        (pointer(c2), fallback)
    }

    /// The L2 slot of /24 `s24`, which holds longer prefixes (its L3 chunk was `was`), planning
    /// its L3 chunk.
    fn region24(&self, s24: u32, was: Option<u32>, pools: &mut Pools) -> u64 {
        let Some(c3) = was.or_else(|| pools.free.1.pop()) else {
            return SLOT_FALLBACK;
        };
        let mut leaves = Chunk::EMPTY;
        for (d, s) in leaves.slots.iter_mut().enumerate() {
            *s = self.leaf((s24 << 8) | d as u32, 32);
        }
        let known = was.and_then(|_| self.l3.get(&c3));
        if known.is_none_or(|c| **c != leaves) {
            pools.l3.push(ChunkWrite {
                level: Level::L3,
                index: c3,
                chunk: Box::new(leaves),
            });
        }
        pointer(c3)
    }

    /// Records a write the kernel accepted.
    pub fn applied(&mut self, write: &ChunkWrite) {
        match write.level {
            Level::Root => self.root[write.index as usize] = *write.chunk,
            Level::L2 => {
                self.l2.insert(write.index, write.chunk.clone());
            }
            Level::L3 => {
                self.l3.insert(write.index, write.chunk.clone());
            }
        }
    }

    /// Marks the planned writes all applied (after a failure, keep the regions dirty instead).
    pub fn done(&mut self) {
        self.dirty.clear();
    }

    /// The leaf the program would reach for `addr`, walking the mirror.
    #[cfg(test)]
    pub fn lookup(&self, addr: u32) -> u64 {
        let [a0, a1, a2, a3] = addr.to_be_bytes();
        let mut slot = self.root[a0 as usize].slots[a1 as usize];
        for (pool, octet) in [(&self.l2, a2), (&self.l3, a3)] {
            match target(slot) {
                None => return slot,
                Some(c) => match pool.get(&c) {
                    Some(chunk) => slot = chunk.slots[octet as usize],
                    None => return SLOT_FALLBACK,
                },
            }
        }
        if target(slot).is_some() {
            SLOT_FALLBACK
        } else {
            slot
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kilo_common::slot_field;
    use proptest::prelude::*;

    /// The longest match of `role` by brute force: its field, or 0.
    fn reference(entries: &[(usize, Ipv4Net, u32)], role: usize, addr: u32) -> u32 {
        entries
            .iter()
            .filter(|(r, n, _)| *r == role && n.contains(&std::net::Ipv4Addr::from(addr)))
            .max_by_key(|(_, n, _)| n.prefix_len())
            .map(|(_, _, f)| *f)
            .unwrap_or(0)
    }

    fn apply(index: &mut DirectIndex) -> Vec<ChunkWrite> {
        let writes = index.plan();
        for w in &writes {
            index.applied(w);
        }
        index.done();
        writes
    }

    /// Every role's field for `addr` is the brute-force answer (or a fallback).
    fn check(index: &DirectIndex, entries: &[(usize, Ipv4Net, u32)], addr: u32) {
        let leaf = index.lookup(addr);
        for role in 0..3 {
            let got = slot_field(leaf, role as u32);
            if got != FIELD_FALLBACK {
                assert_eq!(
                    got,
                    reference(entries, role, addr),
                    "role {role} at {}",
                    std::net::Ipv4Addr::from(addr)
                );
            }
        }
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn longest_match_per_role_at_every_level() {
        let entries = vec![
            (0, net("10.0.0.0/8"), 1),
            (0, net("10.1.0.0/16"), 2),
            (0, net("10.1.2.0/24"), 3),
            (0, net("10.1.2.128/25"), 4),
            (0, net("10.1.2.7/32"), 5),
            (1, net("10.1.2.0/23"), 6),
            (2, net("0.0.0.0/0"), 7),
        ];
        let mut index = DirectIndex::new(4, 4);
        for (r, n, f) in &entries {
            index.set(*r, *n, Some(*f));
        }
        let writes = apply(&mut index);
        // One L3 chunk (10.1.2.0/24), one L2 chunk (10.1.0.0/16), every root chunk (/0).
        let count = |l| writes.iter().filter(|w| w.level == l).count();
        assert_eq!(
            (count(Level::L3), count(Level::L2), count(Level::Root)),
            (1, 1, 256)
        );
        for a in [
            "10.1.2.7",
            "10.1.2.8",
            "10.1.2.200",
            "10.1.3.1",
            "10.1.4.1",
            "10.2.0.1",
            "11.0.0.1",
            "0.0.0.0",
            "255.255.255.255",
        ] {
            check(
                &index,
                &entries,
                u32::from(a.parse::<std::net::Ipv4Addr>().unwrap()),
            );
        }
        assert!(index.plan().is_empty(), "nothing changed: nothing to write");
    }

    #[test]
    fn one_change_is_one_chunk_and_freed_chunks_are_reused_later() {
        let mut index = DirectIndex::new(2, 2);
        index.set(0, net("10.0.1.0/24"), Some(1));
        apply(&mut index);
        // A /24 into the same /16: one L2 chunk rewrite.
        index.set(0, net("10.0.2.0/24"), Some(2));
        let w = apply(&mut index);
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].level, Level::L2);
        // A /32 inside: a new L3 chunk, then the L2 chunk pointing to it.
        index.set(0, net("10.0.2.9/32"), Some(3));
        let w = apply(&mut index);
        assert_eq!(
            w.iter().map(|w| w.level).collect::<Vec<_>>(),
            [Level::L3, Level::L2]
        );
        // Removing both deep entries frees both chunks with one root write.
        index.set(0, net("10.0.2.9/32"), None);
        index.set(0, net("10.0.1.0/24"), None);
        index.set(0, net("10.0.2.0/24"), None);
        let w = apply(&mut index);
        assert_eq!(w.iter().map(|w| w.level).collect::<Vec<_>>(), [Level::Root]);
        assert_eq!(index.lookup(u32::from_be_bytes([10, 0, 2, 9])), 0);
        assert_eq!(index.free(), (vec![1, 0], vec![1, 0]));
    }

    #[test]
    fn an_empty_pool_falls_back_and_recovers() {
        let mut index = DirectIndex::new(1, 0);
        let entries = vec![
            (0, net("10.0.1.0/24"), 1),
            (1, net("10.9.0.0/16"), 2),
            (2, net("10.9.1.5/32"), 3),
        ];
        for (r, n, f) in &entries {
            index.set(*r, *n, Some(*f));
        }
        apply(&mut index);
        // 10.0/16 took the only L2 chunk; 10.9/16 (which needs one for its /32) falls back.
        assert_eq!(
            index.lookup(u32::from_be_bytes([10, 9, 1, 1])),
            SLOT_FALLBACK
        );
        assert_eq!(
            slot_field(index.lookup(u32::from_be_bytes([10, 0, 1, 1])), 0),
            1
        );
        // The first /16 empties: the fallback region takes its chunk at the next plan.
        index.set(0, net("10.0.1.0/24"), None);
        apply(&mut index);
        apply(&mut index);
        assert_eq!(
            slot_field(index.lookup(u32::from_be_bytes([10, 9, 2, 1])), 1),
            2
        );
        // Its /24 with the /32 still needs an L3 chunk (a pool of none): that /24 falls back.
        assert_eq!(
            index.lookup(u32::from_be_bytes([10, 9, 1, 5])),
            SLOT_FALLBACK
        );
    }

    #[test]
    fn a_disabled_index_is_all_fallback() {
        let mut index = DirectIndex::disabled();
        index.set(0, net("10.0.1.0/24"), Some(1));
        index.set(0, net("10.0.1.1/32"), Some(2));
        assert_eq!(apply(&mut index).len(), 256);
        for a in [0, u32::from_be_bytes([10, 0, 1, 1]), u32::MAX] {
            assert_eq!(index.lookup(a), SLOT_FALLBACK);
        }
        index.set(0, net("10.0.1.1/32"), None);
        assert!(apply(&mut index).is_empty());
    }

    #[test]
    fn adoption_of_a_consistent_kernel_writes_nothing() {
        let entries = [
            (0, "10.0.1.0/24"),
            (1, "10.0.1.3/32"),
            (2, "192.168.0.0/16"),
        ];
        let fill = |index: &mut DirectIndex| {
            for (r, n) in entries {
                index.set(r, net(n), Some(r as u32 + 1));
            }
        };
        let mut index = DirectIndex::new(8, 8);
        fill(&mut index);
        apply(&mut index);
        // A new index over what `index` wrote, with `root` as the kernel's root chunks.
        let adopted = |root: Vec<Chunk>| {
            let mut again = DirectIndex::new(8, 8);
            again
                .adopt(root, |level, i| {
                    let pool = if level == Level::L2 {
                        &index.l2
                    } else {
                        &index.l3
                    };
                    Ok::<_, ()>(*pool[&i])
                })
                .unwrap();
            fill(&mut again);
            again
        };
        assert!(adopted(index.root.clone()).plan().is_empty());
        // A stale slot in the adopted root (no entry behind it) is cleared.
        let mut stale = index.root.clone();
        stale[172].slots[16] = 5;
        let w = adopted(stale).plan();
        assert_eq!(w.len(), 1);
        assert_eq!(
            (w[0].level, w[0].index, w[0].chunk.slots[16]),
            (Level::Root, 172, 0)
        );
    }

    fn arb_entry() -> impl Strategy<Value = (usize, Ipv4Net, u32)> {
        // Addresses from a small space so that entries nest and collide.
        (
            0..3usize,
            0..4u32,
            0..64u32,
            0..8u32,
            prop::sample::select(vec![8u8, 15, 16, 20, 24, 25, 30, 32]),
            1..100u32,
        )
            .prop_map(|(r, a, b, c, len, f)| {
                let addr = (10 << 24) | (a << 16) | (b << 8) | c;
                let n = Ipv4Net::new(addr.into(), len).unwrap().trunc();
                (r, n, f)
            })
    }

    proptest! {
        #[test]
        fn matches_brute_force_through_changes(
            first in prop::collection::vec(arb_entry(), 0..40),
            second in prop::collection::vec(arb_entry(), 0..40),
            pools in 0..6u32,
            probes in prop::collection::vec((0..4u32, 0..64u32, 0..8u32), 30),
        ) {
            let mut index = DirectIndex::new(pools, pools);
            let dedup = |v: &[(usize, Ipv4Net, u32)]| {
                let m: BTreeMap<(usize, Ipv4Net), u32> = v.iter().map(|(r, n, f)| ((*r, *n), *f)).collect();
                m.into_iter().map(|((r, n), f)| (r, n, f)).collect::<Vec<_>>()
            };
            let first = dedup(&first);
            let second = dedup(&second);
            for (r, n, f) in &first {
                index.set(*r, *n, Some(*f));
            }
            apply(&mut index);
            // Move to the second set: set its entries, remove the rest.
            for (r, n, _) in &first {
                if !second.iter().any(|(r2, n2, _)| r2 == r && n2 == n) {
                    index.set(*r, *n, None);
                }
            }
            for (r, n, f) in &second {
                index.set(*r, *n, Some(*f));
            }
            // Chunks freed by one plan serve fallback regions at the next: two more settle it.
            for _ in 0..3 {
                apply(&mut index);
                for (a, b, c) in &probes {
                    check(&index, &second, (10 << 24) | (a << 16) | (b << 8) | c);
                }
            }
            prop_assert!(apply(&mut index).is_empty());
        }
    }
}
