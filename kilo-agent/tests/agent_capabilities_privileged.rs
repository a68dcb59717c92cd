//! Least privilege, with the real `kg` started under `setpriv` with reduced capability sets in
//! a namespace (file backend, wireguard-go, the eBPF datapath on a private bpffs):
//!
//! - with the DaemonSet's set (plus SETPCAP and a stray CHOWN), every thread keeps only the
//!   steady-state set in its effective, permitted and bounding sets after start-up, and the mesh
//!   still reconciles: a Peer added later reaches WireGuard, an interface appearing later (and
//!   one recreated under its pinned link) gets the program;
//! - restarted without SYS_ADMIN on the mounted bpffs, kg adopts the pinned datapath;
//! - without PERFMON it says at start which capability is missing, and fails to load;
//! - the private key (0600) is in none of the debug logs, /metrics, /graph, `kgctl showconf` or
//!   `kgctl graph`; no pin or pin directory is writable by group or others.
use kilo_testkit as support;

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use kilo_agent::agent::caps;
use support::{
    agent::peer_yaml,
    bpffs::BpfFs,
    eventually,
    kg::{Kg, Launch},
    netns::{NetNs, WgGo, veth},
};

struct Node {
    ns: NetNs,
    _gw: NetNs,
    wg: WgGo,
    bpffs: BpfFs,
    dir: tempfile::TempDir,
}

impl Node {
    fn new() -> Node {
        let ns = NetNs::new("priv");
        let gw = NetNs::new("privg");
        veth(&ns, "eth0", &gw, "eth0");
        ns.sh("ip addr add 10.9.0.1/24 dev eth0 && ip link add kube-bridge type bridge && ip link set kube-bridge up");
        let wg = WgGo::start(&ns);
        let dir = tempfile::Builder::new()
            .prefix("privilege-")
            .tempdir()
            .unwrap();
        let objects = dir.path().join("objects");
        std::fs::create_dir(&objects).unwrap();
        std::fs::write(
            objects.join("n1.yaml"),
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\nspec:\n  podCIDR: 10.42.1.0/24\n",
        )
        .unwrap();
        std::fs::write(
            objects.join("laptop.yaml"),
            peer_yaml(
                "laptop",
                "a2V5OQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
                "10.5.0.1/32",
            ),
        )
        .unwrap();
        Node {
            ns,
            _gw: gw,
            wg,
            bpffs: BpfFs::new(),
            dir,
        }
    }

    fn objects(&self) -> PathBuf {
        self.dir.path().join("objects")
    }

    fn pins(&self) -> PathBuf {
        self.bpffs.pin_dir("kilo")
    }

    fn log(&self, run: usize) -> PathBuf {
        self.dir.path().join(format!("kg{run}.log"))
    }

    /// Starts kg with `caps` (setpriv's syntax: `+net_admin,+bpf`) as its bounding set, hence
    /// (as root) its permitted and effective sets.
    fn start(&self, run: usize, caps: &str) -> Kg {
        Launch::kg()
            .netns(&self.ns.name)
            .wrap([
                "setpriv".to_string(),
                "--inh-caps=-all".into(),
                format!("--bounding-set=-all,{caps}"),
                "--".into(),
            ])
            .args([
                "--backend=file",
                &format!("--backend-dir={}", self.objects().display()),
                "--hostname=n1",
                "--create-interface=false",
                &format!("--interface={}", self.wg.name),
                "--datapath-interface=kube-bridge",
                "--datapath-interface=late0",
                "--cni=false",
                "--clean-up=false",
                &format!(
                    "--private-key={}",
                    self.dir.path().join("state/key").display()
                ),
                &format!("--bpffs-dir={}", self.pins().display()),
                "--listen=127.0.0.1:1107",
                "--log-format=text",
                "--log-level=debug",
                "--resync-period=1s",
            ])
            .log_file(self.log(run))
            .kill_on_drop()
            .spawn()
    }

    fn read_log(&self, run: usize) -> String {
        std::fs::read_to_string(self.log(run)).unwrap_or_default()
    }

    fn get(&self, path: &str) -> String {
        let out = self
            .ns
            .try_sh(&format!("busybox wget -q -O - http://127.0.0.1:1107{path}"));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn peers(&self) -> String {
        self.ns.sh(&format!("wg show {} peers", self.wg.name))
    }
}

/// Every thread's `field` set (`CapEff`...) of process `pid`.
fn thread_sets(pid: u32, field: &str) -> Vec<(String, u64)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| {
            let t = t.ok()?;
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            Some((comm.trim().to_string(), caps::set(&status, field)?))
        })
        .collect()
}

fn steady_state() -> u64 {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    caps::steady_state(true, release.trim())
}

/// Every path under `dir` (itself included).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_owned()];
    if dir.is_dir() {
        for e in std::fs::read_dir(dir).unwrap() {
            out.extend(walk(&e.unwrap().path()));
        }
    }
    out
}

#[test]
fn kg_drops_what_start_up_needed_and_keeps_reconciling() {
    if !support::require_root("kg_drops_what_start_up_needed_and_keeps_reconciling") {
        return;
    }
    let node = Node::new();
    let kg = node.start(1, "+net_admin,+bpf,+perfmon,+sys_admin,+setpcap,+chown");
    eventually("kg drops its capabilities and reconciles", || {
        let log = node.read_log(1);
        log.contains("capabilities dropped") && log.contains("reconciled")
    });
    let keep = steady_state();
    let pid = kg.pid();
    for field in ["CapEff", "CapPrm", "CapBnd"] {
        let sets = thread_sets(pid, field);
        assert!(sets.len() > 1, "kg runs several threads: {sets:?}");
        for (thread, set) in sets {
            assert_eq!(
                set,
                keep,
                "{field} of thread {thread}: {:?}",
                caps::names(set)
            );
        }
    }
    let log = node.read_log(1);
    assert!(log.contains("\"CAP_SYS_ADMIN\", \"CAP_PERFMON\""), "{log}");
    assert!(log.contains("bounding_set=true"), "{log}");

    // The mesh still reconciles: a Peer added now reaches WireGuard...
    assert!(node.peers().contains("a2V5OQ"), "{}", node.peers());
    std::fs::write(
        node.objects().join("phone.yaml"),
        peer_yaml(
            "phone",
            "cGhvbmUAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            "10.5.0.2/32",
        ),
    )
    .unwrap();
    eventually("the new peer is configured", || {
        node.peers().contains("cGhvbmUA")
    });
    // ... an interface appearing now gets the program (its link is pinned once attached) ...
    let late = node.pins().join("links/late0");
    node.ns
        .sh("ip link add late0 type veth peer name late1 && ip link set late0 up");
    eventually("late0 gets the program", || late.exists());
    // ... and so does one recreated under the pin of its old link.
    node.ns.sh(
        "ip link del late0 && ip link add late0 type veth peer name late1 && ip link set late0 up",
    );
    eventually("the recreated late0 gets the program", || {
        node.read_log(1).contains("stale link pin, attaching anew") && late.exists()
    });
    let errors = node.get("/metrics");
    assert!(errors.contains("kilo_reconciles_total"), "{errors}");
    assert!(
        !errors.contains("kilo_errors_total{"),
        "errors counted: {errors}"
    );

    // No pin or pin directory is writable by group or others.
    for path in walk(&node.pins()) {
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o022, 0, "{} has mode {mode:o}", path.display());
    }

    // The private key (0600) appears in no output: debug logs, metrics, graph, kgctl.
    let key_path = node.dir.path().join("state/key");
    let mode = std::fs::metadata(&key_path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let private = std::fs::read_to_string(&key_path).unwrap();
    let private = private.trim();
    assert_eq!(private.len(), 44, "a base64 key");
    let kgctl = |args: &[&str]| {
        let out = Launch::kgctl()
            .args(["--backend=file", "--backend-dir"])
            .arg(node.objects())
            .args(args)
            .output();
        assert!(out.status.success(), "kgctl {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let outputs = [
        ("/metrics", node.get("/metrics")),
        ("/graph", node.get("/graph")),
        ("/graph?format=dot", node.get("/graph?format=dot")),
        ("kgctl showconf node", kgctl(&["showconf", "node", "n1"])),
        (
            "kgctl showconf peer",
            kgctl(&["showconf", "peer", "laptop"]),
        ),
        ("kgctl graph", kgctl(&["graph"])),
    ];
    for (what, text) in &outputs {
        assert!(!text.is_empty(), "{what} printed nothing");
        assert!(!text.contains(private), "the private key in {what}");
    }
    assert!(
        outputs[3].1.contains("PublicKey"),
        "showconf node: {}",
        outputs[3].1
    );
    drop(kg);
    let log = node.read_log(1);
    assert!(log.contains("DEBUG"), "debug logs: {log}");
    assert!(!log.contains(private), "the private key in the logs");

    // Restarted without SYS_ADMIN (bpffs is mounted): adopts the pinned datapath, moving each
    // link to its program since it cannot read which one runs.
    let kg = node.start(2, "+net_admin,+bpf,+perfmon");
    eventually("the restarted kg reconciles", || {
        node.read_log(2).contains("reconciled")
    });
    let log = node.read_log(2);
    assert!(!log.contains("capability missing"), "{log}");
    assert!(log.contains("link_update=3"), "{log}");
    assert!(!log.contains("could not apply"), "{log}");
    for (thread, set) in thread_sets(kg.pid(), "CapEff") {
        assert_eq!(set, keep, "CapEff of thread {thread}");
    }
}

#[test]
fn kg_names_the_capability_it_misses() {
    if !support::require_root("kg_names_the_capability_it_misses") {
        return;
    }
    let node = Node::new();
    // SYS_ADMIN would stand in for PERFMON (and BPF).
    let mut kg = node.start(1, "+net_admin,+bpf");
    let mut status = None;
    eventually("kg exits", || {
        status = kg.try_wait();
        status.is_some()
    });
    let status = status.unwrap();
    let log = node.read_log(1);
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("capability missing capability=\"CAP_PERFMON\""),
        "{log}"
    );
    assert!(!log.contains("capability=\"CAP_BPF\""), "{log}");
}
