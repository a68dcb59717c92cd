//! The lab: pod -> router -> receiver network namespaces joined by veth pairs, removed on drop
//! on every path (signals included), and what is read in them (device counters, conntrack).
use std::{
    fs::File,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    process::Command,
};

use kilo_testkit::netns::sh;

use crate::{
    POD,
    sender::{Macs, parse_mac},
};

/// The three namespaces; dropping deletes them (and with them every link, program attachment,
/// nft table and conntrack entry made inside).
pub struct Lab {
    pub pod: String,
    pub rtr: String,
    pub rcv: String,
    pub macs: Macs,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in [&self.pod, &self.rtr, &self.rcv] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

impl Lab {
    /// A lab whose names carry `tag` (one letter), so that several exist side by side.
    pub fn new(tag: &str) -> Lab {
        let pid = std::process::id();
        let mut lab = Lab {
            pod: format!("kbl{tag}-pod-{pid}"),
            rtr: format!("kbl{tag}-rtr-{pid}"),
            rcv: format!("kbl{tag}-rcv-{pid}"),
            macs: Macs {
                pod: [0; 6],
                router: [0; 6],
            },
        };
        for ns in [&lab.pod, &lab.rtr, &lab.rcv] {
            sh(&format!(
                "ip netns add {ns} && ip -n {ns} link set lo up && \
                 ip netns exec {ns} sysctl -qw net.ipv6.conf.all.disable_ipv6=1 \
                 net.ipv6.conf.default.disable_ipv6=1"
            ));
        }
        let (pod, rtr, rcv) = (&lab.pod, &lab.rtr, &lab.rcv);
        for (i, (a, a_if, b, b_if)) in [(pod, "eth0", rtr, "pod0"), (rtr, "out0", rcv, "eth0")]
            .into_iter()
            .enumerate()
        {
            let t = format!("kbl{pid}{tag}{i}");
            sh(&format!(
                "ip link add {t}a type veth peer name {t}b && \
                 ip link set {t}a netns {a} && ip link set {t}b netns {b} && \
                 ip -n {a} link set {t}a name {a_if} && ip -n {a} link set {a_if} up && \
                 ip -n {b} link set {t}b name {b_if} && ip -n {b} link set {b_if} up"
            ));
        }
        let mac = |ns: &str, dev: &str| {
            sh(&format!(
                "ip netns exec {ns} cat /sys/class/net/{dev}/address"
            ))
            .trim()
            .to_owned()
        };
        let pod0_mac = mac(rtr, "pod0");
        let pod_mac = mac(pod, "eth0");
        let rcv_mac = mac(rcv, "eth0");
        sh(&format!(
            "ip -n {pod} addr add {POD}/24 dev eth0 && ip -n {pod} route add default via 10.10.1.1 && \
             ip -n {pod} neigh replace 10.10.1.1 lladdr {pod0_mac} dev eth0 nud permanent"
        ));
        sh(&format!(
            "ip -n {rtr} addr add 10.10.1.1/24 dev pod0 && ip -n {rtr} addr add 192.0.2.1/24 dev out0 && \
             ip -n {rtr} route add 10.20.0.0/24 via 192.0.2.2 && \
             ip -n {rtr} route add default via 192.0.2.2 && \
             ip -n {rtr} neigh replace 192.0.2.2 lladdr {rcv_mac} dev out0 nud permanent && \
             ip netns exec {rtr} sysctl -qw net.ipv4.ip_forward=1"
        ));
        // The receiver drops every IP packet at its ingress: no socket, no ICMP.
        sh(&format!(
            "ip -n {rcv} addr add 192.0.2.2/24 dev eth0 && \
             ip -n {rcv} route add 10.10.1.0/24 via 192.0.2.1 && \
             {}",
            drop_at_ingress(rcv, "eth0")
        ));
        lab.macs = Macs {
            pod: parse_mac(&pod_mac),
            router: parse_mac(&pod0_mac),
        };
        lab
    }

    /// Steers the router's pod-facing receive to the CPUs of `mask` (0: RPS off).
    pub fn rps(&self, mask: u32) {
        sh(&format!(
            "ip netns exec {} sh -c 'echo {mask:x} > /sys/class/net/pod0/queues/rx-0/rps_cpus'",
            self.rtr
        ));
    }
}

/// The nftables table of [`drop_at_ingress`].
pub const DROP_TABLE: &str = "benchdrop";

/// An nftables netdev-ingress chain in `ns` that drops every IPv4 packet arriving on `dev`
/// (the kernel the figures were measured on has no tc `gact`/`matchall`).
pub fn drop_at_ingress(ns: &str, dev: &str) -> String {
    format!(
        "ip netns exec {ns} nft 'add table netdev {DROP_TABLE}; \
         add chain netdev {DROP_TABLE} in {{ type filter hook ingress device {dev} priority 0; }}; \
         add rule netdev {DROP_TABLE} in meta protocol ip drop'"
    )
}

/// Set by SIGINT/SIGTERM; the next run panics, so the guard's drop still deletes the lab.
pub static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::Relaxed);
}

pub fn stop_on_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

pub fn enter(ns: &str) {
    let path = format!("/run/netns/{ns}");
    let file = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    // SAFETY: a valid namespace fd; affects only the calling thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {path}: {}", io::Error::last_os_error());
}

/// (rx packets, tx packets) of `dev` in the calling thread's namespace.
pub fn dev_packets(dev: &str) -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/thread-self/net/dev").expect("/proc/net/dev");
    for line in text.lines() {
        if let Some((name, rest)) = line.split_once(':')
            && name.trim() == dev
        {
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|x| x.parse().unwrap())
                .collect();
            return (f[1], f[9]);
        }
    }
    panic!("no device {dev}");
}

pub fn conntrack_count() -> u64 {
    std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count")
        .map(|s| s.trim().parse().unwrap_or(0))
        .unwrap_or(0)
}

/// Deletes every IPv4 conntrack entry of the calling thread's namespace (ctnetlink
/// IPCTNL_MSG_CT_DELETE without attributes).
pub fn flush_conntrack() {
    // SAFETY: plain netlink socket calls on buffers we own.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_NETFILTER,
        );
        assert!(fd >= 0, "netlink socket: {}", io::Error::last_os_error());
        let fd = OwnedFd::from_raw_fd(fd);
        let mut msg = [0u8; 20];
        msg[0..4].copy_from_slice(&20u32.to_ne_bytes());
        msg[4..6].copy_from_slice(&0x0102u16.to_ne_bytes()); // CTNETLINK << 8 | CT_DELETE
        msg[6..8].copy_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
        msg[8..12].copy_from_slice(&1u32.to_ne_bytes());
        msg[16] = libc::AF_INET as u8;
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as u16;
        let rc = libc::sendto(
            fd.as_raw_fd(),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&raw const sa).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        );
        assert_eq!(rc, 20, "ctnetlink send: {}", io::Error::last_os_error());
        let mut buf = [0u8; 4096];
        let n = libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0);
        assert!(n >= 20, "ctnetlink ack: {}", io::Error::last_os_error());
        let kind = u16::from_ne_bytes([buf[4], buf[5]]);
        let err = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
        assert!(
            kind == libc::NLMSG_ERROR as u16 && (err == 0 || err == -libc::ENOENT),
            "conntrack flush failed: type {kind} error {err}"
        );
    }
}
