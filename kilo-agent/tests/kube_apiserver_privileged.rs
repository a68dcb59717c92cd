//! kg on a real kube-apiserver (`support::apiserver`), in network namespaces: it publishes its
//! own annotations, keeps the CNI configuration's ranges at the node's pod CIDR, applies Peers,
//! reports each outage once, follows a node's Ready condition with `--check-in-period=0` and
//! removes only its own annotations on SIGTERM. The demo's three-node mesh runs on the API server
//! and rides out its outage.
use kilo_testkit as support;

use support::eventually;

use std::time::{Duration, Instant};

use futures::FutureExt as _;
use kilo_agent::{
    backend::kubernetes,
    mesh::{KubeNode, Peer},
};
use kube::{Api, api::PostParams};
use support::{
    apiserver::{ApiServer, install_crd, manifest, runtime},
    bpffs::BpfFs,
    kg::{Kg, Launch},
    mesh::DemoMesh,
    netns::{NetNs, WgGo, veth},
};

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
    // included; heartbeats (`last-seen` and kg's copy alone) aside.
    std::thread::sleep(Duration::from_secs(2));
    let patches = lab.server.node_patches("kgtest");
    let own: Vec<_> = patches
        .iter()
        .filter(|p| not_heartbeat(&p["metadata"]["annotations"]))
        .collect();
    assert_eq!(own.len(), 1, "{patches:#?}");
    let keys = own[0]["metadata"]["annotations"].as_object().unwrap();
    assert!(keys.keys().all(|k| is_kgs(k)), "{keys:?}");
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
            .all(|k| !is_kgs(k) || k == "kilo.squat.ai/location"),
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
    // after that, heartbeats (`last-seen` and kg's copy) only.
    for (name, wireguard_ip) in [("n1", "10.4.0.1/16"), ("n2", ""), ("n3", "10.4.0.2/16")] {
        let patches = server.node_patches(name);
        let own: Vec<_> = patches
            .iter()
            .filter(|p| not_heartbeat(&p["metadata"]["annotations"]))
            .collect();
        assert_eq!(own.len(), 1, "{name}: {patches:#?}");
        let a = own[0]["metadata"]["annotations"].as_object().unwrap();
        assert!(a.keys().all(|k| is_kgs(k)), "{a:?}");
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

/// An annotation kg writes: Kilo's, or kg's own (`kg.kilo.squat.ai/`).
fn is_kgs(key: &str) -> bool {
    key.starts_with("kilo.squat.ai/") || key.starts_with("kg.kilo.squat.ai/")
}

/// Whether a patch's annotations hold more than a heartbeat (`last-seen` and kg's copy).
fn not_heartbeat(annotations: &serde_json::Value) -> bool {
    annotations.as_object().is_some_and(|a| {
        a.keys()
            .any(|k| k != "kilo.squat.ai/last-seen" && k != "kg.kilo.squat.ai/last-seen")
    })
}
