//! kgctl and `kg webhook` against a real kube-apiserver (`support::apiserver`): the Peer CRD
//! from `manifests/` is accepted and becomes Established, every overlay applies, the server's
//! schema refuses malformed Peers, kgctl prints for objects in the API server exactly what it
//! prints for the same objects in files, and the server calls `kg webhook` over TLS. kg itself
//! on the API server: `kube_apiserver_privileged.rs`.
use kilo_testkit as support;

use support::eventually;

use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use kilo_agent::{
    backend::kubernetes,
    mesh::{Peer, objects::parse_stream},
};
use kube::{Api, api::PostParams};
use support::{
    apiserver::{ApiServer, create, install_crd, manifest, runtime},
    kg::Launch,
};

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

/// `kgctl check` lists the agents' pods from the API server and names each node it cannot vouch
/// for: one without a running agent pod, and one whose pod does not answer through the pod proxy
/// (no kubelet here); it fails unless every node is in sync. kg's own answers: the e2e.
#[test]
fn kgctl_check_names_each_node_it_cannot_vouch_for() {
    if !support::apiserver::available("kgctl_check_names_each_node_it_cannot_vouch_for") {
        return;
    }
    let server = ApiServer::start();
    let kubeconfig = format!("--kubeconfig={}", server.kubeconfig().display());
    let check = |nodes: &[&str]| {
        Launch::kgctl()
            .arg(&kubeconfig)
            .arg("check")
            .args(nodes)
            .env_remove("KUBECONFIG")
            .output()
    };
    let none = check(&[]);
    assert!(!none.status.success());
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(err.contains("no running agent pod"), "{err}");

    let rt = runtime();
    rt.block_on(async {
        use k8s_openapi::api::core::v1::Pod;
        let client = kubernetes::client(server.config()).unwrap();
        let pods: Api<Pod> = Api::namespaced(client, "kube-system");
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "kilo-x", "labels": {"app.kubernetes.io/name": "kilo"}},
            "spec": {"nodeName": "a", "containers": [{"name": "kilo", "image": "kilo-rs"}]},
        }))
        .unwrap();
        pod = pods.create(&PostParams::default(), &pod).await.unwrap();
        pod.status = Some(serde_json::from_value(serde_json::json!({"phase": "Running"})).unwrap());
        pods.replace_status("kilo-x", &PostParams::default(), &pod)
            .await
            .unwrap();
    });
    let out = check(&["a", "b"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("b: no running kg pod in kube-system"),
        "{stdout}"
    );
    let a = stdout
        .lines()
        .find(|l| l.starts_with("a (kilo-x): "))
        .unwrap_or_else(|| panic!("no line for a: {stdout}"));
    assert!(!a.contains("in sync"), "{a}");
    assert!(stderr.contains("2 of 2 nodes not in sync"), "{stderr}");
}
