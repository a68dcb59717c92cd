//! Map keys and values shared by the eBPF program (`kilo-ebpf`) and the agent.
//! `#[repr(C)]`, plain old data; the `user` feature adds `aya::Pod` for userspace.
//!
//! Maps (names are the ELF symbol names, also the pin file names):
//! - [`MAP_DST`], [`MAP_NAT_SRC`]: kernel LPM tries, key [`LpmData`] (the family, then the
//!   address) with prefix length [`FAMILY_BITS`] + the CIDR's length, value [`EntryValue`]. One
//!   trie holds both families; a lookup is one call, and an entry one write, replaced atomically
//!   by the kernel. [`MAP_DST`] holds the mesh destinations and the masquerade destinations
//!   ([`ENTRY_MASQUERADE`]), so the longest match on a destination decides between them; a
//!   masquerade destination inside a mesh destination is written as that mesh destination
//!   ([`ENTRY_COVERED`]). [`MAP_NAT_SRC`] holds the NAT sources.
//! - [`MAP_ENCAP`], [`MAP_IPIP_SRC`], [`MAP_DECAP`]: IPIP inside a location, same keys and
//!   values: destinations to encapsulate at egress of the private interface (the entry's
//!   [`ENTRY_IPIP`] addresses), the outer sources accepted at its ingress (Kilo's `KILO-IPIP`),
//!   and the inner destinations this node serves.
//! - [`MAP_CONFIG`]: array of one [`Config`].
//! - [`MAP_COUNTERS`]: the per-CPU packet and byte counters, a plain (mmapable) array of
//!   [`Counter`] laid out CPU by CPU: CPU `c`'s region starts at `c * stride`
//!   ([`Config::counter_stride`]), holds the [`Decision`] counters in its first
//!   [`DECISION_SLOTS`] and the per-entry counters ([`EntryValue::counter`]) after them.
//!
//! The `stats` feature (std, no dependency) adds the module `median`: the benchmarks' median,
//! shared by the test kit and `cargo xtask bench`.
#![no_std]

#[cfg(feature = "stats")]
extern crate std;

#[cfg(feature = "stats")]
pub mod median;

/// Names of the maps in the object (and of their pins).
pub const MAP_DST: &str = "KILO_DST";
pub const MAP_NAT_SRC: &str = "KILO_NAT_SRC";
pub const MAP_ENCAP: &str = "KILO_ENCAP";
pub const MAP_IPIP_SRC: &str = "KILO_IPIP_SRC";
pub const MAP_DECAP: &str = "KILO_DECAP";
pub const MAP_CONFIG: &str = "KILO_CONFIG";
pub const MAP_COUNTERS: &str = "KILO_COUNTERS";
/// aya-log's ring buffer (pinned too, so an adopted program and a new one log to the same).
pub const MAP_LOGS: &str = "AYA_LOGS";

/// The classifier for devices with an Ethernet header (veth, bridge, physical NICs).
pub const PROG_L2: &str = "kilo_ingress";
/// The classifier for raw-IP devices (WireGuard, TUN): the packet starts at the IP header.
pub const PROG_L3: &str = "kilo_ingress_l3";
/// The classifier at egress of the private interface that adds the outer IPv4 header.
pub const PROG_ENCAP: &str = "kilo_encap";
/// The classifier at ingress of the private interface that removes it (or drops the packet).
pub const PROG_DECAP: &str = "kilo_decap";
/// A classifier that returns at once: the benchmarks' baseline, in its own object
/// (`kilo-ebpf-bench`), never loaded by the agent.
pub const PROG_NOOP: &str = "kilo_noop";
/// The benchmarks' floor, in the same object: the LPM-trie lookups `kilo_ingress` makes, in
/// tries of its own ([`MAP_BENCH_DST`], [`MAP_BENCH_NAT_SRC`]), and nothing else.
pub const PROG_LOOKUPS: &str = "kilo_lookups";
pub const MAP_BENCH_DST: &str = "BENCH_DST";
pub const MAP_BENCH_NAT_SRC: &str = "BENCH_NAT_SRC";

/// What the pinned maps mean: [`Config::layout`]. Raise it whenever a map's meaning changes
/// (not only its size), so an upgraded agent replaces the pins instead of adopting them.
pub const LAYOUT: u32 = 4;

/// Default capacity of each trie (entries are allocated as inserted).
pub const DEFAULT_MAX_ENTRIES: u32 = 1 << 16;
/// Default number of per-entry counter slots (per-CPU memory: 16 bytes x slots x CPUs).
pub const DEFAULT_COUNTER_SLOTS: u32 = 1 << 14;
/// Counters at the start of each CPU's region of [`MAP_COUNTERS`] that count decisions
/// ([`Decision::COUNT`] rounded up to whole 64-byte lines, so entry counters start on one).
pub const DECISION_SLOTS: u32 = 12;
/// The [`Config::counter_stride`] for `slots` entry counters: [`DECISION_SLOTS`] + `slots`,
/// rounded up to whole 64-byte lines.
pub const fn counter_stride(slots: u32) -> u32 {
    (DECISION_SLOTS + slots).div_ceil(4) * 4
}
/// [`EntryValue::counter`] of an entry that has no counter slot.
pub const NO_COUNTER: u32 = u32::MAX;

/// `LpmData::family` values (the Linux address family numbers).
pub const FAMILY_V4: u32 = 2;
pub const FAMILY_V6: u32 = 10;
/// Bits of [`LpmData::family`], matched exactly before the address.
pub const FAMILY_BITS: u32 = 32;

/// The data of an LPM trie key: the family, then the address (IPv4 in the first 4 bytes,
/// network order). An entry's prefix length is `FAMILY_BITS + len`; a lookup's covers it all.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LpmData {
    pub family: u32,
    pub addr: [u8; 16],
}

/// Default masquerade mark bit. kube-proxy uses 0x4000 (masquerade) and 0x8000 (drop),
/// Calico 0xffff0000, Cilium 0x0f00 (and its identity in the upper 16 bits), Weave 0x20000 and
/// 0x40000, Tailscale 0xff0000, wg-quick's fwmark 51820 (0xca6c) has no 0x1000 bit:
/// 0x1000 (bit 12, "11"07 for Kilo's table 1107) is free in all of them.
pub const DEFAULT_MARK: u32 = 0x1000;
pub const DEFAULT_MARK_MASK: u32 = 0x1000;

/// `Config::flags`: redirect mesh traffic whose entry names an egress (opt-in).
pub const CONFIG_FAST_PATH: u32 = 1;
/// `Config::flags`: the tries have held a whole plan once (a sync completed). Until then the
/// agent attaches no new program to them. Not read by the program.
pub const CONFIG_SYNCED: u32 = 2;
/// `Config::flags`: the kernel keeps route realms (CONFIG_IP_ROUTE_CLASSID): the agent has read
/// one of its own routes through `tunl0` back carrying [`KILO_REALM`]. `kilo_encap` then looks
/// up only packets whose route carries it; without it, every IPv4 packet (correct, slower).
pub const CONFIG_ROUTE_REALM: u32 = 4;

/// The route realm of the routes the datapath encapsulates (Kilo's `tunl0` routes, sent out of
/// the private interface): `ip route ... realm 1107` (Kilo's table number), i.e. RTA_FLOW with
/// this "to" realm in its low 16 bits and no "from" realm. The kernel copies a route's RTA_FLOW
/// into the tclassid of the dst it builds (`rt_set_nexthop`); for a forwarded packet
/// `set_class_tag` adds the realm of the route back to the source in the high 16 bits, so
/// `bpf_get_route_realm` returns `KILO_REALM | from << 16`: compare the low 16 bits only.
pub const KILO_REALM: u16 = 1107;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// [`LAYOUT`] of the agent that wrote it (0: never written).
    pub layout: u32,
    /// [`CONFIG_FAST_PATH`], [`CONFIG_SYNCED`], [`CONFIG_ROUTE_REALM`].
    pub flags: u32,
    /// The program's log level (aya-log: 0 off, 1 error, 2 warn, 3 info, 4 debug, 5 trace),
    /// read only on the paths that log.
    pub log_level: u32,
    /// Bits set (under `mask`) on packets to masquerade.
    pub mark: u32,
    /// Bits of the skb mark the program owns: cleared on every packet it does not masquerade.
    pub mask: u32,
    /// Counters in one CPU's region of [`MAP_COUNTERS`] (see [`counter_stride`]).
    pub counter_stride: u32,
}

impl Config {
    pub const DEFAULT: Config = Config {
        layout: LAYOUT,
        flags: 0,
        log_level: 0,
        mark: DEFAULT_MARK,
        mask: DEFAULT_MARK_MASK,
        counter_stride: counter_stride(DEFAULT_COUNTER_SLOTS),
    };
}

/// `EntryValue::flags`: a service CIDR (never redirected: kube-proxy must DNAT it first).
pub const ENTRY_SERVICE: u32 = 1;
/// `EntryValue::flags`: the fast path may redirect to `ifindex` (with `bpf_redirect`).
pub const ENTRY_REDIRECT: u32 = 2;
/// `EntryValue::flags`: redirect with `bpf_redirect_neigh` toward `nh_addr` (needs ENTRY_REDIRECT).
pub const ENTRY_NEIGH: u32 = 4;

/// `EntryValue::flags`: encapsulate in IPv4 (protocol 4) from `nh_addr[4..8]` to `nh_addr[..4]`.
pub const ENTRY_IPIP: u32 = 8;
/// `EntryValue::flags`, [`MAP_DST`]: a masquerade destination (without it: a mesh destination).
pub const ENTRY_MASQUERADE: u32 = 16;
/// `EntryValue::flags`, [`MAP_DST`]: a masquerade destination inside a mesh destination, which
/// Kilo leaves alone: the value (counter slot included) of the longest mesh destination holding
/// it. Not read by the program.
pub const ENTRY_COVERED: u32 = 32;

/// The value of every trie entry.
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
    /// Gateway address, IPv4 in the first 4 bytes (network order). With [`ENTRY_IPIP`]: the
    /// outer destination in bytes 0..4, the outer source in bytes 4..8.
    pub nh_addr: [u8; 16],
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
    /// Marked for masquerading (masquerade destination, or NAT source to no mesh destination).
    Masquerade = 4,
    /// Fast path: redirected to the entry's egress.
    Redirect = 5,
    /// Wrapped in an outer IPv4 header (egress of the private interface).
    Encapsulated = 6,
    /// Outer IPv4 header removed (ingress of the private interface).
    Decapsulated = 7,
    /// IPIP from a source outside the location, or to a destination this node does not
    /// serve: dropped (Kilo's `KILO-IPIP`).
    IpipRefused = 8,
}

impl Decision {
    pub const COUNT: u32 = 9;
    pub const ALL: [Decision; 9] = [
        Decision::NotIp,
        Decision::Malformed,
        Decision::Pass,
        Decision::Mesh,
        Decision::Masquerade,
        Decision::Redirect,
        Decision::Encapsulated,
        Decision::Decapsulated,
        Decision::IpipRefused,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Decision::NotIp => "not_ip",
            Decision::Malformed => "malformed",
            Decision::Pass => "pass",
            Decision::Mesh => "mesh",
            Decision::Masquerade => "masquerade",
            Decision::Redirect => "redirect",
            Decision::Encapsulated => "encapsulated",
            Decision::Decapsulated => "decapsulated",
            Decision::IpipRefused => "ipip_refused",
        }
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all are #[repr(C)], Copy, made of integers with no padding.
    unsafe impl aya::Pod for super::LpmData {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::EntryValue {}
    unsafe impl aya::Pod for super::Counter {}
}

// No implicit padding in what the program and the agent share byte for byte.
const _: () = assert!(core::mem::size_of::<Config>() == 24);
const _: () = assert!(core::mem::size_of::<LpmData>() == 20);
