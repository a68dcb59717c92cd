//! The demo's mesh (`xtask/scripts/mesh.sh up`) for tests that start `kg` themselves: three
//! nodes in two locations, a pod behind a bridge on each, wireguard-go devices, an "internet"
//! host at 192.168.50.100, the Node objects in `objects/`. Removed (wireguard-go ended by PID,
//! namespaces deleted) on drop.
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use super::netns::{run_in, try_sh};

pub struct DemoMesh {
    /// The namespaces' prefix: `<prefix>-n1`, `<prefix>-pod1`, `<prefix>-inet`, ...
    pub prefix: String,
    /// The WireGuard interfaces' prefix: node `i`'s is `<wg><i>`.
    pub wg: String,
    pub work: tempfile::TempDir,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/scripts/mesh.sh")
}

impl DemoMesh {
    /// Builds the mesh; `tag` keeps the names of concurrent tests apart.
    pub fn up(tag: &str) -> DemoMesh {
        let pid = std::process::id();
        let mesh = DemoMesh {
            prefix: format!("krs-{tag}{pid}"),
            wg: format!("k{tag}{}-", pid % 100_000),
            work: tempfile::tempdir().unwrap(),
        };
        let out = mesh.script("up");
        assert!(
            out.status.success(),
            "mesh.sh up: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        mesh
    }

    fn script(&self, action: &str) -> Output {
        Command::new("bash")
            .arg(script())
            .arg(action)
            .env("KRS_DEMO_PREFIX", &self.prefix)
            .env("KRS_DEMO_WG", &self.wg)
            .env("KRS_DEMO_WORK", self.work.path())
            .output()
            .expect("run mesh.sh")
    }

    /// The full name of namespace `ns` (`n1`, `pod3`, `inet`, ...).
    pub fn ns(&self, ns: &str) -> String {
        format!("{}-{ns}", self.prefix)
    }

    /// Node `i`'s WireGuard interface (1-based).
    pub fn wg(&self, i: usize) -> String {
        format!("{}{i}", self.wg)
    }

    /// Runs a shell command in namespace `ns`, whatever its status.
    pub fn try_sh(&self, ns: &str, cmd: &str) -> Output {
        try_sh(&format!("ip netns exec {} sh -c '{cmd}'", self.ns(ns)))
    }

    /// Runs a shell command in namespace `ns`; panics with its output if it fails.
    pub fn sh(&self, ns: &str, cmd: &str) -> String {
        let out = self.try_sh(ns, cmd);
        assert!(
            out.status.success(),
            "{ns}: `{cmd}` failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Whether `from` (a namespace) pings `to`: one reply of two, a second apart, suffices.
    pub fn pings(&self, from: &str, to: &str) -> bool {
        self.try_sh(from, &format!("busybox ping -c2 -W1 {to}"))
            .status
            .success()
    }

    /// Runs `f` in namespace `ns`.
    pub fn run<T: Send>(&self, ns: &str, f: impl FnOnce() -> T + Send) -> T {
        run_in(&self.ns(ns), f)
    }

    /// The Node objects' YAML, one per node, in node order.
    pub fn node_yaml(&self) -> Vec<String> {
        (1..=3)
            .map(|i| {
                std::fs::read_to_string(self.work.path().join(format!("objects/node-n{i}.yaml")))
                    .unwrap()
            })
            .collect()
    }
}

impl Drop for DemoMesh {
    fn drop(&mut self) {
        self.script("down");
    }
}
