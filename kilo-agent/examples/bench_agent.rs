//! The agent: the real `kg` binary (its planner, the file backend, the eBPF datapath, a
//! wireguard-go device) in network namespaces of its own, in the shapes Kilo's agent was
//! measured in (3 nodes; 54 nodes + 21 Peers, with a 70-object burst), at 1,000 nodes + 1,000
//! Peers (a 100-object burst) and at 5,000 nodes: RSS, idle CPU, the processes kg starts, the
//! CPU, writes and reconciles of a burst until the kernel matches the plan, for one new Peer
//! the time until the WireGuard device carries it and kg's CPU for the whole change, and the
//! start-up, cold and restarted, phase by phase.
//! Kilo's figures beside them are its reference figures (constants, not measured here).
//!
//! Run as root: `cargo xtask bench agent [--quick]` (xtask passes the `kg` of the same build in
//! `KILO_BENCH_KG`). The agents run side by side and their idle CPU is measured over the same
//! windows (three of 60 s, the median reported; one of 5 s with `--quick`, where the large
//! shapes are 200 + 200 and 500 nodes). Every other node is in a location of its own and the
//! agent leads its own, so each node and Peer is a WireGuard peer, a route and datapath
//! entries. "The kernel matches the plan": the agent's reconcile counter moved and the
//! WireGuard device lists every new peer (read over its UAPI socket). CPU is the agent's
//! scheduled run time (`/proc/PID/task/*/schedstat`); `--resync-period` is Kilo's default,
//! 30 s. A figure /proc does not give reads "not measured", and so does a target that needs
//! it.
use kilo_testkit as support;

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use kilo_agent::{
    mesh::{Key, annotations::KEY as ANNOTATION_KEY},
    reconcile::wireguard::uapi_socket,
};
use support::{
    agent::{ENDPOINT_ANNOTATION, peer_yaml},
    kg::{Kg, Launch},
    median::median,
    metrics,
    netns::{NetNs, WgGo, veth},
    report,
};

/// Kilo's reference figures: its agent measured live on a machine of the kind the benchmarks
/// run on (3 agents in namespaces, wireguard-go, a real API server), and its execs counted by
/// running Kilo's iptables controller; constants, not measured here. docs/kilo-reference.md
/// gives each one's source and method.
mod kilo {
    pub const RSS_3_MB: f64 = 34.0;
    pub const IDLE_CPU_3_PCT: f64 = 0.03;
    pub const RSS_54_MB: (f64, f64, f64) = (37.0, 59.0, 65.0);
    pub const IDLE_CPU_54_PCT: f64 = 0.40;
    pub const IPTABLES_PROCS_PER_30S: f64 = 6.0;
    pub const BURST_70_S: f64 = 5.4;
    pub const BURST_70_PROCS: f64 = 320.0;
    pub const BURST_70_WG_RECONFIGS: f64 = 70.0;
    /// docs/kilo-reference.md: iptables execs on every node for +1 node +1 Peer, and per
    /// resync; constant in the number of nodes.
    pub const EXECS_PER_CHANGE: f64 = 10.0;
    pub const EXECS_PER_RESYNC: f64 = 11.0;
}

fn key(i: u32, salt: u8) -> Key {
    let mut k = [salt; 32];
    k[1..5].copy_from_slice(&i.to_le_bytes()); // byte 0 is clamped by x25519
    Key(wireguard_control::Key(k).get_public().0)
}

fn hex(k: &Key) -> String {
    k.0.iter().map(|b| format!("{b:02x}")).collect()
}

fn node_yaml(name: &str, i: u32, key: &Key) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels:\n    topology.kubernetes.io/region: r-{name}\n  annotations:\n    {ANNOTATION_KEY}: \"{key}\"\n    {ENDPOINT_ANNOTATION}: \"192.0.2.{}:51820\"\nspec:\n  podCIDR: 10.{}.{}.0/24\n",
        i % 250 + 1,
        64 + i / 256,
        i % 256
    )
}

/// A node (salt 1) or Peer (salt 2) object; returns its WireGuard key.
fn write_object(dir: &Path, kind: &str, i: u32) -> Key {
    if kind == "node" {
        let k = key(i, 1);
        let name = format!("node-{i}");
        std::fs::write(dir.join(format!("{name}.yaml")), node_yaml(&name, i, &k)).unwrap();
        k
    } else {
        let k = key(i, 2);
        let yaml = peer_yaml(
            &format!("peer-{i}"),
            k,
            &format!("10.200.{}.{}/32", i / 256, i % 256),
        );
        std::fs::write(dir.join(format!("peer-{i}.yaml")), yaml).unwrap();
        k
    }
}

/// One agent and its namespaces.
struct Run {
    label: String,
    nodes: u32,
    peers: u32,
    burst: u32,
    dir: tempfile::TempDir,
    _ns: NetNs,
    _gw: NetNs,
    wg: WgGo,
    kg: Kg,
    bpffs: PathBuf,
    /// kg's program and arguments.
    command: (PathBuf, Vec<String>),
}

impl Run {
    fn start(label: &str, nodes: u32, peers: u32, burst: u32, kg: &Path) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let objects = dir.path().join("objects");
        std::fs::create_dir(&objects).unwrap();
        // Our node (its pod CIDR makes it ready) and nodes - 1 others.
        std::fs::write(
            objects.join("me.yaml"),
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: me\n  labels:\n    topology.kubernetes.io/region: r-me\nspec:\n  podCIDR: 10.63.255.0/24\n",
        )
        .unwrap();
        for i in 1..nodes {
            write_object(&objects, "node", i);
        }
        for i in 0..peers {
            write_object(&objects, "peer", i);
        }
        // The CNI configuration the manifests' init container installs.
        let conf = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests/overlays/kubeadm/cni-conf.json");
        std::fs::copy(conf, dir.path().join("10-kilo.conflist")).unwrap();
        let ns = NetNs::new("agent");
        let gw = NetNs::new("agentgw");
        veth(&ns, "eth0", &gw, "eth0");
        ns.sh("ip addr add 10.9.0.1/24 dev eth0 && ip route add default via 10.9.0.254 dev eth0");
        // The node's name resolves through its hosts file, as a node's own name usually does.
        ns.hosts("127.0.0.1 localhost\n10.9.0.1 me\n");
        let wg = WgGo::start(&ns);
        let bpffs = PathBuf::from(format!(
            "/sys/fs/bpf/kilo-bench-{}-{}",
            std::process::id(),
            wg.name
        ));
        let args = vec![
            "--backend=file".to_owned(),
            format!("--backend-dir={}", objects.display()),
            "--hostname=me".to_owned(),
            format!("--private-key={}", dir.path().join("key").display()),
            "--listen=127.0.0.1:1107".to_owned(),
            format!("--interface={}", wg.name),
            "--create-interface=false".to_owned(),
            "--check-in-period=0".to_owned(),
            format!(
                "--cni-path={}",
                dir.path().join("10-kilo.conflist").display()
            ),
            format!("--bpffs-dir={}", bpffs.display()),
            "--log-level=warn".to_owned(),
        ];
        let command = (kg.to_owned(), args);
        let kg = launch(&ns, &command)
            .log_file(dir.path().join("kg.log"))
            .spawn();
        Run {
            label: label.into(),
            nodes,
            peers,
            burst,
            dir,
            _ns: ns,
            _gw: gw,
            wg,
            kg,
            bpffs,
            command,
        }
    }

    /// Stops kg (SIGTERM, SIGKILL after 10 s).
    fn stop(&mut self) {
        self.kg.signal(libc::SIGTERM);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) && self.kg.try_wait().is_none() {
            std::thread::sleep(Duration::from_millis(20));
        }
        if self.kg.try_wait().is_none() {
            self.kg.signal(libc::SIGKILL);
        }
        self.kg.wait();
    }

    /// Replaces kg by a new one with `--clean-up=false` (so that the next start finds its
    /// pins, device peers and routes) and its start-up lines logged; returns its start-up, from
    /// the spawn to its line saying the kernel matches the first plan. `cold`: the pins removed
    /// first, and the old kg cleaning up as it stops.
    fn restart(&mut self, cold: bool) -> StartUp {
        self.stop();
        if cold {
            let _ = std::fs::remove_dir_all(&self.bpffs);
        }
        let log = self.dir.path().join(if cold {
            "kg-cold.log"
        } else {
            "kg-restart.log"
        });
        let t = Instant::now();
        self.kg = launch(&self._ns, &self.command)
            .arg("--clean-up=false")
            .env("RUST_LOG", "warn,kilo_agent::start_up=info")
            .log_file(&log)
            .spawn();
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(up) = StartUp::read(&text, t.elapsed()) {
                return up;
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "{}: no start-up line within 120 s: {text}",
                self.label
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn objects(&self) -> PathBuf {
        self.dir.path().join("objects")
    }

    /// WireGuard peers the plan has: every other node and every Peer.
    fn expected(&self) -> usize {
        (self.nodes - 1 + self.peers) as usize
    }

    /// The device's peers (hex keys), over UAPI.
    fn wg_peers(&self) -> Vec<String> {
        let Ok(mut s) = UnixStream::connect(uapi_socket(&self.wg.name)) else {
            return Vec::new();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        s.write_all(b"get=1\n\n").unwrap();
        // The socket stays open for more requests: the answer ends with an empty line.
        let mut buf = Vec::new();
        let mut chunk = [0u8; 65536];
        while !buf.ends_with(b"\n\n") {
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let out = String::from_utf8_lossy(&buf);
        out.lines()
            .filter_map(|l| l.strip_prefix("public_key="))
            .map(str::to_owned)
            .collect()
    }

    /// (reconciles, writes) so far (none while kg does not answer).
    fn counts(&self) -> (u64, BTreeMap<String, u64>) {
        let m = self.kg.metrics().unwrap_or_default();
        let reconciles = metrics::metric(&m, "kilo_reconciles_total").unwrap_or(0);
        (
            reconciles,
            metrics::by_label(&m, "kilo_writes_total", "kind"),
        )
    }

    fn pid(&self) -> u32 {
        self.kg.pid()
    }

    /// Scheduled CPU time of all of kg's threads, in ns (`None` when /proc does not tell).
    fn cpu_ns(&self) -> Option<u64> {
        let tasks = format!("/proc/{}/task", self.pid());
        let mut sum = 0;
        for t in std::fs::read_dir(tasks).ok()? {
            let s = std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok()?;
            sum += s.split_whitespace().next()?.parse::<u64>().ok()?;
        }
        Some(sum)
    }

    /// (VmRSS, VmHWM) in MB; each `None` when /proc does not tell it.
    fn rss_mb(&self) -> (Option<f64>, Option<f64>) {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        let mb = |f: &str| -> Option<f64> {
            let kb: f64 = s
                .lines()
                .find_map(|l| l.strip_prefix(f)?.trim().strip_suffix("kB"))?
                .trim()
                .parse()
                .ok()?;
            Some(kb / 1024.0)
        };
        (mb("VmRSS:"), mb("VmHWM:"))
    }

    /// Waits (bounded) until the WireGuard device carries `key`, asking only the device (so kg
    /// spends no CPU on being watched); returns the time it took from `since`.
    fn wait_device(&self, key: &str, since: Instant) -> Duration {
        loop {
            assert!(
                since.elapsed() < Duration::from_secs(120),
                "{}: the device did not carry the new peer within 120 s (log: {})",
                self.label,
                std::fs::read_to_string(self.dir.path().join("kg.log")).unwrap_or_default()
            );
            if self.wg_peers().iter().any(|k| k == key) {
                return since.elapsed();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits (bounded) until the device has `want` peers including `keys`, and the reconcile
    /// counter has passed `after`; returns the time it took from `since`.
    fn wait_kernel(&self, want: usize, keys: &[String], after: u64, since: Instant) -> Duration {
        let mut shown = Instant::now();
        loop {
            if shown.elapsed() > Duration::from_secs(10) {
                eprintln!(
                    "{}: waiting for {want} WireGuard peers: reconciles {}, peers {}",
                    self.label,
                    self.counts().0,
                    self.wg_peers().len()
                );
                shown = Instant::now();
            }
            assert!(
                since.elapsed() < Duration::from_secs(120),
                "{}: the kernel did not match the plan within 120 s (log: {})",
                self.label,
                std::fs::read_to_string(self.dir.path().join("kg.log")).unwrap_or_default()
            );
            if self.counts().0 > after {
                let peers = self.wg_peers();
                if peers.len() >= want && keys.iter().all(|k| peers.contains(k)) {
                    return since.elapsed();
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// kg in `ns`, as `command` says.
fn launch(ns: &NetNs, (program, args): &(PathBuf, Vec<String>)) -> Launch {
    Launch::program(program).netns(&ns.name).args(args)
}

impl Drop for Run {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.bpffs);
    }
}

/// One kg's start-up: from the spawn to its log line saying the kernel matches its first plan,
/// and its own phases (target `kilo_agent::start_up`): building the agent, phase by phase, then
/// the wait for the first snapshot and the first pass.
#[derive(Default, Clone)]
struct StartUp {
    spawn_to_match_ms: f64,
    phases: Vec<(String, f64)>,
}

impl StartUp {
    /// From kg's JSON log so far, once it has both start-up lines.
    fn read(log: &str, since_spawn: Duration) -> Option<StartUp> {
        let lines: Vec<serde_json::Value> = log
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|v: &serde_json::Value| v["target"] == "kilo_agent::start_up")
            .collect();
        let built = lines.iter().find(|v| v["message"] == "built")?;
        let matched = lines
            .iter()
            .find(|v| v["message"] == "the kernel matches the first plan")?;
        let ms = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        let mut phases: Vec<(String, f64)> = built["phases"]
            .as_str()?
            .split(", ")
            .filter_map(|p| {
                let (name, v) = p.strip_suffix(" ms")?.rsplit_once(' ')?;
                Some((name.to_owned(), v.parse().ok()?))
            })
            .collect();
        let (after, pass) = (ms(matched, "after_ms"), ms(matched, "pass_ms"));
        phases.push((
            "the first snapshot".into(),
            after - ms(built, "after_ms") - pass,
        ));
        phases.push(("the first pass (plan, publish, writes)".into(), pass));
        phases.push(("kg's own total".into(), after));
        Some(StartUp {
            spawn_to_match_ms: since_spawn.as_secs_f64() * 1e3,
            phases,
        })
    }
}

#[derive(Default)]
struct Figures {
    rss: Option<f64>,
    hwm: Option<f64>,
    converge_s: f64,
    /// Per idle window.
    idle_cpu_pct: Vec<f64>,
    idle_writes: Vec<f64>,
    idle_reconciles: Vec<f64>,
    burst: u32,
    burst_ms: f64,
    burst_cpu_ms: Option<f64>,
    burst_writes: u64,
    /// WireGuard peer additions during the burst (`None`: kg's metrics did not say).
    burst_wg_adds: Option<u64>,
    /// WireGuard peer updates and removals during the burst.
    burst_wg_other: u64,
    burst_reconciles: u64,
    cold: StartUp,
    restart: StartUp,
    /// Processes kg started, as the sampler saw them (`None`: /proc could not be listed).
    burst_procs: Option<u64>,
    idle_procs: Option<u64>,
    change_procs: Option<u64>,
    change_ms: Vec<f64>,
    /// kg's CPU for one change that took exactly one reconcile, end to end.
    change_cpu_ms: Vec<f64>,
}

/// Samples, on a thread of its own, the processes whose parent is one of the agents, and
/// keeps every PID it saw: what kg started (exec fails under its seccomp filter, so none is
/// expected; a process that lives shorter than the period can slip through).
struct Children {
    seen: std::sync::Arc<std::sync::Mutex<Vec<Option<std::collections::BTreeSet<u32>>>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const CHILD_SAMPLE: Duration = Duration::from_millis(10);

impl Children {
    fn start(parents: Vec<u32>) -> Children {
        use std::sync::{Arc, Mutex, atomic::AtomicBool};
        let seen = Arc::new(Mutex::new(vec![
            None::<std::collections::BTreeSet<u32>>;
            parents.len()
        ]));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(found) = children_of(&parents) {
                    let mut seen = s.lock().unwrap();
                    for (i, set) in seen.iter_mut().enumerate() {
                        set.get_or_insert_default()
                            .extend(found.iter().filter(|(p, _)| *p == i).map(|(_, c)| *c));
                    }
                }
                std::thread::sleep(CHILD_SAMPLE);
            }
        });
        Children {
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// How many children of agent `i` were seen so far (`None`: /proc was never listed).
    fn count(&self, i: usize) -> Option<u64> {
        self.seen.lock().unwrap()[i]
            .as_ref()
            .map(|s| s.len() as u64)
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// (index of the parent in `parents`, child PID) of every process whose parent is listed;
/// `None` when /proc cannot be listed.
fn children_of(parents: &[u32]) -> Option<Vec<(usize, u32)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // The state and parent follow the command's closing parenthesis.
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if let Some(i) = ppid.and_then(|pp| parents.iter().position(|p| *p == pp)) {
            out.push((i, pid));
        }
    }
    Some(out)
}

/// `after - before` of two sampler counts, `None` unless both were read.
fn started(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    Some(after? - before?)
}

/// The CPU ms between two readings of [`Run::cpu_ns`], `None` unless both were read.
fn cpu_ms(before: Option<u64>, after: Option<u64>) -> Option<f64> {
    Some(after?.checked_sub(before?)? as f64 / 1e6)
}

fn main() {
    if !support::require_root("bench_agent") {
        return;
    }
    let quick = report::quick();
    let kg = support::kg::binary("kg");
    assert!(
        kg.exists(),
        "no kg at {} (build it: cargo build --release --bins)",
        kg.display()
    );
    let idle = Duration::from_secs(if quick { 5 } else { 60 });
    let big = if quick { 200 } else { 1_000 };
    let huge = if quick { 500 } else { 5_000 };
    let huge_label = if quick { "500 nodes" } else { "5,000 nodes" };
    let shapes = [
        ("3 nodes", 3, 0, 0),
        ("54 nodes + 21 Peers", 54, 21, 70),
        (
            if quick {
                "200 nodes + 200 Peers"
            } else {
                "1,000 nodes + 1,000 Peers"
            },
            big,
            big,
            100,
        ),
        (huge_label, huge, 0, 0),
    ];
    let wgv = Command::new("wireguard-go").arg("--version").output();
    if let Ok(o) = wgv {
        let v = String::from_utf8_lossy(&o.stdout);
        report::meta("wireguard-go", v.lines().next().unwrap_or_default().trim());
    }
    let windows = if quick { 1 } else { 3 };
    report::meta(
        "idle windows",
        &format!("{windows} of {} s, one after the other", idle.as_secs()),
    );

    let t0 = Instant::now();
    let runs: Vec<Run> = shapes
        .iter()
        .map(|(l, n, p, b)| Run::start(l, *n, *p, *b, &kg))
        .collect();
    let mut figs: Vec<Figures> = runs.iter().map(|_| Figures::default()).collect();
    let children = Children::start(runs.iter().map(Run::pid).collect());
    for (r, f) in runs.iter().zip(&mut figs) {
        let d = r.wait_kernel(r.expected(), &[], 0, t0);
        f.converge_s = d.as_secs_f64();
        eprintln!("{}: converged after {:.1} s", r.label, f.converge_s);
    }
    // Our own node's annotations and the last start-up work settle first.
    std::thread::sleep(Duration::from_secs(if quick { 2 } else { 5 }));

    // Idle, all agents over the same windows.
    // Counts first, CPU last before a window and first after it: our own scrapes of /metrics
    // stay out of the idle figure.
    let idle_before: Vec<Option<u64>> = (0..runs.len()).map(|i| children.count(i)).collect();
    for _ in 0..windows {
        let before: Vec<(Option<u64>, u64, BTreeMap<String, u64>)> = runs
            .iter()
            .map(|r| {
                let (rc, w) = r.counts();
                (r.cpu_ns(), rc, w)
            })
            .collect();
        let t = Instant::now();
        std::thread::sleep(idle);
        let window = t.elapsed().as_secs_f64();
        for ((r, f), (cpu, rc, w)) in runs.iter().zip(&mut figs).zip(&before) {
            if let Some(ms) = cpu_ms(*cpu, r.cpu_ns()) {
                f.idle_cpu_pct.push(ms / 1e3 / window * 100.0);
            }
            let (rc1, w1) = r.counts();
            f.idle_reconciles.push((rc1 - rc) as f64);
            f.idle_writes
                .push((w1.values().sum::<u64>() - w.values().sum::<u64>()) as f64);
        }
    }
    for (i, (r, f)) in runs.iter().zip(&mut figs).enumerate() {
        (f.rss, f.hwm) = r.rss_mb();
        f.idle_procs = started(idle_before[i], children.count(i));
    }

    // Bursts, then single changes, one agent at a time.
    let reps = if quick { 2 } else { 5 };
    for (i, (r, f)) in runs.iter().zip(&mut figs).enumerate() {
        let dir = r.objects();
        if r.burst > 0 {
            let procs = children.count(i);
            let (rc, w) = r.counts();
            let cpu = r.cpu_ns();
            let start = Instant::now();
            let mut keys = Vec::new();
            for j in 0..r.burst {
                // Half new nodes, half new Peers.
                let k = if j % 2 == 0 {
                    write_object(&dir, "node", 10_000 + j)
                } else {
                    write_object(&dir, "peer", 10_000 + j)
                };
                keys.push(hex(&k));
            }
            f.burst = r.burst;
            let want = r.expected() + r.burst as usize;
            f.burst_ms = r.wait_kernel(want, &keys, rc, start).as_secs_f64() * 1e3;
            // What the burst cost, once the agent is idle again.
            std::thread::sleep(Duration::from_secs(1));
            f.burst_cpu_ms = cpu_ms(cpu, r.cpu_ns());
            let (rc1, w1) = r.counts();
            f.burst_reconciles = rc1 - rc;
            f.burst_writes = w1.values().sum::<u64>() - w.values().sum::<u64>();
            let added = |w: &BTreeMap<String, u64>, kind: &str| w.get(kind).copied().unwrap_or(0);
            f.burst_wg_adds = w1
                .contains_key("wireguard_peer_add")
                .then(|| added(&w1, "wireguard_peer_add") - added(&w, "wireguard_peer_add"));
            f.burst_wg_other = ["wireguard_peer_update", "wireguard_peer_remove"]
                .iter()
                .map(|k| added(&w1, k) - added(&w, k))
                .sum();
            f.burst_procs = started(procs, children.count(i));
        }
        // One new Peer at a time: the time until the device carries it, and kg's CPU for the
        // whole change (plan, diff, writes) when it took exactly one reconcile (a periodic
        // resync in the window would add its own). Only the device is watched until then.
        let procs = children.count(i);
        for j in 0..reps {
            let (rc, _) = r.counts();
            let cpu = r.cpu_ns();
            let start = Instant::now();
            let k = write_object(&dir, "peer", 20_000 + j);
            let d = r.wait_device(&hex(&k), start);
            f.change_ms.push(d.as_secs_f64() * 1e3);
            // The rest of the reconcile (routes, datapath) after the WireGuard write.
            std::thread::sleep(Duration::from_millis(300));
            let spent = cpu_ms(cpu, r.cpu_ns());
            let (rc1, _) = r.counts();
            assert!(rc1 > rc, "{}: a change without a reconcile", r.label);
            if let (Some(ms), 1) = (spent, rc1 - rc) {
                f.change_cpu_ms.push(ms);
            }
        }
        f.change_procs = started(procs, children.count(i));
        eprintln!("{}: burst and changes done", r.label);
    }
    drop(children);
    // Start-up, one agent at a time: a cold start, then a restart finding what it left.
    let mut runs = runs;
    for (r, f) in runs.iter_mut().zip(&mut figs) {
        f.cold = r.restart(true);
        f.restart = r.restart(false);
        eprintln!(
            "{}: cold start {:.0} ms, restart {:.0} ms",
            r.label, f.cold.spawn_to_match_ms, f.restart.spawn_to_match_ms
        );
    }
    drop(runs);
    emit(&shapes.map(|s| s.0), &figs, idle, windows);
}

/// A cell of samples, or "not measured" when there are none.
fn cell(id: &str, row: &str, col: &str, v: &[f64]) {
    if v.is_empty() {
        report::text(id, row, col, "not measured");
    } else {
        report::cell(id, row, col, v);
    }
}

/// A cell of one figure that may not have been read.
fn one(id: &str, row: &str, col: &str, v: Option<f64>) {
    cell(id, row, col, &Vec::from_iter(v));
}

fn emit(labels: &[&str], figs: &[Figures], idle: Duration, windows: u32) {
    let id = "kg";
    report::table(id, "The agent by shape (kg, this run)", "see rows");
    let idle_s = idle.as_secs() * u64::from(windows);
    for (l, f) in labels.iter().zip(figs) {
        one(id, "RSS after the idle windows (MB)", l, f.rss);
        one(id, "peak RSS (MB)", l, f.hwm);
        let w = |row: &str, v: &[f64]| cell(id, row, l, v);
        w(
            &format!("idle CPU over {} s (%)", idle.as_secs()),
            &f.idle_cpu_pct,
        );
        w(
            &format!(
                "idle: reconciles (periodic resyncs) per {} s",
                idle.as_secs()
            ),
            &f.idle_reconciles,
        );
        w(
            &format!("idle: kernel writes per {} s", idle.as_secs()),
            &f.idle_writes,
        );
        one(
            id,
            &format!("idle: processes started in {idle_s} s"),
            l,
            f.idle_procs.map(|p| p as f64),
        );
        report::cell(
            id,
            "start to kernel matching the plan (s)",
            l,
            &[f.converge_s],
        );
        if f.burst > 0 {
            let c = |row: &str, v: f64| report::cell(id, row, l, &[v]);
            c("burst: new objects", f64::from(f.burst));
            c(
                "burst: time to the kernel matching the plan (ms)",
                f.burst_ms,
            );
            one(id, "burst: CPU (ms)", l, f.burst_cpu_ms);
            let count = |row: &str, v: Option<u64>| one(id, row, l, v.map(|n| n as f64));
            count("burst: kernel writes", Some(f.burst_writes));
            count("burst: WireGuard peers added", f.burst_wg_adds);
            count(
                "burst: WireGuard peer updates and removals",
                Some(f.burst_wg_other),
            );
            count("burst: reconciles", Some(f.burst_reconciles));
            count("burst: processes started", f.burst_procs);
        }
        w(
            "one new Peer to the WireGuard device carrying it (ms)",
            &f.change_ms,
        );
    }
    let sampled = format!(
        "Processes started: the processes whose parent is kg, sampled in /proc every {} ms over \
         the whole run (exec fails under kg's seccomp filter, so none is expected; one that \
         lives shorter than the period could slip through).",
        CHILD_SAMPLE.as_millis()
    );
    report::note(
        id,
        &format!(
            "{sampled} A reconcile applies its WireGuard diff in one UAPI transaction; the burst's \
             WireGuard figures are kg's own `kilo_writes_total{{kind=\"wireguard_peer_*\"}}`; the \
             updates are existing peers whose WireGuard IP moved, as Kilo numbers the locations' \
             WireGuard IPs in location order and each new node here is a location of its own."
        ),
    );

    let id = "start";
    report::table(
        id,
        "Start-up, one agent at a time: from its spawn to the kernel matching its first plan",
        "ms",
    );
    for (l, f) in labels.iter().zip(figs) {
        for (name, up) in [("cold start", &f.cold), ("restart", &f.restart)] {
            let row = format!("{name}: spawn to the kernel matching the plan");
            report::cell(id, &row, l, &[up.spawn_to_match_ms]);
            for (phase, ms) in &up.phases {
                report::cell(id, &format!("{name}: {phase}"), l, &[*ms]);
            }
        }
    }
    report::note(
        id,
        "Each agent is stopped and started again with --clean-up=false, twice: a cold start (the \
         old agent cleans up as it stops, and its pins are removed), then a restart, which finds \
         the first one's pins, WireGuard peers and routes. The phases are kg's own, from its two \
         start-up log lines (target kilo_agent::start_up): building the agent phase by phase \
         (the host name's lookup runs beside the phases before it and is counted for the rest \
         of its wait), then the wait for the first complete snapshot, and the first pass. kg's \
         own total starts where it starts building, after the process and its runtime are up. \
         The node's name (`me`) resolves through the namespace's hosts file, as a node's own \
         name usually does; where it must be asked of a resolver that does not answer, the \
         lookup holds start-up for up to its 2 s bound.",
    );
    let restart = |f: &Figures| f.restart.spawn_to_match_ms;
    report::target(
        "agent: a restart (pins in place) matches its plan within 0.5 s at 3 nodes and 1 s at 1,000 nodes + 1,000 Peers",
        &format!(
            "{:.0} ms at 3 nodes, {:.0} ms at {} (cold starts: {:.0} and {:.0} ms)",
            restart(&figs[0]),
            restart(&figs[2]),
            labels[2],
            figs[0].cold.spawn_to_match_ms,
            figs[2].cold.spawn_to_match_ms
        ),
        report::State::at_full_size(restart(&figs[0]) <= 500.0 && restart(&figs[2]) <= 1_000.0),
    );

    // One change, end to end, against what Kilo spends on the same change.
    let id = "change";
    report::table(
        id,
        "One new Peer: kg's CPU end to end against Kilo's execs (Kilo: reference figures)",
        "see rows",
    );
    for (l, f) in labels.iter().zip(figs) {
        cell(
            id,
            "kg: CPU for the change, plan + diff + writes (ms)",
            l,
            &f.change_cpu_ms,
        );
        one(
            id,
            "kg: processes started",
            l,
            f.change_procs.map(|p| p as f64),
        );
        report::cell(
            id,
            "Kilo (reference): iptables execs per node for +1 node +1 Peer",
            l,
            &[kilo::EXECS_PER_CHANGE],
        );
        report::cell(
            id,
            "Kilo (reference): iptables execs per node per resync",
            l,
            &[kilo::EXECS_PER_RESYNC],
        );
    }
    report::note(
        id,
        "kg: its scheduled CPU time (all threads) from writing the Peer's file until the change \
         is applied (the device carries the peer, then 300 ms for the routes and the datapath), \
         for changes that took exactly one reconcile; only the WireGuard device is watched \
         meanwhile, so kg spends nothing on being observed. Kilo's reference figures, not \
         measured here: docs/kilo-reference.md (Kilo 0.7.0's own iptables \
         controller, counted with a logging shim): about 10 iptables execs on every node for a \
         change of +1 node +1 Peer and 11 per resync (every 30 s), constant in the number of \
         nodes, each exec a process start plus a table dump; on top, a full WireGuard \
         reconfiguration on every leader.",
    );

    // Against Kilo's reference figures.
    let id = "kilo";
    report::table(
        id,
        "kg against Kilo's agent (Kilo's reference figures from a live run of Kilo's agents, \
         not this run)",
        "see rows",
    );
    let (three, mid) = (&figs[0], &figs[1]);
    let (three_idle, mid_idle) = (median(&three.idle_cpu_pct), median(&mid.idle_cpu_pct));
    let row = |name: &str, kilo: f64, ours: Option<f64>| {
        report::cell(id, name, "Kilo (reference)", &[kilo]);
        one(id, name, "kg (this run)", ours);
        if let Some(o) = ours {
            report::cell(id, name, "kg / Kilo", &[o / kilo]);
        }
    };
    let finite = |v: f64| v.is_finite().then_some(v);
    row("RSS at 3 nodes (MB)", kilo::RSS_3_MB, three.rss);
    row(
        "idle CPU at 3 nodes (%)",
        kilo::IDLE_CPU_3_PCT,
        finite(three_idle),
    );
    row(
        "RSS at 54 nodes + 21 Peers (MB; Kilo 37-59)",
        kilo::RSS_54_MB.0,
        mid.rss,
    );
    row(
        "peak RSS at 54 nodes + 21 Peers (MB)",
        kilo::RSS_54_MB.2,
        mid.hwm,
    );
    row(
        "idle CPU at 54 nodes + 21 Peers (%)",
        kilo::IDLE_CPU_54_PCT,
        finite(mid_idle),
    );
    row(
        "70-object burst: time to converge (s)",
        kilo::BURST_70_S,
        Some(mid.burst_ms / 1e3),
    );
    let wg_writes = mid.burst_wg_adds.map(|a| a + mid.burst_wg_other);
    // Not a ratio: Kilo rewrites the whole device each time, kg writes one peer.
    let wg_row = "70-object burst: WireGuard writes per leader (Kilo: full reconfigurations; \
                  kg: peer additions, updates and removals)";
    report::cell(
        id,
        wg_row,
        "Kilo (reference)",
        &[kilo::BURST_70_WG_RECONFIGS],
    );
    one(id, wg_row, "kg (this run)", wg_writes.map(|w| w as f64));
    row(
        "70-object burst: processes per agent",
        kilo::BURST_70_PROCS,
        mid.burst_procs.map(|p| p as f64),
    );
    row(
        "processes per 30 s per idle agent (Kilo: iptables)",
        kilo::IPTABLES_PROCS_PER_30S,
        mid.idle_procs.map(|p| p as f64 * 30.0 / idle_s as f64),
    );
    report::note(
        id,
        &format!(
            "Kilo's reference figures: 3 agents in namespaces, wireguard-go and a real API server \
             on a machine of the same kind (34 MB and 0.03% CPU idle at 3 nodes; 37-59 MB, peak 65 MB, \
             0.40% CPU at 54 nodes + 21 Peers; 6 iptables processes per 30 s per node; a \
             70-object burst converged in 5.4 s with 320 processes per agent and 70 full \
             WireGuard reconfigurations per leader). kg here: the file backend. {sampled}"
        ),
    );

    let memory = match (three.rss, mid.rss) {
        (Some(a), Some(b)) => (
            format!("{a:.1} MB at 3 nodes (Kilo 34), {b:.1} MB at 54 + 21 (Kilo 37-59)"),
            report::State::of(a <= kilo::RSS_3_MB / 2.0 && b <= kilo::RSS_54_MB.0 / 2.0),
        ),
        _ => (
            "RSS not read from /proc".to_owned(),
            report::State::NotMeasured,
        ),
    };
    report::target("agent: at most half Kilo's memory", &memory.0, memory.1);
    report::target(
        "agent: at most a tenth of Kilo's idle CPU",
        &format!(
            "{three_idle:.4}% at 3 nodes (Kilo 0.03%), {mid_idle:.4}% at 54 + 21 (Kilo 0.40%), \
             the median over {} of {} s",
            match three.idle_cpu_pct.len() {
                1 => "one window".to_owned(),
                n => format!("{n} windows"),
            },
            idle.as_secs()
        ),
        if three_idle.is_finite() && mid_idle.is_finite() {
            report::State::of(
                three_idle <= kilo::IDLE_CPU_3_PCT / 10.0
                    && mid_idle <= kilo::IDLE_CPU_54_PCT / 10.0,
            )
        } else {
            report::State::NotMeasured
        },
    );
    report::target(
        "agent: a 70-object burst converged within 0.5 s, each new peer added to WireGuard once",
        &format!(
            "{:.0} ms; {} WireGuard peer additions and {} updates or removals for {} new \
             objects, in {} reconciles (Kilo: 5.4 s, 70 full reconfigurations)",
            mid.burst_ms,
            mid.burst_wg_adds
                .map_or("not measured".to_owned(), |a| a.to_string()),
            mid.burst_wg_other,
            mid.burst,
            mid.burst_reconciles
        ),
        match mid.burst_wg_adds {
            Some(adds) => report::State::of(mid.burst_ms <= 500.0 && adds == u64::from(mid.burst)),
            None => report::State::NotMeasured,
        },
    );
    println!(
        "{:<28} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "shape", "RSS MB", "peak MB", "idle CPU%", "burst ms", "burst CPU", "change ms", "chg CPU"
    );
    for (l, f) in labels.iter().zip(figs) {
        println!(
            "{l:<28} {:>8.1} {:>8.1} {:>10.4} {:>10.0} {:>10.1} {:>10.1} {:>10.2}",
            f.rss.unwrap_or(f64::NAN),
            f.hwm.unwrap_or(f64::NAN),
            median(&f.idle_cpu_pct),
            f.burst_ms,
            f.burst_cpu_ms.unwrap_or(f64::NAN),
            median(&f.change_ms),
            median(&f.change_cpu_ms)
        );
    }
}
