//! A real Kubernetes API server for the tests: etcd and kube-apiserver (built by `cargo xtask
//! setup` from Debian's source package, see `xtask/scripts/kube-apiserver.sh`) on loopback
//! ports of this network namespace, TLS with a certificate made here, a bearer token in
//! `system:masters`, RBAC on. Both processes are ended (by PID) and their files removed on drop.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kilo_agent::mesh::{KubeNode, Peer, Snapshot};
use kube::{Api, api::PostParams};

use super::apistub::Cert;

/// Where `cargo xtask setup` caches kube-apiserver (keyed on the Debian source version).
pub fn binary() -> PathBuf {
    cached("kube-apiserver")
}

/// The pinned kubectl (`pins::KUBECTL`, a current kustomize), which `cargo xtask setup` unpacks.
pub fn kubectl() -> PathBuf {
    cache_dir()
        .join(format!("kubectl-{}", pin("KUBECTL")))
        .join("usr/bin/kubectl")
}

fn cached(name: &str) -> PathBuf {
    cache_dir()
        .join(format!("kube-apiserver-{}", pin("KUBE_APISERVER")))
        .join(name)
}

/// The value of `const NAME: &str` in xtask/src/pins.rs.
fn pin(name: &str) -> &'static str {
    let pins = include_str!("../../../xtask/src/pins.rs");
    pins.lines()
        .find(|l| l.contains(&format!("const {name}:")))
        .and_then(|l| l.split('"').nth(1))
        .unwrap_or_else(|| panic!("{name} in xtask/src/pins.rs"))
}

fn cache_dir() -> PathBuf {
    std::env::var_os("KILO_CACHE_DIR").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/kilo-rs"),
        PathBuf::from,
    )
}

/// True when the API server can be started. Without it (no `cargo xtask setup`), a test says
/// why it skips; under `cargo xtask test` that is a failure ([`super::REQUIRE_ALL`]).
pub fn available(test: &str) -> bool {
    let ok = binary().exists() && kubectl().exists() && Path::new("/usr/bin/etcd").exists();
    super::skip_unless(
        test,
        (!ok).then(|| {
            format!(
                "no kube-apiserver at {} or no /usr/bin/etcd (run `cargo xtask setup`)",
                binary().display()
            )
        }),
    )
}

pub const TOKEN: &str = "kilo-rs-test-token";

/// etcd + kube-apiserver, running until dropped.
pub struct ApiServer {
    pub url: String,
    pub dir: tempfile::TempDir,
    cert: Cert,
    etcd: Child,
    apiserver: Child,
    args: Vec<String>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for child in [&mut self.apiserver, &mut self.etcd] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Held while one server starts: a test binary's tests start theirs one at a time, so each
/// start-up has the CPU a lone one has (eight at once on two cores took minutes).
fn starting() -> std::sync::MutexGuard<'static, ()> {
    static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    STARTING.lock().unwrap_or_else(|e| e.into_inner())
}

fn spawn(cmd: &mut Command, log: &Path) -> Child {
    let out = std::fs::File::create(log).unwrap();
    cmd.stdout(out.try_clone().unwrap())
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"))
}

impl ApiServer {
    /// Starts both on 127.0.0.1 and waits until `/readyz` answers (about 5 s).
    pub fn start() -> Self {
        Self::start_at("127.0.0.1")
    }

    /// Starts both, the API server on `address` (an address of this namespace, for clients in
    /// other namespaces; etcd stays on loopback), and waits until `/readyz` answers.
    pub fn start_at(address: &str) -> Self {
        let _one = starting();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let cert = Cert::for_hosts(&[address, "localhost"]);
        std::fs::write(d.join("tls.crt"), &cert.pem).unwrap();
        std::fs::write(d.join("tls.key"), cert.key_pem()).unwrap();
        let sa = rcgen::KeyPair::generate().unwrap();
        std::fs::write(d.join("sa.key"), sa.serialize_pem()).unwrap();
        std::fs::write(d.join("sa.pub"), sa.public_key_pem()).unwrap();
        std::fs::write(
            d.join("tokens.csv"),
            format!("{TOKEN},admin,admin,\"system:masters\"\n"),
        )
        .unwrap();
        // Every patch of a Node, for tests that count what an agent writes.
        std::fs::write(
            d.join("audit.yaml"),
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
             - level: Request\n  verbs: [patch]\n  resources: [{group: \"\", resources: [nodes]}]\n\
             - level: None\n",
        )
        .unwrap();
        let (client, peer, secure) = (free_port(), free_port(), free_port());
        let etcd = spawn(
            Command::new("/usr/bin/etcd")
                .arg(format!("--data-dir={}", d.join("etcd").display()))
                .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
                .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
                ))
                .arg(format!("--initial-cluster=default=http://127.0.0.1:{peer}"))
                .arg("--name=default"),
            &d.join("etcd.log"),
        );
        let args: Vec<String> = vec![
            format!("--etcd-servers=http://127.0.0.1:{client}"),
            format!("--bind-address={address}"),
            format!("--advertise-address={address}"),
            format!("--secure-port={secure}"),
            "--insecure-port=0".into(),
            format!("--cert-dir={}", d.join("certs").display()),
            format!("--tls-cert-file={}", d.join("tls.crt").display()),
            format!("--tls-private-key-file={}", d.join("tls.key").display()),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            format!("--service-account-key-file={}", d.join("sa.pub").display()),
            format!(
                "--service-account-signing-key-file={}",
                d.join("sa.key").display()
            ),
            format!("--token-auth-file={}", d.join("tokens.csv").display()),
            "--authorization-mode=RBAC".into(),
            "--disable-admission-plugins=ServiceAccount".into(),
            "--service-cluster-ip-range=10.96.0.0/12".into(),
            format!("--audit-policy-file={}", d.join("audit.yaml").display()),
            format!("--audit-log-path={}", d.join("audit.log").display()),
        ];
        let apiserver = spawn(Command::new(binary()).args(&args), &d.join("apiserver.log"));
        let server = ApiServer {
            url: format!("https://{address}:{secure}"),
            dir,
            cert,
            etcd,
            apiserver,
            args,
        };
        server.wait_ready("apiserver.log");
        server
    }

    /// The bodies of the patches of Node `name` the server has answered, oldest first.
    pub fn node_patches(&self, name: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.path().join("audit.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["objectRef"]["name"] == name && e["stage"] == "ResponseComplete")
            .map(|e| e["requestObject"].clone())
            .collect()
    }

    /// Stops the API server (etcd keeps the objects); clients see connections refused.
    pub fn stop(&mut self) {
        let _ = self.apiserver.kill();
        let _ = self.apiserver.wait();
    }

    /// Starts the API server again on the same port and waits until it is ready.
    pub fn restart(&mut self) {
        let _one = starting();
        self.apiserver = spawn(
            Command::new(binary()).args(&self.args),
            &self.dir.path().join("apiserver-restarted.log"),
        );
        self.wait_ready("apiserver-restarted.log");
    }

    /// Waits until `/readyz` says ok: 60 s, or 180 s inside the kernel matrix's VM, where
    /// everything runs emulated (TCG) several times slower. `log` is the server's log, shown
    /// when it never gets ready.
    fn wait_ready(&self, log: &str) {
        let within = if std::env::var_os("KILO_KERNEL_MATRIX").is_some() {
            Duration::from_secs(180)
        } else {
            Duration::from_secs(60)
        };
        let start = Instant::now();
        let config = self.config();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let client = kilo_agent::backend::kubernetes::client(config).unwrap();
                loop {
                    let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
                    if client.request_text(req).await.is_ok_and(|t| t == "ok") {
                        return;
                    }
                    assert!(
                        start.elapsed() < within,
                        "kube-apiserver not ready after {within:?}:\n{}",
                        std::fs::read_to_string(self.dir.path().join(log)).unwrap_or_default()
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            });
    }

    /// A kubeconfig (token auth, this server's CA) written to this server's directory.
    /// Written once, atomically: kg processes read it while the test asks for it again.
    pub fn kubeconfig(&self) -> PathBuf {
        let path = self.dir.path().join("kubeconfig");
        if path.exists() {
            return path;
        }
        use base64::Engine as _;
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n    \
             certificate-authority-data: {}\nusers:\n- name: test\n  user:\n    token: {TOKEN}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n\
             current-context: test\n",
            self.url,
            base64::engine::general_purpose::STANDARD.encode(&self.cert.pem)
        );
        let partial = path.with_extension("partial");
        std::fs::write(&partial, text).unwrap();
        std::fs::rename(&partial, &path).unwrap();
        path
    }

    /// The client configuration for this server (make the client inside the runtime that uses
    /// it: `kilo_agent::backend::kubernetes::client(server.config())`).
    pub fn config(&self) -> kube::Config {
        let kc = kube::config::Kubeconfig::read_from(self.kubeconfig()).unwrap();
        futures::executor::block_on(kube::Config::from_custom_kubeconfig(
            kc,
            &kube::config::KubeConfigOptions::default(),
        ))
        .unwrap()
    }
}

/// The text of `manifests/NAME`.
pub fn manifest(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../manifests")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A current-thread runtime for a test's calls to the API server.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Creates the Peer CRD and waits until the server says it is Established.
pub async fn install_crd(client: &kube::Client) {
    let crd: CustomResourceDefinition = serde_yaml::from_str(&manifest("base/crds.yaml")).unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.create(&PostParams::default(), &crd).await.unwrap();
    let start = Instant::now();
    loop {
        let crd = api.get("peers.kilo.squat.ai").await.unwrap();
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        if established {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "CRD never Established"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates `snapshot`'s Nodes and Peers.
pub async fn create(client: &kube::Client, snapshot: &Snapshot) {
    let nodes: Api<KubeNode> = Api::all(client.clone());
    for n in snapshot.nodes.values() {
        nodes.create(&PostParams::default(), n).await.unwrap();
    }
    let peers: Api<Peer> = Api::all(client.clone());
    for p in snapshot.peers.values() {
        // A freshly created CRD can take a moment before its resource is served.
        let start = Instant::now();
        while let Err(e) = peers.create(&PostParams::default(), p).await {
            assert!(start.elapsed() < Duration::from_secs(30), "peer: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
