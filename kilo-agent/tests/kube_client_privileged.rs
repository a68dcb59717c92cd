//! The real `kg` binary reaches an API server through a kubeconfig, over TLS with the
//! kubeconfig's CA and over plain HTTP, and waits out a certificate it cannot trust. The server
//! is a small stand-in (`support::apistub`) in kg's network namespace.
use kilo_testkit as support;

use support::eventually;

use std::{path::Path, time::Duration};

use support::{
    apistub::{Answer, ApiStub, Cert},
    kg::{Kg, Launch},
    netns::NetNs,
};

/// The kubeconfig `text`, written as `dir/kc`.
fn write(dir: &Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("kc");
    std::fs::write(&path, text).unwrap();
    path
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
        let kc = write(dir.path(), &stub.kubeconfig(tls.then_some(&cert), "s3cret"));
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
    let kc = write(dir.path(), &stub.kubeconfig(Some(&other), "s3cret"));
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
