//! Node tier, datapath part: the agent's reconciler driving the real eBPF datapath
//! ([`DatapathReconciler`]) in a throwaway namespace. It converges (programs attached, NAT rule,
//! entries), a second pass writes nothing, a map entry deleted behind its back (here by a second
//! loader that adopts the pins, as an operator's tool would) is restored with exactly one write
//! at the next read-back (within `READ_BACK_EVERY` reconciles; idle ones compare the plan with
//! the agent's record), and clean-up removes programs, pins and the NAT table. A first apply that
//! fails part-way attaches no program. The IPIP programs are attached to the private interface
//! only while the plan has a location neighbour, adopted by a restarted agent without a write,
//! and detached when the neighbours are gone.
use kilo_testkit as support;

use std::{collections::BTreeMap, path::PathBuf};

use ipnet::IpNet;
use kilo_agent::{
    datapath::{
        Datapath, DatapathConfig, DatapathMaps as _, DatapathOps as _, DatapathReconciler, Trie,
    },
    mesh::Key,
    plan::{DatapathEntry, DatapathPlan, Devices, EntryKind, IpipPlan, NextHop, Plan},
    reconcile::{
        DeviceSettings, Reconciler, netlink::NetlinkKernel, wireguard::FakeWireGuard,
        wireguard::system_resolver,
    },
    writes::{READ_BACK_EVERY, Write},
};
use support::netns::NetNs;

fn entry(kind: EntryKind, owner: &str) -> DatapathEntry {
    DatapathEntry {
        kind,
        owner: owner.into(),
        next_hop: None,
    }
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

#[test]
fn reconcile_converges_is_idle_then_restores_a_deleted_map_entry() {
    if !support::require_root("reconcile_converges_is_idle_then_restores_a_deleted_map_entry") {
        return;
    }
    let ns = NetNs::new("dpr");
    // A TUN device (raw IP, like WireGuard) stands in for the WireGuard link (the WireGuard device itself is faked here; the
    // real one is covered by agent_node_privileged.rs), plus the pod-facing bridge.
    ns.sh("ip tuntap add kwg0 mode tun && ip link set kwg0 up");
    ns.sh("ip link add kube-bridge type bridge && ip link set kube-bridge up");
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/krs-dpr-{}", std::process::id()));
    let table = format!("krsdpr{}", std::process::id());
    let config = DatapathConfig {
        pin_dir: Some(pin_dir.clone()),
        nft_table: table.clone(),
        ..DatapathConfig::default()
    };
    let plan = Plan {
        datapath: DatapathPlan {
            mesh_destinations: BTreeMap::from([
                (net("10.2.2.0/24"), entry(EntryKind::Node, "b")),
                (net("10.4.0.2/32"), entry(EntryKind::WireGuardIp, "b")),
                (
                    net("10.96.0.0/12"),
                    entry(EntryKind::Service, "--service-cidr"),
                ),
            ]),
            nat_sources: BTreeMap::from([(net("10.2.1.0/24"), entry(EntryKind::LocalPods, "a"))]),
            masquerade_destinations: BTreeMap::new(),
        },
        ..Plan::default()
    };
    let (first, second, third, fourth, cleaned) = ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let devices = Devices {
                wireguard: "kwg0".into(),
                private: None,
                tunnel: None,
            };
            let datapath = DatapathReconciler::new(
                Datapath::open(config.clone()).expect("open datapath"),
                devices.clone(),
                &["kube-bridge".to_string()],
                false,
            );
            let mut reconciler = Reconciler::new(
                NetlinkKernel::connect().unwrap(),
                FakeWireGuard::default(),
                datapath,
                DeviceSettings {
                    devices,
                    create_interface: false,
                    mtu: None,
                    private_key: Key([7; 32]),
                    dns: Box::new(system_resolver),
                },
            );
            let first = reconciler.reconcile(&plan).await.unwrap();
            let second = reconciler.reconcile(&plan).await.unwrap();
            {
                // Someone else adopts the pins and deletes an entry.
                let mut other = Datapath::open(config).expect("adopt the pins");
                other
                    .maps()
                    .remove(Trie::Destination, net("10.2.2.0/24"))
                    .expect("delete an entry");
            }
            // Idle reconciles trust the record until the next read-back, which repairs it.
            let mut third = reconciler.reconcile(&plan).await.unwrap();
            for _ in 1..READ_BACK_EVERY {
                if !third.writes.is_empty() {
                    break;
                }
                third = reconciler.reconcile(&plan).await.unwrap();
            }
            let fourth = reconciler.reconcile(&plan).await.unwrap();
            let cleaned = reconciler.clean_up(false).await.unwrap();
            (first, second, third, fourth, cleaned)
        })
    });
    assert!(first.problems.is_empty(), "{:?}", first.problems);
    assert_eq!(first.writes.get(Write::MapInsert), 4, "{}", first.writes);
    assert_eq!(first.writes.get(Write::LinkAttach), 2, "{}", first.writes);
    assert_eq!(first.writes.get(Write::NftRule), 1, "{}", first.writes);
    assert!(
        second.writes.is_empty(),
        "idle pass wrote {}",
        second.writes
    );
    assert_eq!(third.writes.get(Write::MapInsert), 1, "{}", third.writes);
    assert_eq!(
        third.writes.total(),
        1,
        "only the deleted entry is written back: {}",
        third.writes
    );
    assert!(fourth.writes.is_empty(), "{}", fourth.writes);
    assert!(cleaned.problems.is_empty(), "{:?}", cleaned.problems);
    assert!(!pin_dir.exists(), "pins left in {}", pin_dir.display());
    let ruleset = ns.sh("nft list tables");
    assert!(!ruleset.contains(&table), "nft table left: {ruleset}");
    let filters = ns.sh("bpftool net show dev kube-bridge 2>/dev/null || true");
    assert!(
        !filters.contains("kilo"),
        "program left attached: {filters}"
    );
}

/// Whether a program is attached at TCX ingress of `ifname` (in the calling thread's namespace).
fn attached(ifname: &str) -> bool {
    use aya::programs::{SchedClassifier, TcAttachType};
    let index = kilo_agent::datapath::ifindex(ifname).unwrap();
    let (_, progs) = SchedClassifier::query_tcx(index, TcAttachType::Ingress).unwrap();
    !progs.is_empty()
}

/// Fresh maps whose first apply fails part-way (a trie too small for the plan) get no program:
/// it would decide on half a topology. The first apply that completes attaches it.
#[test]
fn no_program_is_attached_to_maps_whose_first_sync_failed() {
    if !support::require_root("no_program_is_attached_to_maps_whose_first_sync_failed") {
        return;
    }
    let ns = NetNs::new("dpfirst");
    ns.sh("ip tuntap add kwg0 mode tun && ip link set kwg0 up");
    ns.sh("ip link add kube-bridge type bridge && ip link set kube-bridge up");
    let fs = support::bpffs::BpfFs::new();
    let config = DatapathConfig {
        pin_dir: Some(fs.pin_dir("kilo")),
        nft_table: format!("krsfirst{}", std::process::id()),
        attach: kilo_agent::datapath::AttachMode::Tcx,
        max_entries: 2,
        ..DatapathConfig::default()
    };
    let mesh = |n: u8| {
        (0..n)
            .map(|i| (net(&format!("10.50.{i}.0/24")), entry(EntryKind::Node, "b")))
            .collect()
    };
    let too_big = DatapathPlan {
        mesh_destinations: mesh(3),
        ..DatapathPlan::default()
    };
    let fits = DatapathPlan {
        mesh_destinations: mesh(2),
        ..DatapathPlan::default()
    };
    let (failed, after_failure, writes, after_success) = ns.run(move || {
        let devices = Devices {
            wireguard: "kwg0".into(),
            private: None,
            tunnel: None,
        };
        let mut dp = DatapathReconciler::new(
            Datapath::open(config).expect("open datapath"),
            devices,
            &["kube-bridge".to_string()],
            false,
        );
        let failed = dp.apply(&too_big, &Default::default(), None).is_err();
        let after_failure = [attached("kwg0"), attached("kube-bridge")];
        let writes = dp
            .apply(&fits, &Default::default(), None)
            .expect("a plan that fits");
        let after_success = [attached("kwg0"), attached("kube-bridge")];
        dp.clean_up().unwrap();
        (failed, after_failure, writes, after_success)
    });
    assert!(failed, "the first apply overflows the trie");
    assert_eq!(
        after_failure,
        [false, false],
        "attached to half-written maps"
    );
    assert_eq!(writes.get(Write::LinkAttach), 2, "{writes}");
    assert_eq!(after_success, [true, true]);
}

/// Whether a program is attached at TCX `hook` of `ifname`.
fn attached_at(ifname: &str, hook: aya::programs::TcAttachType) -> bool {
    use aya::programs::SchedClassifier;
    let index = kilo_agent::datapath::ifindex(ifname).unwrap();
    let (_, progs) = SchedClassifier::query_tcx(index, hook).unwrap();
    !progs.is_empty()
}

#[test]
fn ipip_programs_attach_only_with_a_location_neighbour_and_are_adopted() {
    if !support::require_root("ipip_programs_attach_only_with_a_location_neighbour_and_are_adopted")
    {
        return;
    }
    use aya::programs::TcAttachType::{Egress, Ingress};
    let ns = NetNs::new("dpipip");
    ns.sh("ip tuntap add kwg0 mode tun && ip link set kwg0 up");
    ns.sh(
        "ip link add eth0 type veth peer name eth1 && ip link set eth0 up && ip link set eth1 up",
    );
    let fs = support::bpffs::BpfFs::new();
    let config = DatapathConfig {
        pin_dir: Some(fs.pin_dir("kilo")),
        nft_table: format!("krsipip{}", std::process::id()),
        attach: kilo_agent::datapath::AttachMode::Tcx,
        ..DatapathConfig::default()
    };
    let nat = DatapathPlan::default();
    let hop = Some(NextHop::Ipip {
        local: "192.168.50.1".parse().unwrap(),
        remote: "192.168.50.2".parse().unwrap(),
    });
    let neighbour = IpipPlan {
        encapsulate: BTreeMap::from([(
            net("10.42.2.0/24"),
            DatapathEntry {
                next_hop: hop,
                ..entry(EntryKind::Node, "n2")
            },
        )]),
        sources: BTreeMap::from([(net("192.168.50.2/32"), entry(EntryKind::Node, "n2"))]),
        decapsulate: BTreeMap::from([(net("10.42.1.0/24"), entry(EntryKind::Node, "n1"))]),
    };
    ns.run(move || {
        let devices = Devices {
            wireguard: "kwg0".into(),
            private: Some("eth0".into()),
            tunnel: None,
        };
        let open = || {
            DatapathReconciler::new(
                Datapath::open(config.clone()).expect("open datapath"),
                devices.clone(),
                &[],
                false,
            )
        };
        let mut dp = open();
        // Alone in its location: nothing on eth0.
        let w = dp.apply(&nat, &IpipPlan::default(), None).unwrap();
        assert_eq!(w.get(Write::LinkAttach), 1, "kwg0 only: {w}");
        assert!(!attached_at("eth0", Egress) && !attached_at("eth0", Ingress));
        // A neighbour: both programs, three entries; then idle.
        let w = dp.apply(&nat, &neighbour, None).unwrap();
        assert_eq!(
            (w.get(Write::LinkAttach), w.get(Write::MapInsert)),
            (2, 3),
            "{w}"
        );
        assert!(attached_at("eth0", Egress) && attached_at("eth0", Ingress));
        assert!(dp.apply(&nat, &neighbour, None).unwrap().is_empty());
        // A restarted agent adopts the pinned links and maps: nothing to write.
        drop(dp);
        assert!(
            attached_at("eth0", Egress),
            "pinned links outlive the agent"
        );
        let mut dp = open();
        let w = dp.apply(&nat, &neighbour, None).unwrap();
        assert!(w.is_empty(), "adopting wrote {w}");
        // The neighbour leaves: entries deleted, programs detached.
        let w = dp.apply(&nat, &IpipPlan::default(), None).unwrap();
        assert_eq!(
            (w.get(Write::LinkDetach), w.get(Write::MapDelete)),
            (2, 3),
            "{w}"
        );
        assert!(!attached_at("eth0", Egress) && !attached_at("eth0", Ingress));
        dp.clean_up().unwrap();
    });
}

/// The same without TCX (kernels before 6.6): clsact filters, the decapsulation before any
/// other program at ingress; detached with the neighbour or at clean-up, the clsact qdisc
/// with them.
#[test]
fn ipip_programs_attach_and_detach_as_netlink_filters() {
    if !support::require_root("ipip_programs_attach_and_detach_as_netlink_filters") {
        return;
    }
    let ns = NetNs::new("dpipnl");
    ns.sh("ip tuntap add kwg0 mode tun && ip link set kwg0 up");
    ns.sh(
        "ip link add eth0 type veth peer name eth1 && ip link set eth0 up && ip link set eth1 up",
    );
    let fs = support::bpffs::BpfFs::new();
    let config = DatapathConfig {
        pin_dir: Some(fs.pin_dir("kilo")),
        nft_table: format!("krsipnl{}", std::process::id()),
        attach: kilo_agent::datapath::AttachMode::Netlink,
        ..DatapathConfig::default()
    };
    let neighbour = IpipPlan {
        sources: BTreeMap::from([(net("192.168.50.2/32"), entry(EntryKind::Node, "n2"))]),
        ..IpipPlan::default()
    };
    let filters = |ns: &NetNs| {
        ns.sh("tc filter show dev eth0 ingress; echo ---; tc filter show dev eth0 egress")
    };
    let (attached, detached) = ns.run(|| {
        let mut dp = DatapathReconciler::new(
            Datapath::open(config).expect("open datapath"),
            Devices {
                wireguard: "kwg0".into(),
                private: Some("eth0".into()),
                tunnel: None,
            },
            &[],
            false,
        );
        let nat = DatapathPlan::default();
        let w = dp.apply(&nat, &neighbour, None).unwrap();
        assert_eq!(w.get(Write::LinkAttach), 3, "kwg0 and both on eth0: {w}");
        let attached = filters(&ns);
        let w = dp.apply(&nat, &IpipPlan::default(), None).unwrap();
        assert_eq!(w.get(Write::LinkDetach), 2, "{w}");
        let show =
            || String::from_utf8_lossy(&ns.try_sh("tc qdisc show dev eth0").stdout).into_owned();
        let mut detached = show();
        // Clean-up takes them (and the qdisc) too.
        dp.apply(&nat, &neighbour, None).unwrap();
        dp.clean_up().unwrap();
        detached += &show();
        (attached, detached)
    });
    let (ingress, egress) = attached.split_once("---").unwrap();
    assert!(
        ingress.contains("kilo_decap") && ingress.contains("pref 1106"),
        "{attached}"
    );
    assert!(egress.contains("kilo_encap"), "{attached}");
    assert!(!detached.contains("clsact"), "qdisc left: {detached}");
}
