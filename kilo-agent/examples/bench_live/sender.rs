//! The sender: raw Ethernet/IPv4/UDP frames from the pod namespace on an AF_PACKET socket
//! (qdisc bypassed, `sendmmsg`), pinned to one CPU, so that it stays cheaper than the router
//! and a cross-CPU router saturates.
use std::{
    io,
    net::Ipv4Addr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    thread,
    time::Duration,
};

use kilo_agent::datapath::ifindex;

use crate::{DPORT, INET_DST, POD, SENDER_CPU, SPORT, lab::enter};

#[derive(Clone, Copy)]
pub enum Flows {
    /// One established flow: fixed addresses and ports.
    One(Ipv4Addr),
    /// `count` new flows to the internet, one packet each (destination port, then address).
    New(u32),
}

/// Source and destination MAC of the pod's frames.
#[derive(Clone, Copy)]
pub struct Macs {
    pub pod: [u8; 6],
    pub router: [u8; 6],
}

pub fn parse_mac(s: &str) -> [u8; 6] {
    let mut mac = [0u8; 6];
    for (m, part) in mac.iter_mut().zip(s.trim().split(':')) {
        *m = u8::from_str_radix(part, 16).expect("MAC address");
    }
    mac
}

const FRAME: usize = 60;

/// A 60-byte Ethernet + IPv4 + UDP frame from the pod (port 4000) to `dst:dport`, UDP checksum 0.
fn frame(macs: Macs, dst: Ipv4Addr, dport: u16) -> [u8; FRAME] {
    let mut f = [0x5au8; FRAME];
    f[0..6].copy_from_slice(&macs.router);
    f[6..12].copy_from_slice(&macs.pod);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut f[14..34];
    ip.copy_from_slice(&[
        0x45, 0, 0, 46, 0, 0, 0x40, 0, 64, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    ip[12..16].copy_from_slice(&POD.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let mut sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f[34..36].copy_from_slice(&SPORT.to_be_bytes());
    f[36..38].copy_from_slice(&dport.to_be_bytes());
    f[38..40].copy_from_slice(&26u16.to_be_bytes());
    f[40..42].copy_from_slice(&[0, 0]);
    f
}

fn new_flow(macs: Macs, i: u32) -> [u8; FRAME] {
    let ip = u32::from(INET_DST) + i / 50_000;
    frame(macs, Ipv4Addr::from(ip), 10_000 + (i % 50_000) as u16)
}

/// Sends from the pod namespace's eth0 on CPU 0; returns the number of frames sent.
/// With `gap_ns` > 0, one frame per call, paced `gap_ns` apart (spinning).
pub fn send(pod: &str, macs: Macs, flows: Flows, packets: u64, gap_ns: u64) -> u64 {
    let pod = pod.to_owned();
    thread::spawn(move || {
        enter(&pod);
        kilo_testkit::pin_to_cpu(SENDER_CPU);
        // Fewer preemptions by the machine's other work (and cold caches after them).
        // SAFETY: setpriority on the calling thread.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, -10) };
        const BATCH: usize = 64;
        const PACKET_QDISC_BYPASS: libc::c_int = 20;
        // SAFETY: an AF_PACKET socket and sendmmsg over arrays that outlive the calls.
        unsafe {
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "packet socket: {}", io::Error::last_os_error());
            let fd = OwnedFd::from_raw_fd(fd);
            let one: libc::c_int = 1;
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_QDISC_BYPASS,
                (&raw const one).cast(),
                4,
            );
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_ifindex = ifindex("eth0").expect("pod eth0") as i32;
            assert_eq!(
                libc::bind(
                    fd.as_raw_fd(),
                    (&raw const sll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32
                ),
                0,
                "bind: {}",
                io::Error::last_os_error()
            );
            let total = match flows {
                Flows::One(_) => packets,
                Flows::New(n) => u64::from(n),
            };
            let mut frames = [[0u8; FRAME]; BATCH];
            if let Flows::One(dst) = flows {
                frames = [frame(macs, dst, DPORT); BATCH];
            }
            let mut iovs: [libc::iovec; BATCH] = std::mem::zeroed();
            let mut msgs: [libc::mmsghdr; BATCH] = std::mem::zeroed();
            for (j, (m, iov)) in msgs.iter_mut().zip(iovs.iter_mut()).enumerate() {
                iov.iov_base = frames[j].as_mut_ptr().cast();
                iov.iov_len = FRAME;
                m.msg_hdr.msg_iov = iov;
                m.msg_hdr.msg_iovlen = 1;
            }
            let mut sent = 0u64;
            let start = std::time::Instant::now();
            while sent < total {
                let k = if gap_ns > 0 {
                    let due = Duration::from_nanos(sent * gap_ns);
                    while start.elapsed() < due {
                        std::hint::spin_loop();
                    }
                    1
                } else {
                    (total - sent).min(BATCH as u64) as usize
                };
                if let Flows::New(_) = flows {
                    for (j, f) in frames.iter_mut().enumerate().take(k) {
                        *f = new_flow(macs, (sent + j as u64) as u32);
                    }
                }
                let rc = libc::sendmmsg(fd.as_raw_fd(), msgs.as_mut_ptr(), k as u32, 0);
                if rc < 0 {
                    let e = io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::ENOBUFS | libc::EAGAIN | libc::EINTR) => continue,
                        _ => panic!("sendmmsg: {e}"),
                    }
                }
                sent += rc as u64;
            }
            sent
        }
    })
    .join()
    .expect("sender thread panicked")
}
