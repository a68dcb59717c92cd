//! Mesh tier, IPIP inside a location done by the datapath: real `kg` agents with Kilo's default
//! `--encapsulate=always` (file backend, wireguard-go, pods behind bridges), on a kernel without
//! the `ipip` module.
//!
//! - Two locations of two nodes, each location on its own underlay, joined by a router: a
//!   non-leader's pod pings and sends TCP (large enough for GSO super-packets) to pods in its
//!   own location and in the other; a capture on the location's underlay sees IPIP between the
//!   nodes and never a bare pod address; the routes Kilo points at `tunl0` leave by `eth0` with
//!   its MTU minus 20 and realm `KILO_REALM`, and kg told the datapath realms hold
//!   (`CONFIG_ROUTE_REALM`); the counters moved. The node's own traffic to a location node
//!   leaves bare and uncounted (its route has no realm). A plain IPIP packet built by the kernel (what a Kilo
//!   node's `tunl0` sends) from a node of the location reaches the pod; the same from an
//!   address outside the location is dropped and counted.
//! - `--encapsulate=crosssubnet`, one location over two subnets joined by a router: plain
//!   between same-subnet nodes, IPIP across subnets (through the router, which knows no pods).
use kilo_testkit as support;

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::Duration,
};

use support::{
    bpffs::{BpfFs, Listener},
    kg::{Kg, Launch},
    netns::{NetNs, WgGo, veth},
    packets::udp_to,
};

/// One node: where it sits and what it has.
struct Spec {
    name: &'static str,
    location: &'static str,
    /// Index of its underlay.
    under: usize,
    /// Its private address (with prefix) and default gateway.
    addr: &'static str,
    gateway: &'static str,
    /// A Kilo node instead of kg: the kernel's `tunl0` does its IPIP (see [`kilo_node`]).
    kilo: bool,
    /// Pod CIDR 10.42.<pods>.0/24, the pod at .2.
    pods: u8,
}

struct Node {
    name: &'static str,
    ns: NetNs,
    pod: NetNs,
    _wg: Option<WgGo>,
    kg: Option<Kg>,
}

struct Mesh {
    nodes: Vec<Node>,
    unders: Vec<NetNs>,
    _router: Option<NetNs>,
    work: tempfile::TempDir,
    bpffs: BpfFs,
}

impl Mesh {
    /// Builds the underlays (a bridge each; with `router`, a router between the first two at
    /// .254), the nodes with their pods and WireGuard devices, and starts `kg` on each with
    /// `flags` (nothing else beyond what a node needs).
    fn new(specs: &[Spec], unders: usize, router: bool, flags: &[&str]) -> Mesh {
        let unders: Vec<NetNs> = (0..unders)
            .map(|_| {
                let u = NetNs::new("ipu");
                u.sh("ip link add br0 type bridge && ip link set br0 up");
                u
            })
            .collect();
        let router = router.then(|| {
            let r = NetNs::new("ipr");
            r.sh("sysctl -qw net.ipv4.ip_forward=1");
            for (i, net) in ["192.168.50", "192.168.60"].iter().enumerate() {
                veth(&r, &format!("eth{i}"), &unders[i], "router");
                unders[i].sh("ip link set router master br0");
                r.sh(&format!("ip addr add {net}.254/24 dev eth{i}"));
            }
            r
        });
        let work = tempfile::tempdir().unwrap();
        let objects = work.path().join("objects");
        std::fs::create_dir(&objects).unwrap();
        let bpffs = BpfFs::new();
        let mut nodes = Vec::new();
        for s in specs {
            let ns = NetNs::new("ipn");
            let under = &unders[s.under];
            veth(&ns, "eth0", under, s.name);
            under.sh(&format!("ip link set {} master br0", s.name));
            ns.sh(&format!(
                "ip addr add {} dev eth0 && ip route add default via {} && sysctl -qw net.ipv4.ip_forward=1",
                s.addr, s.gateway
            ));
            ns.sh(&format!(
                "ip link add kube-bridge type bridge && ip addr add 10.42.{}.1/24 dev kube-bridge && ip link set kube-bridge up",
                s.pods
            ));
            let pod = NetNs::new("ipp");
            veth(&pod, "eth0", &ns, "veth-pod");
            ns.sh("ip link set veth-pod master kube-bridge");
            pod.sh(&format!(
                "ip addr add 10.42.{0}.2/24 dev eth0 && ip route add default via 10.42.{0}.1",
                s.pods
            ));
            if s.kilo {
                kilo_node(&ns, s, specs, &objects);
                nodes.push(Node {
                    name: s.name,
                    ns,
                    pod,
                    _wg: None,
                    kg: None,
                });
                continue;
            }
            // wireguard-go, or with kernel WireGuard a name for the device kg creates.
            let wg = (!support::kernel_wireguard()).then(|| WgGo::start(&ns));
            let wg_name = wg
                .as_ref()
                .map_or_else(support::netns::device_name, |w| w.name.clone());
            std::fs::write(
                objects.join(format!("{}.yaml", s.name)),
                format!(
                    "apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n  annotations:\n    kilo.squat.ai/location: {}\nspec:\n  podCIDR: 10.42.{}.0/24\n",
                    s.name, s.location, s.pods
                ),
            )
            .unwrap();
            let cni = work.path().join(format!("{}.conflist", s.name));
            std::fs::copy(
                concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../manifests/overlays/kubeadm/cni-conf.json"
                ),
                &cni,
            )
            .unwrap();
            let kg = Launch::kg()
                .netns(&ns.name)
                .args([
                    "--backend=file".to_string(),
                    format!("--backend-dir={}", objects.display()),
                    format!("--hostname={}", s.name),
                    format!("--cni-path={}", cni.display()),
                    support::create_interface_flag().into(),
                    format!("--interface={wg_name}"),
                    format!(
                        "--private-key={}",
                        work.path().join(format!("{}.key", s.name)).display()
                    ),
                    format!("--bpffs-dir={}", bpffs.pin_dir(s.name).display()),
                    "--listen=127.0.0.1:1107".into(),
                    "--resync-period=5s".into(),
                    "--log-format=text".into(),
                    // The failover probe's echoes to the leader are wrapped too: these meshes
                    // count the encapsulation's packets exactly.
                    "--failover-probe-period=0".into(),
                ])
                .args(flags)
                .log_file(work.path().join(format!("{}.log", s.name)))
                .spawn();
            nodes.push(Node {
                name: s.name,
                ns,
                pod,
                _wg: wg,
                kg: Some(kg),
            });
        }
        Mesh {
            nodes,
            unders,
            _router: router,
            work,
            bpffs,
        }
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for e in std::fs::read_dir(self.work.path()).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                out += &format!(
                    "--- {}\n{}\n",
                    e.path().display(),
                    std::fs::read_to_string(e.path()).unwrap_or_default()
                );
            }
        }
        out
    }

    /// Pings from node `from`'s pod to `dst` (three packets, all answered), once the mesh
    /// lets one through.
    fn ping(&self, from: usize, dst: &str) {
        let pod = &self.nodes[from].pod;
        for _ in 0..60 {
            if pod
                .try_sh(&format!("busybox ping -c1 -W1 {dst}"))
                .status
                .success()
            {
                break;
            }
        }
        let out = pod.try_sh(&format!("busybox ping -c3 -W2 {dst}"));
        assert!(
            out.status.success(),
            "ping {dst} from pod {from}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            self.logs()
        );
    }

    /// A value from node `i`'s `/metrics` (0 when absent).
    fn metric(&self, i: usize, series: &str) -> u64 {
        let kg = self.nodes[i].kg.as_ref().expect("kg runs");
        let text = kg.metrics().expect("kg's /metrics");
        support::metrics::metric(&text, series).unwrap_or(0)
    }

    /// The flags of node `i`'s pinned config map.
    fn config_flags(&self, i: usize) -> u32 {
        use aya::maps::{Array, Map, MapData};
        let pin = (self.bpffs.pin_dir(self.nodes[i].name))
            .join("maps")
            .join(kilo_common::MAP_CONFIG);
        let data = MapData::from_pin(&pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
        let config: Array<_, kilo_common::Config> = Array::try_from(Map::Array(data)).unwrap();
        config.get(&0, 0).unwrap().flags
    }

    /// SIGTERM to every agent (they clean up), then waits for them.
    fn stop(&mut self) {
        for n in &self.nodes {
            if let Some(kg) = &n.kg {
                kg.signal(libc::SIGTERM);
            }
        }
        for n in &mut self.nodes {
            if let Some(mut kg) = n.kg.take() {
                kg.wait();
            }
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sets node `s` up as a Kilo agent with `--encapsulate=always` leaves a node that does not lead
/// its location: `tunl0` up with the first address of its pod CIDR, and every other node's pod
/// CIDR through `tunl0` to its location's leader (the first node of its location, as in these
/// meshes); its Node object carries what Kilo publishes (key, endpoint, internal IP, last-seen),
/// with last-seen kept fresh by [`Heartbeat`].
fn kilo_node(ns: &NetNs, s: &Spec, specs: &[Spec], objects: &std::path::Path) {
    let leader = specs
        .iter()
        .find(|o| o.location == s.location)
        .expect("a leader");
    let leader_ip = leader.addr.split('/').next().unwrap();
    ns.sh(&format!(
        "ip link set tunl0 mtu 1480 up && ip addr add 10.42.{}.1/32 dev tunl0 && \
         sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.tunl0.rp_filter=0",
        s.pods
    ));
    for o in specs.iter().filter(|o| o.name != s.name) {
        ns.sh(&format!(
            "ip route add 10.42.{}.0/24 via {leader_ip} dev tunl0 onlink",
            o.pods
        ));
    }
    write_kilo_object(s, objects);
}

/// The Node object of a Kilo node `s`, last seen now (written whole, then renamed into place).
fn write_kilo_object(s: &Spec, objects: &std::path::Path) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let ip = s.addr.split('/').next().unwrap();
    let yaml = format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  annotations:\n    \
         kilo.squat.ai/location: {location}\n    kilo.squat.ai/key: {key}\n    \
         kilo.squat.ai/endpoint: {ip}:51820\n    kilo.squat.ai/internal-ip: {addr}\n    \
         kilo.squat.ai/granularity: location\n    kilo.squat.ai/last-seen: \"{now}\"\n\
         spec:\n  podCIDR: 10.42.{pods}.0/24\n",
        name = s.name,
        location = s.location,
        key = support::kg::peer_key(s.pods),
        addr = s.addr,
        pods = s.pods,
    );
    let tmp = objects.join(format!(".{}.tmp", s.name));
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, objects.join(format!("{}.yaml", s.name))).unwrap();
}

/// Keeps a Kilo node's last-seen fresh (every 10 s, as its agent's check-in would) until dropped.
struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    fn start(s: &'static Spec, objects: std::path::PathBuf) -> Heartbeat {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                for _ in 0..100 {
                    if flag.load(Ordering::Relaxed) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                write_kilo_object(s, &objects);
            }
        });
        Heartbeat {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Why the kernel's IPIP (`tunl0`) cannot be had here, if it cannot: the host's kernel may
/// have no `ipip` module (the kernel matrix runs the test on kernels that have it).
fn ipip_module_missing() -> Option<String> {
    let _ = support::netns::try_sh("modprobe -q ipip");
    (!std::path::Path::new("/sys/module/ipip").exists())
        .then(|| "no ipip module (the kernel's tunl0, which Kilo uses)".to_string())
}

fn decision(d: &str) -> String {
    format!("kilo_datapath_packets_total{{decision=\"{d}\"}}")
}

/// IPv4 frames seen on every port of the underlay `under` while `f` runs: (protocol, source,
/// destination) of each (an AF_PACKET socket: no capture tool needed).
fn capture<T>(under: &NetNs, f: impl FnOnce() -> T) -> (T, Vec<(u8, Ipv4Addr, Ipv4Addr)>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = mpsc::channel();
    let path = format!("/run/netns/{}", under.name);
    let flag = stop.clone();
    let thread = std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a valid namespace fd; affects only this thread.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0);
        // SAFETY: plain socket calls on a socket this thread owns.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW,
                i32::from((libc::ETH_P_ALL as u16).to_be()),
            )
        };
        assert!(fd >= 0, "AF_PACKET: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: a valid socket and a timeval of the right size.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                size_of::<libc::timeval>() as u32,
            )
        };
        ready_tx.send(()).unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 256];
        while !flag.load(Ordering::Relaxed) {
            // SAFETY: reading into a buffer of the given length.
            let n = unsafe { libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
            if n >= 34 && buf[12..14] == [0x08, 0x00] {
                let a = |at: usize| Ipv4Addr::new(buf[at], buf[at + 1], buf[at + 2], buf[at + 3]);
                seen.push((buf[23], a(26), a(30)));
            }
        }
        // SAFETY: closing the socket this thread opened.
        unsafe { libc::close(fd) };
        seen
    });
    ready_rx.recv().unwrap();
    let out = f();
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    (out, thread.join().unwrap())
}

/// Sends `bytes` over TCP from `from` to `dst:5001` in `to`; returns what arrived, summed.
fn tcp(from: &NetNs, to: &NetNs, dst: Ipv4Addr, bytes: usize) -> (usize, u64) {
    let (ready_tx, ready_rx) = mpsc::channel();
    let path = format!("/run/netns/{}", to.name);
    let server = std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a valid namespace fd; affects only this thread.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0);
        let listener = TcpListener::bind("0.0.0.0:5001").unwrap();
        ready_tx.send(()).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut data = Vec::new();
        let _ = s.read_to_end(&mut data);
        (data.len(), data.iter().map(|b| u64::from(*b)).sum::<u64>())
    });
    ready_rx.recv().unwrap();
    from.run(move || {
        let mut s =
            TcpStream::connect_timeout(&SocketAddr::new(dst.into(), 5001), Duration::from_secs(10))
                .expect("connect");
        let data: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        s.write_all(&data).unwrap();
    });
    server.join().unwrap()
}

/// What `tcp` must have received.
fn sent(bytes: usize) -> (usize, u64) {
    (bytes, (0..bytes).map(|i| (i % 251) as u64).sum())
}

fn is_pod(a: &Ipv4Addr) -> bool {
    a.octets()[..2] == [10, 42]
}

/// Sends, from `ns`, a plain IPIP packet made by the kernel (a raw socket of protocol 4, as a
/// Kilo node's `tunl0` would) to `outer_dst`, carrying a UDP datagram from `inner_src` to
/// `inner_dst:port`.
fn send_ipip(ns: &NetNs, outer_dst: &str, inner_src: &str, inner_dst: &str, port: u16) {
    let inner = udp_to(inner_src.parse().unwrap(), inner_dst.parse().unwrap(), port);
    let dst: Ipv4Addr = outer_dst.parse().unwrap();
    ns.run(move || {
        // SAFETY: a raw socket this closure owns, a sockaddr_in of the right size.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_IPIP);
            assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as u16;
            sa.sin_addr.s_addr = u32::from_ne_bytes(dst.octets());
            for _ in 0..3 {
                let n = libc::sendto(
                    fd,
                    inner.as_ptr() as *const libc::c_void,
                    inner.len(),
                    0,
                    &sa as *const _ as *const libc::sockaddr,
                    size_of::<libc::sockaddr_in>() as u32,
                );
                assert!(n > 0, "sendto: {}", std::io::Error::last_os_error());
                std::thread::sleep(Duration::from_millis(50));
            }
            libc::close(fd);
        }
    });
}

#[test]
fn two_locations_with_default_encapsulation() {
    if !support::require_root("two_locations_with_default_encapsulation") {
        return;
    }
    let spec = |name, location, under, addr, gateway, pods| Spec {
        name,
        location,
        under,
        addr,
        gateway,
        pods,
        kilo: false,
    };
    let mut mesh = Mesh::new(
        &[
            spec("n1", "east", 0, "192.168.50.1/24", "192.168.50.254", 1),
            spec("n2", "east", 0, "192.168.50.2/24", "192.168.50.254", 2),
            spec("n3", "west", 1, "192.168.60.3/24", "192.168.60.254", 3),
            spec("n4", "west", 1, "192.168.60.4/24", "192.168.60.254", 4),
        ],
        2,
        true,
        &[],
    );
    // n2, not a leader (n1 leads east): to the other location (its leader's pod and the
    // other non-leader's), and to its own leader's pod. Captured once the mesh is up (before,
    // pods' packets take the nodes' default route).
    for dst in ["10.42.3.2", "10.42.4.2", "10.42.1.2"] {
        mesh.ping(1, dst);
    }
    let ((), frames) = capture(&mesh.unders[0], || {
        for dst in ["10.42.3.2", "10.42.4.2", "10.42.1.2"] {
            mesh.ping(1, dst);
        }
        for (to, dst) in [(2, "10.42.3.2"), (3, "10.42.4.2"), (0, "10.42.1.2")] {
            let got = tcp(
                &mesh.nodes[1].pod,
                &mesh.nodes[to].pod,
                dst.parse().unwrap(),
                1 << 20,
            );
            assert_eq!(got, sent(1 << 20), "TCP to {dst}\n{}", mesh.logs());
        }
    });
    let (n1, n2): (Ipv4Addr, Ipv4Addr) = (
        "192.168.50.1".parse().unwrap(),
        "192.168.50.2".parse().unwrap(),
    );
    let ipip = frames
        .iter()
        .filter(|(p, s, d)| *p == 4 && [(n1, n2), (n2, n1)].contains(&(*s, *d)))
        .count();
    let bare: Vec<_> = frames
        .iter()
        .filter(|(_, s, d)| is_pod(s) || is_pod(d))
        .collect();
    assert!(ipip > 100, "{ipip} IPIP frames between n1 and n2");
    assert!(
        bare.is_empty(),
        "bare pod addresses on the underlay: {bare:?}"
    );

    // The route to the other location leaves by eth0, toward the leader, 20 bytes short,
    // with our realm; so do the other routes Kilo points at tunl0, and no other of ours.
    let route = mesh.nodes[1].ns.sh("ip route show 10.42.3.0/24");
    let realm = format!("realm {}", kilo_common::KILO_REALM);
    assert!(
        route.contains("via 192.168.50.1 dev eth0")
            && route.contains("mtu 1480")
            && route.contains(&realm),
        "{route}"
    );
    for table in ["main", "1107"] {
        let routes = mesh.nodes[1]
            .ns
            .sh(&format!("ip route show proto 107 table {table}"));
        for line in routes.lines() {
            assert_eq!(line.contains("dev eth0"), line.contains(&realm), "{line}");
        }
    }
    // Seen by kg: the encapsulation checks the realm first.
    for i in 0..4 {
        let flags = mesh.config_flags(i);
        assert_ne!(
            flags & kilo_common::CONFIG_ROUTE_REALM,
            0,
            "node {i}: {flags:#x}"
        );
    }
    assert!(mesh.metric(1, &decision("encapsulated")) > 0);
    assert!(mesh.metric(1, &decision("decapsulated")) > 0);
    assert!(mesh.metric(0, &decision("decapsulated")) > 0);
    // TCP super-packets (GSO) were wrapped whole: more bytes than an MTU per packet.
    let (packets, bytes) = (
        mesh.metric(1, &decision("encapsulated")),
        mesh.metric(1, "kilo_datapath_bytes_total{decision=\"encapsulated\"}"),
    );
    assert!(bytes / packets > 1500, "{bytes} bytes in {packets} packets");

    // n2's own traffic to n1 is in the encapsulation's map (n1's private IP, for n2's pods
    // through table 1107) but its route (main table) carries no realm: it leaves bare and
    // uncounted. (With the full lookup, the program would have wrapped it.)
    let wrapped = mesh.metric(1, &decision("encapsulated"));
    let ((), frames) = capture(&mesh.unders[0], || {
        mesh.nodes[1]
            .ns
            .sh("busybox ping -c3 -W2 192.168.50.1 >/dev/null");
    });
    let bare_icmp = frames
        .iter()
        .filter(|(p, s, d)| *p == 1 && (*s, *d) == (n2, n1))
        .count();
    assert!(
        bare_icmp >= 3,
        "{bare_icmp} bare echo requests from n2 to n1"
    );
    assert_eq!(mesh.metric(1, &decision("encapsulated")), wrapped);
    // ...while its pods' traffic to n1 (through table 1107, with the realm) is still wrapped.
    let ((), frames) = capture(&mesh.unders[0], || mesh.ping(1, "192.168.50.1"));
    assert!(
        frames
            .iter()
            .any(|(p, s, d)| *p == 4 && (*s, *d) == (n2, n1))
    );
    assert!(mesh.metric(1, &decision("encapsulated")) >= wrapped + 3);

    // Kilo's wire format: IPIP made by the kernel from n2 reaches n1's pod...
    let listener = Listener::new(&mesh.nodes[0].pod, false, 7001);
    send_ipip(
        &mesh.nodes[1].ns,
        "192.168.50.1",
        "10.42.2.2",
        "10.42.1.2",
        7001,
    );
    assert_eq!(listener.source(), Some("10.42.2.2".parse().unwrap()));
    // ...and the same from outside the location is dropped and counted.
    let stranger = NetNs::new("ipx");
    veth(&stranger, "eth0", &mesh.unders[0], "stranger");
    mesh.unders[0].sh("ip link set stranger master br0");
    stranger.sh("ip addr add 192.168.50.99/24 dev eth0");
    let refused = mesh.metric(0, &decision("ipip_refused"));
    let listener = Listener::new(&mesh.nodes[0].pod, false, 7002);
    send_ipip(&stranger, "192.168.50.1", "10.42.2.2", "10.42.1.2", 7002);
    assert_eq!(listener.source(), None, "a stranger's IPIP got through");
    assert!(mesh.metric(0, &decision("ipip_refused")) >= refused + 3);

    mesh.stop();
    let routes = mesh.nodes[1].ns.sh("ip route show proto 107");
    assert!(routes.trim().is_empty(), "routes left: {routes}");
}

#[test]
fn crosssubnet_encapsulates_only_across_subnets() {
    if !support::require_root("crosssubnet_encapsulates_only_across_subnets") {
        return;
    }
    let spec = |name, under, addr, gateway, pods| Spec {
        name,
        location: "lab",
        under,
        addr,
        gateway,
        pods,
        kilo: false,
    };
    // Two subnets joined by a router that knows nothing of pods: only IPIP crosses it.
    let mesh = Mesh::new(
        &[
            spec("c1", 0, "192.168.50.1/24", "192.168.50.254", 11),
            spec("c2", 0, "192.168.50.2/24", "192.168.50.254", 12),
            spec("c3", 1, "192.168.60.3/24", "192.168.60.254", 13),
        ],
        2,
        true,
        &["--encapsulate=crosssubnet"],
    );
    mesh.ping(0, "10.42.12.2");
    mesh.ping(0, "10.42.13.2");
    let ((), frames) = capture(&mesh.unders[0], || {
        mesh.ping(0, "10.42.12.2");
        mesh.ping(0, "10.42.13.2");
    });
    // c3's pods: toward the router (c3 is off the link), 20 bytes short.
    let route = mesh.nodes[0].ns.sh("ip route show 10.42.13.0/24");
    assert!(
        route.contains("via 192.168.50.254 dev eth0") && route.contains("mtu 1480"),
        "{route}"
    );
    let addr = |s: &str| s.parse::<Ipv4Addr>().unwrap();
    let between = |a: Ipv4Addr, b: Ipv4Addr| {
        move |(_, s, d): &&(u8, Ipv4Addr, Ipv4Addr)| [(a, b), (b, a)].contains(&(*s, *d))
    };
    let (c1, c2, c3) = (
        addr("192.168.50.1"),
        addr("192.168.50.2"),
        addr("192.168.60.3"),
    );
    let plain = frames
        .iter()
        .filter(between(addr("10.42.11.2"), addr("10.42.12.2")))
        .count();
    let ipip_across = frames
        .iter()
        .filter(between(c1, c3))
        .filter(|f| f.0 == 4)
        .count();
    let ipip_within = frames
        .iter()
        .filter(between(c1, c2))
        .filter(|f| f.0 == 4)
        .count();
    let bare_across = frames
        .iter()
        .filter(between(addr("10.42.11.2"), addr("10.42.13.2")))
        .count();
    assert!(
        plain >= 6,
        "{plain} plain frames between the same-subnet pods"
    );
    assert_eq!(ipip_within, 0, "IPIP inside a subnet");
    assert!(ipip_across >= 6, "{ipip_across} IPIP frames across subnets");
    assert_eq!(bare_across, 0, "bare pod addresses across subnets");
}

/// A Kilo node's `tunl0` and kg's eBPF IPIP, in one location, both ways: n1 (kg, the leader of
/// east, with the `ipip` module loaded as on a node that ran Kilo) and n2 (Kilo's setup:
/// `tunl0`, routes through it to n1), and n3 (kg) in west. n2's pod reaches n1's pod and west's
/// through the kernel's IPIP, which n1's program unwraps; the replies are wrapped by n1's
/// program and unwrapped by n2's `tunl0`. Only IPIP and no bare pod address crosses east's
/// underlay, and the counters on both sides moved.
#[test]
fn kernel_tunl0_and_ebpf_ipip_interoperate() {
    let test = "kernel_tunl0_and_ebpf_ipip_interoperate";
    if !support::require_root(test) || !support::skip_unless_kernel(test, ipip_module_missing()) {
        return;
    }
    static SPECS: [Spec; 3] = [
        Spec {
            name: "n1",
            location: "east",
            under: 0,
            addr: "192.168.50.1/24",
            gateway: "192.168.50.254",
            pods: 1,
            kilo: false,
        },
        Spec {
            name: "n2",
            location: "east",
            under: 0,
            addr: "192.168.50.2/24",
            gateway: "192.168.50.254",
            pods: 2,
            kilo: true,
        },
        Spec {
            name: "n3",
            location: "west",
            under: 1,
            addr: "192.168.60.3/24",
            gateway: "192.168.60.254",
            pods: 3,
            kilo: false,
        },
    ];
    let mesh = Mesh::new(&SPECS, 2, true, &[]);
    let _heartbeat = Heartbeat::start(&SPECS[1], mesh.work.path().join("objects"));
    // The module is loaded where kg runs too: n1 has its own tunl0.
    mesh.nodes[0].ns.sh("ip link show tunl0");
    let rx = |ns: &NetNs| -> u64 {
        ns.sh("cat /sys/class/net/tunl0/statistics/rx_packets")
            .trim()
            .parse()
            .unwrap()
    };
    for dst in ["10.42.1.2", "10.42.3.2"] {
        mesh.ping(1, dst);
    }
    let unwrapped_by_tunl0 = rx(&mesh.nodes[1].ns);
    let (n1, n2): (Ipv4Addr, Ipv4Addr) = (
        "192.168.50.1".parse().unwrap(),
        "192.168.50.2".parse().unwrap(),
    );
    let ((), frames) = capture(&mesh.unders[0], || {
        // From the Kilo node's pod, and toward it from kg's nodes.
        mesh.ping(1, "10.42.1.2");
        mesh.ping(1, "10.42.3.2");
        mesh.ping(0, "10.42.2.2");
        mesh.ping(2, "10.42.2.2");
        let got = tcp(
            &mesh.nodes[1].pod,
            &mesh.nodes[2].pod,
            "10.42.3.2".parse().unwrap(),
            1 << 20,
        );
        assert_eq!(
            got,
            sent(1 << 20),
            "TCP from the Kilo node's pod\n{}",
            mesh.logs()
        );
    });
    let ipip = |from: Ipv4Addr, to: Ipv4Addr| {
        frames
            .iter()
            .filter(|(p, s, d)| *p == 4 && (*s, *d) == (from, to))
            .count()
    };
    let bare: Vec<_> = frames
        .iter()
        .filter(|(_, s, d)| is_pod(s) || is_pod(d))
        .collect();
    assert!(
        ipip(n2, n1) >= 12,
        "{} IPIP frames from tunl0 to kg",
        ipip(n2, n1)
    );
    assert!(
        ipip(n1, n2) >= 12,
        "{} IPIP frames from kg to tunl0",
        ipip(n1, n2)
    );
    assert!(
        bare.is_empty(),
        "bare pod addresses on the underlay: {bare:?}"
    );
    assert!(
        rx(&mesh.nodes[1].ns) >= unwrapped_by_tunl0 + 12,
        "n2's tunl0 unwrapped kg's IPIP"
    );
    assert!(mesh.metric(0, &decision("decapsulated")) >= 12);
    assert!(mesh.metric(0, &decision("encapsulated")) >= 12);
    assert_eq!(mesh.metric(0, &decision("malformed")), 0);
}
