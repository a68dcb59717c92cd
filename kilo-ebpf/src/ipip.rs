//! IPIP inside a location (Kilo's `tunl0`, without the `ipip` module): `kilo_encap`, at egress
//! of the private interface, wraps IPv4 to a destination in `KILO_ENCAP` in an outer IPv4 header
//! (protocol 4) between the entry's addresses; `kilo_decap`, at its ingress, removes it when the
//! outer source is in `KILO_IPIP_SRC` and the inner destination in `KILO_DECAP`, and drops other
//! IPIP (Kilo's `KILO-IPIP`). Both pass every other packet untouched and uncounted.
//!
//! `kilo_encap` sees all of the host's traffic out of that interface. The agent gives the routes
//! it encapsulates the realm `KILO_REALM`; once it has seen the kernel keep it
//! (`CONFIG_ROUTE_REALM`), a packet whose route lacks it leaves after one helper call, without
//! the lookup (which still gives the outer addresses). A packet without a route (a fast-path
//! redirect with an explicit next hop) has no realm: the agent redirects nothing to wrap so.
use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4, BPF_F_ADJ_ROOM_FIXED_GSO, TC_ACT_OK, TC_ACT_SHOT,
        bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    },
    helpers::generated::bpf_get_route_realm,
    macros::{classifier, map},
    maps::LpmTrie,
    programs::TcContext,
};
use kilo_common::{CONFIG_ROUTE_REALM, DEFAULT_MAX_ENTRIES, Decision, ENTRY_IPIP, KILO_REALM};

use crate::{
    Run, Trie, config,
    packet::{ETH_HLEN, ETH_P_IP, IP_HLEN, ipv4, key, skb},
};

#[map]
static KILO_ENCAP: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_IPIP_SRC: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static KILO_DECAP: Trie = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);

const IPPROTO_IPIP: u8 = 4;

/// The IPv4 header of an Ethernet frame that carries IPv4.
#[inline(always)]
fn eth_ipv4(ctx: &TcContext) -> Option<[u8; IP_HLEN]> {
    if skb(ctx).protocol != u32::from(ETH_P_IP.to_be()) {
        return None;
    }
    ipv4(ctx, ETH_HLEN)
}

/// The outer header's identification (RFC 6864): this CPU's count of wrapped packets, offset
/// per CPU so that CPUs wrapping for the same pair of nodes start far apart; consecutive
/// packets from one CPU never share an ID, so an underlay that fragments can reassemble.
#[inline(always)]
fn outer_id(run: &Run) -> u16 {
    (run.counted(Decision::Encapsulated as u32) as u16)
        .wrapping_add((run.cpu as u16).wrapping_mul(0x9e37))
}

/// At egress of the private interface (Ethernet): see the module doc. The outer header copies
/// the inner TOS, TTL and DF bit, as Linux's fallback `tunl0` does, with an ID of its own; a GSO packet's segments
/// each get their own outer header when segmented (`SKB_GSO_IPXIP4`). A packet that cannot be
/// wrapped is dropped rather than sent bare.
#[classifier]
pub fn kilo_encap(ctx: TcContext) -> i32 {
    let ok = TC_ACT_OK as i32;
    if skb(&ctx).protocol != u32::from(ETH_P_IP.to_be()) {
        return ok;
    }
    let Some(cfg) = config() else {
        return ok;
    };
    // The realm is the "to" realm of the packet's route, in the low 16 bits (the high ones
    // hold the realm of the route back to a forwarded packet's source).
    if cfg.flags & CONFIG_ROUTE_REALM != 0
        // SAFETY: the context of a TC program is a __sk_buff.
        && unsafe { bpf_get_route_realm(ctx.as_ptr() as *mut _) } & 0xffff
            != u32::from(KILO_REALM)
    {
        return ok;
    }
    // IPIP already: ours (a redirect passing here again) or someone's; never wrapped twice.
    let Some(hdr) = ipv4(&ctx, ETH_HLEN).filter(|h| h[9] != IPPROTO_IPIP) else {
        return ok;
    };
    let Some(entry) = KILO_ENCAP.get(&key::<4>(&hdr, 16)) else {
        return ok;
    };
    let run = Run::with_config(&ctx, cfg);
    if entry.flags & ENTRY_IPIP == 0 {
        return ok;
    }
    let mut outer = [0u8; IP_HLEN];
    outer[0] = 0x45;
    outer[1] = hdr[1];
    let len = u16::from_be_bytes([hdr[2], hdr[3]]).wrapping_add(IP_HLEN as u16);
    outer[2..4].copy_from_slice(&len.to_be_bytes());
    outer[4..6].copy_from_slice(&outer_id(&run).to_be_bytes());
    outer[6] = hdr[6] & 0x40;
    outer[8] = hdr[8];
    outer[9] = IPPROTO_IPIP;
    outer[12..16].copy_from_slice(&entry.nh_addr[4..8]);
    outer[16..20].copy_from_slice(&entry.nh_addr[..4]);
    let mut sum = (0..IP_HLEN / 2).fold(0u32, |s, i| {
        s + u32::from(u16::from_be_bytes([outer[2 * i], outer[2 * i + 1]]))
    });
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    outer[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    // A TCP GSO packet's segment size shrinks by the outer header; other GSO packets (UDP)
    // keep theirs, which the route's MTU (the device's minus 20) already left room for.
    let grow = |flags: u32| {
        let flags = u64::from(BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 | flags);
        ctx.adjust_room(IP_HLEN as i32, BPF_ADJ_ROOM_MAC, flags)
            .is_ok()
    };
    if !(grow(0) || grow(BPF_F_ADJ_ROOM_FIXED_GSO)) || ctx.store(ETH_HLEN, &outer, 0).is_err() {
        run.count(Decision::Malformed as u32);
        return TC_ACT_SHOT as i32;
    }
    run.count_entry(entry);
    run.count(Decision::Encapsulated as u32);
    ok
}

/// At ingress of the private interface (Ethernet): see the module doc. Only IPIP is looked at;
/// an outer header with options or fragmented is refused (no node of ours sends one). The outer
/// header goes without a decapsulation flag: `BPF_F_ADJ_ROOM_DECAP_L3_IPV4` (Linux 6.3, refused
/// before) only sets the protocol, which IPv4 in IPv4 keeps, and drops a route, which a packet
/// has none of at TC ingress.
#[classifier]
pub fn kilo_decap(ctx: TcContext) -> i32 {
    let ok = TC_ACT_OK as i32;
    let Some(outer) = eth_ipv4(&ctx).filter(|h| h[9] == IPPROTO_IPIP) else {
        return ok;
    };
    let Some(run) = Run::new(&ctx) else {
        return ok;
    };
    let plain = outer[0] == 0x45 && outer[6] & 0x3f == 0 && outer[7] == 0;
    let source = KILO_IPIP_SRC.get(&key::<4>(&outer, 12)).filter(|_| plain);
    let served = source
        .and_then(|_| ipv4(&ctx, ETH_HLEN + IP_HLEN))
        .and_then(|inner| KILO_DECAP.get(&key::<4>(&inner, 16)));
    let (Some(source), Some(served)) = (source, served) else {
        run.count(Decision::IpipRefused as u32);
        return TC_ACT_SHOT as i32;
    };
    if ctx
        .adjust_room(-(IP_HLEN as i32), BPF_ADJ_ROOM_MAC, 0)
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
