//! Crafted packets and a BPF_PROG_TEST_RUN wrapper for the datapath tests and benchmarks.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aya::{TestRun as _, TestRunOptions, programs::SchedClassifier};

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;

/// `sizeof(struct __sk_buff)` and the offsets the tests use.
pub const SKB_SIZE: usize = 192;
const SKB_MARK: usize = 8;
const SKB_IFINDEX: usize = 40;
const SKB_GSO_SEGS: usize = 164;
const SKB_GSO_SIZE: usize = 176;

/// An Ethernet header with VLAN tags (`(tpid, vid)`, outermost first) and the final ethertype.
pub fn eth(tags: &[(u16, u16)], proto: u16) -> Vec<u8> {
    let mut p = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    for (tpid, vid) in tags {
        p.extend_from_slice(&tpid.to_be_bytes());
        p.extend_from_slice(&vid.to_be_bytes());
    }
    p.extend_from_slice(&proto.to_be_bytes());
    p
}

pub fn checksum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += w as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The UDP checksum of `udp` (its checksum field zero) over the pseudo header of `src` and
/// `dst`; never 0, which means "no checksum" (and is not allowed for IPv6).
fn udp_checksum(src: IpAddr, dst: IpAddr, udp: &[u8]) -> u16 {
    let mut pseudo = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&[0, 17]);
            pseudo.extend_from_slice(&(udp.len() as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&(udp.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, 17]);
        }
        _ => panic!("mixed families"),
    }
    pseudo.extend_from_slice(udp);
    match checksum(&pseudo) {
        0 => 0xffff,
        c => c,
    }
}

/// An IPv4/UDP or IPv6/UDP packet (no L2 header) with `payload` bytes of payload.
pub fn ip(src: IpAddr, dst: IpAddr, ttl: u8, payload: usize) -> Vec<u8> {
    let udp_len = 8 + payload;
    let mut udp = vec![0x30, 0x39, 0x00, 0x35];
    udp.extend_from_slice(&(udp_len as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend(std::iter::repeat_n(0xab, payload));
    let c = udp_checksum(src, dst, &udp);
    udp[6..8].copy_from_slice(&c.to_be_bytes());
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut h = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, ttl, 17, 0, 0];
            h[2..4].copy_from_slice(&((20 + udp_len) as u16).to_be_bytes());
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            let c = checksum(&h);
            h[10..12].copy_from_slice(&c.to_be_bytes());
            h.extend(udp);
            h
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut h = vec![0x60, 0, 0, 0];
            h.extend_from_slice(&(udp_len as u16).to_be_bytes());
            h.push(17);
            h.push(ttl);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            h.extend(udp);
            h
        }
        _ => unreachable!(),
    }
}

/// An IP/UDP packet to `dst:port` (no L2 header), checksums valid.
pub fn udp_to(src: IpAddr, dst: IpAddr, port: u16) -> Vec<u8> {
    let mut p = ip(src, dst, 64, 4);
    let off = if src.is_ipv4() { 20 } else { 40 };
    p[off + 2..off + 4].copy_from_slice(&port.to_be_bytes());
    // Recompute the UDP checksum for the new port.
    p[off + 6..off + 8].copy_from_slice(&[0, 0]);
    let c = udp_checksum(src, dst, &p[off..]);
    p[off + 6..off + 8].copy_from_slice(&c.to_be_bytes());
    p
}

pub fn v4(s: &str) -> IpAddr {
    IpAddr::V4(s.parse::<Ipv4Addr>().unwrap())
}

pub fn v6(s: &str) -> IpAddr {
    IpAddr::V6(s.parse::<Ipv6Addr>().unwrap())
}

/// An Ethernet frame carrying an IP packet (family from the addresses).
pub fn frame(tags: &[(u16, u16)], src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let proto = if src.is_ipv4() { ETH_P_IP } else { ETH_P_IPV6 };
    let mut f = eth(tags, proto);
    f.extend(ip(src, dst, 64, 18));
    f
}

/// The result of one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub verdict: u32,
    pub mark: u32,
    /// The packet after the program (as the kernel hands it back).
    pub data: Vec<u8>,
}

/// Runs `prog` once on `data` with the given incoming mark. `ifindex` (> 1) makes the kernel
/// treat the packet as received on that device: on a device without a MAC header (TUN) the
/// first 14 bytes are consumed as a pseudo Ethernet header (giving skb->protocol) and the
/// program sees the packet from the IP header on, exactly as on a WireGuard device.
pub fn run(prog: &SchedClassifier, data: &[u8], mark: u32, ifindex: u32, repeat: u32) -> Run {
    let mut ctx = [0u8; SKB_SIZE];
    ctx[SKB_MARK..SKB_MARK + 4].copy_from_slice(&mark.to_ne_bytes());
    ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&ifindex.to_ne_bytes());
    let mut ctx_out = [0u8; SKB_SIZE];
    let mut out = vec![0u8; data.len() + 256];
    let res = prog
        .test_run(TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ctx_out: Some(&mut ctx_out),
            repeat,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN on {data:02x?}: {e}"));
    out.truncate(res.data_size_out as usize);
    Run {
        verdict: res.return_value,
        mark: u32::from_ne_bytes(ctx_out[SKB_MARK..SKB_MARK + 4].try_into().unwrap()),
        data: out,
    }
}

/// Runs `prog` once on `data` as a GSO packet of `segs` segments of `size` bytes.
pub fn run_gso(prog: &SchedClassifier, data: &[u8], size: u32, segs: u32) -> Run {
    let mut ctx = [0u8; SKB_SIZE];
    ctx[SKB_GSO_SEGS..SKB_GSO_SEGS + 4].copy_from_slice(&segs.to_ne_bytes());
    ctx[SKB_GSO_SIZE..SKB_GSO_SIZE + 4].copy_from_slice(&size.to_ne_bytes());
    let mut out = vec![0u8; data.len() + 256];
    let res = prog
        .test_run(TestRunOptions {
            data_in: Some(data),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN (GSO): {e}"));
    out.truncate(res.data_size_out as usize);
    Run {
        verdict: res.return_value,
        mark: 0,
        data: out,
    }
}

/// Runs `repeat` times and returns the kernel's average time per run, in nanoseconds.
pub fn time(prog: &SchedClassifier, data: &[u8], repeat: u32) -> f64 {
    let mut ctx = [0u8; SKB_SIZE];
    ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&0u32.to_ne_bytes());
    let res = prog
        .test_run(TestRunOptions {
            data_in: Some(data),
            ctx_in: Some(&ctx),
            repeat,
            ..Default::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    res.duration.as_nanos() as f64
}
