//! Leader failover between agents: two kg loops (the leader n1 and its successor n2 of `east`)
//! on one in-memory cluster that applies what they publish, with the real planner, the
//! in-memory kernel and probes whose answers the test decides, on tokio's paused clock.
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::mesh::annotations::{DEMOTED, KG_LAST_SEEN, kg_nodes};

/// An API server in memory: every publish lands on its node and makes a new snapshot.
struct Cluster {
    tx: tokio::sync::watch::Sender<Update>,
    writes: Mutex<Vec<(String, Annotations)>>,
}

impl Cluster {
    fn new(nodes: BTreeMap<String, crate::mesh::KubeNode>) -> Arc<Self> {
        let (tx, _) = tokio::sync::watch::channel(Update::default());
        let c = Arc::new(Cluster {
            tx,
            writes: Mutex::default(),
        });
        c.tx.send_modify(|u| Self::renew(u, nodes));
        c
    }

    fn renew(u: &mut Update, nodes: BTreeMap<String, crate::mesh::KubeNode>) {
        u.generation += 1;
        u.connected = true;
        u.last_seen = Arc::new(crate::backend::last_seen_of(&nodes));
        u.snapshot = Arc::new(Snapshot {
            kg_nodes: kg_nodes(&nodes),
            nodes,
            ..Snapshot::default()
        });
    }

    fn annotation(&self, node: &str, key: &str) -> Option<String> {
        let u = self.tx.borrow();
        u.snapshot.nodes[node]
            .metadata
            .annotations
            .as_ref()?
            .get(key)
            .cloned()
    }

    /// The `demoted` writes so far, as (node, value).
    fn demotions(&self) -> Vec<(String, Option<String>)> {
        self.writes
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(n, a)| a.get(DEMOTED).map(|v| (n.clone(), v.clone())))
            .collect()
    }
}

impl Backend for Cluster {
    fn updates(&self) -> tokio::sync::watch::Receiver<Update> {
        self.tx.subscribe()
    }

    fn publish<'a>(
        &'a self,
        node: &'a str,
        annotations: &'a Annotations,
    ) -> futures::future::BoxFuture<'a, Result<bool, crate::backend::BackendError>> {
        self.writes
            .lock()
            .unwrap()
            .push((node.to_string(), annotations.clone()));
        let mut nodes = self.tx.borrow().snapshot.nodes.clone();
        let n = nodes.get_mut(node).expect("a node of the cluster");
        let current = n.metadata.annotations.get_or_insert_with(BTreeMap::new);
        let changed = crate::backend::apply_annotations(current, annotations);
        if changed {
            self.tx.send_modify(|u| Self::renew(u, nodes));
        }
        Box::pin(async move { Ok(changed) })
    }
}

/// Answers while `answering` is set.
struct Switch(Arc<AtomicBool>);

impl probe::Prober for Switch {
    fn echo(
        &self,
        _: std::net::IpAddr,
        _: u16,
        _: Duration,
    ) -> futures::future::BoxFuture<'_, bool> {
        let answered = self.0.load(Ordering::Relaxed);
        Box::pin(async move {
            // An unanswered echo waits out its timeout.
            if !answered {
                tokio::time::sleep(Duration::from_millis(900)).await;
            }
            answered
        })
    }
}

fn kube_node(name: &str, location: &str, i: u8) -> crate::mesh::KubeNode {
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "labels": {"topology.kubernetes.io/region": location},
            "annotations": {
                "kilo.squat.ai/key": Key([i; 32]).to_string(),
                "kilo.squat.ai/endpoint": format!("203.0.113.{i}:51820"),
                "kilo.squat.ai/internal-ip": format!("172.20.{}.{i}/24", u8::from(location == "west")),
            },
        },
        "spec": {"podCIDR": format!("10.10.{i}.0/24")},
    }))
    .unwrap()
}

struct Node {
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<Stats>,
    metrics: Metrics,
    answering: Arc<AtomicBool>,
}

fn agent(cluster: &Arc<Cluster>, name: &str, location: &str, i: u8) -> Node {
    let begin = tokio::time::Instant::now();
    let planner = planner::planner(crate::plan::Settings {
        hostname: name.into(),
        // The in-memory kernel has no tunnel device.
        encapsulate: crate::plan::Encapsulation::Never,
        ..crate::plan::Settings::default()
    });
    let local = Local {
        hostname: name.into(),
        public_key: Key([i; 32]),
        endpoint: Some(format!("203.0.113.{i}:51820").parse().unwrap()),
        internal_ip: Some(
            format!("172.20.{}.{i}/24", u8::from(location == "west"))
                .parse()
                .unwrap(),
        ),
        granularity: "location".into(),
        cni_compatibility_ip: None,
    };
    let settings = LoopSettings {
        check_in: Some(Duration::from_secs(30)),
        clock: testing::clock(begin),
        ..LoopSettings::default()
    };
    let metrics = Metrics::new();
    let answering = Arc::new(AtomicBool::new(true));
    let mut a = Agent::new(
        cluster.clone(),
        planner,
        reconciler(),
        local,
        settings,
        metrics.clone(),
    )
    .with_probe(Arc::new(Switch(answering.clone())), Duration::from_secs(1));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        a.run(None, async {
            let _ = stopped.await;
        })
        .await
    });
    Node {
        stop,
        run,
        metrics,
        answering,
    }
}

/// The in-memory kernel with a private interface, eth0.
fn reconciler() -> testing::FakeReconciler {
    let mut kernel = crate::reconcile::FakeKernel::default();
    kernel.state.links.insert(
        "eth0".into(),
        crate::reconcile::state::LinkState {
            index: 2,
            up: true,
            mtu: 1500,
        },
    );
    Reconciler::new(
        kernel,
        crate::reconcile::wireguard::FakeWireGuard::default(),
        crate::datapath::FakeDatapath::default(),
        crate::reconcile::DeviceSettings {
            devices: crate::plan::Devices {
                wireguard: "kilo0".into(),
                private: Some("eth0".into()),
                tunnel: None,
            },
            create_interface: true,
            mtu: None,
            private_key: Key([7; 32]),
            dns: Box::new(crate::reconcile::wireguard::system_resolver),
        },
    )
}

fn series(m: &Metrics, name: &str) -> Option<String> {
    m.encode()
        .lines()
        .find(|l| l.starts_with(name))
        .map(str::to_string)
}

/// The successor demotes a leader that stops answering its probes after three periods, with
/// one write; it then leads, seen from both. A failed write is made again at the next probe.
/// The demoted node, healthy and answered again, lifts its demotion after ten periods, with one
/// write, and leads again; nothing is written periodically in between.
#[tokio::test(start_paused = true)]
async fn a_leader_that_stops_answering_is_demoted_once_and_lifts_it_once_healthy() {
    let nodes = [("n1", "east", 1), ("n2", "east", 2), ("n3", "west", 3)]
        .into_iter()
        .map(|(n, l, i)| (n.to_string(), kube_node(n, l, i)))
        .collect();
    let cluster = Cluster::new(nodes);
    let n1 = agent(&cluster, "n1", "east", 1);
    let n2 = agent(&cluster, "n2", "east", 2);
    let n3 = agent(&cluster, "n3", "west", 3);
    tokio::time::sleep(Duration::from_secs(10)).await;
    // Each kg marks its node; n3 is in its own location and watches nobody.
    for n in ["n1", "n2", "n3"] {
        assert_eq!(
            cluster.annotation(n, KG_LAST_SEEN),
            cluster.annotation(n, LAST_SEEN),
            "{n}"
        );
    }
    assert_eq!(cluster.tx.borrow().snapshot.kg_nodes.len(), 3);
    let leader = |m: &Metrics| series(m, "kilo_leader ");
    assert_eq!(leader(&n1.metrics).as_deref(), Some("kilo_leader 1"));
    assert_eq!(leader(&n2.metrics).as_deref(), Some("kilo_leader 0"));
    assert!(cluster.demotions().is_empty());

    // n1 stops answering n2's probes: the third miss in a row demotes it.
    n2.answering.store(false, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(cluster.demotions().is_empty(), "two misses are forgiven");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        cluster.demotions(),
        [("n1".to_string(), Some("n2".to_string()))]
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(leader(&n2.metrics).as_deref(), Some("kilo_leader 1"));
    assert_eq!(leader(&n1.metrics).as_deref(), Some("kilo_leader 0"));
    for m in [&n1.metrics, &n3.metrics] {
        assert_eq!(
            series(m, "kilo_location_leader{location=\"east\"").as_deref(),
            Some("kilo_location_leader{location=\"east\",node=\"n2\"} 1")
        );
    }
    assert_eq!(
        series(&n2.metrics, "kilo_leader_failovers_total").as_deref(),
        Some("kilo_leader_failovers_total{location=\"east\"} 1")
    );

    // n1 answers again (through n2 now): ten healthy periods later it lifts its demotion.
    // (Demoted at 12.9 s, its tenth healthy period ends at 22.9 s.)
    tokio::time::sleep(Duration::from_millis(6500)).await;
    assert_eq!(cluster.demotions().len(), 1, "not before ten periods");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        cluster.demotions(),
        [
            ("n1".to_string(), Some("n2".to_string())),
            ("n1".to_string(), None)
        ]
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(leader(&n1.metrics).as_deref(), Some("kilo_leader 1"));
    assert_eq!(leader(&n2.metrics).as_deref(), Some("kilo_leader 0"));
    assert_eq!(
        series(&n1.metrics, "kilo_leader_recoveries_total").as_deref(),
        Some("kilo_leader_recoveries_total{location=\"east\"} 1")
    );

    // While the leader answers, nothing more is written about it.
    n2.answering.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(cluster.demotions().len(), 2);
    for n in [n1, n2, n3] {
        n.stop.send(()).unwrap();
        n.run.await.unwrap();
    }
}
