//! Starting `kg` (or `kgctl`, or a tool beside them) in tests and benchmarks, one way:
//! [`Launch`] builds the command (namespace, a wrapper such as `setpriv`, flags, environment,
//! where stderr goes, stdin and stdout), [`Kg`] is the running process (its log, its HTTP
//! endpoints, signals by PID, its exit status; stopped on drop). [`Solo`] is the real `kg` on
//! the file backend alone in a throwaway namespace, for tests that provoke faults under it: a
//! wireguard-go device (`--create-interface=false`), a pod bridge, a private bpffs, Peers in
//! the objects directory.
use std::{
    ffi::OsString,
    io::{Read as _, Write as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use super::{
    agent::peer_yaml,
    bpffs::BpfFs,
    eventually, metrics,
    netns::{NetNs, WgGo, run_in, veth},
};

/// The `kg` or `kgctl` of this build: in `KILO_BENCH_KG`'s directory (`cargo xtask bench`
/// sets it), else beside the directory of the running test or benchmark (`target/<profile>/`,
/// for `target/<profile>/deps/<test>` and `target/<profile>/examples/<bench>`), where cargo
/// builds kilo-agent's binaries for its integration tests. The kit is a library, so cargo's
/// `CARGO_BIN_EXE_*` (set only when compiling an integration test) never reaches it.
pub fn binary(name: &str) -> PathBuf {
    if let Some(kg) = std::env::var_os("KILO_BENCH_KG") {
        return Path::new(&kg).with_file_name(name);
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join(name)
}

/// Where the process's stderr goes.
enum LogTo {
    /// Collected as it comes, readable while it runs.
    Memory,
    File {
        path: PathBuf,
        append: bool,
    },
}

/// A command line for `kg` (or another program) to [`spawn`](Launch::spawn) or to
/// [`output`](Launch::output).
pub struct Launch {
    program: PathBuf,
    ns: Option<String>,
    wrapper: Vec<OsString>,
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    log: LogTo,
    stdin: Option<Stdio>,
    stdout: Option<Stdio>,
    drop_signal: i32,
}

impl Launch {
    /// This build's `kg`.
    pub fn kg() -> Launch {
        Launch::program(binary("kg"))
    }

    /// This build's `kgctl`.
    pub fn kgctl() -> Launch {
        Launch::program(binary("kgctl"))
    }

    /// Any program (a tool the test runs beside kg), by path or by name on `$PATH`.
    pub fn program(program: impl Into<PathBuf>) -> Launch {
        Launch {
            program: program.into(),
            ns: None,
            wrapper: Vec::new(),
            args: Vec::new(),
            env: Vec::new(),
            log: LogTo::Memory,
            stdin: None,
            stdout: None,
            drop_signal: libc::SIGTERM,
        }
    }

    /// Runs it in the network namespace `name` (`ip netns exec` execs it: the PID is its own).
    pub fn netns(mut self, name: &str) -> Launch {
        self.ns = Some(name.to_owned());
        self
    }

    /// Runs it under `wrapper` (a command that execs the rest, such as `setpriv ... --`).
    pub fn wrap<S: Into<OsString>>(mut self, wrapper: impl IntoIterator<Item = S>) -> Launch {
        self.wrapper.extend(wrapper.into_iter().map(Into::into));
        self
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Launch {
        self.args.push(arg.into());
        self
    }

    pub fn args<S: Into<OsString>>(mut self, args: impl IntoIterator<Item = S>) -> Launch {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Launch {
        self.env.push((key.into(), Some(value.into())));
        self
    }

    /// Leaves `key` out of its environment.
    pub fn env_remove(mut self, key: impl Into<OsString>) -> Launch {
        self.env.push((key.into(), None));
        self
    }

    /// Writes stderr to `path` (created anew; default: collected in memory).
    pub fn log_file(mut self, path: impl Into<PathBuf>) -> Launch {
        self.log = LogTo::File {
            path: path.into(),
            append: false,
        };
        self
    }

    /// Appends stderr to `path` (one log across restarts).
    pub fn append_log(mut self, path: impl Into<PathBuf>) -> Launch {
        self.log = LogTo::File {
            path: path.into(),
            append: true,
        };
        self
    }

    /// Its stdin (default: inherited).
    pub fn stdin(mut self, stdin: Stdio) -> Launch {
        self.stdin = Some(stdin);
        self
    }

    /// Its stdout (default: discarded).
    pub fn stdout(mut self, stdout: Stdio) -> Launch {
        self.stdout = Some(stdout);
        self
    }

    /// SIGKILL rather than SIGTERM if it still runs when dropped (no clean-up).
    pub fn kill_on_drop(mut self) -> Launch {
        self.drop_signal = libc::SIGKILL;
        self
    }

    fn command(&self) -> Command {
        let mut argv: Vec<OsString> = match &self.ns {
            Some(ns) => ["ip", "netns", "exec", ns].map(OsString::from).into(),
            None => Vec::new(),
        };
        argv.extend(self.wrapper.iter().cloned());
        argv.push(self.program.clone().into());
        argv.extend(self.args.iter().cloned());
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]);
        for (key, value) in &self.env {
            match value {
                Some(v) => cmd.env(key, v),
                None => cmd.env_remove(key),
            };
        }
        cmd
    }

    /// Runs it to completion: its exit status, stdout and stderr.
    pub fn output(self) -> Output {
        let mut cmd = self.command();
        if let Some(stdin) = self.stdin {
            cmd.stdin(stdin);
        }
        cmd.output()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.program.display()))
    }

    /// Starts it.
    pub fn spawn(self) -> Kg {
        let mut cmd = self.command();
        cmd.stdout(self.stdout.unwrap_or_else(Stdio::null));
        if let Some(stdin) = self.stdin {
            cmd.stdin(stdin);
        }
        let log = match &self.log {
            LogTo::Memory => {
                cmd.stderr(Stdio::piped());
                None
            }
            LogTo::File { path, append } => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(*append)
                    .truncate(!*append)
                    .open(path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                cmd.stderr(file);
                Some(path.clone())
            }
        };
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.program.display()));
        let log = match log {
            Some(path) => Log::File(path),
            None => {
                // Drained as it comes (a full pipe would block the process).
                let mut stderr = child.stderr.take().unwrap();
                let text = Arc::<Mutex<String>>::default();
                let sink = text.clone();
                let drain = std::thread::spawn(move || {
                    let mut buf = [0u8; 8192];
                    while let Ok(n) = stderr.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        sink.lock()
                            .unwrap()
                            .push_str(&String::from_utf8_lossy(&buf[..n]));
                    }
                });
                Log::Memory(text, Some(drain))
            }
        };
        let listen = self
            .args
            .iter()
            .rev()
            .find_map(|a| a.to_str()?.strip_prefix("--listen="))
            .map(|l| {
                if l.starts_with(':') {
                    format!("127.0.0.1{l}")
                } else {
                    l.to_owned()
                }
            });
        Kg {
            child,
            log,
            ns: self.ns,
            listen,
            drop_signal: self.drop_signal,
        }
    }
}

enum Log {
    Memory(Arc<Mutex<String>>, Option<JoinHandle<()>>),
    File(PathBuf),
}

/// A process a test started with [`Launch`]: on drop, if it still runs, it gets SIGTERM (so kg
/// cleans up; SIGKILL after [`Launch::kill_on_drop`]) and is reaped; on a failure its log is
/// printed.
pub struct Kg {
    child: Child,
    log: Log,
    ns: Option<String>,
    /// Its `--listen` address, for [`Kg::get`].
    listen: Option<String>,
    drop_signal: i32,
}

impl Kg {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        match &self.log {
            Log::Memory(text, _) => text.lock().unwrap().clone(),
            Log::File(path) => std::fs::read_to_string(path).unwrap_or_default(),
        }
    }

    /// The file its stderr goes to ([`Launch::log_file`]).
    pub fn log_path(&self) -> &Path {
        match &self.log {
            Log::File(path) => path,
            Log::Memory(..) => panic!("the log is in memory"),
        }
    }

    /// Sends `signal` to it (by PID: `ip netns exec` and the wrappers exec it).
    pub fn signal(&self, signal: i32) {
        // SAFETY: a signal to our own child, not yet reaped while `self.child` holds it.
        let rc = unsafe { libc::kill(self.child.id() as i32, signal) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// Its exit status, if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// Waits until it exits (its log complete); its exit status.
    pub fn wait(&mut self) -> ExitStatus {
        let status = self.child.wait().unwrap();
        if let Log::Memory(_, drain) = &mut self.log
            && let Some(drain) = drain.take()
        {
            let _ = drain.join();
        }
        status
    }

    /// SIGTERM, then its exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait()
    }

    /// SIGTERM; its log, once it exited 0.
    pub fn stop(&mut self) -> String {
        let status = self.terminate();
        let log = self.log();
        assert!(
            status.success(),
            "exited with {status}:
{log}"
        );
        log
    }

    /// SIGKILL (no clean-up: routes, WireGuard peers and the pinned datapath stay), then reaps
    /// it.
    pub fn kill(mut self) {
        self.signal(libc::SIGKILL);
        self.wait();
    }

    /// Waits (bounded at 60 s, failing if it exits) until its log has a line containing every
    /// one of `words`; that line.
    pub fn wait_for_line(&mut self, words: &[&str]) -> String {
        let start = Instant::now();
        loop {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| words.iter().all(|w| l.contains(w))) {
                return line.to_owned();
            }
            assert!(self.try_wait().is_none(), "exited:\n{log}");
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no log line with {words:?}:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// GET `path` on its `--listen` address, from its namespace: (status, body); status 0 when
    /// nothing answers.
    pub fn get(&self, path: &str) -> (u16, String) {
        let addr = self.listen.clone().expect("started with --listen=");
        let get = move || {
            let Ok(mut s) = std::net::TcpStream::connect(&addr) else {
                return (0, String::new());
            };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
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
        };
        match &self.ns {
            Some(ns) => run_in(ns, get),
            None => get(),
        }
    }

    /// Its `/metrics` exposition, `None` while it does not answer 200.
    pub fn metrics(&self) -> Option<String> {
        let (status, body) = self.get("/metrics");
        (status == 200).then_some(body)
    }

    /// Waits until `/ready` answers 200.
    pub fn wait_ready(&self) {
        eventually("kg is ready", || self.get("/ready").0 == 200);
    }
}

impl Drop for Kg {
    fn drop(&mut self) {
        if self.try_wait().is_none() {
            self.signal(self.drop_signal);
            self.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- log of {}:\n{}", self.pid(), self.log());
        }
    }
}

/// `kg` alone on the file backend in a throwaway namespace (see the module doc), for node
/// `kgtest` (pod CIDR 10.42.1.0/24), listening on 127.0.0.1:1107 there.
pub struct Solo {
    pub kg: Kg,
    pub ns: NetNs,
    _gw: NetNs,
    pub wg: WgGo,
    pub bpffs: BpfFs,
    pub dir: tempfile::TempDir,
    pub objects: PathBuf,
}

/// Peer `i`'s public key (any 32 bytes are a valid WireGuard public key).
pub fn peer_key(i: u8) -> String {
    kilo_agent::mesh::Key([i; 32]).to_string()
}

/// Peer `i`'s allowed IP.
pub fn peer_cidr(i: u8) -> String {
    format!("10.5.0.{i}/32")
}

impl Solo {
    /// Starts kg with Peers `1..=peers` and `args` after the common ones, and waits until
    /// `/ready` answers 200.
    pub fn start(tag: &str, peers: u8, args: &[&str]) -> Solo {
        let solo = Self::launch(tag, peers, args, true);
        solo.kg.wait_ready();
        solo
    }

    /// [`Solo::start`] with the WireGuard device (wireguard-go, a sidecar) not yet running:
    /// `solo.wg.restart(&solo.ns)` starts it. Returns once kg is started, not ready.
    pub fn start_before_device(tag: &str, peers: u8, args: &[&str]) -> Solo {
        Self::launch(tag, peers, args, false)
    }

    fn launch(tag: &str, peers: u8, args: &[&str], device: bool) -> Solo {
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
        for i in 1..=peers {
            add_peer(&objects, i);
        }
        let kg = Launch::kg()
            .netns(&ns.name)
            .args([
                "--backend=file".to_string(),
                format!("--backend-dir={}", objects.display()),
                "--hostname=kgtest".into(),
                format!("--private-key={}", dir.path().join("key").display()),
                format!("--interface={}", wg.name),
                "--create-interface=false".into(),
                format!("--bpffs-dir={}", bpffs.pin_dir("kilo").display()),
                "--cni=false".into(),
                "--listen=127.0.0.1:1107".into(),
            ])
            .args(args)
            .kill_on_drop()
            .spawn();
        Solo {
            kg,
            ns,
            _gw: gw,
            wg,
            bpffs,
            dir,
            objects,
        }
    }

    pub fn add_peer(&self, i: u8) {
        add_peer(&self.objects, i);
    }

    pub fn remove_peer(&self, i: u8) {
        std::fs::remove_file(self.objects.join(format!("peer{i}.yaml"))).unwrap();
    }

    /// GET `path` on kg's listener: (status, body); status 0 when nothing answers.
    pub fn get(&self, path: &str) -> (u16, String) {
        self.kg.get(path)
    }

    /// The value of `series` (name and labels) on `/metrics`.
    pub fn metric(&self, series: &str) -> u64 {
        let text = self.get("/metrics").1;
        metrics::metric(&text, series).unwrap_or_else(|| panic!("no {series} in {text}"))
    }

    /// `kilo_reconciles_total`.
    pub fn reconciles(&self) -> u64 {
        self.metric("kilo_reconciles_total")
    }

    pub fn errors(&self, event: &str) -> u64 {
        let text = self.get("/metrics").1;
        metrics::metric(&text, &format!("kilo_errors_total{{event=\"{event}\"}}")).unwrap_or(0)
    }

    pub fn triggers(&self, cause: &str) -> u64 {
        self.metric(&format!(
            "kilo_reconcile_triggers_total{{cause=\"{cause}\"}}"
        ))
    }

    /// The log lines so far (JSON, one per line).
    pub fn log(&self) -> String {
        self.kg.log()
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
        self.kg.pid()
    }

    /// Stops kg with SIGTERM; returns its log after checking it exited 0.
    pub fn stop(&mut self) -> String {
        let log = self.kg.stop();
        // Shown with --nocapture (captured otherwise).
        eprintln!("kg's log:\n{log}");
        log
    }
}

fn add_peer(objects: &Path, i: u8) {
    std::fs::write(
        objects.join(format!("peer{i}.yaml")),
        peer_yaml(&format!("peer{i}"), peer_key(i), &peer_cidr(i)),
    )
    .unwrap();
}
