//! The loop on the Kubernetes backend, against a stand-in API server (a `tower-test` mock):
//! heartbeats cost no reconcile, and an unreachable server expires no node.
use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU8, Ordering::Relaxed},
    },
    time::Duration,
};

use http::{Method, Request, Response};
use kube::{Client, client::Body};
use prometheus_client::metrics::counter::Counter;

use crate::{
    agent::{
        Clock, LoopSettings,
        testing::{self, Running},
    },
    backend::{Backend, kubernetes::KubeBackend},
    mesh::annotations::{KG_LAST_SEEN, LAST_SEEN},
};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn json_response(v: &serde_json::Value) -> Response<Body> {
    Response::builder()
        .body(Body::from(serde_json::to_vec(v).unwrap()))
        .unwrap()
}

/// The API server's answer for a group version it does not serve.
fn not_found() -> Response<Body> {
    Response::builder()
        .status(404)
        .body(Body::from(b"404 page not found\n".to_vec()))
        .unwrap()
}

/// How the stand-in API server is broken.
const WORKING: u8 = 0;
/// Refuses connections: the open watch breaks, every new request fails.
const REFUSING: u8 = 1;
/// Unreachable without a word: the open watch hangs, every new request fails.
const HANGING: u8 = 2;

/// A stand-in API server: lists `nodes` and no Peers, answers node watches with the events
/// it has (each answer ends the watch, so the watcher resumes from the last version), applies
/// merge patches to its nodes (recording them, and echoing the node as a watch event), and
/// writes the other nodes' heartbeats every `period`, unless `broken` says otherwise.
async fn api_server(
    mut handle: Handle,
    nodes: Vec<serde_json::Value>,
    period: Duration,
    now: Clock,
    patches: Arc<Mutex<Vec<serde_json::Value>>>,
    broken: Arc<AtomicU8>,
) {
    let mut nodes: BTreeMap<String, serde_json::Value> = nodes
        .into_iter()
        .map(|n| (n["metadata"]["name"].as_str().unwrap().to_string(), n))
        .collect();
    let mut version = 10;
    let mut events = Vec::new();
    let mut watch: Option<tower_test::mock::SendResponse<Response<Body>>> = None;
    let mut beat = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    let modified = |n: &mut serde_json::Value, version: &mut u64| {
        *version += 1;
        n["metadata"]["resourceVersion"] = version.to_string().into();
        serde_json::json!({"type": "MODIFIED", "object": n.clone()})
    };
    loop {
        tokio::select! {
            r = handle.next_request() => {
                let Some((req, send)) = r else { return };
                let path = req.uri().path().to_string();
                let watching = req.uri().query().unwrap_or_default().contains("watch=true");
                match (req.method().clone(), path.as_str(), watching) {
                    (_, _, _) if broken.load(Relaxed) != WORKING => {
                        send.send_error("connection refused");
                    }
                    (Method::GET, "/api/v1/nodes", false) => send.send_response(json_response(&serde_json::json!({
                        "apiVersion": "v1", "kind": "NodeList",
                        "metadata": {"resourceVersion": version.to_string()},
                        "items": nodes.values().collect::<Vec<_>>(),
                    }))),
                    (Method::GET, "/api/v1/nodes", true) => watch = Some(send),
                    (Method::GET, "/apis/kilo.squat.ai/v1alpha1/peers", false) => send.send_response(json_response(&serde_json::json!({
                        "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "PeerList",
                        "metadata": {"resourceVersion": "1"}, "items": [],
                    }))),
                    (Method::GET, "/apis/kilo.squat.ai/v1alpha1/peers", true) => std::mem::forget(send),
                    (Method::GET, "/apis/networking.k8s.io/v1", false) => send.send_response(not_found()),
                    (Method::PATCH, p, false) => {
                        let name = p.strip_prefix("/api/v1/nodes/").unwrap().to_string();
                        let body = req.into_body().collect_bytes().await.unwrap();
                        let patch: serde_json::Value = serde_json::from_slice(&body).unwrap();
                        let node = nodes.get_mut(&name).unwrap();
                        for (k, v) in patch["metadata"]["annotations"].as_object().unwrap() {
                            node["metadata"]["annotations"][k] = v.clone();
                        }
                        patches.lock().unwrap().push(patch);
                        events.push(modified(node, &mut version));
                        send.send_response(json_response(node));
                    }
                    other => panic!("unexpected request {other:?}"),
                }
            }
            _ = beat.tick() => {
                match broken.load(Relaxed) {
                    WORKING => {}
                    // Nobody can write a heartbeat.
                    REFUSING => {
                        if let Some(w) = watch.take() {
                            w.send_error("connection reset");
                        }
                        continue;
                    }
                    _ => continue,
                }
                let seen = (now.now_ms() / 1000).to_string();
                for (name, node) in nodes.iter_mut().filter(|(n, _)| *n != "me") {
                    node["metadata"]["annotations"][LAST_SEEN] = seen.clone().into();
                    let _ = name;
                    events.push(modified(node, &mut version));
                }
            }
        }
        if !events.is_empty()
            && broken.load(Relaxed) == WORKING
            && let Some(w) = watch.take()
        {
            let mut body = Vec::new();
            for e in events.drain(..) {
                body.extend(serde_json::to_vec(&e).unwrap());
                body.push(b'\n');
            }
            w.send_response(Response::builder().body(Body::from(body)).unwrap());
        }
    }
}

fn mesh_node(name: &str, annotations: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "resourceVersion": "1", "annotations": annotations},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    })
}

/// Three nodes, the agent on `me` with the check-in `period` and no resync, under the
/// paused clock; returns the recorded patches and the running agent.
fn idle_mesh(
    period: Duration,
    broken: Arc<AtomicU8>,
) -> (
    Arc<Mutex<Vec<serde_json::Value>>>,
    Arc<KubeBackend>,
    Counter,
    Running,
) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let t0 = testing::T0.to_string();
    // What the agent publishes about `me`, so that only heartbeats change from here on.
    let mut mine = serde_json::to_value(testing::local().annotations(None)).unwrap();
    mine[LAST_SEEN] = t0.clone().into();
    mine[KG_LAST_SEEN] = t0.clone().into();
    let nodes = vec![
        mesh_node("me", mine),
        mesh_node("a", serde_json::json!({LAST_SEEN: t0})),
        mesh_node("b", serde_json::json!({LAST_SEEN: t0})),
    ];
    let patches = Arc::new(Mutex::new(Vec::new()));
    tokio::spawn(api_server(
        handle,
        nodes,
        period,
        testing::clock(tokio::time::Instant::now()),
        patches.clone(),
        broken,
    ));
    let retries = Counter::default();
    let backend = Arc::new(KubeBackend::start(
        Client::new(service, "default"),
        retries.clone(),
    ));
    let running = testing::spawn(
        backend.clone(),
        LoopSettings {
            resync: None,
            check_in: Some(period),
            clean_up: false,
            ..Default::default()
        },
        testing::planned,
    );
    (patches, backend, retries, running)
}

#[tokio::test(start_paused = true)]
async fn idle_heartbeats_are_patched_and_received_without_a_reconcile() {
    for secs in [1, 10, 30] {
        let period = Duration::from_secs(secs);
        let broken = Arc::new(AtomicU8::new(WORKING));
        let (patches, backend, _retries, running) = idle_mesh(period, broken);
        // More than three windows (2 × period each).
        tokio::time::sleep(period * 7 + period / 2).await;
        let last = backend.updates().borrow().clone();
        running.stop.send(()).unwrap();
        let stats = running.run.await.unwrap();
        let beats = patches
            .lock()
            .unwrap()
            .iter()
            .filter(|p| {
                let a = p["metadata"]["annotations"].as_object().unwrap();
                a.len() == 2 && a[LAST_SEEN] == a[KG_LAST_SEEN]
            })
            .count();
        assert!(beats >= 6, "period {secs} s: {beats} heartbeat patches");
        assert_eq!(
            last.generation, 1,
            "period {secs} s: a heartbeat made a snapshot"
        );
        assert!(
            last.last_seen["a"] >= testing::T0 + 6 * secs as i64,
            "period {secs} s: {:?}",
            last.last_seen
        );
        assert_eq!(stats.reconciles, 1, "period {secs} s: reconciled again");
        let plans = running.plans.lock().unwrap().clone();
        assert_eq!(plans.len(), 1, "period {secs} s: {plans:?}");
        assert_eq!(plans[0].1, ["a", "b", "me"]);
        let text = running.metrics.encode();
        assert!(!text.contains("kilo_errors_total{"), "{text}");
    }
}

#[tokio::test(start_paused = true)]
async fn nodes_do_not_expire_while_the_api_server_is_unreachable() {
    for how in [REFUSING, HANGING] {
        unreachable_for_five_windows(how).await;
    }
}

/// Formatted log lines, shared with the subscriber that writes them.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn unreachable_for_five_windows(how: u8) {
    let logs = Captured::default();
    let sink = logs.clone();
    let _logging = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .finish(),
    );
    let period = Duration::from_secs(1);
    let broken = Arc::new(AtomicU8::new(WORKING));
    let (_patches, backend, retries, running) = idle_mesh(period, broken.clone());
    tokio::time::sleep(period * 3 / 2).await;
    broken.store(how, Relaxed);
    // Five windows without a heartbeat.
    tokio::time::sleep(period * 10).await;
    assert!(!backend.updates().borrow().connected, "broken {how}");
    let retries = || retries.get();
    let during = retries();
    broken.store(WORKING, Relaxed);
    // The watcher retries with its backoff (up to 5 s apart).
    tokio::time::sleep(period * 40).await;
    assert!(backend.updates().borrow().connected);
    // One line when the server is lost, one when it is back, whatever the retries between.
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let lines = |needle: &str| text.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        lines("Kubernetes API server unreachable"),
        1,
        "broken {how}: {text}"
    );
    assert_eq!(
        lines("Kubernetes API server reachable again"),
        1,
        "broken {how}: {text}"
    );
    let outage = text
        .split_once("Kubernetes API server unreachable")
        .unwrap()
        .1;
    assert!(
        !outage.contains(" WARN ") && !outage.contains(" ERROR "),
        "broken {how}: {text}"
    );
    // Every failed attempt counted (the watch's every 0.5 to 5 s, the heartbeat's), none
    // once the server answers again.
    assert!(during >= 5, "broken {how}: {during}");
    assert_eq!(retries(), during, "broken {how}");
    running.stop.send(()).unwrap();
    running.run.await.unwrap();
    let plans = running.plans.lock().unwrap().clone();
    assert!(
        plans.iter().all(|(_, nodes)| nodes == &["a", "b", "me"]),
        "broken {how}: {plans:?}"
    );
    // The outage is reported once; the failed heartbeat patches each time.
    let text = running.metrics.encode();
    assert!(
        text.contains("kilo_errors_total{event=\"backend\"} 1"),
        "{text}"
    );
}
