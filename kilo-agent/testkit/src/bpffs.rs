//! A private bpffs for tests that pin (mounted on a temporary directory, unmounted on drop),
//! and UDP probes that tell which source address a receiver sees.
use std::{
    net::{IpAddr, SocketAddr, UdpSocket},
    path::PathBuf,
    sync::mpsc,
    time::Duration,
};

use super::netns::{NetNs, sh, try_sh};

pub struct BpfFs {
    pub dir: tempfile::TempDir,
}

impl BpfFs {
    /// Mounts a bpffs on a new temporary directory (no `Default`: it would hide the mount).
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        sh(&format!("mount -t bpf bpf {}", dir.path().display()));
        BpfFs { dir }
    }

    /// A pin directory inside this bpffs.
    pub fn pin_dir(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        let _ = try_sh(&format!("umount -l {}", self.dir.path().display()));
    }
}

/// A UDP listener in a namespace that reports the source address of the first datagram.
pub struct Listener(std::thread::JoinHandle<Option<IpAddr>>);

impl Listener {
    /// Binds `port` (IPv4 or IPv6 wildcard) in `ns` and returns once it is listening.
    pub fn new(ns: &NetNs, v6: bool, port: u16) -> Self {
        let (ready_tx, ready_rx) = mpsc::channel();
        let path = format!("/run/netns/{}", ns.name);
        let handle = std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap();
            // SAFETY: a valid namespace fd; affects only this thread.
            let rc =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0);
            let bind: SocketAddr = if v6 {
                format!("[::]:{port}").parse().unwrap()
            } else {
                format!("0.0.0.0:{port}").parse().unwrap()
            };
            let sock = UdpSocket::bind(bind).expect("bind listener");
            sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            ready_tx.send(()).unwrap();
            let mut buf = [0u8; 64];
            sock.recv_from(&mut buf).ok().map(|(_, src)| src.ip())
        });
        ready_rx.recv().expect("listener ready");
        Listener(handle)
    }

    /// The source of the first datagram (None if nothing arrived within a few seconds).
    pub fn source(self) -> Option<IpAddr> {
        self.0.join().expect("listener")
    }
}

/// Sends UDP datagrams from `from` to `dst:port` and returns the source address the listener in
/// `to` saw (None if nothing arrived within a few seconds).
pub fn udp_source(from: &NetNs, to: &NetNs, dst: IpAddr, port: u16) -> Option<IpAddr> {
    let listener = Listener::new(to, dst.is_ipv6(), port);
    from.run(move || {
        let bind: SocketAddr = if dst.is_ipv4() {
            "0.0.0.0:0".parse().unwrap()
        } else {
            "[::]:0".parse().unwrap()
        };
        let sock = UdpSocket::bind(bind).unwrap();
        // A few datagrams: the first may wait for neighbour resolution.
        for _ in 0..3 {
            let _ = sock.send_to(b"kilo", SocketAddr::new(dst, port));
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    listener.source()
}
