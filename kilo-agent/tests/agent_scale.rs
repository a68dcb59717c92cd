//! Scale abuse, without root: the agent loop with the real planner and file backend against the
//! in-memory kernel, device and datapath, given 10,000 Peers, one Peer with 10,000 allowed IPs,
//! a 10 MB object file and a Node whose annotation is larger than Kubernetes allows. The huge
//! file is refused unread and the oversized annotation by name; everything else converges, and
//! the loop keeps serving (a Peer added afterwards is applied). The time to converge, the
//! reconcile durations and the peak RSS are printed (`--nocapture`), not judged.
use kilo_testkit as support;

use std::{fmt::Write as _, sync::Arc, time::Duration};

use kilo_agent::{
    agent::{Agent, Local, LoopSettings, planner::planner},
    backend::{Backend, file::FileBackend},
    datapath::FakeDatapath,
    mesh::Key,
    plan::{self, plan_for},
    reconcile::{FakeKernel, Reconciler, wireguard::FakeWireGuard},
    telemetry::Metrics,
};

const PEERS: u32 = 10_000;
const BIG_PEER_IPS: u32 = 10_000;

fn key(i: u32) -> Key {
    let mut k = [7; 32];
    k[1..5].copy_from_slice(&i.to_le_bytes());
    Key(k)
}

/// An address of the /16 `base` (`100.64`, `10.128`), i-th, as a /32.
fn addr(base: &str, i: u32) -> String {
    format!("{base}.{}.{}/32", i / 256, i % 256)
}

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn settings() -> plan::Settings {
    plan::Settings {
        hostname: "me".into(),
        ..plan::Settings::default()
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(300), async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting until {what}"));
}

#[test]
fn ten_thousand_peers_and_a_huge_file_converge_and_the_loop_keeps_serving() {
    let dir = tempfile::Builder::new()
        .prefix("privilege-scale")
        .tempdir()
        .unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("me.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: me\nspec:\n  podCIDR: 10.42.0.0/24\n",
    )
    .unwrap();
    for i in 0..PEERS {
        let yaml = support::agent::peer_yaml(&format!("p{i}"), key(i), &addr("100.64", i));
        std::fs::write(d.join(format!("p{i}.yaml")), yaml).unwrap();
    }
    let ips: Vec<String> = (0..BIG_PEER_IPS).map(|i| addr("10.128", i)).collect();
    let big = support::agent::peer_yaml("big", key(PEERS), &ips.join(", "));
    std::fs::write(d.join("big.yaml"), &big).unwrap();
    // 10 MB: a Node whose annotation alone is 40 times Kubernetes' limit.
    let mut huge = String::from(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: huge\n  annotations:\n    kilo.squat.ai/allowed-location-ips: \"",
    );
    while huge.len() < 10 << 20 {
        huge.push_str("10.0.0.0/8,");
    }
    huge.push_str("\"\nspec:\n  podCIDR: 10.42.9.0/24\n");
    std::fs::write(d.join("huge.yaml"), &huge).unwrap();
    // Under the file limit, over the annotation limit.
    let mut fat = String::from(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: fat\n  annotations:\n    kilo.squat.ai/location: west\n    kilo.squat.ai/allowed-location-ips: \"",
    );
    for i in 0..30_000 {
        write!(fat, "10.{}.{}.0/24,", 100 + i / 65536 % 100, i / 256 % 256).unwrap();
    }
    fat.push_str("\"\nspec:\n  podCIDR: 10.42.8.0/24\n");
    assert!(fat.len() > 256 * 1024 && fat.len() < 1 << 20);
    std::fs::write(d.join("fat.yaml"), &fat).unwrap();

    let metrics = Metrics::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let backend = {
        let _in_runtime = rt.enter();
        Arc::new(FileBackend::start(d).unwrap())
    };
    let mut agent = Agent::new(
        backend.clone(),
        planner(settings()),
        Reconciler::new(
            FakeKernel::default(),
            FakeWireGuard::default(),
            FakeDatapath::default(),
            support::agent::settings("kilo0", None, true, key(u32::MAX)),
        ),
        Local {
            internal_ip: None,
            ..support::agent::local("me", key(u32::MAX - 1), "location")
        },
        LoopSettings {
            resync: None,
            check_in: None,
            clean_up: false,
            clean_up_interface: false,
            ..LoopSettings::default()
        },
        metrics.clone(),
    );
    let metric = |name: &str| support::metrics::metric(&metrics.encode(), name).unwrap_or(0);
    let peers_added = r#"kilo_writes_total{kind="wireguard_peer_add"}"#;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let start = std::time::Instant::now();
    let converged = rt.block_on(async {
        let driver = async {
            until("every peer is applied", || {
                metric(peers_added) == u64::from(PEERS) + 1
            })
            .await;
            let converged = start.elapsed();
            // The loop keeps serving: a Peer added now is applied.
            std::fs::write(
                d.join("late.yaml"),
                support::agent::peer_yaml("late", key(PEERS + 1), "100.65.0.1/32"),
            )
            .unwrap();
            until("the late peer is applied", || {
                metric(peers_added) == u64::from(PEERS) + 2
            })
            .await;
            stop.send(()).unwrap();
            converged
        };
        let (converged, _) = tokio::join!(
            driver,
            agent.run(None, async {
                let _ = stopped.await;
            })
        );
        converged
    });

    let device = agent.reconciler.wireguard().device.as_ref().unwrap();
    assert_eq!(device.peers.len(), PEERS as usize + 2);
    let big_peer = &device.peers[&key(PEERS)];
    assert_eq!(big_peer.allowed_ips.len(), BIG_PEER_IPS as usize);
    // Each peer's allowed IPs are mesh destinations.
    assert!(
        agent.reconciler.datapath().len() >= (PEERS + BIG_PEER_IPS + 1) as usize,
        "{}",
        agent.reconciler.datapath().len()
    );
    // The huge file was refused unread, naming its size; the fat node's annotation by name.
    let update = backend.updates().borrow().clone();
    let errors = update.errors.join("\n");
    assert!(
        errors.contains("huge.yaml") && errors.contains("size: 10485"),
        "{errors}"
    );
    assert!(!update.snapshot.nodes.contains_key("huge"));
    let planned = plan_for(&update.snapshot, &settings());
    let problems: Vec<String> = planned.errors.iter().map(ToString::to_string).collect();
    assert!(
        problems.iter().any(|p| p
            .starts_with("node \"fat\": annotation kilo.squat.ai/allowed-location-ips: ")
            && p.contains("more than the 262144")),
        "{problems:?}"
    );

    let text = metrics.encode();
    let sum = text
        .lines()
        .find_map(|l| l.strip_prefix("kilo_reconcile_duration_seconds_sum "))
        .unwrap_or("?");
    let count = support::metrics::metric(&text, "kilo_reconcile_duration_seconds_count");
    eprintln!(
        "scale: {PEERS} peers + one of {BIG_PEER_IPS} allowed IPs converged in {:.2} s \
         (from start, files already written); reconciles {count:?}, total reconcile time \
         {sum} s; peak RSS of the test process {} MiB",
        converged.as_secs_f64(),
        peak_rss_kib() / 1024
    );
}
