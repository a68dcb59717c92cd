//! The Kubernetes backend: its filters, and its requests against a stand-in API server (a
//! `tower-test` mock).
use std::{collections::BTreeMap, time::Duration};

use http::{Method, Request, Response};
use kube::client::Body;

use kube::runtime::watcher;

use super::{watches::*, *};
use crate::mesh::annotations::{KEY, LAST_SEEN, LEADER, LOCATION};
use ipnet::IpNet;

fn node(annotations: &[(&str, &str)], ready: &str, heartbeat: &str) -> KubeNode {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": "a", "resourceVersion": "1",
            "labels": {"topology.kubernetes.io/region": "eu"},
            "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
            "managedFields": [{"manager": "kubelet", "operation": "Update"}],
        },
        "spec": {"podCIDR": "10.2.1.0/24"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": ready, "lastHeartbeatTime": heartbeat},
                {"type": "MemoryPressure", "status": "False", "lastHeartbeatTime": heartbeat},
            ],
            "images": [{"names": ["busybox"], "sizeBytes": 1}],
        },
    }))
    .unwrap()
}

/// A refused connection is named as such and sends nobody looking for the CRD; only the
/// server's 404 for the Peer resource does.
#[test]
fn watch_failures_say_what_is_wrong() {
    let refused = || {
        kube::Error::Service(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "tcp connect error: Connection refused (os error 111)",
        )))
    };
    let e = watcher::Error::InitialListFailed(refused());
    let text = describe_watch("peers.kilo.squat.ai", &e);
    assert!(text.starts_with("listing peers.kilo.squat.ai: "), "{text}");
    assert!(text.contains("Connection refused"), "{text}");
    assert!(!peer_watch_hint(&e).contains("CRD"));
    let e = watcher::Error::WatchFailed(refused());
    assert!(describe_watch("nodes", &e).starts_with("watching nodes: "));
    let missing = kube::core::Status::failure(
        "the server could not find the requested resource",
        "NotFound",
    )
    .with_code(404);
    let e = watcher::Error::InitialListFailed(kube::Error::Api(Box::new(missing)));
    assert!(peer_watch_hint(&e).contains("Peer CRD is not installed"));
    assert!(
        describe_watch("peers.kilo.squat.ai", &e).contains("404 NotFound"),
        "{}",
        describe_watch("peers.kilo.squat.ai", &e)
    );
    let forbidden = kube::core::Status::failure("peers is forbidden", "Forbidden").with_code(403);
    let e = watcher::Error::InitialListFailed(kube::Error::Api(Box::new(forbidden)));
    assert!(describe_watch("peers.kilo.squat.ai", &e).contains("ClusterRole"));
    assert!(!peer_watch_hint(&e).contains("CRD"));
}

#[test]
fn heartbeats_are_filtered_and_real_changes_pass() {
    let now = 1_000_000;
    let t = |s: i64| (now - s).to_string();
    let old = trim_node(node(&[(LAST_SEEN, &t(30))], "True", "2026-01-01T00:00:00Z"));
    // Kilo's last-seen refresh and a kubelet heartbeat: filtered.
    let hb = trim_node(node(&[(LAST_SEEN, &t(0))], "True", "2026-01-01T00:00:10Z"));
    assert!(!node_changed(Some(&old), &hb));
    // An annotation, the Ready condition, a stale node coming back: not filtered.
    let ann = trim_node(node(
        &[(LAST_SEEN, &t(0)), (LEADER, "")],
        "True",
        "2026-01-01T00:00:05Z",
    ));
    assert!(node_changed(Some(&old), &ann));
    let notready = trim_node(node(
        &[(LAST_SEEN, &t(30))],
        "False",
        "2026-01-01T00:00:05Z",
    ));
    assert!(node_changed(Some(&old), &notready));
    // Even a stale heartbeat refreshed: liveness is the agent's, from `Update::last_seen`.
    let stale = trim_node(node(
        &[(LAST_SEEN, &t(600))],
        "True",
        "2026-01-01T00:00:05Z",
    ));
    assert!(!node_changed(Some(&stale), &hb));
    assert!(node_changed(None, &hb));
    // Trimmed: no managed fields, no images, only the Ready condition without heartbeat.
    assert!(old.metadata.managed_fields.is_none());
    let status = old.status.unwrap();
    assert!(status.images.is_none());
    let cs = status.conditions.unwrap();
    assert_eq!(cs.len(), 1);
    assert!(cs[0].last_heartbeat_time.is_none());
}

#[tokio::test]
async fn publish_sends_one_merge_patch_of_the_annotations() {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let server = tokio::spawn(async move {
        let (req, send) = handle.next_request().await.expect("a request");
        assert_eq!(req.method(), Method::PATCH);
        assert_eq!(req.uri().path(), "/api/v1/nodes/node-a");
        assert_eq!(
            req.headers().get("content-type").unwrap(),
            "application/merge-patch+json"
        );
        let body = req.into_body().collect_bytes().await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"metadata": {"annotations": {
                KEY: "a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
                LAST_SEEN: null,
            }}})
        );
        let mut n = node(
            &[(KEY, "a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")],
            "True",
            "2026-01-01T00:00:05Z",
        );
        n.metadata.resource_version = Some("7".into());
        send.send_response(
            Response::builder()
                .body(Body::from(serde_json::to_vec(&n).unwrap()))
                .unwrap(),
        );
    });
    let backend = KubeBackend::unwatched(Client::new(service, "default"));
    let changes = Annotations::from([
        (
            KEY.to_string(),
            Some("a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".to_string()),
        ),
        (LAST_SEEN.to_string(), None),
    ]);
    assert!(backend.publish("node-a", &changes).await.unwrap());
    assert!(
        !backend
            .publish("node-a", &Annotations::new())
            .await
            .unwrap()
    );
    server.await.unwrap();
    // The answer is held at once; the watch's late delivery of an older version is not.
    let key = |s: &State| s.nodes.objects["a"].metadata.annotations.as_ref().unwrap()[KEY].clone();
    let mut state = backend.state.lock().unwrap();
    assert_eq!(key(&state), "a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=");
    let older = node(&[], "True", "2026-01-01T00:00:04Z");
    state.on_event(&NODES, Ok(watcher::Event::Apply(older)), &backend.tx);
    assert_eq!(key(&state), "a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=");
    let mut newer = node(&[], "True", "2026-01-01T00:00:06Z");
    newer.metadata.resource_version = Some("8".into());
    state.on_event(&NODES, Ok(watcher::Event::Apply(newer)), &backend.tx);
    assert!(
        state.nodes.objects["a"]
            .metadata
            .annotations
            .as_ref()
            .unwrap()
            .is_empty()
    );
}

const NETWORKING: &str = "/apis/networking.k8s.io/v1";

/// The API server's answer for a group version it does not serve.
fn not_found() -> Response<Body> {
    Response::builder()
        .status(404)
        .body(Body::from(b"404 page not found\n".to_vec()))
        .unwrap()
}

fn list(kind: &str, items: serde_json::Value) -> Response<Body> {
    Response::builder()
        .body(Body::from(
            serde_json::to_vec(&serde_json::json!({
                "apiVersion": "v1", "kind": kind,
                "metadata": {"resourceVersion": "10"}, "items": items,
            }))
            .unwrap(),
        ))
        .unwrap()
}

/// The first snapshot may be published before the agent subscribes (kg starts the backend
/// early, so that its first listing overlaps the rest of start-up): a later subscriber gets it.
#[test]
fn a_snapshot_published_before_anyone_subscribed_is_kept() {
    let (tx, rx) = tokio::sync::watch::channel(Update::default());
    drop(rx);
    let mut s = State::default();
    s.nodes.synced = true;
    s.peers.synced = true;
    s.service_cidrs.synced = true;
    s.publish(&tx);
    assert_eq!(tx.subscribe().borrow().generation, 1);
}

#[tokio::test]
async fn watchers_list_then_watch_and_filter_heartbeats() {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let backend = KubeBackend::start(Client::new(service, "default"), Counter::default());
    let mut rx = backend.updates();
    assert_eq!(rx.borrow().generation, 0, "nothing before every list");
    let mut node_watch = None;
    let mut lists = 0;
    while lists < 3 || node_watch.is_none() {
        let (req, send) = handle.next_request().await.expect("a request");
        assert_eq!(req.method(), Method::GET);
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or_default().to_string();
        let watching = query.contains("watch=true");
        match (path.as_str(), watching) {
            ("/api/v1/nodes", false) => {
                lists += 1;
                let n = node(&[(LAST_SEEN, "1")], "True", "2026-01-01T00:00:05Z");
                send.send_response(list("NodeList", serde_json::json!([n])));
            }
            ("/apis/kilo.squat.ai/v1alpha1/peers", false) => {
                lists += 1;
                send.send_response(list("PeerList", serde_json::json!([])));
            }
            ("/api/v1/nodes", true) => node_watch = Some(send),
            ("/apis/kilo.squat.ai/v1alpha1/peers", true) => {
                std::mem::forget(send); // never answers: the watch stays open
            }
            (NETWORKING, false) => {
                lists += 1;
                send.send_response(not_found());
            }
            other => panic!("unexpected request {other:?} ?{query}"),
        }
    }
    rx.changed().await.unwrap();
    let first = rx.borrow_and_update().clone();
    assert_eq!(first.generation, 1);
    assert!(first.snapshot.nodes.contains_key("a"));
    // A watch stream: a heartbeat-only update, then a real change.
    let hb = node(&[(LAST_SEEN, "1")], "True", "2026-01-01T00:00:20Z");
    let real = node(
        &[(LAST_SEEN, "1"), (LOCATION, "b")],
        "True",
        "2026-01-01T00:00:20Z",
    );
    let mut lines = Vec::new();
    for n in [hb, real] {
        lines.extend(
            serde_json::to_vec(&serde_json::json!({"type": "MODIFIED", "object": n})).unwrap(),
        );
        lines.push(b'\n');
    }
    node_watch
        .unwrap()
        .send_response(Response::builder().body(Body::from(lines)).unwrap());
    rx.changed().await.unwrap();
    let second = rx.borrow_and_update().clone();
    assert_eq!(
        second.generation, 2,
        "the heartbeat must not have produced an update"
    );
    assert_eq!(
        second.snapshot.nodes["a"]
            .metadata
            .annotations
            .as_ref()
            .unwrap()[LOCATION],
        "b"
    );
}

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn service_cidr(
    name: &str,
    cidrs: &[&str],
    ready: Option<&str>,
    deleting: bool,
) -> serde_json::Value {
    let mut o = serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": name, "resourceVersion": "5"},
        "spec": {"cidrs": cidrs},
    });
    if let Some(status) = ready {
        o["status"] = serde_json::json!({"conditions": [{
            "type": "Ready", "status": status, "reason": "", "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]});
    }
    if deleting {
        o["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
    }
    o
}

/// Serves one node, no Peers, the discovery document of `networking.k8s.io/v1` with
/// ServiceCIDRs in it, and `servicecidrs`: the list `answer`, then one watch answered with
/// `events` once `release` is notified. Records every request as `METHOD path[?watch]`.
async fn serve_service_cidrs(
    mut handle: Handle,
    answer: Response<Body>,
    mut events: Vec<serde_json::Value>,
    release: Arc<tokio::sync::Notify>,
    requests: Arc<Mutex<Vec<String>>>,
) {
    let mut answer = Some(answer);
    while let Some((req, send)) = handle.next_request().await {
        let path = req.uri().path().to_string();
        let watching = req.uri().query().unwrap_or_default().contains("watch=true");
        requests.lock().unwrap().push(format!(
            "{} {path}{}",
            req.method(),
            if watching { "?watch" } else { "" }
        ));
        match (path.as_str(), watching) {
            ("/api/v1/nodes", false) => send.send_response(list(
                "NodeList",
                serde_json::json!([node(&[], "True", "2026-01-01T00:00:05Z")]),
            )),
            ("/apis/kilo.squat.ai/v1alpha1/peers", false) => {
                send.send_response(list("PeerList", serde_json::json!([])))
            }
            (NETWORKING, false) => send.send_response(json_response(&serde_json::json!({
                "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "networking.k8s.io/v1",
                "resources": [
                    {"name": "networkpolicies", "singularName": "networkpolicy", "namespaced": true,
                     "kind": "NetworkPolicy", "verbs": ["list", "watch"]},
                    {"name": "servicecidrs", "singularName": "servicecidr", "namespaced": false,
                     "kind": "ServiceCIDR", "verbs": ["list", "watch"]},
                ],
            }))),
            ("/apis/networking.k8s.io/v1/servicecidrs", false) => {
                send.send_response(answer.take().expect("one list"))
            }
            ("/apis/networking.k8s.io/v1/servicecidrs", true) if !events.is_empty() => {
                let mut body = Vec::new();
                for e in events.drain(..) {
                    body.extend(serde_json::to_vec(&e).unwrap());
                    body.push(b'\n');
                }
                let release = release.clone();
                tokio::spawn(async move {
                    release.notified().await;
                    send.send_response(Response::builder().body(Body::from(body)).unwrap());
                });
            }
            // Open watches that never deliver.
            (_, true) => std::mem::forget(send),
            other => panic!("unexpected request {other:?}"),
        }
    }
}

/// Where the API server serves ServiceCIDRs, the snapshot carries the ranges of those that
/// are Ready or being deleted, follows their changes, and names a value that is no CIDR.
#[tokio::test]
async fn service_cidrs_are_learned_from_the_api() {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let items = serde_json::json!([
        service_cidr(
            "kubernetes",
            &["10.96.0.0/12", "fd00:10:96::/112"],
            Some("True"),
            false
        ),
        // Not Ready yet: no ClusterIP comes from it.
        service_cidr("extra", &["10.100.0.0/16"], None, false),
        // Being deleted while Services still hold addresses from it.
        service_cidr("old", &["10.200.0.0/16"], Some("False"), true),
        service_cidr("typo", &["10.300.0.0/16"], Some("True"), false),
    ]);
    let mut ready = service_cidr("extra", &["10.100.0.0/16"], Some("True"), false);
    ready["metadata"]["resourceVersion"] = "11".into();
    let mut gone = service_cidr("old", &["10.200.0.0/16"], Some("False"), true);
    gone["metadata"]["resourceVersion"] = "12".into();
    let events = vec![
        serde_json::json!({"type": "MODIFIED", "object": ready}),
        serde_json::json!({"type": "DELETED", "object": gone}),
    ];
    let release = Arc::new(tokio::sync::Notify::new());
    tokio::spawn(serve_service_cidrs(
        handle,
        list("ServiceCIDRList", items),
        events,
        release.clone(),
        requests.clone(),
    ));
    let retries = Counter::default();
    let backend = KubeBackend::start(Client::new(service, "default"), retries.clone());
    let mut rx = backend.updates();
    let first = rx.wait_for(|u| u.generation > 0).await.unwrap().clone();
    let nets = |v: &[&str]| v.iter().map(|c| c.parse().unwrap()).collect::<Vec<IpNet>>();
    assert_eq!(
        first.snapshot.service_cidrs,
        nets(&["10.96.0.0/12", "fd00:10:96::/112", "10.200.0.0/16"]),
        "Ready or being deleted, in the order of their names"
    );
    assert_eq!(
        first.errors,
        ["ServiceCIDR typo: spec.cidrs[0]: invalid CIDR \"10.300.0.0/16\""]
    );
    release.notify_one();
    let last = rx
        .wait_for(|u| {
            u.snapshot
                .service_cidrs
                .contains(&"10.100.0.0/16".parse().unwrap())
                && !u
                    .snapshot
                    .service_cidrs
                    .contains(&"10.200.0.0/16".parse().unwrap())
        })
        .await
        .unwrap()
        .clone();
    assert_eq!(
        last.snapshot.service_cidrs,
        nets(&["10.100.0.0/16", "10.96.0.0/12", "fd00:10:96::/112"])
    );
    assert_eq!(last.snapshot.nodes.len(), 1);
    let mut seen = requests.lock().unwrap().clone();
    seen.sort();
    seen.dedup();
    assert_eq!(
        seen,
        [
            "GET /api/v1/nodes",
            "GET /api/v1/nodes?watch",
            "GET /apis/kilo.squat.ai/v1alpha1/peers",
            "GET /apis/kilo.squat.ai/v1alpha1/peers?watch",
            "GET /apis/networking.k8s.io/v1",
            "GET /apis/networking.k8s.io/v1/servicecidrs",
            "GET /apis/networking.k8s.io/v1/servicecidrs?watch",
        ]
    );
    let discoveries = requests
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.ends_with(NETWORKING))
        .count();
    assert_eq!(discoveries, 1, "asked once");
    assert_eq!(retries.get(), 0);
}

/// An old ClusterRole without `servicecidrs`: the mesh goes on with none learned, and the
/// refused list is not asked again.
#[tokio::test(start_paused = true)]
async fn a_refused_service_cidr_list_leaves_none_and_stops() {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let forbidden = Response::builder()
        .status(403)
        .body(Body::from(
            serde_json::to_vec(&serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "servicecidrs.networking.k8s.io is forbidden", "reason": "Forbidden", "code": 403,
            }))
            .unwrap(),
        ))
        .unwrap();
    tokio::spawn(serve_service_cidrs(
        handle,
        forbidden,
        Vec::new(),
        Arc::default(),
        requests.clone(),
    ));
    let backend = KubeBackend::start(Client::new(service, "default"), Counter::default());
    let mut rx = backend.updates();
    let first = rx.wait_for(|u| u.generation > 0).await.unwrap().clone();
    assert!(first.snapshot.service_cidrs.is_empty());
    assert_eq!(first.snapshot.nodes.len(), 1);
    // Longer than the longest backoff: no second list.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let lists = requests
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.ends_with("/servicecidrs") || r.ends_with("/servicecidrs?watch"))
        .count();
    assert_eq!(lists, 1, "{:?}", requests.lock().unwrap());
}

fn json_response(v: &serde_json::Value) -> Response<Body> {
    Response::builder()
        .body(Body::from(serde_json::to_vec(v).unwrap()))
        .unwrap()
}
