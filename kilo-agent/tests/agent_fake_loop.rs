//! The agent loop against the in-memory kernel, device and datapath with the real file backend
//! (no root): bursts coalesce (more triggers than reconciles, each reconcile timed),
//! `--clean-up=false` leaves everything, the datapath metrics read the maps at scrape time,
//! `--clean-up=true` removes our routes, rules, addresses, map entries and
//! annotations.
use kilo_testkit as support;

use std::{sync::Arc, time::Duration};

use kilo_agent::{
    agent::{Agent, Local, LoopSettings, PlanOutcome},
    backend::file::FileBackend,
    datapath::{Counter, FakeDatapath, Trie},
    mesh::{Key, Snapshot, annotations::KEY as ANNOTATION_KEY},
    reconcile::{FakeKernel, Reconciler, wireguard::FakeWireGuard},
    telemetry::Metrics,
};

fn key(i: u32) -> Key {
    let mut k = [3; 32];
    k[1..5].copy_from_slice(&i.to_le_bytes());
    Key(k)
}

fn peer_yaml(i: u32) -> String {
    support::agent::peer_yaml(&format!("p{i}"), key(i), &format!("10.200.0.{i}/32"))
}

type FakeAgent =
    Agent<Box<dyn FnMut(&Snapshot) -> PlanOutcome>, FakeKernel, FakeWireGuard, FakeDatapath>;

fn agent(dir: &std::path::Path, clean_up: bool, metrics: Metrics) -> FakeAgent {
    Agent::new(
        Arc::new(FileBackend::start(dir).unwrap()),
        Box::new(support::agent::planner("me", true)),
        Reconciler::new(
            FakeKernel::default(),
            FakeWireGuard::default(),
            FakeDatapath::default(),
            support::agent::settings("kilo0", None, true, key(999)),
        ),
        Local {
            internal_ip: None,
            ..support::agent::local("me", key(1000), "full")
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
    support::metrics::metric(&m.encode(), name).unwrap_or(0)
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
    let k = &a.reconciler.kernel().state;
    assert_eq!(k.routes.len(), 21);
    assert_eq!(k.addresses.len(), 1);
    assert_eq!(
        a.reconciler
            .wireguard()
            .device
            .as_ref()
            .unwrap()
            .peers
            .len(),
        21
    );
    assert_eq!(a.reconciler.datapath().len(), 21);
    // The datapath metrics read the maps at scrape time, labelled with the plan's owners.
    let text = a.metrics.encode();
    let entries = r#"kilo_datapath_map_entries{map="mesh_destination"}"#;
    assert_eq!(support::metrics::metric(&text, entries), Some(21), "{text}");
    let capacity = r#"kilo_datapath_map_capacity{map="mesh_destination"}"#;
    assert_eq!(support::metrics::metric(&text, capacity), Some(1 << 16));
    // Every reconcile was timed; each but the first (the start) was triggered by the backend.
    let reconciles = support::metrics::metric(&text, "kilo_reconciles_total").unwrap();
    let timed = support::metrics::metric(&text, "kilo_reconcile_duration_seconds_count");
    assert_eq!(timed, Some(reconciles), "{text}");
    let backend = r#"kilo_reconcile_triggers_total{cause="backend"}"#;
    let triggers = support::metrics::metric(&text, backend).unwrap();
    assert!(triggers >= reconciles - 1 && triggers >= burst, "{text}");
    for (cause, n) in [("start", 1), ("kernel", 0), ("resync", 0)] {
        let series = format!("kilo_reconcile_triggers_total{{cause=\"{cause}\"}}");
        assert_eq!(support::metrics::metric(&text, &series), Some(n), "{text}");
    }
    let mut maps = a.reconciler.datapath().maps();
    let p1: ipnet::IpNet = "10.200.0.1/32".parse().unwrap();
    let slot = maps.tries[&Trie::Destination][&p1].counter as usize;
    maps.counters[slot] = Counter {
        packets: 5,
        bytes: 420,
    };
    a.reconciler.datapath().set_maps(maps);
    let text = a.metrics.encode();
    let p1_packets = r#"kilo_datapath_entry_packets_total{role="mesh_destination",cidr="10.200.0.1/32",kind="peer",owner="p1"}"#;
    assert_eq!(
        support::metrics::metric(&text, p1_packets),
        Some(5),
        "{text}"
    );
    let mine = std::fs::read_to_string(dir.path().join("me.yaml")).unwrap();
    assert!(mine.contains(ANNOTATION_KEY), "{mine}");
    assert_eq!(a.stats.last_problems, Vec::<String>::new());
}

#[test]
fn clean_up_true_removes_our_state_and_annotations() {
    let (a, dir, _) = run_case(true);
    let k = &a.reconciler.kernel().state;
    assert!(
        k.routes.is_empty() && k.rules.is_empty() && k.addresses.is_empty(),
        "{k:?}"
    );
    assert!(
        k.links.contains_key("kilo0"),
        "--clean-up-interface=false keeps the link"
    );
    assert!(a.reconciler.datapath().is_empty());
    let mine = std::fs::read_to_string(dir.path().join("me.yaml")).unwrap();
    assert!(!mine.contains("kilo.squat.ai/"), "{mine}");
}
