//! Reading packets: the `__sk_buff`, bounds-checked loads, the IP headers and the LPM-trie keys
//! of their addresses. Shared by the datapath's programs and the benchmarks' baselines.
use aya_ebpf::{EbpfContext, bindings::__sk_buff, maps::lpm_trie::Key, programs::TcContext};
use kilo_common::{FAMILY_BITS, FAMILY_V4, FAMILY_V6, LpmData};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const IP_HLEN: usize = 20;

/// The context of a TC program: a __sk_buff.
#[inline(always)]
pub fn skb(ctx: &TcContext) -> &__sk_buff {
    // SAFETY: the context of a TC program is a __sk_buff.
    unsafe { &*(ctx.as_ptr() as *const __sk_buff) }
}

/// Reads a `T` at `off` bytes into the packet, if the packet is long enough.
#[inline(always)]
pub fn load<T: Copy>(ctx: &TcContext, off: usize) -> Option<T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + core::mem::size_of::<T>() > end {
        return None;
    }
    // SAFETY: bounds checked above; the packet may be unaligned.
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const T) })
}

/// The IPv4 header at `off` bytes into the packet, if the packet is long enough for one and
/// it says version 4.
#[inline(always)]
pub fn ipv4(ctx: &TcContext, off: usize) -> Option<[u8; IP_HLEN]> {
    load::<[u8; IP_HLEN]>(ctx, off).filter(|h| h[0] >> 4 == 4)
}

/// The (source, destination) keys of the IP header at `off` (IPv6 if `v6`), if the packet holds
/// a whole header of that version (for IPv4, with a valid header length).
#[inline(always)]
pub fn addresses(ctx: &TcContext, v6: bool, off: usize) -> Option<(Key<LpmData>, Key<LpmData>)> {
    if v6 {
        let hdr = load::<[u8; 40]>(ctx, off).filter(|h| h[0] >> 4 == 6)?;
        Some((key::<16>(&hdr, 8), key::<16>(&hdr, 24)))
    } else {
        let hdr = ipv4(ctx, off).filter(|h| h[0] & 0x0f >= 5)?;
        Some((key::<4>(&hdr, 12), key::<4>(&hdr, 16)))
    }
}

/// The lookup key of the address of `N` bytes at `hdr[at..]`. Built from 32-bit words: zeroing
/// the padding of an IPv4 address byte by byte would be a call to `memset`.
#[inline(always)]
pub fn key<const N: usize>(hdr: &[u8], at: usize) -> Key<LpmData> {
    let word = |i: usize| match hdr.get(at + 4 * i..at + 4 * i + 4) {
        Some(w) if 4 * i < N => u32::from_ne_bytes([w[0], w[1], w[2], w[3]]),
        _ => 0,
    };
    let words = [word(0), word(1), word(2), word(3)];
    // SAFETY: four u32s are 16 bytes, and any bytes are an address.
    let addr = unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(words) };
    let family = if N == 16 { FAMILY_V6 } else { FAMILY_V4 };
    Key::new(FAMILY_BITS + 8 * N as u32, LpmData { family, addr })
}
