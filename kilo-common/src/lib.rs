//! Map keys and values shared by the eBPF program (`kilo-ebpf`) and the agent.
//! `#[repr(C)]`, plain old data; the `user` feature adds `aya::Pod` for userspace.
//!
//! Maps (names are the ELF symbol names, also the pin file names):
//! - [`MAP_MESH`], [`MAP_NAT_SRC`], [`MAP_MASQ_DST`]: every entry (the agent's record of the
//!   tables, and the lookup for IPv6 and for IPv4 regions the direct index below sends there):
//!   longest-prefix-match tables built as one hash map per role, key [`EntryKey`] (family,
//!   prefix length, address with host bits clear), value [`EntryValue`], plus [`MAP_LENGTHS`],
//!   the prefix lengths present per role and family, longest first. The program probes those
//!   lengths in order: the first hit is the longest match. A lookup costs one hash probe per
//!   distinct prefix length (a handful in a Kilo mesh: /32 node and WireGuard IPs, the pod CIDR
//!   size, service and peer sizes) and does not grow with the number of entries, unlike the
//!   kernel's LPM trie whose depth grows with it (measured: 1.6x to 2x slower at 100,000
//!   entries than at 10; `kilo_lean` shows it in `bench_datapath`).
//! - [`MAP_FILTER`]: a pre-filter that spares most probes that would miss. Array of
//!   [`FILTER_BUCKETS`] `u64` words, 16 bits per role (role `r` at bit `16 * r`). IPv4: word
//!   [`filter_bucket4`] (the address's /16), bit `l - 17` set when the role's table may hold an
//!   entry of prefix length `l` (17 to 32) inside that /16. IPv6: word [`filter_bucket6`] (the
//!   first 32 bits folded to 16, from [`FILTER_V6_BASE`]), bit `(l - 33) / 8` for lengths 33 to
//!   128 (a class of eight lengths). A clear bit means no such entry: the program skips those
//!   probes. IPv4 lengths up to 16 and IPv6 lengths up to 32 are always probed. See
//!   [`filter_class`].
//! - [`MAP_V4_ROOT`], [`MAP_V4_L2`], [`MAP_V4_L3`]: the IPv4 direct index, which answers
//!   IPv4 lookups of all three roles with at most three array reads and no hashing: arrays of
//!   [`Chunk`]s of 256 slots, the root indexed by the first octet (its slots cover /16s), a
//!   pointer slot leading to an L2 chunk (slots cover /24s) and from there to an L3 chunk (slots
//!   are addresses). A leaf slot holds each role's longest match for its whole range (see
//!   [`slot_field`]); [`FIELD_FALLBACK`] sends the program to the hash tables above for that
//!   role (IPv6 always goes there). Built and kept by the agent (datapath/direct.rs).
//! - [`MAP_CONFIG`]: array of one [`Config`].
//! - [`MAP_COUNTERS`]: the per-CPU packet and byte counters, a plain (mmapable) array of
//!   [`Counter`] laid out CPU by CPU: CPU `c`'s region starts at `c * stride`
//!   ([`Config::counter_stride`]), holds the [`Decision`] counters in its first
//!   [`DECISION_SLOTS`] and the per-entry counters ([`EntryValue::counter`]) after them. One
//!   counter update touches one cache line (a per-CPU array map would first read the slot's
//!   per-CPU pointer from another); the agent sums a slot over the CPUs through an mmap of
//!   the array, with no system call per slot.
#![no_std]

/// Names of the maps in the object (and of their pins).
pub const MAP_MESH: &str = "KILO_MESH";
pub const MAP_NAT_SRC: &str = "KILO_NAT_SRC";
pub const MAP_MASQ_DST: &str = "KILO_MASQ_DST";
pub const MAP_CONFIG: &str = "KILO_CONFIG";
pub const MAP_LENGTHS: &str = "KILO_LENGTHS";
pub const MAP_FILTER: &str = "KILO_FILTER";
pub const MAP_COUNTERS: &str = "KILO_COUNTERS";
pub const MAP_V4_ROOT: &str = "KILO_V4_ROOT";
pub const MAP_V4_L2: &str = "KILO_V4_L2";
pub const MAP_V4_L3: &str = "KILO_V4_L3";
/// aya-log's ring buffer (pinned too, so an adopted program and a new one log to the same).
pub const MAP_LOGS: &str = "AYA_LOGS";

/// Names of the programs in the object.
/// The classifier for devices with an Ethernet header (veth, bridge, physical NICs).
pub const PROG_L2: &str = "kilo_ingress";
/// The classifier for raw-IP devices (WireGuard, TUN): the packet starts at the IP header.
pub const PROG_L3: &str = "kilo_ingress_l3";
/// A classifier that returns at once (benchmark baseline).
pub const PROG_NOOP: &str = "kilo_noop";
/// A classifier that reads one byte of the IP header and returns (benchmark baseline).
pub const PROG_TOUCH: &str = "kilo_touch";
/// The lean program the datapath issue takes as its cost model (benchmark reference): parse
/// (untagged Ethernet IPv4), an LPM-trie lookup of the destination, then of the source, and
/// the mark; no config, no counters. Its tries, `MAP_LEAN_*`, are its own.
pub const PROG_LEAN: &str = "kilo_lean";
/// The lean reference's LPM tries (`[u8; 4]` keys, `u32` values): mesh destinations, NAT sources.
pub const MAP_LEAN_MESH: &str = "KILO_LEAN_MESH";
pub const MAP_LEAN_NAT: &str = "KILO_LEAN_NAT";
/// Room in each of the lean reference's tries (a cap: LPM tries allocate per entry), enough for
/// the benchmarks' 100,000-entry plan.
pub const LEAN_ENTRIES: u32 = 1 << 18;

/// Default capacity of each table. Entries are allocated as inserted (BPF_F_NO_PREALLOC); the
/// bucket array costs 16 bytes per slot (1 MiB per table at this size).
pub const DEFAULT_MAX_ENTRIES: u32 = 1 << 16;
/// Default number of per-entry counter slots (per-CPU memory: 16 bytes x slots x CPUs).
pub const DEFAULT_COUNTER_SLOTS: u32 = 1 << 14;
/// Counters at the start of each CPU's region of [`MAP_COUNTERS`] that count decisions
/// ([`Decision::COUNT`] rounded up to whole 64-byte lines, so entry counters start on one).
pub const DECISION_SLOTS: u32 = 8;
/// The [`Config::counter_stride`] for `slots` entry counters: [`DECISION_SLOTS`] + `slots`,
/// rounded up to whole 64-byte lines.
pub const fn counter_stride(slots: u32) -> u32 {
    (DECISION_SLOTS + slots).div_ceil(4) * 4
}
/// [`EntryValue::counter`] of an entry that has no counter slot.
pub const NO_COUNTER: u32 = u32::MAX;

/// `EntryKey::family` values (the Linux address family numbers).
pub const FAMILY_V4: u32 = 2;
pub const FAMILY_V6: u32 = 10;

/// The key of every table: a CIDR. IPv4 in the first 4 bytes of `addr` (network order), every
/// bit past `prefix_len` zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EntryKey {
    pub family: u32,
    pub prefix_len: u32,
    pub addr: [u8; 16],
}

/// Most distinct prefix lengths per role and family.
pub const MAX_LENGTHS: usize = 32;

/// The prefix lengths present in one role's table, per family, longest first
/// ([`MAP_LENGTHS`] index: 0 mesh, 1 NAT sources, 2 masquerade destinations).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lengths {
    pub n4: u32,
    pub n6: u32,
    pub v4: [u8; MAX_LENGTHS],
    pub v6: [u8; MAX_LENGTHS],
}

impl Lengths {
    pub const EMPTY: Lengths = Lengths {
        n4: 0,
        n6: 0,
        v4: [0; MAX_LENGTHS],
        v6: [0; MAX_LENGTHS],
    };
}

/// Entries of [`MAP_FILTER`]: one per IPv4 /16, then as many for IPv6.
pub const FILTER_BUCKETS: u32 = 1 << 17;
/// First IPv6 word of [`MAP_FILTER`].
pub const FILTER_V6_BASE: u32 = 1 << 16;
/// Bits of one role in a [`MAP_FILTER`] word.
pub const FILTER_ROLE_BITS: u32 = 16;

/// The [`MAP_FILTER`] word of an IPv4 address (network order bytes): its /16.
#[inline(always)]
pub const fn filter_bucket4(addr: [u8; 4]) -> u32 {
    ((addr[0] as u32) << 8) | addr[1] as u32
}

/// The [`MAP_FILTER`] word of an IPv6 address: its first 32 bits folded to 16.
#[inline(always)]
pub const fn filter_bucket6(addr: [u8; 4]) -> u32 {
    FILTER_V6_BASE
        + ((((addr[0] as u32) << 8) | addr[1] as u32) ^ (((addr[2] as u32) << 8) | addr[3] as u32))
}

/// The bit (within a role's 16) of prefix length `len`, if that length is pre-filtered:
/// IPv4 17 to 32, IPv6 33 to 128 (eight lengths a bit: a shift, no division in the program).
#[inline(always)]
pub const fn filter_class(v6: bool, len: u32) -> Option<u32> {
    if v6 {
        if len <= 32 || len > 128 {
            None
        } else {
            Some((len - 33) >> 3)
        }
    } else if len <= 16 || len > 32 {
        None
    } else {
        Some(len - 17)
    }
}

/// The [`MAP_FILTER`] bit of an entry of `role` (0 mesh, 1 NAT sources, 2 masquerade
/// destinations) and prefix length `len`, if that length is filtered.
#[inline(always)]
pub const fn filter_bit(role: u32, v6: bool, len: u32) -> Option<u64> {
    if role > 2 {
        return None;
    }
    match filter_class(v6, len) {
        Some(c) => Some(1u64 << (role * FILTER_ROLE_BITS + c)),
        None => None,
    }
}

/// Default masquerade mark bit. kube-proxy uses 0x4000 (masquerade) and 0x8000 (drop),
/// Calico 0xffff0000, Cilium 0x0f00 (and its identity in the upper 16 bits), Weave 0x20000 and
/// 0x40000, Tailscale 0xff0000, wg-quick's fwmark 51820 (0xca6c) has no 0x1000 bit:
/// 0x1000 (bit 12, "11"07 for Kilo's table 1107) is free in all of them.
pub const DEFAULT_MARK: u32 = 0x1000;
pub const DEFAULT_MARK_MASK: u32 = 0x1000;

/// `Config::flags`: redirect mesh traffic whose entry names an egress (opt-in).
pub const CONFIG_FAST_PATH: u32 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    // The rarely read fields first: an array map's value starts 8 bytes short of a cache line
    // boundary on this kernel (6.18: `struct bpf_array` is 312 bytes), so what every packet
    // and the masquerade path read, from `mark` on, fills the next line and no more.
    /// [`CONFIG_FAST_PATH`].
    pub flags: u32,
    /// The program's log level (aya-log: 0 off, 1 error, 2 warn, 3 info, 4 debug, 5 trace),
    /// read at run time and only on the paths that log, none of which a well-formed packet of a
    /// mesh without fallback regions takes.
    pub log_level: u32,
    /// Bits set (under `mask`) on packets to masquerade.
    pub mark: u32,
    /// Bits of the skb mark the program owns.
    pub mask: u32,
    /// Counters in one CPU's region of [`MAP_COUNTERS`] (see [`counter_stride`]). Here rather
    /// than in a read-only global so that the one config line every packet reads also holds
    /// what the masquerade path needs.
    pub counter_stride: u32,
    /// How many of `nat4` hold the IPv4 NAT sources, or [`NAT4_INDEXED`]: more than fit, look
    /// them up in the direct index. A node has one or two (its pod CIDR, its WireGuard IP), and
    /// checking them here, in the line the masquerade path reads anyway, spares that path the
    /// source's walk of the index: two more cache lines, on pages of their own.
    pub nat4_len: u32,
    /// The IPv4 NAT sources, longest prefix first (so the first match is the longest).
    pub nat4: [Nat4; NAT4_LIST],
    /// Puts `nat6` and `nat6_len` on the next line (see the comment on `flags`).
    pub _pad: [u32; 3],
    /// The IPv6 NAT sources, longest prefix first.
    pub nat6: [Nat6; NAT6_LIST],
    /// Like `nat4_len`, for [`Config::nat6`] ([`NAT6_INDEXED`]: look them up in the hash
    /// table, a probe per prefix length).
    pub nat6_len: u32,
    pub _pad_end: u32,
}

/// Most IPv4 NAT sources [`Config::nat4`] holds.
pub const NAT4_LIST: usize = 3;
/// [`Config::nat4_len`] when the IPv4 NAT sources are looked up in the direct index.
pub const NAT4_INDEXED: u32 = u32::MAX;

/// Most IPv6 NAT sources [`Config::nat6`] holds.
pub const NAT6_LIST: usize = 2;
/// [`Config::nat6_len`] when the IPv6 NAT sources are looked up in the hash table.
pub const NAT6_INDEXED: u32 = u32::MAX;

/// An IPv6 NAT source in [`Config::nat6`]: the first `prefix_len` bits of the address, as two
/// `u64::from_be_bytes` halves (`hi` the first eight bytes), bits past it zero; counted in
/// entry slot `counter`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nat6 {
    pub hi: u64,
    pub lo: u64,
    pub prefix_len: u32,
    pub counter: u32,
}

/// An IPv4 NAT source in [`Config::nat4`]: addresses `a` with `a & mask == net` (both as
/// `u32::from_be_bytes` of the address), counted in entry slot `counter`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Nat4 {
    pub net: u32,
    pub mask: u32,
    pub counter: u32,
}

impl Config {
    pub const DEFAULT: Config = Config {
        flags: 0,
        log_level: 0,
        mark: DEFAULT_MARK,
        mask: DEFAULT_MARK_MASK,
        counter_stride: counter_stride(DEFAULT_COUNTER_SLOTS),
        nat4_len: 0,
        nat4: [Nat4 {
            net: 0,
            mask: 0,
            counter: 0,
        }; NAT4_LIST],
        _pad: [0; 3],
        nat6: [Nat6 {
            hi: 0,
            lo: 0,
            prefix_len: 0,
            counter: 0,
        }; NAT6_LIST],
        nat6_len: 0,
        _pad_end: 0,
    };
}

/// `EntryValue::flags`: a service CIDR (never redirected: kube-proxy must DNAT it first).
pub const ENTRY_SERVICE: u32 = 1;
/// `EntryValue::flags`: the fast path may redirect to `ifindex` (with `bpf_redirect`).
pub const ENTRY_REDIRECT: u32 = 2;
/// `EntryValue::flags`: redirect with `bpf_redirect_neigh` toward `nh_addr` (needs ENTRY_REDIRECT).
pub const ENTRY_NEIGH: u32 = 4;

/// The value of every LPM entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryValue {
    /// Entry counter slot (see [`MAP_COUNTERS`]), or [`NO_COUNTER`].
    pub counter: u32,
    pub flags: u32,
    /// An `EntryKind` code chosen by the agent (metrics label), not read by the program.
    pub kind: u32,
    /// Egress device of the fast path.
    pub ifindex: u32,
    /// Gateway family (`FAMILY_V4`/`FAMILY_V6`) for `bpf_redirect_neigh`, 0 for none.
    pub nh_family: u32,
    /// Gateway address, IPv4 in the first 4 bytes (network order).
    pub nh_addr: [u8; 16],
}

/// One node of the IPv4 direct index: 256 slots, indexed by one octet of the address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub slots: [u64; 256],
}

impl Chunk {
    pub const EMPTY: Chunk = Chunk { slots: [0; 256] };
}

/// Default number of chunks in each of the two lower levels of the IPv4 direct index
/// (2 KiB each: 2 MiB per level). A /16 holding entries longer than /16 takes an L2 chunk; a
/// /24 holding entries longer than /24 takes an L3 chunk.
pub const DEFAULT_V4_CHUNKS: u32 = 1024;
/// A slot with this bit set points to the chunk (of the next level) in its low 32 bits.
pub const SLOT_POINTER: u64 = 1 << 63;
/// Bits per role in a leaf slot (role `r` at bit `FIELD_BITS * r`).
pub const FIELD_BITS: u32 = 21;
/// A role field: 0 no match, `counter slot + 1` the match (its per-entry counter), or
/// [`FIELD_FALLBACK`]: look this role up in its hash table.
pub const FIELD_FALLBACK: u32 = (1 << FIELD_BITS) - 1;
/// A leaf that sends every role to the hash tables (a region without a free chunk).
pub const SLOT_FALLBACK: u64 = (FIELD_FALLBACK as u64)
    | ((FIELD_FALLBACK as u64) << FIELD_BITS)
    | ((FIELD_FALLBACK as u64) << (2 * FIELD_BITS));

/// The field of `role` in a leaf slot.
#[inline(always)]
pub const fn slot_field(slot: u64, role: u32) -> u32 {
    ((slot >> (role * FIELD_BITS)) as u32) & FIELD_FALLBACK
}

/// Per-CPU packet and byte counter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// What the program did with a packet (its counter's index in a CPU's region of
/// [`MAP_COUNTERS`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Decision {
    /// Neither IPv4 nor IPv6 (ARP, LLDP, ...): passed untouched.
    NotIp = 0,
    /// Truncated or malformed IP header: passed untouched.
    Malformed = 1,
    /// No list matched: left alone.
    Pass = 2,
    /// Destination inside the mesh: left alone (never masqueraded).
    Mesh = 3,
    /// Marked for masquerading (NAT source or masquerade destination, not a mesh destination).
    Masquerade = 4,
    /// Fast path: redirected to the entry's egress.
    Redirect = 5,
}

impl Decision {
    pub const COUNT: u32 = 6;
    pub const ALL: [Decision; 6] = [
        Decision::NotIp,
        Decision::Malformed,
        Decision::Pass,
        Decision::Mesh,
        Decision::Masquerade,
        Decision::Redirect,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Decision::NotIp => "not_ip",
            Decision::Malformed => "malformed",
            Decision::Pass => "pass",
            Decision::Mesh => "mesh",
            Decision::Masquerade => "masquerade",
            Decision::Redirect => "redirect",
        }
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all are #[repr(C)], Copy, made of integers with no padding.
    unsafe impl aya::Pod for super::EntryKey {}
    unsafe impl aya::Pod for super::Lengths {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::EntryValue {}
    unsafe impl aya::Pod for super::Counter {}
    unsafe impl aya::Pod for super::Chunk {}
}

// No implicit padding in what the program and the agent share byte for byte.
const _: () = assert!(core::mem::size_of::<Config>() == 128);
