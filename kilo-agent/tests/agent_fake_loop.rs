//! The agent loop against the in-memory kernel, device and datapath with the real file backend
//! (no root): bursts coalesce, `--clean-up=false` leaves everything, `--clean-up=true` removes
//! our routes, rules, addresses, map entries and annotations.
use std::{sync::Arc, time::Duration};

use kilo_agent::{
    agent::{ANNOTATION_KEY, Agent, Local, LoopSettings, PlanOutcome},
    backend::file::FileBackend,
    mesh::{Key, Snapshot},
    plan::{DatapathEntry, Device, EntryKind, MAIN_TABLE, Plan, Route, WireGuardPeer},
    reconcile::{
        FakeDatapath, FakeKernel, Reconciler, Settings,
        state::Devices,
        wireguard::{FakeWireGuard, system_resolver},
    },
    telemetry::Metrics,
};

fn key(i: u32) -> Key {
    let mut k = [3; 32];
    k[1..5].copy_from_slice(&i.to_le_bytes());
    Key(k)
}

fn peer_yaml(i: u32) -> String {
    format!(
        "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: p{i}\nspec:\n  allowedIPs: [10.200.0.{i}/32]\n  publicKey: \"{}\"\n",
        key(i)
    )
}

/// One WireGuard peer, one route and one datapath entry per Peer, once our node is seen.
fn planner(s: &Snapshot) -> PlanOutcome {
    let mut out = PlanOutcome::default();
    if !s.nodes.contains_key("me") {
        out.errors.push("node me not seen yet".into());
        return out;
    }
    let mut plan = Plan {
        addresses: vec!["10.4.0.1/16".parse().unwrap()],
        ..Plan::default()
    };
    for p in s.peers.values() {
        let cidr: ipnet::IpNet = p.spec.allowed_ips[0].parse().unwrap();
        plan.wireguard.peers.push(WireGuardPeer {
            public_key: p.spec.public_key.parse().unwrap(),
            preshared_key: None,
            endpoint: None,
            allowed_ips: vec![cidr],
            persistent_keepalive: 0,
        });
        plan.routes.push(Route {
            dst: cidr,
            gateway: None,
            src: None,
            device: Device::WireGuard,
            onlink: false,
            table: MAIN_TABLE,
        });
        plan.datapath.mesh_destinations.insert(
            cidr,
            DatapathEntry {
                kind: EntryKind::Peer,
                owner: p.metadata.name.clone().unwrap_or_default(),
                next_hop: None,
            },
        );
    }
    plan.routes.sort();
    out.ready_peers = s.peers.len();
    out.plan = Some(plan);
    out
}

type FakeAgent = Agent<fn(&Snapshot) -> PlanOutcome, FakeKernel, FakeWireGuard, FakeDatapath>;

fn agent(dir: &std::path::Path, clean_up: bool, metrics: Metrics) -> FakeAgent {
    Agent::new(
        Arc::new(FileBackend::start(dir).unwrap()),
        planner as fn(&Snapshot) -> PlanOutcome,
        Reconciler::new(
            FakeKernel::default(),
            FakeWireGuard::default(),
            FakeDatapath::default(),
            Settings {
                devices: Devices {
                    wireguard: "kilo0".into(),
                    private: None,
                    tunnel: None,
                },
                create_interface: true,
                mtu: Some(1420),
                private_key: key(999),
                resolver: Box::new(system_resolver),
            },
        ),
        Local {
            hostname: "me".into(),
            public_key: key(1000),
            endpoint: Some("10.0.0.1:51820".parse().unwrap()),
            internal_ip: None,
            granularity: "full".into(),
        },
        LoopSettings {
            resync: None,
            check_in: None,
            clean_up,
            clean_up_interface: false,
            ..LoopSettings::default()
        },
        metrics,
    )
}

fn metric(m: &Metrics, name: &str) -> u64 {
    m.encode()
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(30), async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting until {what}"));
}

fn run_case(clean_up: bool) -> (FakeAgent, tempfile::TempDir, u64) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p1.yaml"), peer_yaml(1)).unwrap();
    let metrics = Metrics::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut a = {
        let _in_runtime = rt.enter();
        agent(dir.path(), clean_up, metrics.clone())
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let burst_reconciles = rt.block_on(async {
        let driver = async {
            let peers_added = r#"kilo_writes_total{kind="wireguard_peer_add"}"#;
            until("p1 is applied", || metric(&metrics, peers_added) == 1).await;
            let before = metric(&metrics, "kilo_reconciles_total");
            for i in 2..=21 {
                std::fs::write(dir.path().join(format!("p{i}.yaml")), peer_yaml(i)).unwrap();
            }
            until("the burst is applied", || {
                metric(&metrics, peers_added) == 21
            })
            .await;
            let burst = metric(&metrics, "kilo_reconciles_total") - before;
            stop.send(()).unwrap();
            burst
        };
        let (burst, _) = tokio::join!(
            driver,
            a.run(None, async {
                let _ = stopped.await;
            })
        );
        burst
    });
    drop(rt);
    (a, dir, burst_reconciles)
}

#[test]
fn bursts_coalesce_and_clean_up_false_leaves_everything() {
    let (a, dir, burst) = run_case(false);
    assert!(burst < 20, "20 file writes cost {burst} reconciles");
    let k = &a.reconciler.kernel.state;
    assert_eq!(k.routes.len(), 21);
    assert_eq!(k.addresses.len(), 1);
    assert_eq!(
        a.reconciler.wireguard.device.as_ref().unwrap().peers.len(),
        21
    );
    assert_eq!(
        a.reconciler
            .datapath
            .applied
            .as_ref()
            .unwrap()
            .mesh_destinations
            .len(),
        21
    );
    let mine = std::fs::read_to_string(dir.path().join("me.yaml")).unwrap();
    assert!(mine.contains(ANNOTATION_KEY), "{mine}");
    assert_eq!(a.stats.last_problems, Vec::<String>::new());
}

#[test]
fn clean_up_true_removes_our_state_and_annotations() {
    let (a, dir, _) = run_case(true);
    let k = &a.reconciler.kernel.state;
    assert!(
        k.routes.is_empty() && k.rules.is_empty() && k.addresses.is_empty(),
        "{k:?}"
    );
    assert!(
        k.links.contains_key("kilo0"),
        "--clean-up-interface=false keeps the link"
    );
    assert!(a.reconciler.datapath.applied.is_none());
    let mine = std::fs::read_to_string(dir.path().join("me.yaml")).unwrap();
    assert!(!mine.contains("kilo.squat.ai/"), "{mine}");
}
