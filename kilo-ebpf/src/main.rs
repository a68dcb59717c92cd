//! The kilo TC datapath at ingress of the pod-facing devices and the WireGuard interface. It
//! parses Ethernet (up to two VLAN tags) or raw IP (the `_l3` entry point), IPv4 or IPv6, and
//! with one kernel LPM-trie lookup per role: destination in `KILO_MESH` → leave alone (or, fast
//! path on, an egress in the entry, not a service: redirect); else source in `KILO_NAT_SRC` or
//! destination in `KILO_MASQ_DST` → set our mark bits (the static nftables rule masquerades);
//! else leave alone. Every other packet leaves with our mark bits clear (others' are kept).
//! Nothing is dropped; malformed packets pass untouched. The only map writes are this CPU's
//! counters (and aya-log records of malformed packets when asked). Layouts: `kilo-common`.
//!
//! IPIP inside a location (Kilo's `tunl0`, without the `ipip` module): `kilo_encap`, at egress
//! of the private interface, wraps IPv4 to a destination in `KILO_ENCAP` in an outer IPv4 header
//! (protocol 4) between the entry's addresses; `kilo_decap`, at its ingress, removes it when the
//! outer source is in `KILO_IPIP_SRC` and the inner destination in `KILO_DECAP`, and drops other
//! IPIP (Kilo's `KILO-IPIP`). Both pass every other packet untouched and uncounted.
#![no_std]
#![no_main]

use aya_ebpf::{
    EbpfContext,
    bindings::{
        __sk_buff, BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4,
        BPF_F_ADJ_ROOM_FIXED_GSO, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, bpf_adj_room_mode,
        bpf_redir_neigh,
    },
    helpers::bpf_get_smp_processor_id,
    helpers::generated::{bpf_redirect, bpf_redirect_neigh},
    macros::{classifier, map},
    maps::{Array, LpmTrie, lpm_trie::Key},
    programs::TcContext,
};
use aya_log_ebpf::debug;
use kilo_common::{
    CONFIG_FAST_PATH, Config, Counter, DECISION_SLOTS, DEFAULT_COUNTER_SLOTS, DEFAULT_MAX_ENTRIES,
    Decision, ENTRY_IPIP, ENTRY_NEIGH, ENTRY_REDIRECT, ENTRY_SERVICE, EntryValue, FAMILY_BITS,
    FAMILY_V4, FAMILY_V6, LpmData, counter_stride,
};

type Trie = LpmTrie<LpmData, EntryValue>;
#[map]
static KILO_MESH: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_NAT_SRC: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_MASQ_DST: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_ENCAP: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_IPIP_SRC: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_DECAP: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
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
const LOG_DEBUG: u32 = 4;
const IPPROTO_IPIP: u8 = 4;
const IP_HLEN: usize = 20;

/// For Ethernet devices (veth, bridges, NICs). An untagged IP frame is known by the skb's
/// protocol, which the stack has set from the frame's ethertype already; other frames are
/// walked (VLAN tags, other protocols).
#[classifier]
pub fn kilo_ingress(ctx: TcContext) -> i32 {
    let Some(run) = Run::new(&ctx) else {
        return TC_ACT_OK as i32;
    };
    let protocol = run.skb().protocol;
    let (verdict, decision) = if protocol == u32::from(ETH_P_IP.to_be()) {
        ip(&run, false, ETH_HLEN)
    } else if protocol == u32::from(ETH_P_IPV6.to_be()) {
        ip(&run, true, ETH_HLEN)
    } else {
        match l2(&ctx) {
            Ok(Some((v6, off))) => ip(&run, v6, off),
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
        Some(4) => ip(&run, false, 0),
        Some(6) => ip(&run, true, 0),
        Some(_) => (TC_ACT_OK as i32, Decision::NotIp),
        None => (TC_ACT_OK as i32, Decision::Malformed),
    };
    run.finish(decision);
    verdict
}

/// At egress of the private interface (Ethernet): see the module doc. The outer header copies
/// the inner TOS, TTL and DF bit, as Linux's fallback `tunl0` does; a GSO packet's segments
/// each get their own outer header when segmented (`SKB_GSO_IPXIP4`). A packet that cannot be
/// wrapped is dropped rather than sent bare.
#[classifier]
pub fn kilo_encap(ctx: TcContext) -> i32 {
    let ok = TC_ACT_OK as i32;
    if skb(&ctx).protocol != u32::from(ETH_P_IP.to_be()) {
        return ok;
    }
    let Some(hdr) = load::<[u8; IP_HLEN]>(&ctx, ETH_HLEN) else {
        return ok;
    };
    // IPIP already: ours (a redirect passing here again) or someone's; never wrapped twice.
    if hdr[0] >> 4 != 4 || hdr[9] == IPPROTO_IPIP {
        return ok;
    }
    let Some(entry) = KILO_ENCAP.get(&key::<4>(&hdr, 16)) else {
        return ok;
    };
    let Some(run) = Run::new(&ctx) else {
        return ok;
    };
    if entry.flags & ENTRY_IPIP == 0 {
        return ok;
    }
    let mut outer = [0u8; IP_HLEN];
    outer[0] = 0x45;
    outer[1] = hdr[1];
    let len = u16::from_be_bytes([hdr[2], hdr[3]]).wrapping_add(IP_HLEN as u16);
    outer[2..4].copy_from_slice(&len.to_be_bytes());
    outer[6] = hdr[6] & 0x40;
    outer[8] = hdr[8];
    outer[9] = IPPROTO_IPIP;
    outer[12..16].copy_from_slice(&entry.nh_addr[4..8]);
    outer[16..20].copy_from_slice(&entry.nh_addr[..4]);
    let mut sum = 0u32;
    for i in 0..IP_HLEN / 2 {
        sum += u32::from(u16::from_be_bytes([outer[2 * i], outer[2 * i + 1]]));
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    outer[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    // A TCP GSO packet's segment size shrinks by the outer header; other GSO packets (UDP)
    // keep theirs, which the route's MTU (the device's minus 20) already left room for.
    let mac = bpf_adj_room_mode::BPF_ADJ_ROOM_MAC;
    let flags = u64::from(BPF_F_ADJ_ROOM_ENCAP_L3_IPV4);
    if (ctx.adjust_room(IP_HLEN as i32, mac, flags).is_err()
        && ctx
            .adjust_room(
                IP_HLEN as i32,
                mac,
                flags | u64::from(BPF_F_ADJ_ROOM_FIXED_GSO),
            )
            .is_err())
        || ctx.store(ETH_HLEN, &outer, 0).is_err()
    {
        run.count(Decision::Malformed as u32);
        return TC_ACT_SHOT as i32;
    }
    run.count_entry(entry);
    run.count(Decision::Encapsulated as u32);
    ok
}

/// At ingress of the private interface (Ethernet): see the module doc. Only IPIP is looked at;
/// an outer header with options or fragmented is refused (no node of ours sends one).
#[classifier]
pub fn kilo_decap(ctx: TcContext) -> i32 {
    let ok = TC_ACT_OK as i32;
    if skb(&ctx).protocol != u32::from(ETH_P_IP.to_be()) {
        return ok;
    }
    let Some(outer) = load::<[u8; IP_HLEN]>(&ctx, ETH_HLEN) else {
        return ok;
    };
    if outer[9] != IPPROTO_IPIP || outer[0] >> 4 != 4 {
        return ok;
    }
    let Some(run) = Run::new(&ctx) else {
        return ok;
    };
    let refuse = || {
        run.count(Decision::IpipRefused as u32);
        TC_ACT_SHOT as i32
    };
    let fragment = outer[6] & 0x3f != 0 || outer[7] != 0;
    let Some(source) = KILO_IPIP_SRC.get(&key::<4>(&outer, 12)) else {
        return refuse();
    };
    if outer[0] != 0x45 || fragment {
        return refuse();
    }
    let Some(inner) = load::<[u8; IP_HLEN]>(&ctx, ETH_HLEN + IP_HLEN) else {
        return refuse();
    };
    if inner[0] >> 4 != 4 {
        return refuse();
    }
    let Some(served) = KILO_DECAP.get(&key::<4>(&inner, 16)) else {
        return refuse();
    };
    let flags = u64::from(BPF_F_ADJ_ROOM_DECAP_L3_IPV4);
    if ctx
        .adjust_room(
            -(IP_HLEN as i32),
            bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
            flags,
        )
        .is_err()
    {
        run.count(Decision::Malformed as u32);
        return TC_ACT_SHOT as i32;
    }
    run.count_entry(source);
    run.count_entry(served);
    run.count(Decision::Decapsulated as u32);
    ok
}

/// The context of a TC program: a __sk_buff.
#[inline(always)]
fn skb(ctx: &TcContext) -> &__sk_buff {
    // SAFETY: the context of a TC program is a __sk_buff.
    unsafe { &*(ctx.as_ptr() as *const __sk_buff) }
}

/// One run: the packet, the config, this CPU's region of KILO_COUNTERS, the packet's length.
struct Run<'a> {
    ctx: &'a TcContext,
    cfg: &'static Config,
    base: u32,
    len: u64,
}

impl<'a> Run<'a> {
    /// None only without a config (which cannot be missing): then all passes, uncounted.
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

    #[inline(always)]
    fn skb(&self) -> &__sk_buff {
        skb(self.ctx)
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

    /// Counts a packet in the counter of the entry `e` (none for NO_COUNTER or a slot past
    /// the region).
    #[inline(always)]
    fn count_entry(&self, e: &EntryValue) {
        if e.counter < self.cfg.counter_stride.wrapping_sub(DECISION_SLOTS) {
            self.count(DECISION_SLOTS + e.counter);
        }
    }

    /// Sets our mark bits for a masquerade, clears them for every other decision (others'
    /// bits are kept), counts the decision and logs a malformed packet.
    #[inline(always)]
    fn finish(&self, decision: Decision) {
        let (mark, mask) = (self.skb().mark, self.cfg.mask);
        let ours = if decision == Decision::Masquerade {
            self.cfg.mark & mask
        } else {
            0
        };
        if mark & mask != ours {
            set_mark(self.ctx.as_ptr() as *mut __sk_buff, (mark & !mask) | ours);
        }
        self.count(decision as u32);
        if decision == Decision::Malformed && self.cfg.log_level >= LOG_DEBUG {
            debug!(
                self.ctx,
                "malformed or truncated packet of {} bytes: passed untouched", self.len
            );
        }
    }
}

/// Writes the skb's mark. Not inlined: else LLVM reuses the load's modified context pointer
/// for the store, which the verifier refuses.
#[inline(never)]
fn set_mark(skb: *mut __sk_buff, mark: u32) {
    // SAFETY: the context of a TC program is a __sk_buff, whose mark it may write.
    unsafe { (*skb).mark = mark };
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

/// The lookup key of the address of `N` bytes at `hdr[at..]`.
#[inline(always)]
fn key<const N: usize>(hdr: &[u8], at: usize) -> Key<LpmData> {
    let mut addr = [0u8; 16];
    addr[..N].copy_from_slice(&hdr[at..at + N]);
    let family = if N == 16 { FAMILY_V6 } else { FAMILY_V4 };
    Key::new(FAMILY_BITS + 8 * N as u32, LpmData { family, addr })
}

/// The decision for an IP packet whose header starts at `off`.
#[inline(always)]
fn ip(run: &Run, v6: bool, off: usize) -> (i32, Decision) {
    let ok = TC_ACT_OK as i32;
    let (src, dst) = if v6 {
        let Some(hdr) = load::<[u8; 40]>(run.ctx, off) else {
            return (ok, Decision::Malformed);
        };
        if hdr[0] >> 4 != 6 {
            return (ok, Decision::Malformed);
        }
        (key::<16>(&hdr, 8), key::<16>(&hdr, 24))
    } else {
        let Some(hdr) = load::<[u8; 20]>(run.ctx, off) else {
            return (ok, Decision::Malformed);
        };
        if hdr[0] >> 4 != 4 || hdr[0] & 0x0f < 5 {
            return (ok, Decision::Malformed);
        }
        (key::<4>(&hdr, 12), key::<4>(&hdr, 16))
    };
    if let Some(entry) = KILO_MESH.get(&dst) {
        run.count_entry(entry);
        if entry.flags & ENTRY_REDIRECT != 0
            && entry.flags & ENTRY_SERVICE == 0
            && run.cfg.flags & CONFIG_FAST_PATH != 0
        {
            return redirect(run.ctx, v6, off, entry);
        }
        return (ok, Decision::Mesh);
    }
    let mut masquerade = false;
    for (trie, k) in [(&KILO_NAT_SRC, &src), (&KILO_MASQ_DST, &dst)] {
        if let Some(entry) = trie.get(k) {
            run.count_entry(entry);
            masquerade = true;
        }
    }
    let decision = if masquerade {
        Decision::Masquerade
    } else {
        Decision::Pass
    };
    (ok, decision)
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
        // SAFETY: a plain C struct of integers and byte arrays.
        let mut nh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        nh.nh_family = if entry.nh_family == FAMILY_V6 { 10 } else { 2 }; // AF_INET6 / AF_INET
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
