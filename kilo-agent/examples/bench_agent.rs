//! Agent benchmark at 1,000 nodes + 1,000 peers with the file backend and a wireguard-go device:
//! processes started by the agent (0), writes of an idle resync (0) and its CPU time, the writes
//! of one added peer, and the agent's RSS.
//!
//! Run as root: `cargo run --release -p kilo-agent --example bench_agent [-- NODES PEERS FOREIGN_ROUTES]`.
//! The agent runs as PID 1 of its own PID namespace (inside a throwaway network namespace), so
//! every PID allocated there is one of its own threads or a process it started: counting them
//! counts processes started. The seccomp filter is installed as `kg` does.
//!
//! A stand-in planner (`tests/support/agent.rs`) maps every node and peer to one WireGuard peer,
//! one route and one datapath entry (the same object counts as the real plan of a leader).
#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    fmt::Write as _,
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use kilo_agent::{
    agent::{ANNOTATION_KEY, Agent, LoopSettings, seccomp},
    backend::{Backend, file::FileBackend},
    datapath::FakeDatapath,
    mesh::Key,
    reconcile::{
        Reconciler, Writes,
        netlink::NetlinkKernel,
        wireguard::{WgApi, WgControl, uapi_socket},
    },
    telemetry::Metrics,
};
use support::agent::{ENDPOINT_ANNOTATION, local, peer_yaml, planner, settings};

const CHILD: &str = "KILO_BENCH_AGENT_DIR";
const CHILD_WG: &str = "KILO_BENCH_AGENT_WG";

fn key(i: u32, salt: u8) -> Key {
    let mut k = [salt; 32];
    k[1..5].copy_from_slice(&i.to_le_bytes()); // byte 0 is clamped by x25519
    Key(wireguard_control::Key(k).get_public().0)
}

fn pod_cidr(i: u32) -> String {
    format!("10.{}.{}.0/24", 64 + i / 256, i % 256)
}

fn peer_ip(i: u32) -> String {
    format!("10.200.{}.{}/32", i / 256, i % 256)
}

fn write_objects(dir: &std::path::Path, nodes: u32, peers: u32) {
    for i in 0..nodes {
        std::fs::write(
            dir.join(format!("node-{i}.yaml")),
            format!(
                "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-{i}\n  labels:\n    topology.kubernetes.io/region: r{i}\n  annotations:\n    {ANNOTATION_KEY}: \"{}\"\n    {ENDPOINT_ANNOTATION}: \"192.0.2.{}:51820\"\nspec:\n  podCIDR: {}\n",
                key(i, 1),
                i % 250 + 1,
                pod_cidr(i)
            ),
        )
        .unwrap();
    }
    for i in 0..peers {
        let yaml = peer_yaml(&format!("peer-{i}"), key(i, 2), &peer_ip(i));
        std::fs::write(
            dir.join(format!("peer-{i}.yaml")),
            format!("{yaml}  persistentKeepalive: 25\n"),
        )
        .unwrap();
    }
}

fn cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// The agent side: PID 1 of its own PID namespace, inside the benchmark's network namespace.
fn agent(dir: String, wg: String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut report = String::new();
    rt.block_on(async {
        let backend = Arc::new(FileBackend::start(&dir).unwrap());
        let reconciler = Reconciler::new(
            NetlinkKernel::connect().unwrap(),
            WgControl::new(&wg, WgApi::Userspace).unwrap(),
            FakeDatapath::default(),
            settings(
                &wg,
                Some("eth0"),
                false,
                Key(wireguard_control::Key::generate_private().0),
            ),
        );
        let mut agent = Agent::new(
            backend.clone(),
            // The first reconcile comes before our own node is published: plan without it.
            planner("me", false),
            reconciler,
            local("me", key(0, 9), "location"),
            LoopSettings {
                check_in: None,
                ..LoopSettings::default()
            },
            Metrics::new(),
        );
        seccomp::forbid_exec().expect("seccomp");
        let snap = backend.updates().borrow().snapshot.clone();
        let _ = writeln!(
            report,
            "objects: {} nodes, {} peers",
            snap.nodes.len(),
            snap.peers.len()
        );
        drop(snap);

        let (t, c) = (Instant::now(), cpu_time());
        let first = agent.reconcile_once().await.expect("first reconcile");
        assert!(first.problems.is_empty(), "{:?}", &first.problems[..first.problems.len().min(3)]);
        let _ = writeln!(
            report,
            "converge: {} writes ({}) in {:?} wall, {:?} CPU",
            first.writes.total(),
            first.writes,
            t.elapsed(),
            cpu_time() - c
        );
        // Our own node file was just created: let the backend see it.
        let mut rx = backend.updates();
        let _ = tokio::time::timeout(Duration::from_secs(5), rx.changed()).await;

        let mut idle = Writes::default();
        let mut cpu = Vec::new();
        let mut wall = Vec::new();
        for _ in 0..10 {
            let (t, c) = (Instant::now(), cpu_time());
            let r = agent.reconcile_once().await.expect("idle reconcile");
            cpu.push(cpu_time() - c);
            wall.push(t.elapsed());
            idle += r.writes;
        }
        cpu.sort();
        wall.sort();
        let _ = writeln!(
            report,
            "idle resync x10: {} writes ({idle}); CPU per resync median {:?} max {:?}; wall median {:?}",
            idle.total(),
            cpu[5],
            cpu[9],
            wall[5]
        );

        std::fs::write(
            std::path::Path::new(&dir).join("peer-new.yaml"),
            peer_yaml("peer-new", key(7, 7), "10.250.0.1/32"),
        )
        .unwrap();
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            rx.wait_for(|u| u.snapshot.peers.contains_key("peer-new")),
        )
        .await;
        let (t, c) = (Instant::now(), cpu_time());
        let change = agent.reconcile_once().await.expect("change reconcile");
        let _ = writeln!(
            report,
            "+1 peer: {} writes ({}) in {:?} wall, {:?} CPU",
            change.writes.total(),
            change.writes,
            t.elapsed(),
            cpu_time() - c
        );
        let _ = writeln!(
            report,
            "agent RSS: {} kB now, {} kB peak",
            status_kb("VmRSS:"),
            status_kb("VmHWM:")
        );
        // Counted while the agent (and its backend's watcher thread) is still alive.
        let last_pid: u64 = std::fs::read_to_string("/proc/sys/kernel/ns_last_pid")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let threads = std::fs::read_dir("/proc/self/task").unwrap().count() as u64;
        let _ = writeln!(
            report,
            "PIDs allocated in the agent's PID namespace: {last_pid}; agent threads: {threads}; processes started by the agent: {}",
            last_pid.saturating_sub(threads)
        );
    });
    print!("{report}");
}

fn main() {
    if let (Ok(dir), Ok(wg)) = (std::env::var(CHILD), std::env::var(CHILD_WG)) {
        agent(dir, wg);
        return;
    }
    if !support::require_root("bench_agent") {
        return;
    }
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (nodes, peers) = (
        args.first().copied().unwrap_or(1000),
        args.get(1).copied().unwrap_or(1000),
    );
    let dir = tempfile::tempdir().unwrap();
    write_objects(dir.path(), nodes, peers);

    let ns = support::netns::NetNs::new("bench");
    let other = support::netns::NetNs::new("benchb");
    support::netns::veth(&ns, "eth0", &other, "eth0");
    ns.sh("ip addr add 10.0.0.1/24 dev eth0");
    // Foreign routes the agent must not pay for (the kernel filters dumps by our protocol).
    let foreign: u32 = args.get(2).copied().unwrap_or(10_000);
    let batch = dir.path().join(".foreign-routes");
    let mut text = String::new();
    for i in 0..foreign {
        let _ = writeln!(
            text,
            "route add 172.16.{}.{}/32 dev eth0 proto static",
            i / 256,
            i % 256
        );
    }
    std::fs::write(&batch, text).unwrap();
    ns.sh(&format!("ip -batch {}", batch.display()));
    std::fs::remove_file(&batch).unwrap();
    let wg = format!("kb{}", std::process::id() % 100_000);
    let mut wggo = Command::new("ip")
        .args(["netns", "exec", &ns.name, "wireguard-go", "-f", &wg])
        .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(uapi_socket(&wg)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "wireguard-go did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.name,
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
        ])
        .arg(std::env::current_exe().unwrap())
        .env(CHILD, dir.path())
        .env(CHILD_WG, &wg)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let _ = wggo.kill();
    let _ = wggo.wait();
    let _ = std::fs::remove_file(uapi_socket(&wg));
    println!(
        "bench_agent: {nodes} nodes + {peers} peers, file backend, wireguard-go (UAPI), {foreign} foreign routes"
    );
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        std::process::exit(1);
    }
}
