//! The real `kgctl` binary reaches an API server through a kubeconfig: over TLS with the
//! kubeconfig's CA (handshake, bearer token, first list requests), over plain HTTP, and with a
//! clear message and no panic when the CA is wrong, the credentials are refused or there is no
//! configuration at all. The server is a small stand-in (`support::apistub`); `kg` against it is
//! in `kube_client_privileged.rs`.
use kilo_testkit as support;

use std::{path::Path, process::Output};

use support::{
    apistub::{Answer, ApiStub, Cert},
    kg::Launch,
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
