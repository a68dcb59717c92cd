//! The real `kg` binary on the file backend in a throwaway namespace, for tests that provoke
//! faults under it: a wireguard-go device (`--create-interface=false`), a pod bridge, a private
//! bpffs, Peers in the objects directory, its logs collected as they come and its HTTP
//! endpoints read from inside the namespace.
use std::{
    io::{Read as _, Write as _},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
};

use super::{
    agent::{metric, peer_yaml},
    bpffs::BpfFs,
    eventually,
    netns::{NetNs, WgGo, veth},
};

pub struct Kg {
    pub ns: NetNs,
    _gw: NetNs,
    pub wg: WgGo,
    pub bpffs: BpfFs,
    pub dir: tempfile::TempDir,
    pub objects: PathBuf,
    child: Option<Child>,
    log: Arc<Mutex<String>>,
}

/// Peer `i`'s public key (any 32 bytes are a valid WireGuard public key).
pub fn peer_key(i: u8) -> String {
    kilo_agent::mesh::Key([i; 32]).to_string()
}

/// Peer `i`'s allowed IP.
pub fn peer_cidr(i: u8) -> String {
    format!("10.5.0.{i}/32")
}

impl Kg {
    /// Starts kg (`bin`: the test's `CARGO_BIN_EXE_kg`, which the examples sharing this module
    /// do not have) for node `kgtest` (pod CIDR 10.42.1.0/24) with Peers `1..=peers` and `args`
    /// after the common ones, and waits until `/ready` answers 200.
    pub fn start(bin: &str, tag: &str, peers: u8, args: &[&str]) -> Kg {
        let kg = Self::launch(bin, tag, peers, args, true);
        eventually("kg is ready", || kg.get("/ready").0 == 200);
        kg
    }

    /// [`Kg::start`] with the WireGuard device (wireguard-go, a sidecar) not yet running:
    /// `kg.wg.restart(&kg.ns)` starts it. Returns once kg is started, not ready.
    pub fn start_before_device(bin: &str, tag: &str, peers: u8, args: &[&str]) -> Kg {
        Self::launch(bin, tag, peers, args, false)
    }

    fn launch(bin: &str, tag: &str, peers: u8, args: &[&str], device: bool) -> Kg {
        let ns = NetNs::new(tag);
        let gw = NetNs::new(&format!("{tag}g"));
        veth(&ns, "eth0", &gw, "eth0");
        ns.sh("ip addr add 10.9.0.1/24 dev eth0 && ip route add default via 10.9.0.254 dev eth0");
        ns.sh("ip link add kube-bridge type bridge && ip link set kube-bridge up");
        let mut wg = WgGo::start(&ns);
        if !device {
            wg.stop();
        }
        let bpffs = BpfFs::new();
        let dir = tempfile::tempdir().unwrap();
        let objects = dir.path().join("objects");
        std::fs::create_dir(&objects).unwrap();
        std::fs::write(
            objects.join("kgtest.yaml"),
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: kgtest\nspec:\n  podCIDR: 10.42.1.0/24\n",
        )
        .unwrap();
        let mut kg = Kg {
            ns,
            _gw: gw,
            wg,
            bpffs,
            dir,
            objects,
            child: None,
            log: Arc::default(),
        };
        for i in 1..=peers {
            kg.add_peer(i);
        }
        let mut child = Command::new("ip")
            .args(["netns", "exec", &kg.ns.name, bin])
            .args([
                "--backend=file".to_string(),
                format!("--backend-dir={}", kg.objects.display()),
                "--hostname=kgtest".into(),
                format!("--private-key={}", kg.dir.path().join("key").display()),
                format!("--interface={}", kg.wg.name),
                "--create-interface=false".into(),
                format!("--bpffs-dir={}", kg.bpffs.pin_dir("kilo").display()),
                "--cni=false".into(),
                "--listen=127.0.0.1:1107".into(),
            ])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Drained as it comes (a full pipe would block kg), readable while kg runs.
        let mut stderr = child.stderr.take().unwrap();
        let log = kg.log.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                log.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        kg.child = Some(child);
        kg
    }

    pub fn add_peer(&self, i: u8) {
        std::fs::write(
            self.objects.join(format!("peer{i}.yaml")),
            peer_yaml(&format!("peer{i}"), peer_key(i), &peer_cidr(i)),
        )
        .unwrap();
    }

    pub fn remove_peer(&self, i: u8) {
        std::fs::remove_file(self.objects.join(format!("peer{i}.yaml"))).unwrap();
    }

    /// GET `path` on kg's listener: (status, body); status 0 when nothing answers.
    pub fn get(&self, path: &str) -> (u16, String) {
        self.ns.run(|| {
            let Ok(mut s) = std::net::TcpStream::connect("127.0.0.1:1107") else {
                return (0, String::new());
            };
            let _ = write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: kg\r\nConnection: close\r\n\r\n"
            );
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            let status = out
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
            (status, body)
        })
    }

    /// The value of `series` (name and labels, exactly) on `/metrics`.
    pub fn metric(&self, series: &str) -> u64 {
        let text = self.get("/metrics").1;
        metric(&text, series).unwrap_or_else(|| panic!("no {series} in {text}"))
    }

    /// `kilo_reconcile_triggers_total{cause}` summed over every cause but `check_in`, and
    /// `kilo_reconciles_total`.
    pub fn reconciles(&self) -> u64 {
        self.metric("kilo_reconciles_total")
    }

    pub fn errors(&self, event: &str) -> u64 {
        let text = self.get("/metrics").1;
        metric(&text, &format!("kilo_errors_total{{event=\"{event}\"}}")).unwrap_or(0)
    }

    pub fn triggers(&self, cause: &str) -> u64 {
        self.metric(&format!(
            "kilo_reconcile_triggers_total{{cause=\"{cause}\"}}"
        ))
    }

    /// The log lines so far (JSON, one per line).
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// How many log lines so far contain `needle`.
    pub fn logged(&self, needle: &str) -> usize {
        self.log().lines().filter(|l| l.contains(needle)).count()
    }

    /// Runs `cmd` in kg's namespace; panics if it fails.
    pub fn sh(&self, cmd: &str) -> String {
        self.ns.sh(cmd)
    }

    /// The WireGuard device's peers (public keys).
    pub fn wg_peers(&self) -> Vec<String> {
        let out = self.ns.try_sh(&format!("wg show {} peers", self.wg.name));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Our routes (protocol 107), as `ip route` prints them.
    pub fn routes(&self) -> String {
        self.ns.sh("ip route show proto 107")
    }

    /// kg's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Stops kg with SIGTERM; returns its log after checking it exited 0.
    pub fn stop(&mut self) -> String {
        if let Some(mut child) = self.child.take() {
            // SAFETY: a signal to our own child (kg itself: `ip netns exec` execs it).
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let status = child.wait().unwrap();
            // The drain ends with the pipe.
            std::thread::sleep(std::time::Duration::from_millis(100));
            assert!(status.success(), "kg exited with {status}:\n{}", self.log());
        }
        // Shown with --nocapture (captured otherwise).
        eprintln!("kg's log:\n{}", self.log());
        self.log()
    }
}

impl Drop for Kg {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kg's log:\n{}", self.log());
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
