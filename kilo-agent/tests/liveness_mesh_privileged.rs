//! Mesh tier, liveness: three real `kg` agents (file backend, wireguard-go, the eBPF datapath)
//! in network namespaces, two locations (n1 and n2 in east, n3 in west), with short check-in
//! and resync periods.
//!
//! - Idle, for several check-in periods: once converged, more than three check-in windows pass
//!   with nothing changing: no kernel write and no error counted, no change of leader, every
//!   agent keeps all three nodes (its plan never goes missing).
//! - Death: the east leader n1 is SIGKILLed (no clean-up); not before its heartbeat runs out,
//!   n2 takes east over and n3 drops it, and then nothing changes; restarted, n1 is back (and
//!   leads east again) after its first heartbeat.
//! - Disconnection: the shared directory is renamed away for several windows: nobody is
//!   dropped and nothing is written; once it is back, the mesh carries on unchanged.
//!
//! Counters and roles are read from each agent's own `/metrics`.
use kilo_testkit as support;

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use support::{
    bpffs::BpfFs,
    kg::{Kg, Launch},
    metrics::metric_sum,
    netns::{NetNs, WgGo, veth},
};

const NODES: usize = 3;

/// What one agent's `/metrics` says.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    nodes: u64,
    leader: u64,
    writes: u64,
    errors: u64,
}

struct Mesh {
    nodes: Vec<NetNs>,
    _under: NetNs,
    wireguard: Vec<WgGo>,
    kg: Vec<Option<Kg>>,
    objects: PathBuf,
    work: tempfile::TempDir,
    bpffs: BpfFs,
    period: u64,
}

impl Mesh {
    fn new(period: u64) -> Mesh {
        let under = NetNs::new("lvu");
        under.sh("ip link add br0 type bridge && ip link set br0 up");
        let work = tempfile::tempdir().unwrap();
        let objects = work.path().join("objects");
        std::fs::create_dir(&objects).unwrap();
        let mut nodes = Vec::new();
        let mut wireguard = Vec::new();
        for i in 1..=NODES {
            let ns = NetNs::new("lvn");
            veth(&ns, "eth0", &under, &format!("p{i}"));
            under.sh(&format!("ip link set p{i} master br0"));
            ns.sh(&format!("ip addr add 192.168.60.{i}/24 dev eth0"));
            wireguard.push(WgGo::start(&ns));
            let location = if i == 3 { "west" } else { "east" };
            std::fs::write(
                objects.join(format!("n{i}.yaml")),
                format!(
                    "apiVersion: v1\nkind: Node\nmetadata:\n  name: n{i}\n  annotations:\n    kilo.squat.ai/location: {location}\nspec:\n  podCIDR: 10.43.{i}.0/24\n"
                ),
            )
            .unwrap();
            nodes.push(ns);
        }
        let mut mesh = Mesh {
            nodes,
            _under: under,
            wireguard,
            kg: (0..NODES).map(|_| None).collect(),
            objects,
            work,
            bpffs: BpfFs::new(),
            period,
        };
        for i in 0..NODES {
            mesh.start(i);
        }
        mesh
    }

    /// Starts `kg` on node `i` (0-based), logging to `kg-n<i+1>.log`.
    fn start(&mut self, i: usize) {
        let kg = Launch::kg()
            .netns(&self.nodes[i].name)
            .args([
                "--backend=file",
                &format!("--backend-dir={}", self.objects.display()),
                &format!("--hostname=n{}", i + 1),
                "--create-interface=false",
                &format!("--interface={}", self.wireguard[i].name),
                "--encapsulate=never",
                // Not Kilo as the CNI here: the host's /etc/cni stays untouched.
                "--cni=false",
                &format!(
                    "--private-key={}",
                    self.work.path().join(format!("n{i}.key")).display()
                ),
                &format!(
                    "--bpffs-dir={}",
                    self.bpffs.pin_dir(&format!("n{i}")).display()
                ),
                "--listen=127.0.0.1:1107",
                "--resync-period=1s",
                &format!("--check-in-period={}s", self.period),
                "--log-format=text",
            ])
            .append_log(self.log_path(i))
            .kill_on_drop()
            .spawn();
        self.kg[i] = Some(kg);
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.work.path().join(format!("kg-n{}.log", i + 1))
    }

    fn logs(&self) -> String {
        self.logs_after(&[0; NODES])
    }

    fn log_lengths(&self) -> Vec<usize> {
        (0..NODES)
            .map(|i| std::fs::metadata(self.log_path(i)).map_or(0, |m| m.len() as usize))
            .collect()
    }

    /// What the agents logged past `lengths`.
    fn logs_after(&self, lengths: &[usize]) -> String {
        (0..NODES)
            .map(|i| {
                let log = std::fs::read(self.log_path(i)).unwrap_or_default();
                String::from_utf8_lossy(&log[lengths[i].min(log.len())..]).into_owned()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Node `i`'s metrics, `None` while it does not answer.
    fn seen(&self, i: usize) -> Option<Seen> {
        let out = self.nodes[i].try_sh("busybox wget -q -O - http://127.0.0.1:1107/metrics");
        if !out.status.success() {
            return None;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let sum = |name: &str| metric_sum(&text, name);
        Some(Seen {
            nodes: sum("kilo_nodes"),
            leader: sum("kilo_leader"),
            writes: sum("kilo_writes_total"),
            errors: sum("kilo_errors_total"),
        })
    }

    fn all(&self, alive: &[usize]) -> Vec<Seen> {
        alive
            .iter()
            .map(|&i| {
                self.seen(i)
                    .unwrap_or_else(|| panic!("n{} does not answer", i + 1))
            })
            .collect()
    }

    /// Waits until the agents `alive` each see `nodes` nodes and the leaders are `leaders`,
    /// and their write counters have stood still for a second.
    fn converge(&self, alive: &[usize], nodes: u64, leaders: &[usize]) -> Vec<Seen> {
        let roles = |s: &[Seen]| {
            alive
                .iter()
                .zip(s)
                .all(|(i, s)| s.nodes == nodes && (s.leader == 1) == leaders.contains(i))
        };
        let mut last = Vec::new();
        let start = Instant::now();
        loop {
            let now: Vec<_> = alive.iter().filter_map(|&i| self.seen(i)).collect();
            if now.len() == alive.len() && roles(&now) && now == last {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no convergence to {nodes} nodes, leaders {leaders:?}: {now:?}\n{}",
                self.logs()
            );
            last = now;
            std::thread::sleep(Duration::from_millis(1000));
        }
        last
    }

    /// Watches the agents `alive` for `windows` check-in windows: every scrape must equal
    /// `baseline` (same nodes, same roles, not one write or error more).
    fn stays(&self, alive: &[usize], baseline: &[Seen], windows: u64) {
        let until = Instant::now() + Duration::from_secs(2 * self.period * windows);
        while Instant::now() < until {
            let now = self.all(alive);
            assert_eq!(
                now,
                baseline,
                "period {} s: something changed while idle\n{}",
                self.period,
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn kill(&mut self, i: usize) {
        self.kg[i].take().unwrap().kill();
    }

    /// SIGTERM to every agent (they clean up), then waits for them.
    fn stop(&mut self) {
        for kg in self.kg.iter_mut().flatten() {
            kg.signal(libc::SIGTERM);
        }
        for mut kg in self.kg.drain(..).flatten() {
            kg.wait();
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.stop();
    }
}

#[test]
fn idle_agents_keep_their_mesh_and_a_dead_one_is_dropped_then_back() {
    if !support::require_root("idle_agents_keep_their_mesh_and_a_dead_one_is_dropped_then_back") {
        return;
    }
    let everyone = [0, 1, 2];
    for period in [1, 2] {
        let mut mesh = Mesh::new(period);
        let baseline = mesh.converge(&everyone, 3, &[0, 2]);
        let lengths = mesh.log_lengths();
        mesh.stays(&everyone, &baseline, 3);
        let logs = mesh.logs_after(&lengths);
        assert!(!logs.contains("no plan"), "{logs}");
        assert!(!logs.contains("not alive"), "{logs}");
        if period > 1 {
            continue;
        }

        // Death of the east leader.
        mesh.kill(0);
        let killed = Instant::now();
        let survivors = [1, 2];
        // Its last heartbeat is at most one period old: for one more period it is alive.
        loop {
            let now = mesh.all(&survivors);
            if killed.elapsed() >= Duration::from_millis(period * 1000 - 100) {
                break;
            }
            assert_eq!(now, baseline[1..], "n1 dropped before its window ran out");
            std::thread::sleep(Duration::from_millis(100));
        }
        let without = mesh.converge(&survivors, 2, &[1, 2]);
        assert_eq!(without[1].leader, 1, "n3 still leads west");
        mesh.stays(&survivors, &without, 2);

        // Back after its first heartbeat.
        mesh.start(0);
        mesh.converge(&everyone, 3, &[0, 2]);

        // The directory unreadable for several windows: nobody expires, nothing is written.
        let settled = mesh.converge(&everyone, 3, &[0, 2]);
        let away = mesh.work.path().join("away");
        std::fs::rename(&mesh.objects, &away).unwrap();
        let outage = Instant::now() + Duration::from_secs(2 * period * 3);
        while Instant::now() < outage {
            let now = mesh.all(&everyone);
            for (s, before) in now.iter().zip(&settled) {
                assert_eq!(
                    (s.nodes, s.leader, s.writes),
                    (before.nodes, before.leader, before.writes),
                    "changed during the outage\n{}",
                    mesh.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        std::fs::rename(&away, &mesh.objects).unwrap();
        // Errors were counted (the outage once, failed heartbeats); from here on, none.
        let after = mesh.converge(&everyone, 3, &[0, 2]);
        for (s, before) in after.iter().zip(&settled) {
            assert_eq!(s.writes, before.writes, "{}", mesh.logs());
        }
        mesh.stays(&everyone, &after, 2);
        mesh.stop();
    }
}
