//! The whole agent loop in a network namespace: file backend, a wireguard-go device, the kernel
//! watcher, the stand-in planner of `support::agent`, clean-up on shutdown.
//!
//! Resync is disabled, so everything the test sees happen was triggered by an event.
use kilo_testkit as support;

use std::{
    os::fd::AsRawFd,
    sync::Arc,
    time::{Duration, Instant},
};

use kilo_agent::{
    agent::{Agent, LoopSettings},
    backend::file::FileBackend,
    datapath::FakeDatapath,
    mesh::{Key, annotations::KEY as ANNOTATION_KEY},
    reconcile::{
        DeviceSettings, Reconciler,
        netlink::{Changes, NetlinkKernel, watch},
        wireguard::{WgApi, WgControl},
    },
    telemetry::Metrics,
};
use support::{
    agent::{local, peer_yaml, planner, settings},
    netns::{NetNs, WgGo, veth},
};

fn key() -> Key {
    Key(wireguard_control::Key::generate_private().0)
}

fn public(k: &Key) -> Key {
    Key(wireguard_control::Key(k.0).get_public().0)
}

fn node_yaml(name: &str, key: &Key, cidr: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  annotations:\n    {ANNOTATION_KEY}: \"{key}\"\nspec:\n  podCIDR: {cidr}\n"
    )
}

/// Waits (bounded; liveness only) until `f` holds.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    eventually_or(what, &mut f, String::new);
}

fn eventually_or(what: &str, f: &mut dyn FnMut() -> bool, show: impl Fn() -> String) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting until {what}: {}",
            show()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of one sample in the text exposition (0 when absent).
fn metric(text: &str, name: &str) -> u64 {
    support::metrics::metric(text, name).unwrap_or(0)
}

fn snapshot(ns: &NetNs) -> String {
    ns.sh("ip route show table all; ip rule; ip addr")
}

#[test]
fn event_driven_loop_converges_repairs_reports_and_cleans_up() {
    if !support::require_root("event_driven_loop_converges_repairs_reports_and_cleans_up") {
        return;
    }
    let a = NetNs::new("lp");
    let b = NetNs::new("lq");
    for ns in [&a, &b] {
        ns.sh("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1");
    }
    veth(&a, "eth0", &b, "eth0");
    a.sh("ip addr add 10.0.0.1/24 dev eth0");
    let before = snapshot(&a);

    let wg = WgGo::start(&a);
    let wgname = wg.name.clone();

    let dir = tempfile::tempdir().unwrap();
    let remote = public(&key());
    std::fs::write(
        dir.path().join("remote.yaml"),
        node_yaml("remote", &remote, "10.2.2.0/24"),
    )
    .unwrap();
    let laptop = public(&key());
    std::fs::write(
        dir.path().join("laptop.yaml"),
        peer_yaml("laptop", laptop, "10.5.0.1/32"),
    )
    .unwrap();

    let sk = key();
    let me_public = public(&sk);
    let metrics = Metrics::new();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let ns_path = format!("/run/netns/{}", a.name);
    let backend_dir = dir.path().to_path_buf();
    let agent_metrics = metrics.clone();
    let agent_wg = wgname.clone();
    let agent = std::thread::spawn(move || {
        let f = std::fs::File::open(&ns_path).unwrap();
        // SAFETY: a valid namespace fd; affects only this thread.
        assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let backend = Arc::new(FileBackend::start(backend_dir).unwrap());
                // As kg does: observes dump only after a notification.
                let changes = Changes::default();
                let mut kernel = NetlinkKernel::connect().unwrap();
                kernel.follow(changes.clone());
                let reconciler = Reconciler::new(
                    kernel,
                    WgControl::new(&agent_wg, WgApi::Userspace).unwrap(),
                    FakeDatapath::default(),
                    DeviceSettings {
                        mtu: None,
                        ..settings(&agent_wg, Some("eth0"), false, sk)
                    },
                );
                let mut agent = Agent::new(
                    backend,
                    planner("me", true),
                    reconciler,
                    local("me", me_public, "location"),
                    LoopSettings {
                        resync: None,
                        check_in: None,
                        clean_up: true,
                        clean_up_interface: true,
                        ..LoopSettings::default()
                    },
                    agent_metrics,
                );
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                let _w = watch(agent.event_filter(), tx, changes).unwrap();
                agent
                    .run(Some(rx), async move {
                        let _ = stop_rx.await;
                    })
                    .await
            })
    });

    let peers = |ns: &NetNs| ns.sh(&format!("wg show {wgname} peers"));
    // Converges: our node file is created with our key, the mesh is applied.
    eventually("remote and laptop are peers", || {
        let p = peers(&a);
        p.contains(&remote.to_string()) && p.contains(&laptop.to_string())
    });
    // The node file is written first without a WireGuard IP (no plan yet), then again once the
    // plan makes this node a leader: wait for the second write rather than race it.
    let mine = || std::fs::read_to_string(dir.path().join("me.yaml")).unwrap_or_default();
    eventually(
        "our node file carries our key, endpoint and WireGuard IP",
        || {
            let m = mine();
            m.contains(&me_public.to_string())
                && m.contains("10.0.0.1:51820")
                && m.contains("kilo.squat.ai/wireguard-ip: 10.4.0.1/16")
        },
    );
    eventually("routes are in place", || {
        a.sh("ip route show proto 107").contains("10.5.0.1 dev")
    });

    // A new peer file and an invalid one in the same burst: the valid one is applied, the
    // invalid one reported (log + metric), the rest of the mesh untouched.
    let validate_before = metric(&metrics.encode(), "kilo_errors_total{event=\"validate\"}");
    let newcomer = public(&key());
    std::fs::write(
        dir.path().join("new.yaml"),
        peer_yaml("new", newcomer, "10.6.0.0/24"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("bad.yaml"),
        peer_yaml("bad", "not-a-key", "10.7.0.0/24"),
    )
    .unwrap();
    std::fs::write(dir.path().join("broken.yaml"), "kind: Peer\nmetadata: [").unwrap();
    eventually("the new peer is applied", || {
        peers(&a).contains(&newcomer.to_string())
    });
    eventually_or(
        "the invalid objects are counted",
        &mut || {
            let text = metrics.encode();
            metric(
                &text,
                "kilo_invalid_objects_total{kind=\"peer\",field=\"spec.publicKey\"}",
            ) == 1
                && metric(&text, "kilo_errors_total{event=\"validate\"}") == validate_before + 1
                && metric(&text, "kilo_errors_total{event=\"backend\"}") == 1
        },
        || metrics.encode(),
    );
    let p = peers(&a);
    assert!(p.contains(&remote.to_string()) && p.contains(&laptop.to_string()));
    assert!(!a.sh("ip route show proto 107").contains("10.7.0.0"));

    // A deleted route of ours is restored by the kernel event alone (resync is off).
    a.sh("ip route del 10.6.0.0/24");
    eventually("the deleted route is back", || {
        a.sh("ip route show proto 107").contains("10.6.0.0/24")
    });
    // A removed WireGuard peer is restored by the next event (WireGuard has no notifications).
    a.sh(&format!("wg set {wgname} peer {laptop} remove"));
    std::fs::write(
        dir.path().join("other.yaml"),
        node_yaml("other", &public(&key()), "10.2.3.0/24"),
    )
    .unwrap();
    eventually("the removed peer is back", || {
        peers(&a).contains(&laptop.to_string())
    });

    let text = metrics.encode();
    assert!(
        text.contains("kilo_writes_total{kind=\"wireguard_peer_add\"}"),
        "{text}"
    );
    assert!(text.contains("kilo_leader 1"), "{text}");

    // SIGTERM with --clean-up and --clean-up-interface: the namespace is as before.
    stop_tx.send(()).unwrap();
    let stats = agent.join().unwrap();
    assert!(stats.reconciles >= 3, "{stats:?}");
    drop(wg);
    assert_eq!(before, snapshot(&a));
    let mine = std::fs::read_to_string(dir.path().join("me.yaml")).unwrap();
    assert!(
        !mine.contains("kilo.squat.ai/"),
        "our annotations were not removed: {mine}"
    );
}
