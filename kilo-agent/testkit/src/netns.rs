//! Throwaway network namespaces (`ip netns`), removed on drop on every path, and wireguard-go
//! devices in them.
//!
//! Tests may run tools (`ip`, `ping`, `nft`); the agent itself never does.
use std::{
    fs::File,
    os::fd::AsRawFd,
    path::Path,
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use kilo_agent::reconcile::wireguard::uapi_socket;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A named network namespace that exists until dropped.
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    /// Creates `krs-<tag>-<pid>-<n>` with loopback up.
    pub fn new(tag: &str) -> Self {
        let name = format!(
            "krs-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        sh(&format!("ip netns add {name}"));
        let ns = NetNs { name };
        ns.sh("ip link set lo up");
        ns
    }

    /// Runs a shell command inside the namespace and panics with its output if it fails.
    pub fn sh(&self, cmd: &str) -> String {
        sh(&format!("ip netns exec {} sh -c '{}'", self.name, cmd))
    }

    /// Runs a shell command inside the namespace and returns its output whatever the status.
    pub fn try_sh(&self, cmd: &str) -> Output {
        try_sh(&format!("ip netns exec {} sh -c '{}'", self.name, cmd))
    }

    /// Runs `f` on a fresh thread that has entered this namespace (for netlink, BPF, sockets);
    /// `f` may borrow from the caller.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        run_in(&self.name, f)
    }

    /// Enters this namespace on the current thread for good (for dedicated threads/runtimes).
    pub fn enter_current_thread(&self) {
        enter(&format!("/run/netns/{}", self.name));
    }
}

impl NetNs {
    /// The `/etc/hosts` of what `ip netns exec` runs in this namespace (it mounts
    /// `/etc/netns/NAME/hosts` over it): `text`. Removed with the namespace.
    pub fn hosts(&self, text: &str) {
        let dir = Path::new("/etc/netns").join(&self.name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hosts"), text).unwrap();
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = try_sh(&format!("ip netns del {}", self.name));
        let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(&self.name));
    }
}

/// [`NetNs::run`] in the namespace named `name` (one this test made by other means).
pub fn run_in<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = format!("/run/netns/{name}");
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(&path);
            f()
        })
        .join()
        .expect("thread in namespace panicked")
    })
}

fn enter(path: &str) {
    let file = File::open(path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    // SAFETY: a valid namespace fd; affects only the calling thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
}

/// Joins two namespaces with a veth pair: `a_if` in `a`, `b_if` in `b`, both up.
pub fn veth(a: &NetNs, a_if: &str, b: &NetNs, b_if: &str) {
    let tmp = format!("krs{}", NEXT.fetch_add(1, Ordering::Relaxed));
    sh(&format!(
        "ip link add {tmp}a type veth peer name {tmp}b && \
         ip link set {tmp}a netns {} && ip link set {tmp}b netns {}",
        a.name, b.name
    ));
    a.sh(&format!(
        "ip link set {tmp}a name {a_if} && ip link set {a_if} up"
    ));
    b.sh(&format!(
        "ip link set {tmp}b name {b_if} && ip link set {b_if} up"
    ));
}

pub fn sh(cmd: &str) -> String {
    let out = try_sh(cmd);
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn try_sh(cmd: &str) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{cmd}`: {e}"))
}

/// A wireguard-go device in a namespace, stopped (and its socket removed) on drop.
pub struct WgGo {
    pub name: String,
    child: Child,
}

impl WgGo {
    /// Starts `kt<pid>x<n>` in `ns` and returns once its UAPI socket answers.
    pub fn start(ns: &NetNs) -> WgGo {
        let name = device_name();
        let child = spawn_wg(ns, &name);
        WgGo { name, child }
    }

    /// Starts the device again in `ns` (a sidecar restarted after its device went away).
    pub fn restart(&mut self, ns: &NetNs) {
        self.stop();
        self.child = spawn_wg(ns, &self.name);
    }

    /// Stops the device: wireguard-go ends, and its interface and socket go with it.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(uapi_socket(&self.name));
    }
}

/// A WireGuard device name of this process, `kt<pid>x<n>`, unique within it.
pub fn device_name() -> String {
    format!(
        "kt{}x{}",
        std::process::id() % 100_000,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Runs wireguard-go for device `name` in `ns` and returns once its UAPI socket answers.
fn spawn_wg(ns: &NetNs, name: &str) -> Child {
    let child = Command::new("ip")
        .args(["netns", "exec", &ns.name, "wireguard-go", "-f", name])
        .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start wireguard-go");
    let sock = uapi_socket(name);
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "wireguard-go did not create {}",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

impl Drop for WgGo {
    fn drop(&mut self) {
        self.stop();
    }
}
