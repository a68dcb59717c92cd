//! The benchmarks' baselines, in an object of its own so the agent never loads it:
//! - `kilo_noop` returns at once (the cost of the TC hook and of BPF_PROG_TEST_RUN themselves);
//! - `kilo_lookups` makes only the lookups the design requires, as `kilo_ingress` makes them for
//!   an untagged IP frame: the destination in `BENCH_DST`, and on a miss the source in
//!   `BENCH_NAT_SRC`. It reads no config, counts nothing, sets no mark and passes every packet.
//!   The benchmarks fill its tries with the datapath's own entries, so the datapath's cost minus
//!   this one is what the program adds to the kernel's LPM-trie lookups.
#![no_std]
#![no_main]

mod packet;

use aya_ebpf::{
    bindings::TC_ACT_OK,
    macros::{classifier, map},
    maps::LpmTrie,
    programs::TcContext,
};
use kilo_common::{DEFAULT_MAX_ENTRIES, EntryValue, LpmData};
use packet::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, addresses, skb};

#[map]
static BENCH_DST: LpmTrie<LpmData, EntryValue> = LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);
#[map]
static BENCH_NAT_SRC: LpmTrie<LpmData, EntryValue> =
    LpmTrie::with_max_entries(DEFAULT_MAX_ENTRIES, 0);

#[classifier]
pub fn kilo_noop(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}

#[classifier]
pub fn kilo_lookups(ctx: TcContext) -> i32 {
    let protocol = skb(&ctx).protocol;
    let keys = if protocol == u32::from(ETH_P_IP.to_be()) {
        addresses(&ctx, false, ETH_HLEN)
    } else if protocol == u32::from(ETH_P_IPV6.to_be()) {
        addresses(&ctx, true, ETH_HLEN)
    } else {
        None
    };
    if let Some((src, dst)) = keys
        && BENCH_DST.get(&dst).is_none()
    {
        // The result is not used: the helper call is what the baseline measures.
        let _ = BENCH_NAT_SRC.get(&src);
    }
    TC_ACT_OK as i32
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
