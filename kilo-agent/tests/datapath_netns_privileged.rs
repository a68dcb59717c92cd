//! The datapath in network namespaces: pod -> node (program on the pod-facing veth, the nft
//! rule, ip_forward) -> a mesh receiver and a non-mesh host. Checks masquerading by the source
//! address each receiver sees, counters, idempotent syncs, survival without the agent, adoption
//! by a new loader, clean-up, netlink attachment, and the opt-in fast path.
use kilo_testkit as support;

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use ipnet::IpNet;
use kilo_agent::writes::Write;
use kilo_agent::{
    datapath::{
        AttachMode, Datapath, DatapathConfig, Decision, NoResolver, Role,
        nft::{self, MasqueradeRule},
    },
    plan::{DatapathEntry, DatapathPlan, Device, EntryKind, NextHop},
};
use support::{
    bpffs::{BpfFs, udp_source},
    netns::{NetNs, veth},
};

struct Lab {
    pod: NetNs,
    node: NetNs,
    mesh: NetNs,
    inet: NetNs,
}

const POD: &str = "10.10.1.2";
const NODE_INET: &str = "192.0.2.1";
const MESH_HOST: &str = "10.20.0.2";
const INET_HOST: &str = "192.0.2.2";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

impl Lab {
    fn new() -> Self {
        let lab = Lab {
            pod: NetNs::new("pod"),
            node: NetNs::new("node"),
            mesh: NetNs::new("mesh"),
            inet: NetNs::new("inet"),
        };
        veth(&lab.pod, "eth0", &lab.node, "pod0");
        veth(&lab.node, "mesh0", &lab.mesh, "eth0");
        veth(&lab.node, "inet0", &lab.inet, "eth0");
        lab.pod
            .sh("ip addr add 10.10.1.2/24 dev eth0 && ip route add default via 10.10.1.1");
        lab.node.sh(
            "ip addr add 10.10.1.1/24 dev pod0 && ip addr add 10.20.0.1/24 dev mesh0 && \
             ip addr add 192.0.2.1/24 dev inet0 && sysctl -qw net.ipv4.ip_forward=1 && \
             ip route add 10.96.0.0/24 via 10.20.0.2",
        );
        lab.mesh.sh(
            "ip addr add 10.20.0.2/24 dev eth0 && ip route add 10.10.1.0/24 via 10.20.0.1 && \
             ip addr add 10.96.0.10/32 dev lo",
        );
        lab.inet.sh("ip addr add 192.0.2.2/24 dev eth0");
        lab
    }

    /// The source address the mesh host and the internet host see for the pod's traffic.
    fn sources(&self, port: u16) -> (Option<IpAddr>, Option<IpAddr>) {
        (
            udp_source(&self.pod, &self.mesh, ip(MESH_HOST), port),
            udp_source(&self.pod, &self.inet, ip(INET_HOST), port + 1),
        )
    }
}

fn entry(kind: EntryKind, next_hop: Option<NextHop>) -> DatapathEntry {
    DatapathEntry {
        kind,
        owner: format!("{kind:?}"),
        next_hop,
    }
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn plan(next_hop: Option<NextHop>) -> DatapathPlan {
    DatapathPlan {
        mesh_destinations: BTreeMap::from([
            (net("10.20.0.0/24"), entry(EntryKind::Node, next_hop)),
            (net("10.10.1.0/24"), entry(EntryKind::Node, None)),
            (net("10.96.0.0/24"), entry(EntryKind::Service, next_hop)),
        ]),
        nat_sources: BTreeMap::from([(net("10.10.1.0/24"), entry(EntryKind::LocalPods, None))]),
        masquerade_destinations: BTreeMap::new(),
    }
}

fn config(pin_dir: PathBuf, attach: AttachMode) -> DatapathConfig {
    DatapathConfig {
        pin_dir: Some(pin_dir),
        attach,
        ..Default::default()
    }
}

/// Opens, attaches to pod0, installs the rule and syncs, in the node namespace.
fn start(lab: &Lab, cfg: DatapathConfig) -> (Datapath, u64) {
    lab.node.run(move || {
        let (mut dp, mut writes) = Datapath::open_counted(cfg).expect("open");
        writes += dp.attach("pod0").expect("attach");
        writes += dp.ensure_masquerade().expect("nft");
        writes += dp.apply(&plan(None), &NoResolver).expect("apply");
        let total = writes.total();
        (dp, total)
    })
}

fn pins(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for sub in ["maps", "links", "netlink"] {
        if let Ok(rd) = std::fs::read_dir(dir.join(sub)) {
            out.extend(rd.map(|e| format!("{sub}/{}", e.unwrap().file_name().to_string_lossy())));
        }
    }
    out.sort();
    out
}

fn lifecycle(attach: AttachMode) {
    let lab = Lab::new();
    let fs = BpfFs::new();
    let dir = fs.pin_dir("kilo");
    // Without the datapath the node forwards the pod's own address everywhere.
    assert_eq!(lab.sources(7000), (Some(ip(POD)), Some(ip(POD))));

    let (dp, writes) = start(&lab, config(dir.clone(), attach));
    assert!(writes > 0);
    let ruleset = lab.node.sh("nft list ruleset");
    assert!(
        ruleset.contains("table inet kilo")
            && ruleset.contains("type nat hook postrouting priority srcnat")
            && ruleset.contains("meta mark & 0x00001000 == 0x00001000")
            && ruleset.contains("masquerade"),
        "{ruleset}"
    );
    // The mesh host sees the pod; the internet host sees the node.
    assert_eq!(lab.sources(7010), (Some(ip(POD)), Some(ip(NODE_INET))));
    let c = dp.counters().unwrap();
    assert!(c.decision(Decision::Mesh).packets >= 1, "{c:?}");
    assert!(c.decision(Decision::Masquerade).packets >= 1, "{c:?}");
    let mesh_hits = c.entry(Role::Mesh, &net("10.20.0.0/24")).unwrap().packets;
    let nat_hits = c
        .entry(Role::NatSource, &net("10.10.1.0/24"))
        .unwrap()
        .packets;
    assert!(mesh_hits >= 1 && nat_hits >= 1, "{c:?}");
    assert_eq!(
        c.entry(Role::Mesh, &net("10.96.0.0/24")).unwrap().packets,
        0
    );

    // Idempotent: a second pass writes nothing.
    let dp = lab.node.run(move || {
        let mut dp = dp;
        assert!(dp.apply(&plan(None), &NoResolver).unwrap().is_empty());
        assert!(dp.ensure_masquerade().unwrap().is_empty());
        assert!(dp.attach("pod0").unwrap().is_empty() || attach == AttachMode::Netlink);
        dp
    });
    assert!(!pins(&dir).is_empty());

    // The agent goes away without cleaning up: traffic gets the same treatment.
    drop(dp);
    assert_eq!(lab.sources(7020), (Some(ip(POD)), Some(ip(NODE_INET))));

    // A new loader adopts maps (entries and counters) and links: nothing to write.
    let cfg = config(dir.clone(), attach);
    let dp = lab.node.run(move || {
        let (mut dp, mut writes) = Datapath::open_counted(cfg).expect("reopen");
        let attach_writes = dp.attach("pod0").expect("adopt");
        if attach == AttachMode::Netlink {
            // A netlink filter cannot be compared, only replaced (atomically).
            assert_eq!(attach_writes.get(Write::LinkAttach), 0, "{attach_writes}");
        } else {
            writes += attach_writes;
        }
        writes += dp.ensure_masquerade().unwrap();
        writes += dp.apply(&plan(None), &NoResolver).unwrap();
        assert!(writes.is_empty(), "adoption wrote {writes}");
        dp
    });
    let c = dp.counters().unwrap();
    assert!(
        c.entry(Role::Mesh, &net("10.20.0.0/24")).unwrap().packets > mesh_hits,
        "counters survived and kept counting while the agent was away: {c:?}"
    );
    assert_eq!(lab.sources(7030), (Some(ip(POD)), Some(ip(NODE_INET))));

    // Clean-up: no pins, no programs on the device, no table; the pod is no longer masqueraded.
    let writes = lab.node.run(move || dp.clean_up().expect("clean up"));
    assert!(
        writes.get(Write::NftTableDelete) == 1 && writes.get(Write::LinkDetach) == 1,
        "{writes}"
    );
    assert!(!dir.exists(), "pin dir left: {:?}", pins(&dir));
    assert!(!lab.node.sh("nft list ruleset").contains("kilo"));
    let tc = lab
        .node
        .sh("tc filter show dev pod0 ingress; bpftool net show dev pod0");
    assert!(!tc.contains("kilo_ingress"), "{tc}");
    assert_eq!(lab.sources(7040), (Some(ip(POD)), Some(ip(POD))));
}

#[test]
fn tcx_lifecycle_masquerades_survives_adopts_and_cleans_up() {
    let test = "tcx_lifecycle_masquerades_survives_adopts_and_cleans_up";
    if !support::require_root(test) || !support::require_tcx(test) {
        return;
    }
    lifecycle(AttachMode::Tcx);
}

#[test]
fn netlink_lifecycle_masquerades_survives_adopts_and_cleans_up() {
    if !support::require_root("netlink_lifecycle_masquerades_survives_adopts_and_cleans_up") {
        return;
    }
    lifecycle(AttachMode::Netlink);
}

#[test]
fn nft_rule_is_idempotent_repaired_and_removed() {
    if !support::require_root("nft_rule_is_idempotent_repaired_and_removed") {
        return;
    }
    let ns = NetNs::new("nft");
    let rule = MasqueradeRule::new(0x1000, 0x1000);
    let r = rule.clone();
    let w = ns.run(move || nft::ensure_masquerade(&r).unwrap());
    assert_eq!(w.get(Write::NftRule), 1);
    let listing = ns.sh("nft list table inet kilo");
    assert!(
        listing.contains("meta mark & 0x00001000 == 0x00001000 masquerade"),
        "{listing}"
    );
    assert!(
        listing.contains("comment \"kilo-rs: masquerade mark 0x1000/0x1000\""),
        "{listing}"
    );
    let r = rule.clone();
    assert!(
        ns.run(move || nft::ensure_masquerade(&r).unwrap())
            .is_empty()
    );
    // Tampering (an extra rule) is repaired; a different mark replaces the rule.
    ns.sh("nft add rule inet kilo postrouting counter accept");
    let r = rule.clone();
    assert_eq!(
        ns.run(move || nft::ensure_masquerade(&r).unwrap())
            .get(Write::NftRule),
        1
    );
    assert!(!ns.sh("nft list table inet kilo").contains("accept\n"));
    let other = MasqueradeRule::new(0x20000, 0x30000);
    let o = other.clone();
    assert_eq!(
        ns.run(move || nft::ensure_masquerade(&o).unwrap())
            .get(Write::NftRule),
        1
    );
    let listing = ns.sh("nft list table inet kilo");
    assert!(
        listing.contains("meta mark & 0x00030000 == 0x00020000 masquerade"),
        "{listing}"
    );
    assert_eq!(
        listing.matches("masquerade").count(),
        2,
        "one rule (and its comment): {listing}"
    );
    // Removal, twice.
    assert_eq!(
        ns.run(|| nft::remove_masquerade("kilo").unwrap())
            .get(Write::NftTableDelete),
        1
    );
    assert!(
        ns.run(|| nft::remove_masquerade("kilo").unwrap())
            .is_empty()
    );
    assert!(!ns.sh("nft list ruleset").contains("kilo"));
}

#[test]
fn nft_keeper_reads_the_ruleset_only_when_announced_or_due() {
    if !support::require_root("nft_keeper_reads_the_ruleset_only_when_announced_or_due") {
        return;
    }
    let ns = NetNs::new("nftk");
    // Each call runs in the namespace; the keeper's sockets stay bound to it.
    let call = |k: nft::Keeper| {
        ns.run(move || {
            let mut k = k;
            let w = k.ensure().unwrap();
            (k, w.get(Write::NftRule))
        })
    };
    let k = nft::Keeper::new(MasqueradeRule::new(0x1000, 0x1000), 4);
    let (mut k, rules) = call(k);
    assert_eq!(
        (rules, k.checks()),
        (1, 1),
        "the first call checks and writes"
    );
    // Our own write is announced too, but not by someone else: not checked again.
    for _ in 0..3 {
        let (next, rules) = call(k);
        assert_eq!((rules, next.checks()), (0, 1), "quiet calls read nothing");
        k = next;
    }
    let (k, rules) = call(k);
    assert_eq!((rules, k.checks()), (0, 2), "every 4th call checks");
    // Someone deletes the table: netfilter announces it and the next call repairs.
    ns.sh("nft delete table inet kilo");
    let (k, rules) = call(k);
    assert_eq!((rules, k.checks()), (1, 3));
    assert!(ns.sh("nft list ruleset").contains("masquerade"));
    // Other tables' changes (another name, or our name in another family) are not ours.
    ns.sh("nft add table inet other && nft add table ip kilo && nft delete table inet other");
    let (k, rules) = call(k);
    assert_eq!((rules, k.checks()), (0, 3), "others' tables: not read");
    // A change inside our table by someone else is: read, and nothing to repair.
    ns.sh("nft add chain inet kilo extra");
    let (k, rules) = call(k);
    assert_eq!((rules, k.checks()), (0, 4), "our table: read");
    let (k, rules) = call(k);
    assert_eq!((rules, k.checks()), (0, 4));
}

#[test]
fn fast_path_redirects_mesh_past_a_forward_drop_but_not_services() {
    if !support::require_root("fast_path_redirects_mesh_past_a_forward_drop_but_not_services") {
        return;
    }
    let lab = Lab::new();
    // A FORWARD policy that drops everything, counting what comes from the pod.
    lab.node.sh(
        "nft add table inet testfw && \
         nft add chain inet testfw fwdrop \"{ type filter hook forward priority 0; policy drop; }\" && \
         nft add rule inet testfw fwdrop iifname pod0 counter drop",
    );
    let dropped = |lab: &Lab| -> u64 {
        let out = lab.node.sh("nft list chain inet testfw fwdrop");
        let i = out.find("packets ").expect("counter");
        out[i + 8..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let hop = Some(NextHop::Gateway {
        address: ip(MESH_HOST),
        device: Device::Private,
    });
    let mut dp = lab.node.run(move || {
        let mut dp = Datapath::open(DatapathConfig {
            pin_dir: None,
            ..Default::default()
        })
        .unwrap();
        dp.attach("pod0").unwrap();
        dp.ensure_masquerade().unwrap();
        let mesh0 = kilo_agent::datapath::ifindex("mesh0").unwrap();
        let resolver = move |d: Device| (d == Device::Private).then_some(mesh0);
        dp.apply(&plan(hop), &resolver).unwrap();
        // A second apply with the same plan and resolver writes nothing.
        assert!(dp.apply(&plan(hop), &resolver).unwrap().is_empty());
        dp
    });

    // Fast path off (the default): FORWARD drops the mesh traffic.
    let d0 = dropped(&lab);
    assert_eq!(udp_source(&lab.pod, &lab.mesh, ip(MESH_HOST), 7100), None);
    assert!(dropped(&lab) > d0);

    // On: mesh traffic is redirected past FORWARD and arrives with the pod's address.
    assert_eq!(dp.set_fast_path(true).unwrap().get(Write::MapConfig), 1);
    let before = dp.counters().unwrap();
    let d1 = dropped(&lab);
    assert_eq!(
        udp_source(&lab.pod, &lab.mesh, ip(MESH_HOST), 7110),
        Some(ip(POD))
    );
    let after = dp.counters().unwrap();
    assert!(
        after.decision(Decision::Redirect).packets > before.decision(Decision::Redirect).packets
    );
    assert_eq!(dropped(&lab), d1, "nothing went through FORWARD");

    // Services are never redirected: FORWARD still sees (and drops) them.
    let before = dp.counters().unwrap();
    let _ = udp_source(&lab.pod, &lab.mesh, ip("10.96.0.10"), 7120);
    let after = dp.counters().unwrap();
    assert_eq!(
        after.decision(Decision::Redirect).packets,
        before.decision(Decision::Redirect).packets
    );
    assert!(after.decision(Decision::Mesh).packets > before.decision(Decision::Mesh).packets);
    assert!(
        after
            .entry(Role::Mesh, &net("10.96.0.0/24"))
            .unwrap()
            .packets
            > before
                .entry(Role::Mesh, &net("10.96.0.0/24"))
                .unwrap()
                .packets
    );
    assert!(dropped(&lab) > d1);

    // Masquerading is unaffected by the fast path.
    lab.node.sh("nft delete table inet testfw");
    assert_eq!(
        udp_source(&lab.pod, &lab.inet, ip(INET_HOST), 7130),
        Some(ip(NODE_INET))
    );
    drop(dp);
}

/// Creates a TUN device `name` in the calling thread's namespace; it lives while the fd does.
fn tun(name: &str) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .expect("/dev/net/tun");
    // SAFETY: a zeroed ifreq with a NUL-terminated name, on a TUN fd.
    unsafe {
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (d, s) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        ifr.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
        let rc = libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF as _, &mut ifr);
        assert_eq!(rc, 0, "TUNSETIFF: {}", std::io::Error::last_os_error());
    }
    file
}

#[test]
fn raw_ip_device_traffic_is_classified_like_wireguard() {
    if !support::require_root("raw_ip_device_traffic_is_classified_like_wireguard") {
        return;
    }
    use std::io::Write as _;
    use support::{bpffs::Listener, packets::udp_to};
    let lab = Lab::new();
    // A raw-IP device standing in for the WireGuard interface: packets written to its fd
    // enter the node at TC ingress of wg0 with no MAC header, as decrypted WireGuard traffic does.
    let mut dev = lab.node.run(|| tun("wg0"));
    lab.node
        .sh("ip link set wg0 up && ip addr add 10.30.0.1/24 dev wg0 && \
         ip -6 addr add fd00:30::1/64 dev wg0 nodad && \
         ip -6 addr add 2001:db8:1::1/64 dev inet0 nodad && \
         sysctl -qw net.ipv6.conf.all.forwarding=1 && \
         sysctl -qw net.ipv4.conf.all.rp_filter=0 && sysctl -qw net.ipv4.conf.wg0.rp_filter=0");
    lab.inet
        .sh("ip -6 addr add 2001:db8:1::2/64 dev eth0 nodad");
    lab.mesh.sh("ip route add 10.30.0.0/24 via 10.20.0.1");
    let dp = lab.node.run(|| {
        let mut dp = Datapath::open(DatapathConfig {
            pin_dir: None,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            kilo_agent::datapath::framing("wg0").unwrap(),
            kilo_agent::datapath::Framing::L3
        );
        dp.attach("wg0").unwrap();
        dp.ensure_masquerade().unwrap();
        let p = DatapathPlan {
            mesh_destinations: BTreeMap::from([(
                net("10.20.0.0/24"),
                entry(EntryKind::Node, None),
            )]),
            nat_sources: BTreeMap::from([
                (net("10.30.0.0/24"), entry(EntryKind::Peer, None)),
                (net("fd00:30::/64"), entry(EntryKind::Peer, None)),
            ]),
            masquerade_destinations: BTreeMap::new(),
        };
        dp.apply(&p, &NoResolver).unwrap();
        dp
    });
    let mut send = |src: &str, dst: &str, port: u16| {
        for _ in 0..3 {
            dev.write_all(&udp_to(ip(src), ip(dst), port)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    // A peer to the internet: masqueraded (IPv4 and IPv6).
    let l = Listener::new(&lab.inet, false, 7200);
    send("10.30.0.5", INET_HOST, 7200);
    assert_eq!(l.source(), Some(ip(NODE_INET)));
    let l = Listener::new(&lab.inet, true, 7201);
    send("fd00:30::5", "2001:db8:1::2", 7201);
    assert_eq!(l.source(), Some(ip("2001:db8:1::1")));
    // A peer to a mesh destination: left alone.
    let l = Listener::new(&lab.mesh, false, 7202);
    send("10.30.0.5", MESH_HOST, 7202);
    assert_eq!(l.source(), Some(ip("10.30.0.5")));
    let c = dp.counters().unwrap();
    assert!(
        c.entry(Role::NatSource, &net("10.30.0.0/24"))
            .unwrap()
            .packets
            >= 1,
        "{c:?}"
    );
    assert!(
        c.entry(Role::NatSource, &net("fd00:30::/64"))
            .unwrap()
            .packets
            >= 1,
        "{c:?}"
    );
    assert!(
        c.entry(Role::Mesh, &net("10.20.0.0/24")).unwrap().packets >= 1,
        "{c:?}"
    );
    assert_eq!(c.decision(Decision::Malformed).packets, 0, "{c:?}");
}

/// Services: the program decides at TC ingress, before kube-proxy's DNAT; Kilo's chains decide
/// in POSTROUTING, after it. kube-proxy is emulated in the node by an nftables DNAT from
/// ClusterIP 10.96.0.1 to the mesh host (a pod in another location) and from 10.96.0.2 to the
/// internet host. Kilo leaves the first unmasqueraded and masquerades the second. Ours decides
/// on the ClusterIP: with the service CIDR a mesh destination (`--service-cidr`) neither is
/// masqueraded; without it, both are (see the README's differences from Kilo).
#[test]
fn services_are_decided_on_the_cluster_ip_before_kube_proxy_dnat() {
    if !support::require_root("services_are_decided_on_the_cluster_ip_before_kube_proxy_dnat") {
        return;
    }
    let lab = Lab::new();
    let fs = BpfFs::new();
    lab.node.sh("nft add table ip kp && \
         nft add chain ip kp pre \"{ type nat hook prerouting priority dstnat; }\" && \
         nft add rule ip kp pre ip daddr 10.96.0.1 dnat to 10.20.0.2 && \
         nft add rule ip kp pre ip daddr 10.96.0.2 dnat to 192.0.2.2");
    let sources = |port: u16| {
        (
            udp_source(&lab.pod, &lab.mesh, ip("10.96.0.1"), port),
            udp_source(&lab.pod, &lab.inet, ip("10.96.0.2"), port + 1),
        )
    };
    let (dp, _) = start(
        &lab,
        config(fs.pin_dir("kilo"), support::kernel_attach_mode()),
    );
    // With the service CIDR among the mesh destinations: the first as Kilo, the second not
    // masqueraded (Kilo: the node's address).
    assert_eq!(sources(7100), (Some(ip(POD)), Some(ip(POD))));
    // Without it: the second as Kilo, the first masqueraded (Kilo: the pod's address).
    let mut without = plan(None);
    without.mesh_destinations.remove(&net("10.96.0.0/24"));
    let dp = lab.node.run(move || {
        let mut dp = dp;
        dp.apply(&without, &NoResolver).unwrap();
        dp
    });
    assert_eq!(sources(7110), (Some(ip("10.20.0.1")), Some(ip(NODE_INET))));
    lab.node.run(move || dp.clean_up().expect("clean up"));
}
