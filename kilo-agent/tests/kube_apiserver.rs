//! kgctl and kg against a real kube-apiserver (`support::apiserver`): the Peer CRD from
//! `manifests/` is accepted and becomes Established, the server's schema refuses malformed
//! Peers, kgctl prints for objects in the API server exactly what it prints for the same
//! objects in files, and kg publishes its own annotations, keeps the CNI configuration's
//! ranges at the node's pod CIDR, and removes only its own annotations on SIGTERM. `kg webhook`
//! is called by the server over TLS. The demo's three-node mesh runs on the API server and
//! rides out its outage.
use kilo_testkit as support;

use support::eventually;

use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use futures::FutureExt as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kilo_agent::{
    backend::kubernetes,
    mesh::{KubeNode, Peer, Snapshot, objects::parse_stream},
};
use kube::{Api, api::PostParams};
use support::{
    apiserver::ApiServer,
    bpffs::BpfFs,
    kg::{Kg, Launch},
    mesh::DemoMesh,
    netns::{NetNs, WgGo, veth},
};

fn manifest(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Kilo's test fixture (4 nodes, 2 peers) with `last-seen` = now.
fn fixture() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/kilo/fixture.yaml");
    std::fs::read_to_string(p)
        .unwrap()
        .replace("\"NOW\"", &format!("\"{now}\""))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Creates the Peer CRD and waits until the server says it is Established.
async fn install_crd(client: &kube::Client) {
    let crd: CustomResourceDefinition = serde_yaml::from_str(&manifest("base/crds.yaml")).unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.create(&PostParams::default(), &crd).await.unwrap();
    let start = Instant::now();
    loop {
        let crd = api.get("peers.kilo.squat.ai").await.unwrap();
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        if established {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "CRD never Established"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn create(client: &kube::Client, snapshot: &Snapshot) {
    let nodes: Api<KubeNode> = Api::all(client.clone());
    for n in snapshot.nodes.values() {
        nodes.create(&PostParams::default(), n).await.unwrap();
    }
    let peers: Api<Peer> = Api::all(client.clone());
    for p in snapshot.peers.values() {
        // A freshly created CRD can take a moment before its resource is served.
        let start = Instant::now();
        while let Err(e) = peers.create(&PostParams::default(), p).await {
            assert!(start.elapsed() < Duration::from_secs(30), "peer: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn kgctl(backend: &[String], args: &[&str]) -> String {
    let out = Launch::kgctl()
        .args(backend)
        .args(args)
        .env_remove("KUBECONFIG")
        .output();
    assert!(
        out.status.success(),
        "kgctl {backend:?} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap() + &String::from_utf8(out.stderr).unwrap()
}

#[test]
fn kgctl_prints_the_same_from_the_api_server_as_from_files() {
    if !support::apiserver::available("kgctl_prints_the_same_from_the_api_server_as_from_files") {
        return;
    }
    let server = ApiServer::start();
    let text = fixture();
    let snapshot = parse_stream(&text, "fixture").unwrap();
    let rt = runtime();
    rt.block_on(async {
        let client = kubernetes::client(server.config()).unwrap();
        install_crd(&client).await;
        create(&client, &snapshot).await;
    });
    let files = tempfile::tempdir().unwrap();
    for (i, doc) in text.split("\n---\n").skip(1).enumerate() {
        std::fs::write(files.path().join(format!("{i:02}.yaml")), doc).unwrap();
    }
    let from_files = [
        "--backend=file".to_string(),
        format!("--backend-dir={}", files.path().display()),
    ];
    let from_api = [format!("--kubeconfig={}", server.kubeconfig().display())];
    for args in [
        &["--mesh-granularity=location", "graph"][..],
        &["--mesh-granularity=full", "graph"],
        &["--mesh-granularity=location", "showconf", "node", "b"],
        &["--mesh-granularity=full", "showconf", "node", "c"],
        &["--mesh-granularity=location", "showconf", "node", "a"],
        &["--mesh-granularity=location", "showconf", "peer", "b"],
        &[
            "--mesh-granularity=location",
            "showconf",
            "node",
            "b",
            "--as-peer",
            "-o",
            "yaml",
        ],
    ] {
        let want = kgctl(&from_files, args);
        assert!(!want.is_empty(), "{args:?}");
        assert_eq!(kgctl(&from_api, args), want, "{args:?}");
    }
}

/// Every overlay renders with kubectl's own kustomize and the server accepts every object in it.
#[test]
fn every_overlay_applies_to_the_api_server() {
    if !support::apiserver::available("every_overlay_applies_to_the_api_server") {
        return;
    }
    let server = ApiServer::start();
    let overlays = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests/overlays");
    let mut seen = 0;
    for overlay in std::fs::read_dir(&overlays).unwrap() {
        let overlay = overlay.unwrap().path();
        let out = Command::new(support::apiserver::kubectl())
            .arg(format!("--kubeconfig={}", server.kubeconfig().display()))
            .args(["apply", "--dry-run=server", "-k"])
            .arg(&overlay)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {text}", overlay.display());
        let rendered = Command::new(support::apiserver::kubectl())
            .arg("kustomize")
            .arg(&overlay)
            .output()
            .unwrap();
        let rendered = String::from_utf8_lossy(&rendered.stdout).into_owned();
        assert!(
            rendered.contains("resources:\n  - servicecidrs\n  verbs:\n  - list\n  - watch\n"),
            "{}: {rendered}",
            overlay.display()
        );
        // Its distribution's default service CIDR (tests/manifests.rs checks which).
        let kubeadm = ["kubeadm", "flannel", "userspace"]
            .iter()
            .any(|o| overlay.ends_with(o));
        let want = if kubeadm {
            "- --service-cidr=10.96.0.0/12\n"
        } else {
            "- --service-cidr="
        };
        assert!(rendered.contains(want), "{}: {rendered}", overlay.display());
        for object in [
            "customresourcedefinition.apiextensions.k8s.io/peers.kilo.squat.ai",
            "serviceaccount/kilo",
            "clusterrole.rbac.authorization.k8s.io/kilo",
            "clusterrolebinding.rbac.authorization.k8s.io/kilo",
            "daemonset.apps/kilo",
        ] {
            assert!(
                text.contains(object),
                "{}: {object} in {text}",
                overlay.display()
            );
        }
        seen += 1;
    }
    assert!(seen >= 3, "overlays in {}", overlays.display());
    // The webhook: its objects as they are, and with cert-manager's Certificate and CA injection
    // (rendered only: cert-manager's CRDs are not installed here).
    let kubectl = |args: &[&str], dir: &str| {
        let out = Command::new(support::apiserver::kubectl())
            .arg(format!("--kubeconfig={}", server.kubeconfig().display()))
            .args(args)
            .arg(
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../manifests")
                    .join(dir),
            )
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{dir}: {text}");
        text
    };
    let text = kubectl(&["apply", "--dry-run=server", "-k"], "webhook");
    for object in [
        "deployment.apps/kilo-peer-validation",
        "service/kilo-peer-validation",
        "validatingwebhookconfiguration.admissionregistration.k8s.io/peers.kilo.squat.ai",
    ] {
        assert!(text.contains(object), "webhook: {object} in {text}");
    }
    let text = kubectl(&["kustomize"], "webhook-cert-manager");
    for want in [
        "cert-manager.io/inject-ca-from: kube-system/kilo-peer-validation",
        "kind: Certificate",
        "secretName: kilo-peer-validation-tls",
        "- kilo-peer-validation.kube-system.svc",
    ] {
        assert!(
            text.contains(want),
            "webhook-cert-manager: {want} in {text}"
        );
    }
    // The PodMonitor's CRD belongs to the Prometheus Operator: checked for shape only.
    let monitor: serde_yaml::Value =
        serde_yaml::from_str(&manifest("monitoring/podmonitor.yaml")).unwrap();
    assert_eq!(
        monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        "kilo"
    );
}

#[test]
fn the_servers_schema_refuses_malformed_peers() {
    if !support::apiserver::available("the_servers_schema_refuses_malformed_peers") {
        return;
    }
    let server = ApiServer::start();
    let rt = runtime();
    rt.block_on(async {
        let client = kubernetes::client(server.config()).unwrap();
        install_crd(&client).await;
        let api: Api<Peer> = Api::all(client);
        let peer = |spec: serde_json::Value| -> Peer {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer",
                "metadata": {"name": "p"}, "spec": spec
            }))
            .unwrap()
        };
        let key = "a2V5NQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
        let good = peer(serde_json::json!({"allowedIPs": ["10.5.0.3/32"], "publicKey": key}));
        // Wait until the new resource is served (the good peer is then removed again).
        let start = Instant::now();
        while api.create(&PostParams::default(), &good).await.is_err() {
            assert!(start.elapsed() < Duration::from_secs(30));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        api.delete("p", &Default::default()).await.unwrap();
        for (bad, field) in [
            (
                serde_json::json!({"allowedIPs": [], "publicKey": key}),
                "allowedIPs",
            ),
            (
                serde_json::json!({"allowedIPs": ["10.5.0.3/32"], "publicKey": "nope"}),
                "publicKey",
            ),
            (
                serde_json::json!({"allowedIPs": ["10.5.0.3/32"], "publicKey": key,
                    "endpoint": {"dnsOrIP": {"ip": "192.168.0.1"}, "port": 0}}),
                "port",
            ),
        ] {
            let err = api
                .create(&PostParams::default(), &peer(bad.clone()))
                .await
                .expect_err(&format!("{bad} was accepted"));
            let kube::Error::Api(status) = err else {
                panic!("{bad}: {err}")
            };
            assert_eq!(status.code, 422, "{bad}: {status:?}");
            assert!(status.message.contains(field), "{bad}: {}", status.message);
        }
    });
}

/// `kg` in a namespace (an underlay address, a wireguard-go device, Kilo's CNI configuration
/// without ranges) with the kubernetes backend; the API server runs on that namespace's
/// loopback, so every client of it here runs in the namespace too.
struct Lab {
    ns: NetNs,
    _gw: NetNs,
    server: ApiServer,
    wg: WgGo,
    dir: tempfile::TempDir,
    kg: Kg,
}

impl Lab {
    /// The API server with the CRD and `nodes`, then kg for node `kgtest` with `args`.
    fn start(nodes: Vec<KubeNode>, args: &[&str]) -> Lab {
        let ns = NetNs::new("kapi");
        let server = ns.run(ApiServer::start);
        let config = server.config();
        ns.run(move || {
            runtime().block_on(async {
                let client = kubernetes::client(config).unwrap();
                install_crd(&client).await;
                for node in nodes {
                    Api::<KubeNode>::all(client.clone())
                        .create(&PostParams::default(), &node)
                        .await
                        .unwrap();
                }
            })
        });
        let dir = tempfile::tempdir().unwrap();
        let gw = NetNs::new("kapigw");
        veth(&ns, "eth0", &gw, "eth0");
        ns.sh("ip addr add 10.9.0.1/24 dev eth0 && ip route add default via 10.9.0.254 dev eth0");
        let wg = WgGo::start(&ns);
        std::fs::write(
            dir.path().join("10-kilo.conflist"),
            manifest("overlays/kubeadm/cni-conf.json"),
        )
        .unwrap();
        let kg = Launch::kg()
            .netns(&ns.name)
            .args([
                format!("--kubeconfig={}", server.kubeconfig().display()),
                "--hostname=kgtest".into(),
                format!("--private-key={}", dir.path().join("key").display()),
                "--listen=127.0.0.1:1107".into(),
                "--datapath=false".into(),
                "--create-interface=false".into(),
                format!("--interface={}", wg.name),
                format!(
                    "--cni-path={}",
                    dir.path().join("10-kilo.conflist").display()
                ),
                "--log-format=text".into(),
            ])
            .args(args)
            .kill_on_drop()
            .spawn();
        Lab {
            ns,
            _gw: gw,
            server,
            wg,
            dir,
            kg,
        }
    }

    /// Runs `f` with a client of the API server, in the namespace.
    fn api<T: Send>(
        &self,
        f: impl FnOnce(kube::Client) -> futures::future::BoxFuture<'static, T> + Send,
    ) -> T {
        let config = self.server.config();
        self.ns
            .run(|| runtime().block_on(async { f(kubernetes::client(config).unwrap()).await }))
    }

    fn annotations(&self) -> std::collections::BTreeMap<String, String> {
        self.api(|c| {
            async move {
                let n = Api::<KubeNode>::all(c).get("kgtest").await.unwrap();
                n.metadata.annotations.unwrap_or_default()
            }
            .boxed()
        })
    }

    fn create_peer(&self, name: &str, key: &str, ip: &str) {
        let peer: Peer = serde_json::from_value(serde_json::json!({
            "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer",
            "metadata": {"name": name}, "spec": {"allowedIPs": [ip], "publicKey": key}
        }))
        .unwrap();
        self.api(|c| {
            async move {
                Api::<Peer>::all(c)
                    .create(&PostParams::default(), &peer)
                    .await
                    .unwrap();
            }
            .boxed()
        });
    }

    /// GET `path` on kg's listener: the body of a 200, `None` otherwise.
    fn get(&self, path: &str) -> Option<String> {
        let out = self
            .ns
            .try_sh(&format!("busybox wget -q -O - http://127.0.0.1:1107{path}"));
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn wg_peers(&self) -> String {
        self.ns.sh(&format!("wg show {} peers", self.wg.name))
    }

    /// Waits until the WireGuard device has (or, with `present` false, lacks) `key`.
    fn wait_for_peer(&self, key: &str, present: bool) {
        eventually(&format!("peer {key} present: {present}"), || {
            self.wg_peers().contains(key) == present
        });
    }

    /// SIGTERM, then kg's log; kg must exit 0 without panicking.
    fn stop(mut self) -> (String, Self) {
        let log = self.kg.stop();
        assert!(!log.contains("panicked"), "{log}");
        (log, self)
    }
}

fn node(value: serde_json::Value) -> KubeNode {
    serde_json::from_value(value).unwrap()
}

/// kg publishes its own annotations in one patch, sets the CNI ranges and applies Peers; on
/// SIGTERM it removes only its own annotations. (The outage: see the mesh test below.)
#[test]
fn kg_against_the_api_server_publishes_and_cleans_up() {
    let test = "kg_against_the_api_server_publishes_and_cleans_up";
    if !support::require_root(test) || !support::apiserver::available(test) {
        return;
    }
    let lab = Lab::start(
        vec![node(serde_json::json!({
            "metadata": {"name": "kgtest", "labels": {"keep": "me"},
                         "annotations": {"kilo.squat.ai/location": "here", "other/annotation": "x"}},
            "spec": {"podCIDR": "10.2.9.0/24"}
        }))],
        &[],
    );
    eventually("kg publishes its node", || {
        lab.annotations().contains_key("kilo.squat.ai/key")
    });
    let published = lab.annotations();
    assert_eq!(published["kilo.squat.ai/endpoint"], "10.9.0.1:51820");
    assert_eq!(published["kilo.squat.ai/internal-ip"], "10.9.0.1/24");
    assert_eq!(
        published["other/annotation"], "x",
        "others' annotations kept"
    );
    assert_eq!(published["kilo.squat.ai/location"], "here");
    // One merge patch of kg's own keys only, the WireGuard IP of this (lone, so leading) node
    // included; heartbeats (`last-seen` alone) aside.
    std::thread::sleep(Duration::from_secs(2));
    let patches = lab.server.node_patches("kgtest");
    let own: Vec<_> = patches
        .iter()
        .filter(|p| p["metadata"]["annotations"].as_object().unwrap().len() > 1)
        .collect();
    assert_eq!(own.len(), 1, "{patches:#?}");
    let keys = own[0]["metadata"]["annotations"].as_object().unwrap();
    assert!(
        keys.keys().all(|k| k.starts_with("kilo.squat.ai/")),
        "{keys:?}"
    );
    assert_eq!(
        keys["kilo.squat.ai/wireguard-ip"], "10.4.0.1/16",
        "{keys:?}"
    );
    // The node's pod CIDR reaches the CNI configuration's IPAM ranges.
    let conflist = lab.dir.path().join("10-kilo.conflist");
    let ranges = || {
        let conf: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&conflist).unwrap()).unwrap();
        conf["plugins"][0]["ipam"]["ranges"].clone()
    };
    eventually("the CNI ranges are set", || {
        ranges() == serde_json::json!([[{"subnet": "10.2.9.0/24"}]])
    });

    // A Peer becomes a WireGuard peer of this (lone, so leading) node.
    let (laptop, phone) = (
        "bGFwdG9wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
        "cGhvbmUAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
    );
    lab.create_peer("laptop", laptop, "10.5.0.1/32");
    lab.wait_for_peer(laptop, true);
    lab.create_peer("phone", phone, "10.5.0.2/32");
    lab.wait_for_peer(phone, true);
    assert!(lab.wg_peers().contains(laptop));

    // No --service-cidr, and this API server (1.20) serves no ServiceCIDRs: none known, said
    // once with the consequence, and shown in the metrics and /ready.
    let metrics = lab.get("/metrics").unwrap();
    assert!(metrics.contains("\nkilo_service_cidrs 0\n"), "{metrics}");
    let ready = lab.get("/ready").unwrap();
    assert!(
        ready.starts_with("ready\nwarning: no service CIDR known"),
        "{ready}"
    );

    let (log, lab) = lab.stop();
    assert_eq!(log.matches("no service CIDR known").count(), 1, "{log}");
    assert!(log.contains("is masqueraded"), "{log}");
    // Clean-up removed exactly kg's own annotations.
    let left = lab.annotations();
    assert!(
        left.keys()
            .all(|k| !k.starts_with("kilo.squat.ai/") || k == "kilo.squat.ai/location"),
        "{left:?}"
    );
    assert_eq!(left["other/annotation"], "x");
}

/// The outages of [`kg_uses_the_flag_and_reports_each_outage_once`]: each spans several of the
/// watches' retry periods (0.5 s doubling to 2.5 s, plus up to as much again of jitter).
const OUTAGES: [Duration; 2] = [Duration::from_secs(4), Duration::from_secs(12)];

/// This API server (1.20) serves no ServiceCIDRs: kg says so and plans with `--service-cidr`.
/// Each outage of the server is one warning and one line at its return (saying for how long and
/// after how many retries), without the client library's error for every failed request; the
/// retries are counted.
#[test]
fn kg_uses_the_flag_and_reports_each_outage_once() {
    let test = "kg_uses_the_flag_and_reports_each_outage_once";
    if !support::require_root(test) || !support::apiserver::available(test) {
        return;
    }
    let mut lab = Lab::start(
        vec![node(serde_json::json!({
            "metadata": {"name": "kgtest"}, "spec": {"podCIDR": "10.2.9.0/24"}
        }))],
        &["--service-cidr=10.96.0.0/12"],
    );
    eventually("kg is ready", || lab.get("/ready").is_some());
    assert_eq!(
        lab.get("/ready").unwrap(),
        "ready\nservice CIDRs: 10.96.0.0/12\n"
    );
    let retries = |lab: &Lab| -> u64 {
        let metrics = lab.get("/metrics").unwrap();
        assert!(metrics.contains("\nkilo_service_cidrs 1\n"), "{metrics}");
        let line = metrics
            .lines()
            .find_map(|l| l.strip_prefix("kilo_backend_retries_total "))
            .unwrap_or_else(|| panic!("no kilo_backend_retries_total in {metrics}"));
        line.parse().unwrap()
    };
    assert_eq!(retries(&lab), 0);
    for outage in OUTAGES {
        lab.server.stop();
        let down = Instant::now();
        eventually("kg notices the outage", || lab.get("/ready").is_none());
        std::thread::sleep(outage.saturating_sub(down.elapsed()));
        lab.ns.run(|| lab.server.restart());
        eventually("kg is back", || lab.get("/ready").is_some());
    }
    let retried = retries(&lab);
    assert!(retried >= OUTAGES.len() as u64, "{retried} retries");
    let (log, _lab) = lab.stop();
    let lines = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        lines("Kubernetes API server unreachable"),
        OUTAGES.len(),
        "{log}"
    );
    let back: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("Kubernetes API server reachable again"))
        .collect();
    assert_eq!(back.len(), OUTAGES.len(), "{log}");
    for (line, outage) in back.iter().zip(OUTAGES) {
        let field = |name: &str| -> u64 {
            let value = line.split(&format!(" {name}=")).nth(1).unwrap_or_default();
            value.split(' ').next().unwrap().parse().unwrap()
        };
        assert!(field("retries") >= 2, "{line}");
        assert!(field("down_seconds") + 1 >= outage.as_secs(), "{line}");
    }
    // Nor the client library's lines: an ERROR for every failed request, a WARN for every
    // watch the server cut.
    assert_eq!(lines("ERROR"), 0, "{log}");
    assert_eq!(lines("kube_client"), 0, "{log}");
    assert!(
        log.contains("does not serve networking.k8s.io/v1 ServiceCIDRs"),
        "{log}"
    );
    assert!(log.contains("service_cidrs=10.96.0.0/12"), "{log}");
    assert!(!log.contains("no service CIDR known"), "{log}");
}

/// With `--check-in-period=0` a node's liveness is its Ready condition: set False through the
/// API, the node leaves this leader's WireGuard peers; True brings it back.
#[test]
fn with_check_in_0_a_node_follows_its_ready_condition() {
    let test = "with_check_in_0_a_node_follows_its_ready_condition";
    if !support::require_root(test) || !support::apiserver::available(test) {
        return;
    }
    let remote_key = "cmVtb3RlAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let lab = Lab::start(
        vec![
            node(serde_json::json!({
                "metadata": {"name": "kgtest", "annotations": {"kilo.squat.ai/location": "here"}},
                "spec": {"podCIDR": "10.2.9.0/24"}
            })),
            node(serde_json::json!({
                "metadata": {"name": "remote", "annotations": {
                    "kilo.squat.ai/location": "there",
                    "kilo.squat.ai/key": remote_key,
                    "kilo.squat.ai/endpoint": "192.0.2.7:51820",
                    "kilo.squat.ai/internal-ip": "192.0.2.7/24"}},
                "spec": {"podCIDR": "10.2.8.0/24"}
            })),
        ],
        &["--check-in-period=0"],
    );
    let set_ready = |status: &'static str| {
        lab.api(move |c| {
            async move {
                let patch = serde_json::json!({"status": {"conditions": [{
                    "type": "Ready", "status": status, "reason": "Test",
                    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
                Api::<KubeNode>::all(c)
                    .patch_status(
                        "remote",
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(patch),
                    )
                    .await
                    .unwrap();
            }
            .boxed()
        });
    };
    set_ready("True");
    lab.wait_for_peer(remote_key, true);
    set_ready("False");
    lab.wait_for_peer(remote_key, false);
    set_ready("True");
    lab.wait_for_peer(remote_key, true);
    let (log, _lab) = lab.stop();
    assert!(
        !log.contains("kilo.squat.ai/last-seen"),
        "no heartbeat with 0: {log}"
    );
    let patches = _lab.server.node_patches("kgtest");
    assert!(
        patches
            .iter()
            .all(|p| !p["metadata"]["annotations"]["kilo.squat.ai/last-seen"].is_string()),
        "a heartbeat was written: {patches:#?}"
    );
}

/// `kg webhook` answers the real API server over TLS: with a ValidatingWebhookConfiguration
/// pointing at it (its certificate as the CA bundle), a Peer whose CIDR the CRD's schema cannot
/// judge is refused with the field named, and a valid Peer is admitted.
#[test]
fn the_webhook_refuses_what_the_agents_would_skip() {
    if !support::apiserver::available("the_webhook_refuses_what_the_agents_would_skip") {
        return;
    }
    let server = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cert = support::apistub::Cert::new();
    let (cert_file, key_file) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert_file, &cert.pem).unwrap();
    std::fs::write(&key_file, cert.key_pem()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut webhook = Launch::kg()
        .args(["--log-format=text", "webhook"])
        .arg(format!("--cert-file={}", cert_file.display()))
        .arg(format!("--key-file={}", key_file.display()))
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg("--listen-metrics=127.0.0.1:0")
        .spawn();
    eventually("the webhook listens", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let rt = runtime();
    let outcome = rt.block_on(async {
        let client = kubernetes::client(server.config()).unwrap();
        install_crd(&client).await;
        use base64::Engine as _;
        let config: k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "peers.kilo.squat.ai"},
                "webhooks": [{
                    "name": "peers.kilo.squat.ai",
                    "admissionReviewVersions": ["v1"], "sideEffects": "None",
                    "failurePolicy": "Fail",
                    "rules": [{"apiGroups": ["kilo.squat.ai"], "apiVersions": ["v1alpha1"],
                               "resources": ["peers"], "operations": ["CREATE", "UPDATE"]}],
                    "clientConfig": {
                        "url": format!("https://127.0.0.1:{port}/validate"),
                        "caBundle": base64::engine::general_purpose::STANDARD.encode(&cert.pem),
                    },
                }],
            }))
            .unwrap();
        Api::all(client.clone())
            .create(&PostParams::default(), &config)
            .await
            .unwrap();
        let api: Api<Peer> = Api::all(client);
        let peer = |name: &str, cidr: &str| -> Peer {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer",
                "metadata": {"name": name},
                "spec": {"allowedIPs": [cidr],
                         "publicKey": "a2V5NQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}
            }))
            .unwrap()
        };
        // The CRD's resource and the webhook's registration each take a moment to be served:
        // until the bad Peer is refused, an admitted one is removed again.
        let start = Instant::now();
        let refusal = loop {
            match api
                .create(&PostParams::default(), &peer("bad", "10.5.0.300/32"))
                .await
            {
                Err(kube::Error::Api(s)) if s.message.contains("denied") => break s,
                Ok(_) => {
                    api.delete("bad", &Default::default()).await.unwrap();
                }
                Err(_) => {}
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the webhook never refused the bad Peer"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let admitted = api
            .create(&PostParams::default(), &peer("good", "10.5.0.3/32"))
            .await;
        (refusal, admitted.map(|_| ()))
    });
    let status = webhook.terminate();
    let log = webhook.log();
    let (refusal, admitted) = outcome;
    assert!(
        refusal
            .message
            .contains("peer \"bad\": spec.allowedIPs[0]: "),
        "{refusal:?}\n{log}"
    );
    assert!(refusal.message.contains("10.5.0.300/32"), "{refusal:?}");
    admitted.unwrap_or_else(|e| panic!("the valid Peer was refused: {e}\n{log}"));
    assert!(status.success(), "kg webhook: {status}\n{log}");
    assert!(log.contains("reviewed a Peer"), "{log}");
}

/// How long the API server stays down in the outage test (the figure).
const OUTAGE: Duration = Duration::from_secs(30);
/// How soon after the API server's return the changes made meanwhile must be applied.
const CATCH_UP: Duration = Duration::from_secs(10);

/// `kg` on node `i` of a [`DemoMesh`] on the API server at `kubeconfig`, logging to a file;
/// killed on drop if still running.
fn mesh_kg(mesh: &DemoMesh, i: usize, kubeconfig: &std::path::Path, bpffs: &BpfFs) -> Kg {
    let work = mesh.work.path();
    let conflist = work.join(format!("n{i}.conflist"));
    std::fs::write(&conflist, manifest("overlays/kubeadm/cni-conf.json")).unwrap();
    Launch::kg()
        .netns(&mesh.ns(&format!("n{i}")))
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--hostname=n{i}"))
        .arg(format!("--cni-path={}", conflist.display()))
        .arg(support::create_interface_flag())
        .arg(format!("--interface={}", mesh.wg(i)))
        .arg("--encapsulate=never")
        .arg(format!(
            "--private-key={}",
            work.join(format!("n{i}.key")).display()
        ))
        .arg(format!(
            "--bpffs-dir={}",
            bpffs.pin_dir(&format!("n{i}")).display()
        ))
        .args(["--listen=127.0.0.1:1107", "--log-format=text"])
        .log_file(work.join(format!("kg-n{i}.log")))
        .kill_on_drop()
        .spawn()
}

/// SIGTERM; the log once kg exited 0 without panicking.
fn stop(kg: &mut Kg) -> String {
    let log = kg.stop();
    assert!(!log.contains("panicked"), "{log}");
    log
}

/// The demo's three-node mesh with its Node objects in the API server: each kg publishes its
/// own annotations in one merge patch, pods ping across locations; with the API server down
/// for [`OUTAGE`] traffic keeps flowing and nothing is torn down, and a Peer created and a node
/// deleted at its return are applied within [`CATCH_UP`]; SIGTERM while the server is down
/// still cleans the node up and says which annotations stay.
#[test]
fn kg_mesh_on_the_api_server_rides_out_an_outage() {
    let test = "kg_mesh_on_the_api_server_rides_out_an_outage";
    if !support::require_root(test) || !support::apiserver::available(test) {
        return;
    }
    let mesh = DemoMesh::up("km");
    let mut server = mesh.run("inet", || ApiServer::start_at("192.168.50.100"));
    let kubeconfig = server.kubeconfig();
    let api =
        |server: &ApiServer,
         f: &(dyn Fn(kube::Client) -> futures::future::BoxFuture<'static, ()> + Sync)| {
            let config = server.config();
            mesh.run("inet", || {
                runtime().block_on(async { f(kubernetes::client(config).unwrap()).await })
            })
        };
    let nodes: Vec<KubeNode> = mesh
        .node_yaml()
        .iter()
        .map(|y| serde_yaml::from_str(y).unwrap())
        .collect();
    api(&server, &|c| {
        let nodes = nodes.clone();
        async move {
            install_crd(&c).await;
            for n in &nodes {
                Api::<KubeNode>::all(c.clone())
                    .create(&PostParams::default(), n)
                    .await
                    .unwrap();
            }
        }
        .boxed()
    });
    let annotations = |server: &ApiServer, node: &'static str| {
        let out = std::sync::Arc::new(std::sync::Mutex::new(Default::default()));
        let o = out.clone();
        api(server, &move |c| {
            let o = o.clone();
            async move {
                if let Ok(n) = Api::<KubeNode>::all(c).get(node).await {
                    *o.lock().unwrap() = n.metadata.annotations.unwrap_or_default();
                }
            }
            .boxed()
        });
        let map: std::collections::BTreeMap<String, String> = out.lock().unwrap().clone();
        map
    };
    // One after the other, so that the leaders are settled when each starts (n1 leads east).
    let bpffs = BpfFs::new();
    let mut kg = Vec::new();
    for (i, name) in [(1, "n1"), (2, "n2"), (3, "n3")] {
        kg.push(mesh_kg(&mesh, i, &kubeconfig, &bpffs));
        eventually(&format!("{name} publishes its node"), || {
            annotations(&server, name).contains_key("kilo.squat.ai/key")
        });
    }
    eventually("pods reach each other across locations", || {
        mesh.pings("pod1", "10.42.3.2") && mesh.pings("pod2", "10.42.3.2")
    });
    // The device is the kernel's when kg created it (KRS_WIREGUARD=kernel), and it shook hands.
    let kind = if support::kernel_wireguard() {
        "wireguard"
    } else {
        "tun"
    };
    let link = mesh.sh("n1", &format!("ip -d -o link show dev {}", mesh.wg(1)));
    assert!(link.split_whitespace().any(|w| w == kind), "{link}");
    let handshakes = mesh.sh("n1", &format!("wg show {} latest-handshakes", mesh.wg(1)));
    assert!(
        handshakes
            .lines()
            .any(|l| l.split_whitespace().nth(1).is_some_and(|t| t != "0")),
        "{handshakes}"
    );
    // Each kg published its node in one merge patch of its own keys, WireGuard IP included;
    // after that, heartbeats (`last-seen` alone) only.
    for (name, wireguard_ip) in [("n1", "10.4.0.1/16"), ("n2", ""), ("n3", "10.4.0.2/16")] {
        let patches = server.node_patches(name);
        let own: Vec<_> = patches
            .iter()
            .filter(|p| {
                p["metadata"]["annotations"]
                    .as_object()
                    .is_some_and(|a| a.keys().any(|k| k != "kilo.squat.ai/last-seen"))
            })
            .collect();
        assert_eq!(own.len(), 1, "{name}: {patches:#?}");
        let a = own[0]["metadata"]["annotations"].as_object().unwrap();
        assert!(a.keys().all(|k| k.starts_with("kilo.squat.ai/")), "{a:?}");
        for key in [
            "key",
            "endpoint",
            "internal-ip",
            "granularity",
            "wireguard-ip",
        ] {
            assert!(
                a.contains_key(&format!("kilo.squat.ai/{key}")),
                "{name}: {key} in {a:?}"
            );
        }
        assert_eq!(a["kilo.squat.ai/wireguard-ip"], wireguard_ip, "{name}");
        eprintln!("{name}: {} patches, 1 of its annotations", patches.len());
    }
    let peers = |i: usize| {
        mesh.sh(
            &format!("n{i}"),
            &format!("wg show {} allowed-ips", mesh.wg(i)),
        )
    };
    let before = (peers(1), peers(3));
    assert!(before.0.contains("10.42.3.0/24"), "{}", before.0);
    assert!(before.1.contains("10.42.2.0/24"), "{}", before.1);

    // The outage: etcd keeps the objects, clients are refused. Traffic keeps flowing, nothing
    // changes; n2 dies meanwhile (its node is deleted at the server's return).
    server.stop();
    let down = Instant::now();
    drop(kg.remove(1));
    std::thread::sleep(OUTAGE / 2);
    assert!(
        mesh.pings("pod1", "10.42.3.2"),
        "no traffic during the outage"
    );
    std::thread::sleep(OUTAGE.saturating_sub(down.elapsed()));
    assert!(
        mesh.pings("pod1", "10.42.3.2"),
        "no traffic during the outage"
    );
    assert_eq!((peers(1), peers(3)), before, "changed during the outage");
    for k in &kg {
        let log = k.log();
        let lost: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("Kubernetes API server unreachable"))
            .collect();
        assert_eq!(lost.len(), 1, "the outage is one line: {log}");
        assert!(lost[0].contains("error="), "the outage is named: {log}");
        assert!(
            !log.contains("CRD"),
            "a refused connection is not a missing CRD: {log}"
        );
    }
    mesh.run("inet", || server.restart());
    let back = Instant::now();
    let laptop = "bGFwdG9wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    api(&server, &|c| {
        async move {
            let peer: Peer = serde_json::from_value(serde_json::json!({
                "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer",
                "metadata": {"name": "laptop"},
                "spec": {"allowedIPs": ["10.5.0.1/32"], "publicKey": laptop}
            }))
            .unwrap();
            Api::<Peer>::all(c.clone())
                .create(&PostParams::default(), &peer)
                .await
                .unwrap();
            Api::<KubeNode>::all(c)
                .delete("n2", &Default::default())
                .await
                .unwrap();
        }
        .boxed()
    });
    eventually("the Peer and n2's removal are applied", || {
        let (one, three) = (peers(1), peers(3));
        one.contains(laptop) && three.contains(laptop) && !three.contains("10.42.2.0/24")
    });
    let caught_up = back.elapsed();
    eprintln!("applied {caught_up:?} after the API server's return");
    assert!(
        caught_up < CATCH_UP,
        "changes at the server's return took {caught_up:?}:\n{}",
        kg[0].log()
    );
    assert!(mesh.pings("pod1", "10.42.3.2"));

    // SIGTERM with the API server unreachable: the node is cleaned up all the same, and kg
    // says which annotations stay behind.
    server.stop();
    let log = stop(&mut kg[0]);
    assert!(
        log.contains("could not remove this node's annotations"),
        "{log}"
    );
    assert!(log.contains("kilo.squat.ai/key"), "{log}");
    let routes = mesh.sh("n1", "ip route show");
    assert!(!routes.contains("10.42.3.0/24"), "{routes}");
    // The device stays, bare, even one kg created (Kilo's --clean-up-interface=false).
    let addresses = mesh.sh("n1", &format!("ip addr show dev {}", mesh.wg(1)));
    assert!(!addresses.contains("10.4.0.1"), "{addresses}");
    assert!(!bpffs.pin_dir("n1").exists(), "the datapath's pins stay");
    stop(&mut kg[1]);
}
