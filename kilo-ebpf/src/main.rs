//! The kilo TC programs. `kilo_ingress` (Ethernet, up to two VLAN tags) and `kilo_ingress_l3`
//! (raw IP), at ingress of the pod-facing devices and the WireGuard interface, decide with at
//! most two kernel LPM-trie lookups: the destination's longest match in `KILO_DST` is a mesh
//! destination → leave alone (or, fast path on, an egress in the entry, not a service:
//! redirect), or a masquerade destination → set our mark bits (the static nftables rule
//! masquerades); no match: source in `KILO_NAT_SRC` → set our mark bits; else leave alone. Only
//! the entry that decides counts the packet. Every other packet leaves with our mark bits clear
//! (others' are kept).
//! Nothing is dropped; malformed packets pass untouched. The only map writes are this CPU's
//! counters (and aya-log records of malformed packets when asked). The IPIP programs: [`ipip`].
//! Layouts: `kilo-common`.
#![no_std]
#![no_main]

mod ipip;
mod packet;

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, TC_ACT_OK, TC_ACT_REDIRECT, bpf_redir_neigh},
    helpers::bpf_get_smp_processor_id,
    helpers::generated::{bpf_redirect, bpf_redirect_neigh},
    macros::{classifier, map},
    maps::{Array, LpmTrie},
    programs::TcContext,
};
use aya_log_ebpf::debug;
use kilo_common::{
    CONFIG_FAST_PATH, Config, Counter, DECISION_SLOTS, DEFAULT_COUNTER_SLOTS, DEFAULT_MAX_ENTRIES,
    Decision, ENTRY_MASQUERADE, ENTRY_NEIGH, ENTRY_REDIRECT, ENTRY_SERVICE, EntryValue, FAMILY_V6,
    LpmData, counter_stride,
};
use packet::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IP_HLEN, addresses, load, skb};

type Trie = LpmTrie<LpmData, EntryValue>;
#[map]
static KILO_DST: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_NAT_SRC: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_CONFIG: Array<Config> = Array::with_max_entries(1, 0);
/// CPU by CPU: see kilo-common's `MAP_COUNTERS`. The loader sizes it for the possible CPUs.
#[map]
static KILO_COUNTERS: Array<Counter> = Array::with_max_entries(
    counter_stride(DEFAULT_COUNTER_SLOTS),
    aya_ebpf::bindings::BPF_F_MMAPABLE,
);

const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const LOG_DEBUG: u32 = 4;

/// For Ethernet devices (veth, bridges, NICs). An untagged IP frame is known by the skb's
/// protocol, which the stack has set from the frame's ethertype already; other frames are
/// walked (VLAN tags, other protocols).
#[classifier]
pub fn kilo_ingress(ctx: TcContext) -> i32 {
    decide(&ctx, |run| {
        let protocol = skb(run.ctx).protocol;
        if protocol == u32::from(ETH_P_IP.to_be()) {
            ip(run, false, ETH_HLEN)
        } else if protocol == u32::from(ETH_P_IPV6.to_be()) {
            ip(run, true, ETH_HLEN)
        } else {
            match l2(run.ctx) {
                Ok(Some((v6, off))) => ip(run, v6, off),
                Ok(None) => (TC_ACT_OK as i32, Decision::NotIp),
                Err(()) => (TC_ACT_OK as i32, Decision::Malformed),
            }
        }
    })
}

/// For raw-IP devices (WireGuard, TUN): the packet starts at the IP header.
#[classifier]
pub fn kilo_ingress_l3(ctx: TcContext) -> i32 {
    decide(&ctx, |run| {
        // The smallest IP header is 20 bytes (and `start + 1 > end` would compile to a `>=`
        // comparison the verifier does not turn into a packet range).
        match load::<[u8; IP_HLEN]>(run.ctx, 0).map(|h| h[0] >> 4) {
            Some(4) => ip(run, false, 0),
            Some(6) => ip(run, true, 0),
            Some(_) => (TC_ACT_OK as i32, Decision::NotIp),
            None => (TC_ACT_OK as i32, Decision::Malformed),
        }
    })
}

/// Runs `f` for the packet and finishes the run with its decision: our mark bits, the
/// counter, the log. Without a config (which cannot be missing) all passes, uncounted.
#[inline(always)]
fn decide(ctx: &TcContext, f: impl FnOnce(&Run) -> (i32, Decision)) -> i32 {
    let Some(run) = Run::new(ctx) else {
        return TC_ACT_OK as i32;
    };
    let (verdict, decision) = f(&run);
    run.finish(decision);
    verdict
}

/// The config, read once: the agent may rewrite it in place, so a packet's decisions all
/// use one copy rather than fields read at different moments.
#[inline(always)]
fn config() -> Option<Config> {
    let cfg = KILO_CONFIG.get_ptr(0)?;
    // SAFETY: a pointer to the array's value, valid for the program's run.
    Some(unsafe { core::ptr::read_volatile(cfg) })
}

/// One run: the packet, the config, this CPU and its region of KILO_COUNTERS, the packet's
/// length.
struct Run<'a> {
    ctx: &'a TcContext,
    cfg: Config,
    cpu: u32,
    base: u32,
    len: u64,
}

impl<'a> Run<'a> {
    #[inline(always)]
    fn new(ctx: &'a TcContext) -> Option<Self> {
        Some(Self::with_config(ctx, config()?))
    }

    /// A run with the config already read.
    #[inline(always)]
    fn with_config(ctx: &'a TcContext, cfg: Config) -> Self {
        // SAFETY: a helper without arguments.
        let cpu = unsafe { bpf_get_smp_processor_id() };
        Run {
            ctx,
            cfg,
            cpu,
            base: cpu * cfg.counter_stride,
            len: ctx.len() as u64,
        }
    }

    /// How many packets this CPU's counter `index` has counted.
    #[inline(always)]
    fn counted(&self, index: u32) -> u64 {
        KILO_COUNTERS
            .get(self.base + index)
            .map_or(0, |c| c.packets)
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
        let (mark, mask) = (skb(self.ctx).mark, self.cfg.mask);
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

/// Writes the skb's mark, inlined: a call to a BPF subprogram would cost a return, which
/// kernels with return thunks (AMD's SRSO "safe RET", call depth tracking) make expensive.
#[inline(always)]
fn set_mark(skb: *mut __sk_buff, mark: u32) {
    // SAFETY: the context of a TC program is a __sk_buff, whose mark it may write.
    unsafe { (*skb).mark = mark };
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

/// The decision for an IP packet whose header starts at `off`.
#[inline(always)]
fn ip(run: &Run, v6: bool, off: usize) -> (i32, Decision) {
    let ok = TC_ACT_OK as i32;
    let Some((src, dst)) = addresses(run.ctx, v6, off) else {
        return (ok, Decision::Malformed);
    };
    if let Some(entry) = KILO_DST.get(&dst) {
        run.count_entry(entry);
        if entry.flags & ENTRY_MASQUERADE != 0 {
            return (ok, Decision::Masquerade);
        }
        if entry.flags & ENTRY_REDIRECT != 0
            && entry.flags & ENTRY_SERVICE == 0
            && run.cfg.flags & CONFIG_FAST_PATH != 0
        {
            return redirect(run.ctx, v6, off, entry);
        }
        return (ok, Decision::Mesh);
    }
    match KILO_NAT_SRC.get(&src) {
        Some(entry) => {
            run.count_entry(entry);
            (ok, Decision::Masquerade)
        }
        None => (ok, Decision::Pass),
    }
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
