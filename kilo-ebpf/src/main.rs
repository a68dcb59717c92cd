//! The kilo TC datapath: Kilo's masquerade decision (and an opt-in forwarding fast path) made
//! with longest-prefix matches at TC ingress of the pod-facing devices and the WireGuard
//! interface (plus the benchmarks' baselines: `kilo_noop`, `kilo_touch`, `kilo_lean`).
//!
//! Per packet: parse Ethernet (up to two VLAN tags, 802.1Q/802.1ad) or raw IP (the `_l3`
//! entry point, for devices without a MAC header), IPv4 or IPv6; then, with longest-prefix
//! matches (IPv4: a walk of the direct index, at most three array reads per address; IPv6 and
//! IPv4 fallback regions: one hash probe per prefix length present, longest first, skipping the
//! lengths the pre-filter rules out; see kilo-common)
//! - destination in `KILO_MESH`: leave alone (or, with the fast path on and an egress in the
//!   entry, not a service: redirect there);
//! - otherwise, source in `KILO_NAT_SRC` (while there are few, the copy of them in the config
//!   value) or destination in `KILO_MASQ_DST`: set the masquerade mark bits (the one
//!   static nftables rule masquerades marked packets);
//! - otherwise leave alone.
//!
//! Nothing is ever dropped; truncated or malformed packets pass untouched. The only map writes
//! are this CPU's counters (and aya-log records, when the config asks for them: only on the rare
//! paths, malformed packets, the fast path declining, IPv4 lookups sent to the hash tables).
//! Map layouts live in `kilo-common`.
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, TC_ACT_OK, TC_ACT_REDIRECT, bpf_redir_neigh},
    helpers::bpf_get_smp_processor_id,
    helpers::generated::{bpf_redirect, bpf_redirect_neigh},
    macros::{classifier, map},
    maps::{Array, HashMap, LpmTrie, lpm_trie::Key},
    programs::TcContext,
};
use aya_log_ebpf::{debug, trace};
use kilo_common::{
    CONFIG_FAST_PATH, Chunk, Config, Counter, DECISION_SLOTS, DEFAULT_COUNTER_SLOTS, DEFAULT_MARK,
    DEFAULT_MARK_MASK, DEFAULT_MAX_ENTRIES, DEFAULT_V4_CHUNKS, Decision, ENTRY_NEIGH,
    ENTRY_REDIRECT, ENTRY_SERVICE, EntryKey, EntryValue, FAMILY_V4, FAMILY_V6, FIELD_FALLBACK,
    FILTER_BUCKETS, FILTER_ROLE_BITS, LEAN_ENTRIES, Lengths, MAX_LENGTHS, NAT4_INDEXED,
    NAT6_INDEXED, SLOT_FALLBACK, SLOT_POINTER, counter_stride, filter_bucket4, filter_bucket6,
    filter_class, slot_field,
};

const NO_PREALLOC: u32 = aya_ebpf::bindings::BPF_F_NO_PREALLOC;
#[map]
static KILO_MESH: HashMap<EntryKey, EntryValue> =
    HashMap::with_max_entries(DEFAULT_MAX_ENTRIES, NO_PREALLOC);
#[map]
static KILO_NAT_SRC: HashMap<EntryKey, EntryValue> =
    HashMap::with_max_entries(DEFAULT_MAX_ENTRIES, NO_PREALLOC);
#[map]
static KILO_MASQ_DST: HashMap<EntryKey, EntryValue> =
    HashMap::with_max_entries(DEFAULT_MAX_ENTRIES, NO_PREALLOC);
#[map]
static KILO_LENGTHS: Array<Lengths> = Array::with_max_entries(3, 0);
#[map]
static KILO_FILTER: Array<u64> = Array::with_max_entries(FILTER_BUCKETS, 0);
#[map]
static KILO_V4_ROOT: Array<Chunk> = Array::with_max_entries(256, 0);
#[map]
static KILO_V4_L2: Array<Chunk> = Array::with_max_entries(DEFAULT_V4_CHUNKS, 0);
#[map]
static KILO_V4_L3: Array<Chunk> = Array::with_max_entries(DEFAULT_V4_CHUNKS, 0);
#[map]
static KILO_CONFIG: Array<Config> = Array::with_max_entries(1, 0);
/// CPU by CPU: see kilo-common's `MAP_COUNTERS`. The loader sizes it for the possible CPUs.
#[map]
static KILO_COUNTERS: Array<Counter> = Array::with_max_entries(
    counter_stride(DEFAULT_COUNTER_SLOTS),
    aya_ebpf::bindings::BPF_F_MMAPABLE,
);

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;

/// For Ethernet devices (veth, bridges, NICs). An untagged IP frame (or one whose tag the
/// device took off) is known by the skb's protocol, which the stack has set from the frame's
/// ethertype already; other frames are walked (VLAN tags, other protocols).
#[classifier]
pub fn kilo_ingress(ctx: TcContext) -> i32 {
    let Some(run) = Run::new(&ctx) else {
        return TC_ACT_OK as i32;
    };
    // SAFETY: the context of a TC program is a __sk_buff.
    let protocol = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).protocol };
    let (verdict, decision) = if protocol == u32::from(ETH_P_IP.to_be()) {
        ip4(&run, ETH_HLEN)
    } else if protocol == u32::from(ETH_P_IPV6.to_be()) {
        ip6(&run, ETH_HLEN)
    } else {
        match l2(&ctx) {
            Ok(Some((false, off))) => ip4(&run, off),
            Ok(Some((true, off))) => ip6(&run, off),
            Ok(None) => (TC_ACT_OK as i32, Decision::NotIp),
            Err(()) => (TC_ACT_OK as i32, Decision::Malformed),
        }
    };
    run.finish(decision);
    verdict
}

/// For raw-IP devices (WireGuard, TUN): the packet starts at the IP header.
#[classifier]
pub fn kilo_ingress_l3(ctx: TcContext) -> i32 {
    let Some(run) = Run::new(&ctx) else {
        return TC_ACT_OK as i32;
    };
    // The smallest IP header is 20 bytes (and `start + 1 > end` would compile to a `>=`
    // comparison the verifier does not turn into a packet range).
    let (verdict, decision) = match load::<[u8; 20]>(&ctx, 0).map(|h| h[0] >> 4) {
        Some(4) => ip4(&run, 0),
        Some(6) => ip6(&run, 0),
        Some(_) => (TC_ACT_OK as i32, Decision::NotIp),
        None => (TC_ACT_OK as i32, Decision::Malformed),
    };
    run.finish(decision);
    verdict
}

/// One run of the program: the packet, the config (one cache line, read once), and where this
/// CPU's counters start.
struct Run<'a> {
    ctx: &'a TcContext,
    cfg: &'static Config,
    /// This CPU's region of KILO_COUNTERS.
    base: u32,
    len: u64,
}

impl<'a> Run<'a> {
    /// None only without a config (a map that cannot be missing: the program then passes
    /// everything untouched and uncounted).
    #[inline(always)]
    fn new(ctx: &'a TcContext) -> Option<Self> {
        let cfg = KILO_CONFIG.get(0)?;
        // SAFETY: a helper without arguments.
        let cpu = unsafe { bpf_get_smp_processor_id() };
        Some(Run {
            ctx,
            cfg,
            base: cpu * cfg.counter_stride,
            len: ctx.len() as u64,
        })
    }

    /// Counts a packet in this CPU's counter `index` (a decision, or DECISION_SLOTS + an
    /// entry's slot).
    #[inline(always)]
    fn count(&self, index: u32) {
        if let Some(c) = KILO_COUNTERS.get_ptr_mut(self.base + index) {
            // SAFETY: this CPU's region: no other CPU writes it, and a program runs to
            // completion on its CPU (the agent only reads, or zeroes a slot it is recycling).
            unsafe {
                (*c).packets += 1;
                (*c).bytes += self.len;
            }
        }
    }

    /// Counts a packet in this CPU's counter of entry slot `slot` (none for NO_COUNTER or a
    /// slot past the region).
    #[inline(always)]
    fn count_entry(&self, slot: u32) {
        if slot < self.cfg.counter_stride.wrapping_sub(DECISION_SLOTS) {
            self.count(DECISION_SLOTS + slot);
        }
    }

    /// Counts the decision (and logs a malformed packet).
    #[inline(always)]
    fn finish(&self, decision: Decision) {
        self.count(decision as u32);
        if decision == Decision::Malformed && self.logs(LOG_DEBUG) {
            debug!(
                self.ctx,
                "malformed or truncated packet of {} bytes: passed untouched", self.len
            );
        }
    }

    /// Whether the config asks for logs at `level`.
    #[inline(always)]
    fn logs(&self, level: u32) -> bool {
        self.cfg.log_level >= level
    }
}

const LOG_DEBUG: u32 = 4;
const LOG_TRACE: u32 = 5;

/// Returns at once (the benchmarks' baseline).
#[classifier]
pub fn kilo_noop(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}

/// Reads the first byte of the IP header and returns: a benchmark baseline for the first touch
/// of the packet's headers on this CPU (which the stack pays right after when no program does).
#[classifier]
pub fn kilo_touch(ctx: TcContext) -> i32 {
    let start = ctx.data();
    if start + ETH_HLEN + 1 <= ctx.data_end() {
        // SAFETY: bounds checked above; volatile so that the read is not optimised away.
        unsafe { core::ptr::read_volatile((start + ETH_HLEN) as *const u8) };
    }
    TC_ACT_OK as i32
}

/// The benchmarks' reference for "a lean program's parse, LPM lookup and mark" (the datapath
/// issue's cost model): untagged Ethernet IPv4 only, kernel LPM tries of its own, the default
/// mark, no config and no counters. Ours is measured against it as well as against the empty
/// program.
#[map]
static KILO_LEAN_MESH: LpmTrie<[u8; 4], u32> = LpmTrie::with_max_entries(LEAN_ENTRIES, 0);
#[map]
static KILO_LEAN_NAT: LpmTrie<[u8; 4], u32> = LpmTrie::with_max_entries(LEAN_ENTRIES, 0);

#[classifier]
pub fn kilo_lean(ctx: TcContext) -> i32 {
    let skb = ctx.as_ptr() as *const __sk_buff;
    // SAFETY: the context of a TC program is a __sk_buff.
    if unsafe { (*skb).protocol } == u32::from(ETH_P_IP.to_be())
        && let Some(h) = load::<[u8; 20]>(&ctx, ETH_HLEN)
        && KILO_LEAN_MESH
            .get(&Key::new(32, [h[16], h[17], h[18], h[19]]))
            .is_none()
        && KILO_LEAN_NAT
            .get(&Key::new(32, [h[12], h[13], h[14], h[15]]))
            .is_some()
    {
        // SAFETY: as above.
        let mark = unsafe { (*skb).mark };
        ctx.set_mark((mark & !DEFAULT_MARK_MASK) | DEFAULT_MARK);
    }
    TC_ACT_OK as i32
}

/// Reads a `T` at `off` bytes into the packet, if the packet is long enough.
#[inline(always)]
fn load<T: Copy>(ctx: &TcContext, off: usize) -> Option<T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + core::mem::size_of::<T>() > end {
        return None;
    }
    // SAFETY: bounds checked above; the packet may be unaligned.
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const T) })
}

/// Walks the Ethernet header and up to two VLAN tags: `Some((is_v6, l3 offset))` for IP,
/// `None` for other protocols, `Err` when truncated.
#[inline(always)]
fn l2(ctx: &TcContext) -> Result<Option<(bool, usize)>, ()> {
    let mut proto = u16::from_be(load::<u16>(ctx, 12).ok_or(())?);
    let mut off = ETH_HLEN;
    if proto == ETH_P_8021Q || proto == ETH_P_8021AD {
        proto = u16::from_be(load::<u16>(ctx, 16).ok_or(())?);
        off = ETH_HLEN + 4;
        if proto == ETH_P_8021Q || proto == ETH_P_8021AD {
            proto = u16::from_be(load::<u16>(ctx, 20).ok_or(())?);
            off = ETH_HLEN + 8;
        }
    }
    Ok(match proto {
        ETH_P_IP => Some((false, off)),
        ETH_P_IPV6 => Some((true, off)),
        _ => None,
    })
}

/// An IPv4 address in the 16-byte key layout of the hash tables.
#[inline(always)]
fn v4(addr: u32) -> [u8; 16] {
    let a = addr.to_be_bytes();
    let mut out = [0u8; 16];
    out[0] = a[0];
    out[1] = a[1];
    out[2] = a[2];
    out[3] = a[3];
    out
}

/// The pre-filter word of `addr` (see kilo-common's `MAP_FILTER`).
#[inline(always)]
fn filter_word(v6: bool, addr: &[u8; 16]) -> u64 {
    let first = [addr[0], addr[1], addr[2], addr[3]];
    let bucket = if v6 {
        filter_bucket6(first)
    } else {
        filter_bucket4(first)
    };
    match KILO_FILTER.get(bucket) {
        Some(w) => *w,
        None => u64::MAX,
    }
}

/// The leaf slot of an IPv4 address in the direct index: the root chunk of its first octet,
/// then (while the slot points on) the L2 and L3 chunks. A missing chunk reads as a fallback.
#[inline(always)]
fn leaf4(addr: u32) -> u64 {
    let addr = addr.to_be_bytes();
    let Some(root) = KILO_V4_ROOT.get(addr[0] as u32) else {
        return SLOT_FALLBACK;
    };
    let slot = root.slots[addr[1] as usize];
    if slot & SLOT_POINTER == 0 {
        return slot;
    }
    let Some(l2) = KILO_V4_L2.get(slot as u32) else {
        return SLOT_FALLBACK;
    };
    let slot = l2.slots[addr[2] as usize];
    if slot & SLOT_POINTER == 0 {
        return slot;
    }
    let Some(l3) = KILO_V4_L3.get(slot as u32) else {
        return SLOT_FALLBACK;
    };
    let slot = l3.slots[addr[3] as usize];
    if slot & SLOT_POINTER == 0 {
        slot
    } else {
        SLOT_FALLBACK
    }
}

/// A 128-bit address (or an IPv4 one in the first four bytes) as big-endian (hi, lo) halves.
#[inline(always)]
fn halves(addr: &[u8; 16]) -> (u64, u64) {
    let hi = u64::from_be_bytes([
        addr[0], addr[1], addr[2], addr[3], addr[4], addr[5], addr[6], addr[7],
    ]);
    let lo = u64::from_be_bytes([
        addr[8], addr[9], addr[10], addr[11], addr[12], addr[13], addr[14], addr[15],
    ]);
    (hi, lo)
}

/// The masks of the first `l` bits (at most 128) of a 128-bit address held as (hi, lo) halves.
#[inline(always)]
fn masks(l: u32) -> (u64, u64) {
    let hi = if l >= 64 {
        u64::MAX
    } else {
        u64::MAX.checked_shl(64 - l).unwrap_or(0)
    };
    let lo = if l <= 64 {
        0
    } else {
        u64::MAX.checked_shl(128 - l).unwrap_or(0)
    };
    (hi, lo)
}

/// The longest-prefix match of `addr` in one role's table: probe each prefix length present,
/// longest first, skipping IPv4 lengths the pre-filter word `filter` rules out.
#[inline(always)]
fn find(
    map: &'static HashMap<EntryKey, EntryValue>,
    role: u32,
    v6: bool,
    addr: &[u8; 16],
    filter: u64,
) -> Option<&'static EntryValue> {
    let lens = KILO_LENGTHS.get(role)?;
    let bits = (filter >> (role * FILTER_ROLE_BITS)) as u32;
    let (hi, lo) = halves(addr);
    let (n, family, width) = if v6 {
        (lens.n6, FAMILY_V6, 128)
    } else {
        (lens.n4, FAMILY_V4, 32)
    };
    let mut key = EntryKey {
        family,
        prefix_len: 0,
        addr: [0; 16],
    };
    for i in 0..MAX_LENGTHS {
        if i as u32 >= n {
            break;
        }
        let l = if v6 { lens.v6[i] } else { lens.v4[i] } as u32;
        let l = if l > width { width } else { l };
        if let Some(c) = filter_class(v6, l)
            && (bits >> c) & 1 == 0
        {
            continue;
        }
        // Keep the first l bits of the 128-bit (hi, lo) address (IPv4 lives in hi's top 32).
        let (mh, ml) = masks(l);
        key.prefix_len = l;
        let h = (hi & mh).to_be_bytes();
        let w = (lo & ml).to_be_bytes();
        key.addr = [
            h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], w[0], w[1], w[2], w[3], w[4], w[5],
            w[6], w[7],
        ];
        // SAFETY: the value is only read, and only while the program runs.
        if let Some(v) = unsafe { map.get(&key) } {
            return Some(v);
        }
    }
    None
}

/// The decision for an IPv4 packet whose header starts at `off`: each role's match from the
/// direct index (a counter slot + 1, 0 for none), or from the hash tables where the index
/// says FIELD_FALLBACK (which it does, with the fast path on, for the mesh entries that may be
/// redirected: their egress is in the hash table's value).
#[inline(always)]
fn ip4(run: &Run, off: usize) -> (i32, Decision) {
    let ok = TC_ACT_OK as i32;
    let Some(hdr) = load::<[u8; 20]>(run.ctx, off) else {
        return (ok, Decision::Malformed);
    };
    if hdr[0] >> 4 != 4 || hdr[0] & 0x0f < 5 {
        return (ok, Decision::Malformed);
    }
    // One register for the address, not a byte each (and the source read only past the mesh
    // hit, which then keeps fewer values alive across the inlined lookups).
    let dst = u32::from_be_bytes([hdr[16], hdr[17], hdr[18], hdr[19]]);
    let dst_leaf = leaf4(dst);
    match slot_field(dst_leaf, 0) {
        0 => {}
        FIELD_FALLBACK => {
            if run.logs(LOG_TRACE) {
                trace!(run.ctx, "IPv4 lookup of {:i} sent to the hash tables", dst);
            }
            if let Some(r) = mesh_hashed(run, false, off, &v4(dst)) {
                return r;
            }
        }
        field => {
            run.count_entry(field - 1);
            return (ok, Decision::Mesh);
        }
    }
    let Some(src) = load::<[u8; 4]>(run.ctx, off + 12) else {
        return (ok, Decision::Malformed);
    };
    let src = u32::from_be_bytes(src);
    let nat = if run.cfg.nat4_len == NAT4_INDEXED {
        indexed(run, slot_field(leaf4(src), 1), &KILO_NAT_SRC, 1, src)
    } else {
        nat4_listed(run, src)
    };
    let masq = indexed(run, slot_field(dst_leaf, 2), &KILO_MASQ_DST, 2, dst);
    masquerade(run, nat | masq)
}

/// Whether `src` is one of the config's IPv4 NAT sources (counting the first, longest, match).
#[inline(always)]
fn nat4_listed(run: &Run, src: u32) -> bool {
    for (i, n) in run.cfg.nat4.iter().enumerate() {
        if i as u32 >= run.cfg.nat4_len {
            break;
        }
        if src & n.mask == n.net {
            run.count_entry(n.counter);
            return true;
        }
    }
    false
}

/// Whether `src` is one of the config's IPv6 NAT sources (counting the first, longest, match).
#[inline(always)]
fn nat6_listed(run: &Run, src: &[u8; 16]) -> bool {
    let (hi, lo) = halves(src);
    for (i, n) in run.cfg.nat6.iter().enumerate() {
        if i as u32 >= run.cfg.nat6_len {
            break;
        }
        let (mh, ml) = masks(n.prefix_len);
        if hi & mh == n.hi && lo & ml == n.lo {
            run.count_entry(n.counter);
            return true;
        }
    }
    false
}

/// The decision for an IPv6 packet whose header starts at `off` (hash tables only).
#[inline(always)]
fn ip6(run: &Run, off: usize) -> (i32, Decision) {
    let ok = TC_ACT_OK as i32;
    let Some(hdr) = load::<[u8; 40]>(run.ctx, off) else {
        return (ok, Decision::Malformed);
    };
    if hdr[0] >> 4 != 6 {
        return (ok, Decision::Malformed);
    }
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&hdr[8..24]);
    dst.copy_from_slice(&hdr[24..40]);
    if let Some(r) = mesh_hashed(run, true, off, &dst) {
        return r;
    }
    let nat = if run.cfg.nat6_len == NAT6_INDEXED {
        hashed(run, &KILO_NAT_SRC, 1, true, &src)
    } else {
        nat6_listed(run, &src)
    };
    let masq = hashed(run, &KILO_MASQ_DST, 2, true, &dst);
    masquerade(run, nat | masq)
}

/// A mesh destination from the hash table: left alone, or redirected by the fast path.
#[inline(always)]
fn mesh_hashed(run: &Run, v6: bool, off: usize, dst: &[u8; 16]) -> Option<(i32, Decision)> {
    let entry = find(&KILO_MESH, 0, v6, dst, filter_word(v6, dst))?;
    run.count_entry(entry.counter);
    if entry.flags & ENTRY_REDIRECT != 0
        && entry.flags & ENTRY_SERVICE == 0
        && run.cfg.flags & CONFIG_FAST_PATH != 0
    {
        let r = redirect(run.ctx, v6, off, entry);
        if r.1 == Decision::Mesh && run.logs(LOG_DEBUG) {
            debug!(
                run.ctx,
                "fast path declined (TTL expiring or redirect to ifindex {} failed): left to the stack",
                entry.ifindex
            );
        }
        return Some(r);
    }
    Some((TC_ACT_OK as i32, Decision::Mesh))
}

/// Whether `addr` matches a NAT source or masquerade destination entry (counting it), from
/// the direct index's `field` or, for FIELD_FALLBACK, the hash table.
#[inline(always)]
fn indexed(
    run: &Run,
    field: u32,
    map: &'static HashMap<EntryKey, EntryValue>,
    role: u32,
    addr: u32,
) -> bool {
    match field {
        0 => false,
        FIELD_FALLBACK => hashed(run, map, role, false, &v4(addr)),
        f => {
            run.count_entry(f - 1);
            true
        }
    }
}

/// Whether `addr` matches an entry of a NAT source or masquerade destination hash table
/// (counting it).
#[inline(always)]
fn hashed(
    run: &Run,
    map: &'static HashMap<EntryKey, EntryValue>,
    role: u32,
    v6: bool,
    addr: &[u8; 16],
) -> bool {
    match find(map, role, v6, addr, filter_word(v6, addr)) {
        Some(entry) => {
            run.count_entry(entry.counter);
            true
        }
        None => false,
    }
}

/// Sets the masquerade mark bits (keeping the others) if `yes`.
#[inline(always)]
fn masquerade(run: &Run, yes: bool) -> (i32, Decision) {
    let ok = TC_ACT_OK as i32;
    if !yes {
        return (ok, Decision::Pass);
    }
    // SAFETY: the context of a TC program is a __sk_buff.
    let mark = unsafe { (*(run.ctx.as_ptr() as *const __sk_buff)).mark };
    run.ctx
        .set_mark((mark & !run.cfg.mask) | (run.cfg.mark & run.cfg.mask));
    (ok, Decision::Masquerade)
}

/// The fast path: decrement the TTL / hop limit like a router and redirect to the entry's
/// egress. Packets whose TTL would expire go to the stack (which answers with ICMP).
#[inline(always)]
fn redirect(ctx: &TcContext, v6: bool, off: usize, entry: &EntryValue) -> (i32, Decision) {
    let ok = TC_ACT_OK as i32;
    if v6 {
        let Some(hl) = load::<u8>(ctx, off + 7) else {
            return (ok, Decision::Malformed);
        };
        if hl <= 1 || ctx.store(off + 7, &(hl - 1), 0).is_err() {
            return (ok, Decision::Mesh);
        }
    } else {
        let Some(word) = load::<[u8; 2]>(ctx, off + 8) else {
            return (ok, Decision::Malformed);
        };
        if word[0] <= 1 {
            return (ok, Decision::Mesh);
        }
        let old = u16::from_ne_bytes(word) as u64;
        let new = u16::from_ne_bytes([word[0] - 1, word[1]]) as u64;
        if ctx.l3_csum_replace(off + 10, old, new, 2).is_err()
            || ctx.store(off + 8, &(word[0] - 1), 0).is_err()
        {
            return (ok, Decision::Mesh);
        }
    }
    let ret = if entry.flags & ENTRY_NEIGH != 0 {
        let mut nh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        nh.nh_family = if entry.nh_family == FAMILY_V6 {
            10 // AF_INET6
        } else {
            2 // AF_INET
        };
        // SAFETY: both union members are plain bytes.
        unsafe {
            core::ptr::copy_nonoverlapping(
                entry.nh_addr.as_ptr(),
                core::ptr::addr_of_mut!(nh.__bindgen_anon_1) as *mut u8,
                16,
            );
            bpf_redirect_neigh(
                entry.ifindex,
                &mut nh,
                core::mem::size_of::<bpf_redir_neigh>() as i32,
                0,
            )
        }
    } else {
        // SAFETY: a plain helper call.
        unsafe { bpf_redirect(entry.ifindex, 0) }
    };
    if ret == TC_ACT_REDIRECT as i64 {
        (TC_ACT_REDIRECT as i32, Decision::Redirect)
    } else {
        (ok, Decision::Mesh)
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
