//! The loop under tokio's paused clock: bursts, expiries, retries, check-ins, publishing.
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use super::*;
use crate::{
    backend::{Annotations, Update},
    mesh::annotations::{CNI_COMPATIBILITY_IP, KG_LAST_SEEN, LAST_SEEN, WIREGUARD_IP},
};

mod failover;
mod kube_backend;

#[test]
fn discovered_endpoints_in_kilo_format() {
    let k = Key([1; 32]);
    let a: SocketAddr = "192.0.2.7:4500".parse().unwrap();
    let json = discovered_endpoints_json(&BTreeMap::from([(&k, &a)]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        v[k.to_string()],
        serde_json::json!({"IP": "192.0.2.7", "Port": 4500, "Zone": ""})
    );
}

#[test]
fn only_differing_annotations_are_published() {
    let local = Local {
        hostname: "a".into(),
        public_key: Key([1; 32]),
        endpoint: Some("10.0.0.1:51820".parse().unwrap()),
        internal_ip: Some("10.0.0.1/24".parse().unwrap()),
        granularity: "location".into(),
        cni_compatibility_ip: None,
    };
    let want = local.annotations(None);
    assert_eq!(want[WIREGUARD_IP], "");
    assert_eq!(want[CNI_COMPATIBILITY_IP], "");
    let all = annotation_changes(None, &want);
    assert_eq!(all.len(), 6);
    let cilium = Local {
        cni_compatibility_ip: Some("10.0.1.77/32".parse().unwrap()),
        ..local.clone()
    };
    assert_eq!(
        cilium.annotations(None)[CNI_COMPATIBILITY_IP],
        "10.0.1.77/32"
    );
    let mut current = want.clone();
    current.insert("kilo.squat.ai/leader".into(), "true".into());
    assert!(annotation_changes(Some(&current), &want).is_empty());
    let want2 = local.annotations(Some("10.4.0.1/16".parse().unwrap()));
    let c = annotation_changes(Some(&current), &want2);
    assert_eq!(
        c,
        Annotations::from([(WIREGUARD_IP.into(), Some("10.4.0.1/16".into()))])
    );
}

/// A backend the test drives: it sends updates and records what the agent publishes.
struct Driven {
    tx: tokio::sync::watch::Sender<Update>,
    published: Mutex<Vec<Annotations>>,
    /// Publishing fails while set.
    failing: std::sync::atomic::AtomicBool,
}

impl Backend for Driven {
    fn updates(&self) -> tokio::sync::watch::Receiver<Update> {
        self.tx.subscribe()
    }

    fn publish<'a>(
        &'a self,
        _node: &'a str,
        annotations: &'a Annotations,
    ) -> futures::future::BoxFuture<'a, Result<bool, crate::backend::BackendError>> {
        if self.failing.load(std::sync::atomic::Ordering::Relaxed) {
            return Box::pin(async {
                Err(crate::backend::BackendError::Kube("unreachable".into()))
            });
        }
        self.published.lock().unwrap().push(annotations.clone());
        Box::pin(async { Ok(true) })
    }
}

use testing::{Plans, Running, T0, planned, spawn};

/// A backend's first update: `snapshot`, complete.
fn first_update(snapshot: Arc<Snapshot>) -> Update {
    Update {
        snapshot,
        generation: 1,
        connected: true,
        ..Update::default()
    }
}

fn start(
    update: Update,
    outcome: impl Fn() -> PlanOutcome + Send + 'static,
) -> (Arc<Driven>, Running) {
    let settings = LoopSettings {
        resync: Some(Duration::from_secs(8)),
        check_in: Some(Duration::from_secs(10)),
        ..LoopSettings::default()
    };
    start_with(update, settings, outcome)
}

/// [`start`] with other loop settings.
fn start_with(
    update: Update,
    settings: LoopSettings,
    outcome: impl Fn() -> PlanOutcome + Send + 'static,
) -> (Arc<Driven>, Running) {
    let (tx, _) = tokio::sync::watch::channel(update);
    let backend = Arc::new(Driven {
        tx,
        published: Mutex::default(),
        failing: Default::default(),
    });
    (backend.clone(), spawn(backend, settings, outcome))
}

fn nodes(names: &[&str]) -> Arc<Snapshot> {
    let nodes = names
        .iter()
        .map(|n| {
            let node = serde_json::from_value(serde_json::json!({"metadata": {"name": n}}));
            (n.to_string(), node.unwrap())
        })
        .collect();
    Arc::new(Snapshot {
        nodes,
        ..Snapshot::default()
    })
}

fn beats(b: &[(&str, i64)]) -> Arc<BTreeMap<String, i64>> {
    Arc::new(b.iter().map(|(n, t)| (n.to_string(), T0 + t)).collect())
}

/// Sleeps (paused clock) until `ms` after the start.
async fn at(begin: tokio::time::Instant, ms: u64) {
    tokio::time::sleep_until(begin + Duration::from_millis(ms)).await;
}

/// When the first plan at or after `from` without (or with) `node` came.
fn first(plans: &Plans, from: u128, node: &str, with: bool) -> Option<u128> {
    let plans = plans.lock().unwrap();
    plans
        .iter()
        .find(|(t, n)| *t >= from && n.iter().any(|n| n == node) == with)
        .map(|(t, _)| *t)
}

/// The first change after a quiet period is planned the instant it arrives; the rest of its
/// burst coalesces into one more plan after the debounce window, whatever the period between
/// bursts (shorter or longer than the window, or than the resync period).
#[tokio::test(start_paused = true)]
async fn first_change_at_once_rest_of_burst_coalesced() {
    let begin = tokio::time::Instant::now();
    let (backend, agent) = start(first_update(nodes(&["me"])), planned);
    let debounce = DEBOUNCE.as_millis();
    for (start, gap, count) in [(1_000u64, 5u64, 20u64), (3_000, 1, 60), (20_000, 30, 3)] {
        at(begin, start).await;
        let before = agent.plans.lock().unwrap().len();
        let mut names = vec!["me".to_string()];
        for i in 0..count {
            at(begin, start + i * gap).await;
            names.push(format!("n{start}-{i}"));
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let now_s = i64::try_from(start / 1000).unwrap();
            let alive: Vec<(&str, i64)> = refs.iter().map(|n| (*n, now_s)).collect();
            backend.tx.send_modify(|u| {
                u.snapshot = nodes(&refs);
                u.last_seen = beats(&alive);
                u.generation += 1;
            });
        }
        at(begin, start + count * gap + 2 * debounce as u64).await;
        let plans = agent.plans.lock().unwrap();
        let burst = &plans[before..];
        assert_eq!(
            burst.first().map(|(t, _)| *t),
            Some(u128::from(start)),
            "the burst at {start} ms was not planned at once: {burst:?}"
        );
        assert!(
            burst.len() <= 2,
            "a burst of {count} cost {} plans",
            burst.len()
        );
        assert_eq!(
            burst.last().map(|(_, n)| n.len()),
            Some(names.len()),
            "the burst at {start} ms ended unapplied"
        );
    }
}

/// `--compatibility=cilium`: the local `cni-compatibility-ip` is read at every pass; a new
/// address (or none) is planned with and published at once.
#[tokio::test]
async fn cni_compatibility_ip_is_read_at_every_pass() {
    let (tx, _) = tokio::sync::watch::channel(first_update(nodes(&["me"])));
    let backend = Arc::new(Driven {
        tx,
        published: Mutex::default(),
        failing: Default::default(),
    });
    let planned_with: Arc<Mutex<Vec<String>>> = Arc::default();
    let recorded = planned_with.clone();
    let planner = move |s: &Snapshot| {
        let a = s.nodes["me"].metadata.annotations.as_ref();
        let ip = a.and_then(|a| a.get(CNI_COMPATIBILITY_IP));
        recorded
            .lock()
            .unwrap()
            .push(ip.cloned().unwrap_or_default());
        planned()
    };
    let address: Arc<Mutex<Option<&str>>> = Arc::new(Mutex::new(Some("10.0.1.77/32")));
    let read = address.clone();
    let mut agent = Agent::new(
        backend.clone(),
        planner,
        testing::reconciler(),
        testing::local(),
        LoopSettings::default(),
        Metrics::new(),
    )
    .with_cni_compatibility_probe(Box::new(move || {
        let ip = read.lock().unwrap().map(|a| a.parse().unwrap());
        Box::pin(async move { Ok(ip) })
    }));
    for next in [Some("10.0.1.78/32"), None, None] {
        agent.pass().await.unwrap();
        *address.lock().unwrap() = next;
    }
    let want = ["10.0.1.77/32", "10.0.1.78/32", ""];
    assert_eq!(*planned_with.lock().unwrap(), want);
    let published: Vec<String> = backend
        .published
        .lock()
        .unwrap()
        .iter()
        .map(|a| a[CNI_COMPATIBILITY_IP].clone().unwrap())
        .collect();
    assert_eq!(
        published, want,
        "the backend never shows them: each pass publishes"
    );
}

#[tokio::test(start_paused = true)]
async fn nodes_expire_at_their_instant_not_at_resync_ticks() {
    let begin = tokio::time::Instant::now();
    let (backend, agent) = start(
        Update {
            snapshot: nodes(&["me", "a", "b"]),
            generation: 1,
            // a vouched for until 21 s, b until 26 s; `me` has no heartbeat yet.
            last_seen: beats(&[("a", 0), ("b", 5)]),
            connected: true,
            ..Update::default()
        },
        planned,
    );
    // A heartbeat from b (until 33 s): recorded, no plan.
    at(begin, 12_000).await;
    let planned = agent.plans.lock().unwrap().len();
    backend
        .tx
        .send_modify(|u| u.last_seen = beats(&[("a", 0), ("b", 12)]));
    at(begin, 15_000).await;
    assert_eq!(
        agent.plans.lock().unwrap().len(),
        planned,
        "a heartbeat made a plan"
    );
    // a revives at 41 s.
    at(begin, 41_000).await;
    backend
        .tx
        .send_modify(|u| u.last_seen = beats(&[("a", 41), ("b", 12)]));
    at(begin, 50_000).await;
    let debounce = DEBOUNCE.as_millis();
    let dropped_a = first(&agent.plans, 0, "a", false).unwrap();
    assert!(
        (21_000..=21_000 + debounce).contains(&dropped_a),
        "{dropped_a}"
    );
    let dropped_b = first(&agent.plans, 0, "b", false).unwrap();
    assert!(
        (33_000..=33_000 + debounce).contains(&dropped_b),
        "{dropped_b}"
    );
    let back = first(&agent.plans, dropped_a, "a", true).unwrap();
    assert!((41_000..=41_000 + debounce).contains(&back), "{back}");
    // Resync ticks (8, 16, 24, 32, 40, 48 s) plan at once, the same nodes as the plan before.
    let plans_seen = agent.plans.lock().unwrap().clone();
    let ticks: Vec<u128> = plans_seen
        .iter()
        .map(|(t, _)| *t)
        .filter(|t| t % 8_000 == 0 && *t > 0)
        .collect();
    assert_eq!(ticks, [8_000, 16_000, 24_000, 32_000, 40_000, 48_000]);
    for w in plans_seen.windows(2) {
        if w[1].0 % 8_000 == 0 {
            assert_eq!(w[0].1, w[1].1, "the resync at {} changed the nodes", w[1].0);
        }
    }
    assert!(
        plans_seen
            .iter()
            .all(|(_, n)| n.contains(&"me".to_string()))
    );
    // Check-ins at 10, 20, 30, 40 s wrote the heartbeat alone (with kg's copy).
    let published = backend.published.lock().unwrap().clone();
    let beats_only = published
        .iter()
        .filter(|a| a.len() == 2 && a[LAST_SEEN] == a[KG_LAST_SEEN])
        .count();
    assert!(beats_only >= 4, "{published:?}");
    // Each reconcile counted under its cause: two expiries, the revival, the resync ticks;
    // heartbeats and check-ins asked for none.
    let text = agent.metrics.encode();
    let triggers = |cause: &str| {
        let series = format!("kilo_reconcile_triggers_total{{cause=\"{cause}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series)?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {series} in {text}"))
    };
    assert_eq!(triggers("liveness"), 2, "{text}");
    assert_eq!(triggers("start"), 1, "{text}");
    assert_eq!(triggers("backend"), 1, "{text}");
    assert_eq!(triggers("check_in"), 0, "{text}");
    assert!(triggers("resync") >= 5, "{text}");
    agent.stop.send(()).unwrap();
    agent.run.await.unwrap();
}

/// Nodes `names`, `me` carrying the annotations the test agent publishes (as a backend
/// shows them once published).
fn published(names: &[&str]) -> Arc<Snapshot> {
    let mut snapshot = (*nodes(names)).clone();
    let mut want = testing::local().annotations(None);
    want.remove(WIREGUARD_IP);
    snapshot.nodes.get_mut("me").unwrap().metadata.annotations = Some(want);
    Arc::new(snapshot)
}

/// A pass over the snapshot already planned (a resync, a kernel notification) reuses the
/// plan: planning a large mesh is most of an idle resync's cost.
#[tokio::test(start_paused = true)]
async fn an_unchanged_snapshot_is_planned_once() {
    let begin = tokio::time::Instant::now();
    let (backend, agent) = start(first_update(published(&["me"])), planned);
    at(begin, 30_000).await;
    assert_eq!(agent.plans.lock().unwrap().len(), 1);
    assert!(
        agent.metrics.reconciles.get() >= 4,
        "resyncs at 8, 16, 24 s"
    );
    backend.tx.send_modify(|u| {
        u.snapshot = published(&["me", "a"]);
        u.generation = 2;
        u.last_seen = beats(&[("a", 30)]);
    });
    at(begin, 31_000).await;
    let plans = agent.plans.lock().unwrap().clone();
    assert_eq!(plans.len(), 2, "{plans:?}");
    assert_eq!(plans[1].1, ["a", "me"]);
    agent.stop.send(()).unwrap();
    agent.run.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn nothing_expires_while_the_backend_is_disconnected() {
    let begin = tokio::time::Instant::now();
    let (backend, agent) = start(
        Update {
            snapshot: nodes(&["me", "a"]),
            generation: 1,
            last_seen: beats(&[("a", 0)]), // until 21 s
            connected: true,
            ..Update::default()
        },
        planned,
    );
    at(begin, 5_000).await;
    backend.tx.send_modify(|u| u.connected = false);
    // Resyncs keep planning, with a, long past its heartbeat.
    at(begin, 100_000).await;
    assert_eq!(first(&agent.plans, 0, "a", false), None);
    backend.tx.send_modify(|u| u.connected = true);
    // Back: a gets a whole window from now, and then expires.
    at(begin, 130_000).await;
    let dropped = first(&agent.plans, 0, "a", false).unwrap();
    assert!(
        (120_000..=120_000 + DEBOUNCE.as_millis()).contains(&dropped),
        "{dropped}"
    );
    assert!(
        agent
            .plans
            .lock()
            .unwrap()
            .iter()
            .filter(|(t, _)| *t < 120_000)
            .count()
            > 10
    );
    agent.stop.send(()).unwrap();
    agent.run.await.unwrap();
}

/// A heartbeat that cannot be published counts as Kilo's `checkin` error.
#[tokio::test(start_paused = true)]
async fn a_failed_heartbeat_is_a_checkin_error() {
    let begin = tokio::time::Instant::now();
    let (backend, agent) = start(first_update(nodes(&["me"])), planned);
    at(begin, 1_000).await;
    backend
        .failing
        .store(true, std::sync::atomic::Ordering::Relaxed);
    // Two check-ins (every 10 s) fail.
    at(begin, 25_000).await;
    agent.stop.send(()).unwrap();
    agent.run.await.unwrap();
    let text = agent.metrics.encode();
    assert!(
        text.contains("kilo_errors_total{event=\"checkin\"} 2"),
        "{text}"
    );
}

/// A publish that fails is tried again after 1 s, 2 s, 4 s..., not only at the next resync.
#[tokio::test(start_paused = true)]
async fn a_failed_publish_is_retried_with_backoff() {
    let begin = tokio::time::Instant::now();
    let (tx, _) = tokio::sync::watch::channel(first_update(nodes(&["me"])));
    let backend = Arc::new(Driven {
        tx,
        published: Mutex::default(),
        failing: true.into(),
    });
    let settings = LoopSettings {
        resync: Some(Duration::from_secs(60)),
        check_in: None,
        ..LoopSettings::default()
    };
    let agent = spawn(backend.clone(), settings, planned);
    // Fails at 0.1 s, 1.1 s and 3.1 s; the server is back at 5 s; the retry at 7.1 s lands.
    at(begin, 5_000).await;
    assert!(backend.published.lock().unwrap().is_empty());
    backend
        .failing
        .store(false, std::sync::atomic::Ordering::Relaxed);
    at(begin, 7_000).await;
    assert!(backend.published.lock().unwrap().is_empty());
    at(begin, 7_500).await;
    assert_eq!(backend.published.lock().unwrap().len(), 1);
    // Then nothing more until the resync: the retry is over.
    at(begin, 59_000).await;
    agent.stop.send(()).unwrap();
    let stats = agent.run.await.unwrap();
    assert_eq!(stats.reconciles, 4);
    let text = agent.metrics.encode();
    assert!(
        text.contains("kilo_reconcile_triggers_total{cause=\"retry\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("kilo_errors_total{event=\"local\"} 3"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failure_to_plan_keeps_the_role_and_is_reported_once() {
    let begin = tokio::time::Instant::now();
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fail = failing.clone();
    let (backend, agent) = start(first_update(nodes(&["me"])), move || {
        if fail.load(std::sync::atomic::Ordering::Relaxed) {
            return PlanOutcome::default();
        }
        PlanOutcome {
            leader: true,
            wireguard_ip: Some("10.4.0.1/16".parse().unwrap()),
            ready_nodes: 1,
            ..planned()
        }
    });
    at(begin, 1_000).await;
    failing.store(true, std::sync::atomic::Ordering::Relaxed);
    // Five resyncs without a plan.
    at(begin, 41_000).await;
    agent.stop.send(()).unwrap();
    let stats = agent.run.await.unwrap();
    assert_eq!(stats.reconciles, 1);
    let text = agent.metrics.encode();
    let metric = |series: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in {text}"))
    };
    assert_eq!(metric("kilo_errors_total{event=\"plan\"}"), "1", "{text}");
    assert_eq!(metric("kilo_leader"), "1", "{text}");
    assert_eq!(metric("kilo_nodes"), "1", "{text}");
    let published = backend.published.lock().unwrap().clone();
    let ips: Vec<_> = published
        .iter()
        .filter_map(|a| a.get(WIREGUARD_IP)?.as_deref())
        .collect();
    // Set once; never cleared without a plan (the `None` is the clean-up at the end).
    assert_eq!(ips, ["10.4.0.1/16"], "{published:?}");
}

/// Duplicate identities reach the invalid-objects counter once each, labelled with the
/// losing object's kind and field, however many resyncs see them.
#[tokio::test(start_paused = true)]
async fn conflicts_are_counted_once_with_kind_and_field() {
    let begin = tokio::time::Instant::now();
    let settings = crate::plan::Settings {
        hostname: "a".into(),
        ..crate::plan::Settings::default()
    };
    let snapshot = crate::mesh::cloned_snapshot();
    let (_backend, agent) = start(first_update(nodes(&["a"])), move || {
        planner::outcome(crate::plan::plan_for(&snapshot, &settings))
    });
    // Three resyncs (every 8 s).
    at(begin, 25_000).await;
    agent.stop.send(()).unwrap();
    agent.run.await.unwrap();
    let text = agent.metrics.encode();
    for field in ["annotation kilo.squat.ai/key", "spec.podCIDR"] {
        let series = format!("kilo_invalid_objects_total{{kind=\"node\",field=\"{field}\"}} 1");
        assert!(text.lines().any(|l| l == series), "no {series} in {text}");
    }
    assert!(text.contains("kilo_nodes 1"), "{text}");
}

/// With `--clean-up=false` (a rolling update), stopping publishes a fresh last-seen, so the
/// restarted node has a whole expiry before the others leave it out.
#[tokio::test(start_paused = true)]
async fn a_stop_without_clean_up_checks_in_on_the_way_out() {
    let begin = tokio::time::Instant::now();
    let update = Update {
        snapshot: nodes(&["me"]),
        generation: 1,
        connected: true,
        ..Update::default()
    };
    let settings = LoopSettings {
        check_in: Some(Duration::from_secs(30)),
        clean_up: false,
        ..LoopSettings::default()
    };
    let (backend, agent) = start_with(update, settings, planned);
    at(begin, 47_000).await;
    agent.stop.send(()).unwrap();
    agent.run.await.unwrap();
    let published = backend.published.lock().unwrap().clone();
    let last = published.last().expect("published");
    assert_eq!(last.len(), 2, "{published:?}");
    let at_stop = (T0 + 47).to_string();
    assert_eq!(last[LAST_SEEN].as_deref(), Some(&*at_stop), "{published:?}");
    assert_eq!(
        last[KG_LAST_SEEN], last[LAST_SEEN],
        "kg's copy in the same patch"
    );
}
