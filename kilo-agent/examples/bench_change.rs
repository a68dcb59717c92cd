//! One change through a real API server: the demo's three-node mesh (two locations, so two
//! leaders) with the real `kg` on each node on the kubernetes backend against a real
//! kube-apiserver and etcd; a Peer is created 20 times, one at a time after a quiet period, and
//! each time the bench takes the time until every leader's WireGuard device carries it: the
//! median and the worst, beside Kilo's reference figure.
//!
//! Run as root: `cargo xtask bench change [--quick]` (the API server is the tests' one, built
//! by `cargo xtask setup` and cached under `$KILO_CACHE_DIR`; without it the target reads not
//! measured). The Peer is created in-process with kube's client over a connection already open,
//! and the time runs from just before the create request is sent: the commit comes after that,
//! so the figure is an upper bound of the time from the commit. The time from the create's
//! response (after the commit) is shown beside it, a lower bound. The devices are read over
//! their UAPI sockets (wireguard-go), which costs kg nothing.
use kilo_testkit as support;

use std::{
    process::Command,
    time::{Duration, Instant},
};

use kilo_agent::{backend::kubernetes, mesh::Peer};
use kube::{Api, api::PostParams};
use support::{
    apiserver::{self, ApiServer},
    bpffs::BpfFs,
    kg::{Kg, Launch},
    mesh::DemoMesh,
    report,
};

/// Kilo's reference figure for the same change (docs/kilo-reference.md; not measured here).
const KILO_S: f64 = 0.11;
/// The target: the median under this.
const TARGET_MS: f64 = 20.0;
/// Changes measured.
const CHANGES: u32 = 20;
/// The quiet period before each change, longer than the agent's coalescing window, so each
/// change is the first of a quiet period.
const QUIET: Duration = Duration::from_millis(500);

const TARGET: &str = "one change: a new Peer on every leader's WireGuard device under 20 ms \
                      (median of 20; kubernetes backend, real API server)";

/// `kubectl` against `server`, run in the mesh's "internet" namespace where it listens.
fn kubectl(mesh: &DemoMesh, server: &ApiServer, args: &[&str]) {
    let out = Command::new("ip")
        .args(["netns", "exec", &mesh.ns("inet")])
        .arg(apiserver::kubectl())
        .arg(format!("--kubeconfig={}", server.kubeconfig().display()))
        .args(args)
        .output()
        .expect("run kubectl");
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The public keys on a wireguard-go device (empty while it does not answer).
fn device_keys(name: &str) -> Vec<String> {
    let Ok(iface) = name.parse() else {
        return Vec::new();
    };
    wireguard_control::Device::get(&iface, wireguard_control::Backend::Userspace)
        .map(|d| {
            d.peers
                .iter()
                .map(|p| p.config.public_key.to_base64())
                .collect()
        })
        .unwrap_or_default()
}

fn log(mesh: &DemoMesh, i: usize) -> std::path::PathBuf {
    mesh.work.path().join(format!("kg-n{i}.log"))
}

/// Node `i`'s kg on the kubernetes backend (the mesh's usual flags otherwise), logging to
/// `kg-n<i>.log`; SIGTERM on drop, so it cleans up before the mesh goes.
fn start_agent(mesh: &DemoMesh, i: usize, bpffs: &BpfFs, kubeconfig: &str) -> Kg {
    let flags = mesh
        .kg_flags(i, bpffs)
        .into_iter()
        .filter(|f| !f.starts_with("--backend"));
    Launch::kg()
        .netns(&mesh.ns(&format!("n{i}")))
        .args(flags)
        .args(["--backend=kubernetes", kubeconfig])
        .log_file(log(mesh, i))
        .spawn()
}

/// Node `i`'s kg reports itself a leader (`kilo_leader 1`), once it answers.
fn leader(mesh: &DemoMesh, i: usize) -> Option<bool> {
    let m = mesh.metrics(i)?;
    Some(support::metrics::metric(&m, "kilo_leader")? == 1)
}

fn main() {
    if !support::require_root("bench_change") {
        return;
    }
    if !apiserver::available("bench_change") {
        report::target(
            TARGET,
            "no API server here (cargo xtask setup builds it)",
            report::State::NotMeasured,
        );
        return;
    }
    let mesh = DemoMesh::up("bc");
    let server = mesh.run("inet", || ApiServer::start_at("192.168.50.100"));
    let crd = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/base/crds.yaml");
    kubectl(&mesh, &server, &["create", "-f", &crd.to_string_lossy()]);
    kubectl(
        &mesh,
        &server,
        &[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/peers.kilo.squat.ai",
        ],
    );
    for i in 1..=3 {
        let node = mesh.work.path().join(format!("objects/node-n{i}.yaml"));
        kubectl(&mesh, &server, &["create", "-f", &node.to_string_lossy()]);
    }
    let bpffs = BpfFs::new();
    let kubeconfig = format!("--kubeconfig={}", server.kubeconfig().display());
    let mut kg: Vec<Kg> = (1..=3)
        .map(|i| start_agent(&mesh, i, &bpffs, &kubeconfig))
        .collect();
    // The leaders, once every kg answers and the mesh settled.
    let start = Instant::now();
    let leaders: Vec<usize> = loop {
        let states: Vec<Option<bool>> = (1..=3).map(|i| leader(&mesh, i)).collect();
        if states.iter().all(Option::is_some) && start.elapsed() > Duration::from_secs(5) {
            break (1..=3).filter(|i| states[i - 1] == Some(true)).collect();
        }
        let exited = kg.iter_mut().any(|k| k.try_wait().is_some());
        assert!(
            start.elapsed() < Duration::from_secs(120) && !exited,
            "kg exited or did not answer within 120 s:\n{}",
            (1..=3)
                .map(|i| std::fs::read_to_string(log(&mesh, i)).unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(!leaders.is_empty(), "no leader");
    let devices: Vec<String> = leaders.iter().map(|&i| mesh.wg(i)).collect();
    report::meta(
        "mesh",
        &format!(
            "3 nodes in 2 locations, leaders n{}; {CHANGES} Peers, one every {} ms or more",
            leaders
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" and n"),
            QUIET.as_millis()
        ),
    );

    let config = server.config();
    let (from_send, from_response) = mesh.run("inet", || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let peers: Api<Peer> = Api::all(kubernetes::client(config).unwrap());
                // The connection is open before the first measured request.
                peers.list(&Default::default()).await.expect("list Peers");
                let (mut send, mut response) = (Vec::new(), Vec::new());
                for j in 0..CHANGES {
                    tokio::time::sleep(QUIET).await;
                    let key = wireguard_control::Key::generate_private().get_public();
                    let peer: Peer = serde_json::from_value(serde_json::json!({
                        "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer",
                        "metadata": {"name": format!("bench-{j}")},
                        "spec": {"allowedIPs": [format!("10.5.{j}.1/32")],
                                 "publicKey": key.to_base64()}
                    }))
                    .unwrap();
                    let sent = Instant::now();
                    peers
                        .create(&PostParams::default(), &peer)
                        .await
                        .expect("create a Peer");
                    let answered = Instant::now();
                    let want = key.to_base64();
                    while !devices.iter().all(|d| device_keys(d).contains(&want)) {
                        assert!(
                            sent.elapsed() < Duration::from_secs(30),
                            "Peer {j} not on every leader's device after 30 s"
                        );
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    let done = Instant::now();
                    send.push((done - sent).as_secs_f64() * 1e3);
                    response.push((done - answered).as_secs_f64() * 1e3);
                }
                (send, response)
            })
    });
    drop(kg);

    let id = "latency";
    report::table(
        id,
        "One new Peer to every leader's WireGuard device (kubernetes backend, real API server)",
        "ms",
    );
    let worst = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
    for (row, v) in [
        ("kg: from the create request sent", &from_send),
        ("kg: from the create response", &from_response),
    ] {
        report::cell(id, row, "median (range)", v);
        report::cell(id, row, "worst", &[worst(v)]);
    }
    report::cell(
        id,
        "Kilo (reference figure, not measured here)",
        "median (range)",
        &[KILO_S * 1e3],
    );
    report::note(
        id,
        &format!(
            "{CHANGES} Peers, one at a time; the time ends when every leader's device lists the \
             new key (read every 0.2 ms over UAPI). From the request sent: an upper bound of the \
             time from the API server's commit; from the response: a lower bound. Kilo's \
             figure is its reference figure for the same change ({KILO_S} s, see \
             docs/kilo-reference.md)."
        ),
    );
    let median = support::median::median(&from_send);
    report::target(
        TARGET,
        &format!(
            "{median:.1} ms median, {:.1} ms worst from the create request (from its response: \
             {:.1} ms median) (Kilo: {KILO_S} s)",
            worst(&from_send),
            support::median::median(&from_response)
        ),
        if from_send.len() == CHANGES as usize {
            report::State::of(median < TARGET_MS)
        } else {
            report::State::NotMeasured
        },
    );
    println!(
        "one change to every leader's device: {median:.1} ms median, {:.1} ms worst (from the \
         request; from the response {:.1} ms median)",
        worst(&from_send),
        support::median::median(&from_response)
    );
}
