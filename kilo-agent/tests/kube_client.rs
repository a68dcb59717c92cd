//! The real `kgctl` and `kg` binaries reach an API server through a kubeconfig: over TLS with
//! the kubeconfig's CA (handshake, bearer token, first list requests), over plain HTTP, and
//! with a clear message and no panic when the CA is wrong, the credentials are refused or
//! there is no configuration at all. The server is a small stand-in (`support::apistub`).
use kilo_testkit as support;

use support::eventually;

use std::{path::Path, process::Output, time::Duration};

use support::{
    apistub::{Answer, ApiStub, Cert},
    kg::{Kg, Launch},
    netns::NetNs,
};

fn kgctl(kubeconfig: &Path, args: &[&str]) -> Output {
    Launch::kgctl()
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(args)
        .output()
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

#[test]
fn kgctl_lists_over_tls_with_the_kubeconfig_ca_and_token() {
    let cert = Cert::new();
    let stub = ApiStub::start(Some(&cert), Answer::Lists);
    let dir = tempfile::tempdir().unwrap();
    let kc = write(dir.path(), "kc", &stub.kubeconfig(Some(&cert), "s3cret"));
    let out = kgctl(&kc, &["graph"]);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(text(&out.stdout).contains("digraph kilo"), "{out:?}");
    let seen = stub.requests.lock().unwrap().clone();
    let paths: Vec<&str> = seen.iter().map(|(r, _)| r.as_str()).collect();
    assert!(
        paths.iter().any(|r| r.starts_with("GET /api/v1/nodes")),
        "{paths:?}"
    );
    assert!(
        paths
            .iter()
            .any(|r| r.starts_with("GET /apis/kilo.squat.ai/v1alpha1/peers")),
        "{paths:?}"
    );
    assert!(
        seen.iter().all(|(_, t)| t.as_deref() == Some("s3cret")),
        "{seen:?}"
    );
}

#[test]
fn kgctl_lists_over_plain_http() {
    let stub = ApiStub::start(None, Answer::Lists);
    let dir = tempfile::tempdir().unwrap();
    let kc = write(dir.path(), "kc", &stub.kubeconfig(None, "s3cret"));
    let out = kgctl(&kc, &["graph"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stub.seen()
            .iter()
            .any(|r| r.starts_with("GET /api/v1/nodes")),
        "{:?}",
        stub.seen()
    );
}

#[test]
fn kgctl_names_a_certificate_it_cannot_trust_and_exits_non_zero() {
    let (served, trusted) = (Cert::new(), Cert::new());
    let stub = ApiStub::start(Some(&served), Answer::Lists);
    let dir = tempfile::tempdir().unwrap();
    let kc = write(dir.path(), "kc", &stub.kubeconfig(Some(&trusted), "s3cret"));
    let out = kgctl(&kc, &["graph"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.starts_with("kgctl: listing nodes from https://127.0.0.1:"),
        "{err}"
    );
    assert!(err.contains("certificate"), "{err}");
    assert!(
        stub.seen().is_empty(),
        "no request crosses a failed handshake"
    );
}

#[test]
fn kgctl_says_the_credentials_were_refused() {
    let cert = Cert::new();
    let stub = ApiStub::start(Some(&cert), Answer::Unauthorized);
    let dir = tempfile::tempdir().unwrap();
    let kc = write(dir.path(), "kc", &stub.kubeconfig(Some(&cert), "wrong"));
    let out = kgctl(&kc, &["showconf", "node", "a"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("listing nodes"), "{err}");
    assert!(err.contains("401 Unauthorized"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn kgctl_without_any_configuration_says_what_it_looked_for() {
    let home = tempfile::tempdir().unwrap();
    let out = Launch::kgctl()
        .arg("graph")
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("HOME", home.path())
        .output();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no Kubernetes configuration"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `kg --backend kubernetes` in a namespace, with a stub API server in the same namespace;
/// without CAP_NET_ADMIN: kg says it is missing, and still talks to the API server.
fn start_kg(ns: &NetNs, dir: &Path, kubeconfig: &Path) -> Kg {
    Launch::kg()
        .netns(&ns.name)
        .wrap(["setpriv", "--bounding-set=-net_admin"])
        .args([
            "--backend=kubernetes",
            &format!("--kubeconfig={}", kubeconfig.display()),
            "--hostname=kgtest",
            &format!("--private-key={}", dir.join("key").display()),
            "--listen=127.0.0.1:1107",
            "--datapath=false",
            "--cni=false",
            "--log-format=text",
        ])
        .spawn()
}

/// SIGTERM; the log once kg exited 0 without panicking.
fn stop(mut kg: Kg) -> String {
    let log = kg.stop();
    assert!(!log.contains("panicked"), "{log}");
    log
}

/// kg lists Nodes and Peers over TLS and over HTTP; with an untrusted certificate it stays up,
/// says what it waits for and why, and retries. Started without CAP_NET_ADMIN, it names it.
#[test]
fn kg_connects_over_tls_and_http_and_waits_out_a_bad_certificate() {
    if !support::require_root("kg_connects_over_tls_and_http_and_waits_out_a_bad_certificate") {
        return;
    }
    let ns = NetNs::new("kube");
    let dir = tempfile::tempdir().unwrap();
    let (cert, other) = (Cert::new(), Cert::new());
    for tls in [true, false] {
        let stub = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let stub = ApiStub::serve(stub, tls.then_some(&cert), Answer::Lists, Some(&ns));
        let kc = write(
            dir.path(),
            "kc",
            &stub.kubeconfig(tls.then_some(&cert), "s3cret"),
        );
        let mut kg = start_kg(&ns, dir.path(), &kc);
        kg.wait_for_line(&["capability missing", "CAP_NET_ADMIN"]);
        kg.wait_for_line(&["Kubernetes API server", &stub.url()]);
        for resource in [
            "GET /api/v1/nodes",
            "GET /apis/kilo.squat.ai/v1alpha1/peers",
        ] {
            eventually(&format!("kg sends {resource}"), || {
                stub.seen().iter().any(|r| r.starts_with(resource))
            });
        }
        stop(kg);
    }

    let stub = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let stub = ApiStub::serve(stub, Some(&cert), Answer::Lists, Some(&ns));
    let kc = write(dir.path(), "kc", &stub.kubeconfig(Some(&other), "s3cret"));
    let mut kg = start_kg(&ns, dir.path(), &kc);
    // One line for the server it cannot reach, naming the certificate, whichever request
    // (discovery, the lists) fails first.
    let line = kg.wait_for_line(&["Kubernetes API server unreachable", "certificate"]);
    assert!(line.contains("error="), "{line}");
    // Still running after the first failure: it retries rather than exits.
    std::thread::sleep(Duration::from_millis(500));
    let log = stop(kg);
    assert!(stub.seen().is_empty(), "{:?}", stub.seen());
    assert!(!log.contains("s3cret"), "token logged");
}
