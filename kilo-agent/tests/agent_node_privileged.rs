//! Node tier: the reconcilers against the real kernel in a throwaway network namespace, with a
//! real wireguard-go device driven over its UAPI socket (`--create-interface=false`).
//!
//! The plan is built by hand (a leader with one remote segment), so each case says exactly what
//! the kernel must hold.
use kilo_testkit as support;

use std::{collections::BTreeSet, time::Duration};

use kilo_agent::{
    datapath::FakeDatapath,
    mesh::Key,
    plan::{Device, KILO_TABLE, MAIN_TABLE, Plan, Route, Rule, WireGuardPeer, WireGuardPlan},
    reconcile::{
        DeviceSettings, Reconciler, Report,
        netlink::{Changes, EventFilter, NetlinkKernel, watch},
        wireguard::{WgApi, WgControl, WireGuard},
    },
    writes::{READ_BACK_EVERY, Write},
};
use support::netns::{NetNs, WgGo, sh, veth};

fn no_ipv6(ns: &NetNs) {
    ns.sh("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1");
}

fn key() -> Key {
    Key(wireguard_control::Key::generate_private().0)
}

fn public(k: &Key) -> Key {
    Key(wireguard_control::Key(k.0).get_public().0)
}

/// The hand-built plan of a leader (10.4.0.1, pods 10.2.1.0/24) with one remote segment
/// (10.4.0.2, pods 10.2.2.0/24, endpoint 10.0.0.2) and the extra peers given.
fn plan(remote: Key, extra: &[Key]) -> Plan {
    let mut peers = vec![WireGuardPeer {
        public_key: remote,
        preshared_key: None,
        endpoint: Some("10.0.0.2:51820".parse().unwrap()),
        allowed_ips: vec![
            "10.2.2.0/24".parse().unwrap(),
            "10.4.0.2/32".parse().unwrap(),
        ],
        persistent_keepalive: 0,
    }];
    for (i, k) in extra.iter().enumerate() {
        peers.push(WireGuardPeer {
            public_key: *k,
            preshared_key: Some(Key([i as u8 + 1; 32])),
            endpoint: None,
            allowed_ips: vec![format!("10.10.{i}.0/24").parse().unwrap()],
            persistent_keepalive: 25,
        });
    }
    Plan {
        addresses: vec!["10.4.0.1/16".parse().unwrap()],
        wireguard: WireGuardPlan {
            listen_port: 51820,
            peers,
        },
        routes: vec![
            Route {
                dst: "10.2.2.0/24".parse().unwrap(),
                gateway: Some("10.4.0.2".parse().unwrap()),
                src: Some("10.0.0.1".parse().unwrap()),
                device: Device::WireGuard,
                onlink: true,
                table: MAIN_TABLE,
            },
            Route {
                dst: "10.0.0.2/32".parse().unwrap(),
                gateway: Some("10.0.0.2".parse().unwrap()),
                src: None,
                device: Device::Private,
                onlink: false,
                table: KILO_TABLE,
            },
        ],
        rules: vec![Rule {
            src: Some("10.2.1.0/24".parse().unwrap()),
            dst: Some("10.0.0.2/32".parse().unwrap()),
            iif: None,
            table: KILO_TABLE,
        }],
        ..Plan::default()
    }
}

/// One more route through the remote segment (10.10.0.0/24 in the main table).
fn route_through_remote() -> Route {
    Route {
        dst: "10.10.0.0/24".parse().unwrap(),
        gateway: Some("10.4.0.2".parse().unwrap()),
        src: None,
        device: Device::WireGuard,
        onlink: true,
        table: MAIN_TABLE,
    }
}

type Real = Reconciler<NetlinkKernel, WgControl, FakeDatapath>;

fn reconciler(wg: &str, private_key: Key) -> Real {
    Reconciler::new(
        NetlinkKernel::connect().unwrap(),
        WgControl::new(wg, WgApi::Userspace).unwrap(),
        FakeDatapath::default(),
        DeviceSettings {
            mtu: Some(1380),
            ..support::agent::settings(wg, Some("eth0"), false, private_key)
        },
    )
}

/// Runs `f` with a reconciler on a current-thread runtime inside the namespace.
fn in_ns<T: Send + 'static>(
    ns: &NetNs,
    wg: &str,
    private_key: Key,
    f: impl AsyncFnOnce(&mut Real) -> T + Send + 'static,
) -> T {
    let wg = wg.to_string();
    ns.run(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let mut r = reconciler(&wg, private_key);
                f(&mut r).await
            })
    })
}

fn ok(report: &Report) {
    assert!(
        report.problems.is_empty(),
        "problems: {:?}",
        report.problems
    );
}

/// Agent namespace `a` (eth0 10.0.0.1/24) and remote namespace `b` (10.0.0.2/24).
fn pair() -> (NetNs, NetNs) {
    let a = NetNs::new("ag");
    let b = NetNs::new("rm");
    no_ipv6(&a);
    no_ipv6(&b);
    veth(&a, "eth0", &b, "eth0");
    a.sh("ip addr add 10.0.0.1/24 dev eth0");
    b.sh("ip addr add 10.0.0.2/24 dev eth0");
    (a, b)
}

#[test]
fn converges_writes_nothing_twice_and_repairs_tampering() {
    if !support::require_root("converges_writes_nothing_twice_and_repairs_tampering") {
        return;
    }
    let (a, _b) = pair();
    let wg = WgGo::start(&a);
    let (sk, remote) = (key(), public(&key()));
    let extra = public(&key());
    let p = plan(remote, &[extra]);

    let (first, second) = in_ns(&a, &wg.name, sk, {
        let p = p.clone();
        async move |r: &mut Real| {
            let first = r.reconcile(&p).await.unwrap();
            let second = r.reconcile(&p).await.unwrap();
            (first, second)
        }
    });
    ok(&first);
    for (kind, n) in [
        (Write::LinkSet, 1),
        (Write::AddressAdd, 1),
        (Write::RouteAdd, 2),
        (Write::RuleAdd, 1),
        (Write::WireguardDeviceSet, 1),
        (Write::WireguardPeerAdd, 2),
    ] {
        assert_eq!(first.writes.get(kind), n, "{kind} in {}", first.writes);
    }
    ok(&second);
    assert!(
        second.writes.is_empty(),
        "second reconcile wrote {}",
        second.writes
    );

    let routes = a.sh("ip route show table all proto 107");
    assert!(
        routes.contains(&format!(
            "10.2.2.0/24 via 10.4.0.2 dev {} src 10.0.0.1 onlink",
            wg.name
        )),
        "{routes}"
    );
    assert!(
        routes.contains("10.0.0.2 via 10.0.0.2 dev eth0 table 1107"),
        "{routes}"
    );
    let rules = a.sh("ip rule");
    assert!(
        rules.contains("from 10.2.1.0/24 to 10.0.0.2 lookup 1107 proto 107"),
        "{rules}"
    );
    let link = a.sh(&format!("ip addr show dev {}", wg.name));
    assert!(
        link.contains("mtu 1380") && link.contains("inet 10.4.0.1/16") && link.contains(",UP"),
        "{link}"
    );
    let dump = a.sh(&format!("wg show {} dump", wg.name));
    assert!(
        dump.contains(&remote.to_string()) && dump.contains("10.0.0.2:51820"),
        "{dump}"
    );

    // Tampering: delete a route, remove a peer, remove the address, add a foreign route.
    a.sh("ip route del 10.0.0.2/32 table 1107");
    a.sh(&format!("wg set {} peer {extra} remove", wg.name));
    a.sh(&format!("ip addr flush dev {}", wg.name));
    a.sh("ip route add 192.0.2.0/24 dev eth0 proto static");
    let repair = in_ns(&a, &wg.name, sk, {
        let p = p.clone();
        async move |r: &mut Real| r.reconcile(&p).await.unwrap()
    });
    ok(&repair);
    assert_eq!(repair.writes.get(Write::RouteAdd), 2, "{}", repair.writes); // flushing the address dropped the onlink route too
    assert_eq!(
        repair.writes.get(Write::WireguardPeerAdd),
        1,
        "{}",
        repair.writes
    );
    assert_eq!(repair.writes.get(Write::AddressAdd), 1, "{}", repair.writes);
    assert_eq!(
        repair.writes.get(Write::RouteDel),
        0,
        "foreign route touched: {}",
        repair.writes
    );
    assert!(
        a.sh("ip route")
            .contains("192.0.2.0/24 dev eth0 proto static")
    );
    assert!(
        a.sh(&format!("wg show {} peers", wg.name))
            .contains(&extra.to_string())
    );
    assert!(
        a.sh("ip route show table 1107")
            .contains("10.0.0.2 via 10.0.0.2")
    );
}

#[test]
fn adding_a_peer_keeps_the_other_sessions() {
    if !support::require_root("adding_a_peer_keeps_the_other_sessions") {
        return;
    }
    let (a, b) = pair();
    let wga = WgGo::start(&a);
    let wgb = WgGo::start(&b);
    let (ska, skb) = (key(), key());
    // The remote side, configured by hand with wg(8).
    b.sh(&format!(
        "echo {skb} > /tmp/{n}.key && wg set {n} private-key /tmp/{n}.key listen-port 51820 \
         peer {pa} allowed-ips 10.4.0.1/32,10.2.1.0/24 endpoint 10.0.0.1:51820 && \
         rm /tmp/{n}.key && ip addr add 10.4.0.2/16 dev {n} && ip link set {n} up",
        n = wgb.name,
        pa = public(&ska)
    ));
    let remote = public(&skb);
    let p1 = plan(remote, &[public(&key())]);
    let first = in_ns(&a, &wga.name, ska, {
        let p = p1.clone();
        async move |r: &mut Real| r.reconcile(&p).await.unwrap()
    });
    ok(&first);
    a.sh("busybox ping -c2 -W5 10.4.0.2");
    let before = in_ns(&a, &wga.name, ska, async move |r: &mut Real| {
        r.wireguard_mut().observe().unwrap().unwrap()
    });
    let stats = before.stats[&remote].clone();
    assert!(stats.last_handshake.is_some(), "no handshake: {stats:?}");

    let mut p2 = p1.clone();
    let newcomer = public(&key());
    p2.wireguard.peers.push(WireGuardPeer {
        public_key: newcomer,
        preshared_key: None,
        endpoint: Some("10.0.0.3:51820".parse().unwrap()),
        allowed_ips: vec!["10.20.0.0/24".parse().unwrap()],
        persistent_keepalive: 0,
    });
    let (second, after) = in_ns(&a, &wga.name, ska, {
        async move |r: &mut Real| {
            let w = r.reconcile(&p2).await.unwrap();
            (w, r.wireguard_mut().observe().unwrap().unwrap())
        }
    });
    ok(&second);
    assert_eq!(second.writes.total(), 1, "{}", second.writes);
    assert_eq!(second.writes.get(Write::WireguardPeerAdd), 1);
    // The endpoint WireGuard uses for the handshaken remote (Kilo's discovered endpoint).
    assert_eq!(
        second.handshaken_endpoints.get(&remote),
        Some(&"10.0.0.2:51820".parse().unwrap())
    );
    assert_eq!(
        second.handshaken_endpoints.len(),
        1,
        "no handshake with the others"
    );
    assert!(after.peers.contains_key(&newcomer));
    // The session with the remote survived: same handshake, counters not reset.
    let now = after.stats[&remote].clone();
    assert_eq!(now.last_handshake, stats.last_handshake);
    assert!(
        now.rx_bytes >= stats.rx_bytes && now.tx_bytes >= stats.tx_bytes,
        "{now:?} vs {stats:?}"
    );
    assert_eq!(after.peers[&remote], before.peers[&remote]);
    a.sh("busybox ping -c1 -W5 10.4.0.2");
}

/// Kilo numbers WireGuard IPs by segment, so a new location can move this node's IP to the one
/// a remote leader had (the next one moving up): in one pass, with no error and without the
/// device ever losing its routes (an old address deleted last took the new one, its secondary,
/// with it, and with them every route through the device until the next pass).
#[test]
fn a_new_wireguard_ip_keeps_the_routes_through_the_device() {
    if !support::require_root("a_new_wireguard_ip_keeps_the_routes_through_the_device") {
        return;
    }
    let (a, _b) = pair();
    let wg = WgGo::start(&a);
    let (sk, remote) = (key(), public(&key()));
    let steady = Route {
        dst: "10.9.0.0/24".parse().unwrap(),
        gateway: None,
        src: None,
        device: Device::WireGuard,
        onlink: false,
        table: MAIN_TABLE,
    };
    let mut p1 = plan(remote, &[]);
    p1.routes.push(steady.clone());
    // This node moves from 10.4.0.1 to 10.4.0.2, the remote from 10.4.0.2 to 10.4.0.3.
    let mut p2 = p1.clone();
    p2.addresses = vec!["10.4.0.2/16".parse().unwrap()];
    p2.wireguard.peers[0].allowed_ips[1] = "10.4.0.3/32".parse().unwrap();
    p2.routes[0].gateway = Some("10.4.0.3".parse().unwrap());
    let (first, second, third) = in_ns(&a, &wg.name, sk, async move |r: &mut Real| {
        let first = r.reconcile(&p1).await.unwrap();
        let second = r.reconcile(&p2).await.unwrap();
        let third = r.reconcile(&p2).await.unwrap();
        (first, second, third)
    });
    ok(&first);
    ok(&second);
    let routes = a.sh("ip route show proto 107");
    assert!(routes.contains("10.9.0.0/24 dev"), "{routes}");
    assert!(routes.contains("10.2.2.0/24 via 10.4.0.3"), "{routes}");
    let addresses = a.sh(&format!("ip -o addr show dev {}", wg.name));
    assert!(addresses.contains("inet 10.4.0.2/16"), "{addresses}");
    assert!(!addresses.contains("10.4.0.1"), "{addresses}");
    assert!(
        third.writes.is_empty(),
        "a pass after the change wrote {}",
        third.writes
    );
}

fn snapshot(ns: &NetNs) -> String {
    ns.sh("ip route show table all; ip -6 route show table all; ip rule; ip -6 rule; ip addr")
}

#[test]
fn clean_up_leaves_the_namespace_as_before() {
    if !support::require_root("clean_up_leaves_the_namespace_as_before") {
        return;
    }
    let (a, _b) = pair();
    let before = snapshot(&a);
    let wg = WgGo::start(&a);
    let sk = key();
    let p = plan(public(&key()), &[public(&key())]);
    let (converged, keep, clean) = in_ns(&a, &wg.name, sk, async move |r: &mut Real| {
        let converged = r.reconcile(&p).await.unwrap();
        // --clean-up=false: nothing is touched, the mesh keeps running.
        let keep = r.reconcile(&p).await.unwrap();
        let clean = r.clean_up(true).await.unwrap();
        (converged, keep, clean)
    });
    ok(&converged);
    assert!(keep.writes.is_empty());
    ok(&clean);
    assert_eq!(clean.writes.get(Write::RouteDel), 2, "{}", clean.writes);
    assert_eq!(clean.writes.get(Write::RuleDel), 1, "{}", clean.writes);
    assert_eq!(clean.writes.get(Write::LinkDel), 1, "{}", clean.writes);
    assert_eq!(before, snapshot(&a));
}

#[test]
fn kernel_events_about_our_objects_trigger_and_foreign_churn_does_not() {
    if !support::require_root("kernel_events_about_our_objects_trigger_and_foreign_churn_does_not")
    {
        return;
    }
    let (a, _b) = pair();
    let wg = WgGo::start(&a);
    let sk = key();
    let remote = public(&key());
    let p = plan(remote, &[]);
    let name = a.name.clone();
    let wgname = wg.name.clone();
    let counted = in_ns(&a, &wg.name, sk, async move |r: &mut Real| {
        let report = r.reconcile(&p).await.unwrap();
        let filter = EventFilter {
            names: [wgname.clone(), "eth0".into()].into(),
            indexes: report
                .links
                .values()
                .map(|l| l.index)
                .collect::<BTreeSet<_>>(),
            wireguard_index: report.links.get(&wgname).map(|l| l.index),
            own_port: Some(r.kernel().port()),
        };
        let (tx, mut rx) = tokio::sync::mpsc::channel(1000);
        let _watch = watch(std::sync::Arc::new(filter.into()), tx, Changes::default()).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await; // subscription in place
        // Our own writes (a peer more: its routes) are echoes, not a reason to reconcile.
        let mut more = plan(remote, &[public(&key())]);
        more.routes.push(route_through_remote());
        let more = r.reconcile(&more).await.unwrap();
        assert!(more.writes.get(Write::RouteAdd) > 0, "{}", more.writes);
        sh(&format!(
            "ip netns exec {name} sh -c 'for i in $(seq 1 50); do ip route add 198.51.100.$i/32 dev eth0 proto bird; done; \
             ip rule add from 198.51.100.0/24 lookup 300; ip route del 10.0.0.2/32 table 1107'"
        ));
        tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("no trigger for a deleted route of ours")
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await; // let stragglers arrive
        let mut n = 1;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        n
    });
    assert_eq!(
        counted, 1,
        "our own writes and foreign churn (50 routes, 1 rule) must not trigger"
    );
}

/// Lets the watcher (on this runtime) take in what the kernel announced.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

#[test]
fn idle_reconciles_read_the_kernel_only_after_a_notification_or_every_nth() {
    if !support::require_root(
        "idle_reconciles_read_the_kernel_only_after_a_notification_or_every_nth",
    ) {
        return;
    }
    let (a, _b) = pair();
    let wg = WgGo::start(&a);
    let (sk, remote) = (key(), public(&key()));
    let p = plan(remote, &[]);
    let ip = format!("ip netns exec {}", a.name);
    in_ns(&a, &wg.name, sk, async move |r: &mut Real| {
        let changes = Changes::default();
        r.kernel_mut().follow(changes.clone());
        let (tx, _rx) = tokio::sync::mpsc::channel(1);
        let watcher = watch(Default::default(), tx, changes.clone()).unwrap();
        settle().await;
        ok(&r.reconcile(&p).await.unwrap());
        // The echoes of our writes: the pass after them reads once, the next ones not.
        settle().await;
        ok(&r.reconcile(&p).await.unwrap());
        let dumps = r.kernel().dumps();
        for _ in 0..3 {
            let idle = r.reconcile(&p).await.unwrap();
            ok(&idle);
            assert!(idle.writes.is_empty(), "{}", idle.writes);
        }
        assert_eq!(r.kernel().dumps(), dumps, "idle passes dumped the kernel");

        // A change that triggers no reconcile (an address on another link) is still seen by
        // the next pass: here, as a conflict with the WireGuard address.
        sh(&format!("{ip} ip addr add 10.4.0.1/32 dev eth0"));
        settle().await;
        let conflict = r.reconcile(&p).await.unwrap();
        assert_eq!(r.kernel().dumps(), dumps + 1);
        assert!(
            conflict.problems.iter().any(|p| p.contains("also on eth0")),
            "{:?}",
            conflict.problems
        );
        sh(&format!("{ip} ip addr del 10.4.0.1/32 dev eth0"));

        // One of our routes deleted behind our back: repaired by the next pass.
        sh(&format!("{ip} ip route del 10.0.0.2/32 table 1107"));
        settle().await;
        let repair = r.reconcile(&p).await.unwrap();
        assert_eq!(repair.writes.get(Write::RouteAdd), 1, "{}", repair.writes);
        settle().await;
        ok(&r.reconcile(&p).await.unwrap());

        // A change the watcher misses is read at the READ_BACK_EVERY-th pass.
        watcher.abort();
        settle().await;
        let dumps = r.kernel().dumps();
        sh(&format!("{ip} ip route del 10.0.0.2/32 table 1107"));
        let mut repaired_at = None;
        for i in 1..=READ_BACK_EVERY {
            if r.reconcile(&p).await.unwrap().writes.get(Write::RouteAdd) == 1 {
                repaired_at.get_or_insert(i);
            }
        }
        assert_eq!(repaired_at, Some(READ_BACK_EVERY));
        assert_eq!(r.kernel().dumps(), dumps + 1);

        // Still unwatched: after a write the next pass reads what it wrote, not the record.
        let mut more = p.clone();
        more.routes.push(route_through_remote());
        assert_eq!(
            r.reconcile(&more)
                .await
                .unwrap()
                .writes
                .get(Write::RouteAdd),
            1
        );
        let after = r.reconcile(&more).await.unwrap();
        ok(&after);
        assert!(after.writes.is_empty(), "{}", after.writes);
    });
}

#[test]
fn dry_run_prints_the_difference_and_changes_nothing() {
    if !support::require_root("dry_run_prints_the_difference_and_changes_nothing") {
        return;
    }
    let (a, _b) = pair();
    let wg = WgGo::start(&a);
    let sk = key();
    let remote = public(&key());
    let p = plan(remote, &[]);
    let before = snapshot(&a);
    let peers_before = a.sh(&format!("wg show {} dump", wg.name));
    let diff = in_ns(&a, &wg.name, sk, {
        let p = p.clone();
        async move |r: &mut Real| r.dry_run(&p).await.unwrap().to_string()
    });
    assert_eq!(before, snapshot(&a), "the dry run changed the kernel");
    assert_eq!(peers_before, a.sh(&format!("wg show {} dump", wg.name)));
    assert!(
        diff.contains(&format!("+ wireguard peer {remote}")),
        "{diff}"
    );
    assert!(diff.contains("+ route 10.2.2.0/24 via 10.4.0.2"), "{diff}");
    assert!(diff.contains("+ route 10.0.0.2/32 via 10.0.0.2"), "{diff}");
    assert!(
        diff.contains("+ rule from 10.2.1.0/24 to 10.0.0.2/32 lookup 1107"),
        "{diff}"
    );
    assert!(diff.contains("+ address 10.4.0.1/16"), "{diff}");
    assert!(
        !diff.contains(&sk.to_string()),
        "private key printed: {diff}"
    );
    let after_converge = in_ns(&a, &wg.name, sk, async move |r: &mut Real| {
        r.reconcile(&p).await.unwrap();
        r.dry_run(&p).await.unwrap().to_string()
    });
    assert_eq!(
        after_converge, "",
        "dry run after convergence: {after_converge}"
    );
}
