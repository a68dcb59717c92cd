//! `cargo xtask e2e [--keep | --down | --bench FILE]`: kg deployed by kubelet on a real cluster on
//! this machine.
//!
//! It builds or takes from the cache what the cluster needs (the Kubernetes binaries from
//! Debian's source package, containerd and the CNI plugins from Debian, the project image and
//! the test images), starts a control plane and kubelet nodes in network namespaces
//! (`xtask/scripts/e2e-cluster.sh`), applies `xtask/e2e` with `kubectl apply -k` as a user
//! would (the userspace overlay, images renamed only), then runs each check as a step that
//! reports PASS or FAIL. The cluster is removed at the end (every process it started, by PID,
//! with the containers, cgroups, mounts and namespaces), unless `--keep`.
//!
//! `--bench FILE` measures instead of checking, on the same cluster: the time from a Peer's
//! creation (the API server's audit timestamp) to every leader's WireGuard device carrying it,
//! and from a node's registration (same) to a pod on it answering a pod in another location.
//! FILE gets `cargo xtask bench`'s JSON lines (see `bench.rs`): one table, one cell per figure
//! with every repetition's value.
use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::Ipv4Addr,
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{install_debian_packages, install_kube_cluster, is_root, output, pins, root_dir, run};

/// Where the cluster lives (fixed, so that a later run removes what an interrupted one left).
const WORK: &str = "/run/krs-e2e";

/// The nodes and their locations (kg's `topology.kubernetes.io/region` label).
const NODES: &[(&str, &str)] = &[
    ("n1", "east"),
    ("n2", "east"),
    ("n3", "west"),
    ("n4", "west"),
    ("n5", "north"),
];

/// A busybox HTTP server whose one CGI script answers with the client's address.
const ECHO_SERVER: &str = r"mkdir -p /www/cgi-bin && printf '#!/bin/sh\necho Content-Type: text/plain\necho\necho $REMOTE_ADDR\n' >/www/cgi-bin/ip && chmod +x /www/cgi-bin/ip && exec httpd -f -p 8080 -h /www";

/// What `kubectl delete -k` leaves on a node with `--clean-up=false`, as the README lists it
/// (besides the `kilo.squat.ai/*` annotations), each with a command that prints it.
const LEFT_BEHIND: &[(&str, &str)] = &[
    ("kg's routes (protocol 107)", "ip route show proto 107"),
    ("kg's rules", "ip rule | grep -v -E '^(0|32766|32767):'"),
    (
        "the nftables table inet kilo",
        "nft list tables | grep 'inet kilo'",
    ),
    (
        "the pins under /sys/fs/bpf/kilo",
        "find /sys/fs/bpf/kilo -type f",
    ),
    (
        "kg's TC programs, attached through the pinned links",
        "for l in /sys/fs/bpf/kilo/links/*; do bpftool link show pinned \"$l\"; done | grep prog",
    ),
    ("the node's key in /var/lib/kilo", "ls /var/lib/kilo/key"),
    (
        "the CNI configuration",
        "ls /etc/cni/net.d/10-kilo.conflist",
    ),
];

/// What `kubectl delete -k` removes from a node (wireguard-go's pod takes its device along).
const GONE: &[(&str, &str)] = &[
    (
        "the WireGuard link kilo0",
        "ip -o link show kilo0 2>/dev/null",
    ),
    (
        "wireguard-go's UAPI socket",
        "ls /run/wireguard/kilo0.sock 2>/dev/null",
    ),
];

/// The capabilities the DaemonSet's kilo container adds (after `drop: [ALL]`).
const KILO_CAPS: &[(&str, u32)] = &[("NET_ADMIN", 12), ("PERFMON", 38), ("BPF", 39)];

/// kg's pins (`--clean-up=false` leaves them, see `deleted`).
const PIN_DIR: &str = "/sys/fs/bpf/kilo";

/// How many times `--bench` measures each figure.
const BENCH_REPETITIONS: usize = 5;
/// Nodes joined one after the other for the node figure (then stopped and deleted).
const BENCH_NODES: &[(&str, &str)] = &[("n6", "east"), ("n7", "west"), ("n8", "east")];

pub fn e2e(keep: bool, down: bool, bench: Option<&Path>) -> Result<()> {
    if !is_root() {
        bail!("the e2e cluster runs kubelets, containerd and network namespaces: run it as root");
    }
    let script = root_dir().join("xtask/scripts/e2e-cluster.sh");
    if down {
        return run(Command::new("bash").arg(&script).args(["down", WORK]));
    }
    let start = Instant::now();
    install_debian_packages(pins::E2E_PACKAGES)?;
    let bin = install_kube_cluster()?;
    crate::image::host_image()?;
    let images = root_dir().join("target/e2e/images");
    run(Command::new("bash")
        .arg(root_dir().join("xtask/scripts/e2e-images.sh"))
        .arg(&images))?;
    let mut tars = vec![root_dir().join("target/image/kilo-rs.tar")];
    for name in ["pause", "busybox", "wireguard-go"] {
        tars.push(images.join(format!("{name}.tar")));
    }
    eprintln!("e2e: prerequisites ready after {:?}", start.elapsed());

    let cluster = Cluster {
        script,
        work: PathBuf::from(WORK),
        keep,
    };
    let mut up = Command::new("bash");
    up.arg(&cluster.script)
        .args(["up", WORK])
        .arg(&bin)
        .args(&tars);
    up.arg("--")
        .args(NODES.iter().map(|(n, l)| format!("{n}:{l}")));
    run(&mut up)?;
    eprintln!("e2e: cluster up after {:?}", start.elapsed());

    let mut report = Report::default();
    if let Some(out) = bench {
        let measured = cluster.bench(report, out);
        drop(cluster);
        return measured;
    }
    cluster.checks(&mut report);
    eprintln!("e2e: checks done after {:?}", start.elapsed());
    drop(cluster);
    report.finish()
}

/// The running cluster; dropping it removes it (unless kept).
struct Cluster {
    script: PathBuf,
    work: PathBuf,
    keep: bool,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.keep {
            eprintln!(
                "e2e: cluster kept (kubectl: {}/kubectl; remove with `cargo xtask e2e --down`)",
                self.work.display()
            );
            return;
        }
        if let Err(e) = run(Command::new("bash").arg(&self.script).args(["down", WORK])) {
            eprintln!("e2e: removing the cluster: {e:#}");
        }
    }
}

/// PASS/FAIL per step, and the closing count.
#[derive(Default)]
struct Report {
    passed: u32,
    failed: Vec<String>,
}

impl Report {
    /// Runs one check; returns whether it passed.
    fn step(&mut self, name: &str, check: impl FnOnce() -> Result<String>) -> bool {
        eprintln!("e2e: -- {name}");
        let t = Instant::now();
        match check() {
            Ok(detail) => {
                println!("PASS {name} ({:.1} s): {detail}", t.elapsed().as_secs_f64());
                self.passed += 1;
                true
            }
            Err(e) => {
                println!("FAIL {name} ({:.1} s): {e:#}", t.elapsed().as_secs_f64());
                self.failed.push(name.to_owned());
                false
            }
        }
    }

    fn finish(self) -> Result<()> {
        println!("e2e: {} passed, {} failed", self.passed, self.failed.len());
        if !self.failed.is_empty() {
            bail!("e2e: failed: {}", self.failed.join("; "));
        }
        Ok(())
    }
}

/// Polls `f` every second until it returns `Some`, or fails with its last error after `limit`.
fn wait_for<T>(limit: Duration, what: &str, f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    poll(limit, Duration::from_secs(1), what, f)
}

/// [`wait_for`], polling every `every`.
fn poll<T>(
    limit: Duration,
    every: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    let mut last = String::from("not yet");
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if start.elapsed() > limit {
            bail!("{what}: not within {limit:?} (last: {last})");
        }
        std::thread::sleep(every);
    }
}

/// `cmd`'s standard output, `input` its standard input; fails when it does.
fn output_in(cmd: &mut Command, input: &str) -> Result<String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Standard base64 with padding (the caBundle).
fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, b| n << 8 | u32::from(*b)) << (8 * (3 - chunk.len()));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn in_cidr(ip: &str, cidr: &str) -> bool {
    let (Some((net, len)), Ok(ip)) = (cidr.split_once('/'), ip.parse::<Ipv4Addr>()) else {
        return false;
    };
    let (Ok(net), Ok(len)) = (net.parse::<Ipv4Addr>(), len.parse::<u32>()) else {
        return false;
    };
    let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
    u32::from(ip) & mask == u32::from(net) & mask
}

impl Cluster {
    fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_in(args, None)
    }

    /// kubectl of the cluster's release, run from the workspace root; `input` as its stdin.
    fn kubectl_in(&self, args: &[&str], input: Option<&str>) -> Result<String> {
        let mut cmd = Command::new(self.work.join("kubectl"));
        cmd.current_dir(root_dir()).args(args);
        output_in(&mut cmd, input.unwrap_or_default())
            .with_context(|| format!("kubectl {}", args.join(" ")))
    }

    fn apply(&self, object: &Value) -> Result<String> {
        self.kubectl_in(&["apply", "-f", "-"], Some(&object.to_string()))
    }

    fn json(&self, args: &[&str]) -> Result<Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl(&all)?).context("kubectl's JSON")
    }

    /// Runs `cmd` in a node's network and mount namespaces.
    fn node_exec(&self, node: &str, cmd: &[&str]) -> Result<String> {
        let out = Command::new("bash")
            .arg(&self.script)
            .args(["node-exec", WORK, node])
            .args(cmd)
            .output()?;
        if !out.status.success() {
            bail!(
                "{node}: {}: {}",
                cmd.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn kilo_pods(&self) -> Result<Vec<Value>> {
        let pods = self.json(&[
            "-n",
            "kube-system",
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=kilo",
        ])?;
        Ok(pods["items"].as_array().cloned().unwrap_or_default())
    }

    fn checks(&self, report: &mut Report) {
        report.step("nodes NotReady before kg (no CNI configuration)", || {
            let nodes = self.json(&["get", "nodes"])?;
            let ready = ready_nodes(&nodes);
            if !ready.is_empty() {
                bail!("already Ready: {ready:?}");
            }
            Ok(format!("{} nodes registered, none Ready", NODES.len()))
        });
        if !report.step("kubectl apply -k xtask/e2e", || self.deploy()) {
            return;
        }
        if !report.step(
            "the DaemonSets (kg, wireguard-go) rolled out on every node",
            || self.rolled_out(),
        ) {
            self.dump_state();
            return;
        }
        report.step("nodes Ready with kg's CNI configuration", || {
            wait_for(Duration::from_secs(120), "every node Ready", || {
                let nodes = self.json(&["get", "nodes"])?;
                Ok((ready_nodes(&nodes).len() == NODES.len()).then_some(()))
            })?;
            let mut seen = Vec::new();
            for (node, _) in NODES {
                let cidr = self.pod_cidr(node)?;
                let conf = self.node_exec(node, &["cat", "/etc/cni/net.d/10-kilo.conflist"])?;
                let conf: Value = serde_json::from_str(&conf).context("10-kilo.conflist")?;
                let subnet = &conf["plugins"][0]["ipam"]["ranges"][0][0]["subnet"];
                if subnet != cidr.as_str() {
                    bail!("{node}: the CNI configuration's range is {subnet}, its pod CIDR {cidr}");
                }
                seen.push(format!("{node} {cidr}"));
            }
            Ok(format!("ranges = pod CIDRs: {}", seen.join(", ")))
        });
        report.step(
            "kg runs with the manifest's capabilities, not privileged",
            || self.check_capabilities(),
        );
        report.step(
            "/health, /ready and /metrics answer on the pod's port",
            || {
                let mut names = Vec::new();
                for pod in self.kilo_pods()? {
                    let name = pod["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    let base = format!("/api/v1/namespaces/kube-system/pods/{name}:1107/proxy");
                    for path in ["health", "ready"] {
                        self.kubectl(&["get", "--raw", &format!("{base}/{path}")])?;
                    }
                    let metrics = self.kubectl(&["get", "--raw", &format!("{base}/metrics")])?;
                    if !metrics.lines().any(|l| l.starts_with("kilo_nodes ")) {
                        bail!("{name}: /metrics has no kilo_nodes");
                    }
                    names.push(name);
                }
                Ok(names.join(", "))
            },
        );
        let pods = report.step("test pods get addresses from their node's pod CIDR", || {
            self.test_pods()
        });
        if !pods {
            return;
        }
        report.step(
            "every test pod reaches every other (Kilo's adjacency check)",
            || self.adjacency(Duration::from_secs(60)),
        );
        report.step("again after a resync period (30 s)", || {
            std::thread::sleep(Duration::from_secs(31));
            self.adjacency(Duration::ZERO)
        });
        report.step(
            "full granularity (kg's args patched, rolled out): every pod reaches every other, and again back in location granularity",
            || self.full_granularity(),
        );
        report.step(
            "a ClusterIP Service's endpoint in another location sees the client pod's address",
            || self.service_across_locations(),
        );
        report.step(
            "a Peer applied with kubectl: `kgctl showconf peer` configures an outside host that then reaches every pod",
            || self.peer(),
        );
        report.step(
            "allowed-location-ips on a location's leader: a LAN host there reached from the other locations' pods, then withdrawn",
            || self.allowed_location_ips(),
        );
        report.step(
            "the deployed webhook refuses a Peer with a malformed CIDR, naming the field",
            || self.webhook(),
        );
        report.step(
            "a rolling update of kg's DaemonSet under pod-to-pod traffic loses no packet; the new kg adopts the pinned datapath",
            || self.rolling_update(),
        );
        report.step(
            "a node deleted with kubectl leaves the others' routes and WireGuard peers",
            || self.node_deleted(),
        );
        report.step(
            "kubectl delete -k leaves on each node exactly what the README lists",
            || self.deleted(),
        );
    }

    /// After `kubectl delete -k`, on each remaining node: what the README says stays
    /// ([`LEFT_BEHIND`], and kg's annotations) is there, and nothing of [`GONE`] is.
    fn deleted(&self) -> Result<String> {
        self.kubectl(&["delete", "-k", "xtask/e2e"])?;
        wait_for(
            Duration::from_secs(120),
            "kg's and wireguard-go's pods gone",
            || {
                let pods = self.json(&[
                    "-n",
                    "kube-system",
                    "get",
                    "pods",
                    "-l",
                    "app.kubernetes.io/part-of=kilo",
                ])?;
                Ok(pods["items"]
                    .as_array()
                    .is_none_or(Vec::is_empty)
                    .then_some(()))
            },
        )?;
        let mut wrong = Vec::new();
        for (node, _) in &NODES[..NODES.len() - 1] {
            let show = |cmd: &str| {
                self.node_exec(node, &["sh", "-c", cmd])
                    .unwrap_or_default()
                    .trim()
                    .replace('\n', "; ")
            };
            for (what, cmd) in LEFT_BEHIND {
                if show(cmd).is_empty() {
                    wrong.push(format!("{node}: {what} gone, the README says it stays"));
                }
            }
            for (what, cmd) in GONE {
                let out = show(cmd);
                if !out.is_empty() {
                    wrong.push(format!("{node}: {what} left: {out}"));
                }
            }
            let n = self.json(&["get", "node", node])?;
            let ours = n["metadata"]["annotations"]
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, _)| k.starts_with("kilo.squat.ai/"))
                .count();
            if ours == 0 {
                wrong.push(format!(
                    "{node}: no kilo.squat.ai/ annotation, the README says they stay"
                ));
            }
        }
        if !wrong.is_empty() {
            bail!("not as the README says:\n  {}", wrong.join("\n  "));
        }
        let listed: Vec<&str> = LEFT_BEHIND.iter().map(|(what, _)| *what).collect();
        Ok(format!(
            "left: {}, kg's annotations; gone: {}",
            listed.join(", "),
            GONE.iter()
                .map(|(what, _)| *what)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }

    /// A pod in the last node's location serves its client's address (busybox httpd's CGI
    /// REMOTE_ADDR) behind a ClusterIP Service; the probe pod of the first node asks.
    fn service_across_locations(&self) -> Result<String> {
        let (client_node, client_loc) = NODES[0];
        let (server_node, server_loc) = NODES
            .iter()
            .rev()
            .find(|(_, l)| *l != client_loc)
            .context("no second location")?;
        self.apply(&busybox_pod(
            "echo",
            "echo",
            server_node,
            &["sh", "-c", ECHO_SERVER],
        ))?;
        self.apply(&json!({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo"},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": 8080}]},
        }))?;
        let client = format!("probe-{client_node}");
        let client_ip = self.json(&["get", "pod", &client])?["status"]["podIP"]
            .as_str()
            .context("client pod IP")?
            .to_owned();
        let svc = self.json(&["get", "service", "echo"])?;
        let cluster_ip = svc["spec"]["clusterIP"]
            .as_str()
            .context("clusterIP")?
            .to_owned();
        // busybox-static's wget crashes (SIGSEGV) here: nc with a hand-written request.
        let request =
            format!("printf 'GET /cgi-bin/ip HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {cluster_ip} 80");
        let seen = wait_for(
            Duration::from_secs(90),
            &format!("{client} -> {cluster_ip}"),
            || {
                let answer = self.kubectl(&["exec", &client, "--", "sh", "-c", &request])?;
                // httpd's REMOTE_ADDR, on the last line: `[::ffff:10.42.0.3]`.
                Ok(answer.lines().last().map(|l| {
                    l.trim()
                        .trim_matches(|c| c == '[' || c == ']')
                        .trim_start_matches("::ffff:")
                        .to_owned()
                }))
            },
        )?;
        if seen != client_ip {
            bail!(
                "the endpoint on {server_node} ({server_loc}) saw {seen}, not {client} ({client_ip})"
            );
        }
        Ok(format!(
            "{client} ({client_loc}) -> {cluster_ip} -> echo on {server_node} ({server_loc}): saw {seen}"
        ))
    }

    /// The webhook's Secret (before, so its pod starts at once), `kubectl apply -k`, then the
    /// CA in the ValidatingWebhookConfiguration, as docs/deploying.md says without cert-manager.
    fn deploy(&self) -> Result<String> {
        let pki = self.work.join("pki");
        let (crt, key) = (pki.join("webhook.crt"), pki.join("webhook.key"));
        self.kubectl(&[
            "-n",
            "kube-system",
            "create",
            "secret",
            "tls",
            "kilo-peer-validation-tls",
            &format!("--cert={}", crt.display()),
            &format!("--key={}", key.display()),
        ])?;
        let applied = self.kubectl(&["apply", "-k", "xtask/e2e"])?;
        let ca = std::fs::read(pki.join("ca.crt"))?;
        let patch = json!([{
            "op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": base64(&ca),
        }]);
        self.kubectl(&[
            "patch",
            "validatingwebhookconfiguration",
            "peers.kilo.squat.ai",
            "--type=json",
            "-p",
            &patch.to_string(),
        ])?;
        Ok(applied.lines().count().to_string() + " objects applied")
    }

    /// A Peer whose allowed IP is no CIDR: once the webhook's pod is available, refused with
    /// the field named (the CRD's schema lets any non-empty string through).
    fn webhook(&self) -> Result<String> {
        run(Command::new("bash")
            .arg(&self.script)
            .args(["pod-routes", WORK]))?;
        self.kubectl(&[
            "-n",
            "kube-system",
            "wait",
            "--for=condition=Available",
            "deployment/kilo-peer-validation",
            "--timeout=120s",
        ])?;
        let peer = json!({
            "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer", "metadata": {"name": "bad"},
            "spec": {
                "allowedIPs": ["10.5.0.300/32"],
                "publicKey": "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=",
            },
        });
        match self.apply(&peer) {
            Ok(out) => {
                let _ = self.kubectl(&["delete", "peer", "bad"]);
                bail!("admitted: {}", out.trim())
            }
            Err(e) => {
                let e = format!("{e:#}");
                if !e.contains("denied the request") || !e.contains("allowedIPs") {
                    bail!("refused, but not by the webhook naming allowedIPs: {e}");
                }
                let why = e.lines().find(|l| l.contains("denied")).unwrap_or(&e);
                Ok(why.trim().to_owned())
            }
        }
    }

    /// The host `ext` (outside the cluster, on the public side) gets a wireguard-go device, a
    /// Peer named after it, and the configuration `kgctl showconf peer` prints for it.
    fn peer(&self) -> Result<String> {
        const IFACE: &str = "krse2e0";
        const ADDRESS: &str = "10.5.0.1/32";
        run(Command::new("bash")
            .arg(&self.script)
            .args(["ext-wireguard", WORK, IFACE]))?;
        let key_file = self.work.join("ext.key");
        let key = output(Command::new("wg").arg("genkey"))?;
        std::fs::write(&key_file, &key)?;
        let public = output_in(Command::new("wg").arg("pubkey"), &key)?;
        self.apply(&json!({
            "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer", "metadata": {"name": "ext"},
            "spec": {
                "allowedIPs": [ADDRESS], "publicKey": public.trim(), "persistentKeepalive": 10,
            },
        }))?;
        let kgctl = root_dir().join(format!("target/{}/release/kgctl", pins::IMAGE_TARGET));
        let conf = output(
            Command::new("nsenter")
                .arg("--net=/run/netns/krs-e2e-cp")
                .arg(&kgctl)
                .arg("--kubeconfig")
                .arg(self.work.join("admin.kubeconfig"))
                .args(["showconf", "peer", "ext"]),
        )?;
        if !conf.contains("[Peer]") {
            bail!("kgctl showconf peer ext printed {conf:?}");
        }
        let conf_file = self.work.join("ext.conf");
        std::fs::write(&conf_file, &conf)?;
        let ext = |args: &[&str]| {
            run(Command::new("nsenter")
                .arg("--net=/run/netns/krs-e2e-ext")
                .args(args))
        };
        ext(&["wg", "setconf", IFACE, &conf_file.to_string_lossy()])?;
        ext(&[
            "wg",
            "set",
            IFACE,
            "private-key",
            &key_file.to_string_lossy(),
        ])?;
        ext(&["ip", "address", "add", ADDRESS, "dev", IFACE])?;
        ext(&["ip", "link", "set", IFACE, "up"])?;
        ext(&["ip", "route", "add", "10.42.0.0/16", "dev", IFACE])?;
        let mut reached = Vec::new();
        for (name, ip) in self.probe_ips()? {
            wait_for(
                Duration::from_secs(60),
                &format!("ext -> {name} ({ip})"),
                || {
                    Ok(Command::new("nsenter")
                        .arg("--net=/run/netns/krs-e2e-ext")
                        .args(["busybox", "ping", "-c", "1", "-W", "2", &ip])
                        .stdout(Stdio::null())
                        .status()?
                        .success()
                        .then_some(()))
                },
            )?;
            reached.push(name);
        }
        Ok(format!("ext ({ADDRESS}) reached {}", reached.join(", ")))
    }

    /// A changed pod annotation rolls kg's DaemonSet while one probe pod pings another in a
    /// different location five times a second. wireguard-go's pods (and so the devices) stay;
    /// each new kg adopts the pinned datapath: the same maps and links in the kernel (their IDs),
    /// and its own writes count no map entry inserted and no program attached anew.
    fn rolling_update(&self) -> Result<String> {
        let pods = self.probe_ips()?;
        let (from, _) = &pods[0];
        let (to, ip) = pods
            .iter()
            .rev()
            .find(|(n, _)| n != from)
            .context("two probe pods")?;
        let old = uids(&self.kilo_pods()?);
        let wireguard = uids(&self.wireguard_pods()?);
        let mut pins = BTreeMap::new();
        for (node, _) in NODES {
            let ids = self.pinned_ids(node)?;
            if ids.is_empty() {
                bail!("{node}: nothing pinned under {PIN_DIR}");
            }
            pins.insert(*node, ids);
        }
        let mut ping = Command::new(self.work.join("kubectl"))
            .args(["exec", from, "--", "sh", "-c"])
            .arg(format!("ping -i 0.2 {ip} >/tmp/ping.log 2>&1"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        std::thread::sleep(Duration::from_secs(3));
        let patch = format!(
            r#"{{"spec":{{"template":{{"metadata":{{"annotations":{{"e2e.kilo-rs/restart":"{}"}}}}}}}}}}"#,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs()
        );
        let rolled = self
            .kubectl(&[
                "-n",
                "kube-system",
                "patch",
                "daemonset",
                "kilo",
                "-p",
                &patch,
            ])
            .and_then(|_| self.rollout("kilo"));
        std::thread::sleep(Duration::from_secs(3));
        let _ = self.kubectl(&["exec", from, "--", "killall", "-INT", "ping"]);
        let _ = ping.wait();
        rolled?;
        let log = self.kubectl(&["exec", from, "--", "cat", "/tmp/ping.log"])?;
        let summary = log
            .lines()
            .find(|l| l.contains("packets transmitted"))
            .with_context(|| format!("no ping summary in {log:?}"))?
            .to_owned();
        let nums: Vec<u64> = summary
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect();
        let (sent, received) = (nums[0], nums[1]);
        let new = self.kilo_pods()?;
        let replaced = uids(&new).iter().filter(|u| !old.contains(u)).count();
        if replaced != NODES.len() {
            bail!("{replaced} of {} kg pods replaced", NODES.len());
        }
        if uids(&self.wireguard_pods()?) != wireguard {
            bail!("wireguard-go's pods were replaced too");
        }
        if sent < 10 || received != sent {
            // The longest run of unanswered pings, in seconds (one every 0.2 s).
            let seqs: Vec<u64> = log
                .split("seq=")
                .skip(1)
                .filter_map(|r| r.split_whitespace().next()?.parse().ok())
                .collect();
            let gap = seqs
                .windows(2)
                .map(|w| w[1] - w[0] - 1)
                .max()
                .unwrap_or(sent);
            bail!(
                "{from} -> {to} ({ip}): {summary} (longest outage {:.1} s)",
                gap as f64 * 0.2
            );
        }
        let mut anew = Vec::new();
        for (node, before) in &pins {
            let after = self.pinned_ids(node)?;
            let changed: Vec<&String> = after.iter().filter(|p| !before.contains(p)).collect();
            if !changed.is_empty() || after.len() != before.len() {
                anew.push(format!(
                    "{node}: pinned anew {changed:?} (before: {before:?})"
                ));
            }
        }
        for pod in &new {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
            let metrics = self.metrics(name)?;
            for kind in ["map_insert", "link_attach", "link_detach"] {
                let n = metric(&metrics, &format!("kilo_writes_total{{kind=\"{kind}\"}}"));
                if n.unwrap_or(0.0) != 0.0 {
                    anew.push(format!("{node}: {name} counts {kind} {n:?}"));
                }
            }
        }
        if !anew.is_empty() {
            bail!("the datapath not (all) adopted:\n  {}", anew.join("\n  "));
        }
        let maps: usize = pins.values().map(|ids| ids.len()).sum();
        Ok(format!(
            "{replaced} kg pods replaced, wireguard-go's kept; {from} -> {to}: {summary}; the {maps} pinned maps and links kept their IDs, no map entry inserted nor program attached anew"
        ))
    }

    /// The last node goes away (its kubelet, containers and containerd stopped) and is deleted:
    /// no other node keeps a route to its pod CIDR, nor its public key among its WireGuard peers.
    fn node_deleted(&self) -> Result<String> {
        let (gone, _) = NODES[NODES.len() - 1];
        let cidr = self.pod_cidr(gone)?;
        let key =
            self.json(&["get", "node", gone])?["metadata"]["annotations"]["kilo.squat.ai/key"]
                .as_str()
                .with_context(|| format!("{gone} has no kilo.squat.ai/key"))?
                .to_owned();
        let peers = |node: &str| self.node_exec(node, &["wg", "show", "kilo0", "peers"]);
        let carried = NODES[..NODES.len() - 1]
            .iter()
            .filter(|(node, _)| peers(node).is_ok_and(|p| p.contains(&key)))
            .count();
        if carried == 0 {
            bail!("no node has {gone}'s key {key} among its peers before it goes");
        }
        run(Command::new("bash")
            .arg(&self.script)
            .args(["stop-node", WORK, gone]))?;
        self.kubectl(&["delete", "node", gone])?;
        for (node, _) in &NODES[..NODES.len() - 1] {
            wait_for(
                Duration::from_secs(60),
                &format!("{node}: no route to {cidr}, no peer {key}"),
                || {
                    let routes = self.node_exec(node, &["ip", "route", "show", &cidr])?;
                    Ok((routes.trim().is_empty() && !peers(node)?.contains(&key)).then_some(()))
                },
            )?;
        }
        Ok(format!(
            "{gone} ({cidr}, its key a peer of {carried} nodes) gone from the others' routes and peers"
        ))
    }

    /// kg's and wireguard-go's DaemonSets, each ready and up to date on every node.
    fn rolled_out(&self) -> Result<String> {
        let mut seen = Vec::new();
        for name in ["kilo", "kilo-wireguard"] {
            seen.push(wait_for(
                Duration::from_secs(300),
                &format!("DaemonSet {name} ready"),
                || {
                    let ds = self.json(&["-n", "kube-system", "get", "daemonset", name])?;
                    let s = &ds["status"];
                    let want = NODES.len() as u64;
                    let ok = [
                        "desiredNumberScheduled",
                        "numberReady",
                        "updatedNumberScheduled",
                    ]
                    .iter()
                    .all(|k| s[k].as_u64() == Some(want));
                    Ok(ok.then(|| format!("{name} {want}/{want} ready")))
                },
            )?);
        }
        Ok(seen.join(", "))
    }

    fn rollout(&self, daemonset: &str) -> Result<String> {
        self.kubectl(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            &format!("daemonset/{daemonset}"),
            "--timeout=300s",
        ])
    }

    /// kg's container's index in its DaemonSet, and its args.
    fn kg_args(&self) -> Result<(usize, Value)> {
        let ds = self.json(&["-n", "kube-system", "get", "daemonset", "kilo"])?;
        let containers = ds["spec"]["template"]["spec"]["containers"]
            .as_array()
            .context("kg's DaemonSet has no containers")?;
        let i = containers
            .iter()
            .position(|c| c["name"] == "kilo")
            .context("no kilo container")?;
        Ok((i, containers[i]["args"].clone()))
    }

    /// Replaces kg's args in its DaemonSet (as a user would, with kubectl patch) and waits for
    /// the rollout.
    fn set_kg_args(&self, i: usize, args: &Value) -> Result<()> {
        let patch = json!([{
            "op": "replace", "path": format!("/spec/template/spec/containers/{i}/args"), "value": args,
        }]);
        self.kubectl(&[
            "-n",
            "kube-system",
            "patch",
            "daemonset",
            "kilo",
            "--type=json",
            "-p",
            &patch.to_string(),
        ])?;
        self.rollout("kilo")?;
        Ok(())
    }

    /// Kilo's e2e in full granularity: `--mesh-granularity=full` added to kg's args, every pod
    /// reaches every other; then the args as the overlay has them, and again.
    fn full_granularity(&self) -> Result<String> {
        let (i, args) = self.kg_args()?;
        let mut full = args.as_array().cloned().unwrap_or_default();
        full.push(json!("--mesh-granularity=full"));
        self.set_kg_args(i, &Value::Array(full))?;
        // Every node leads a segment of its own in full granularity, one per location else.
        let locations = NODES.iter().map(|(_, l)| l).collect::<BTreeSet<_>>().len();
        let leading = |want: usize| {
            wait_for(Duration::from_secs(90), &format!("{want} leaders"), || {
                let leaders = self.leaders()?;
                if leaders.len() == want {
                    Ok(Some(()))
                } else {
                    bail!("leaders {leaders:?}")
                }
            })
        };
        leading(NODES.len())?;
        let in_full = self.adjacency(Duration::from_secs(90))?;
        self.set_kg_args(i, &args)?;
        leading(locations)?;
        let back = self.adjacency(Duration::from_secs(90))?;
        Ok(format!("full: {in_full}; location again: {back}"))
    }

    /// A host on the first location's LAN, outside the cluster, named in
    /// `kilo.squat.ai/allowed-location-ips` of that location's leader: the pods of the other
    /// locations reach it (through the mesh, masqueraded by the leader) only while the
    /// annotation is there.
    fn allowed_location_ips(&self) -> Result<String> {
        const ANNOTATION: &str = "kilo.squat.ai/allowed-location-ips";
        let (_, loc) = NODES[0];
        let leaders = self.leaders()?;
        let (leader, _) = NODES
            .iter()
            .find(|(n, l)| *l == loc && leaders.iter().any(|x| x == n))
            .with_context(|| format!("no leader in {loc} among {leaders:?}"))?;
        let host = output(
            Command::new("bash")
                .arg(&self.script)
                .args(["lan-host", WORK, "lanhost", loc]),
        )?
        .trim()
        .to_owned();
        let clients: Vec<String> = NODES
            .iter()
            .filter(|(_, l)| *l != loc)
            .map(|(n, _)| format!("probe-{n}"))
            .collect();
        let reaches = |pod: &str| -> Result<bool> {
            let script = format!("ping -c 1 -W 2 {host} >/dev/null && echo yes || echo no");
            Ok(self
                .kubectl(&["exec", pod, "--", "sh", "-c", &script])?
                .trim()
                == "yes")
        };
        for pod in &clients {
            if reaches(pod)? {
                bail!("{pod} reaches {host} before the annotation");
            }
        }
        self.kubectl(&[
            "annotate",
            "node",
            leader,
            &format!("{ANNOTATION}={host}/32"),
        ])?;
        for pod in &clients {
            wait_for(Duration::from_secs(60), &format!("{pod} -> {host}"), || {
                Ok(reaches(pod)?.then_some(()))
            })?;
        }
        self.kubectl(&["annotate", "node", leader, &format!("{ANNOTATION}-")])?;
        for pod in &clients {
            wait_for(
                Duration::from_secs(60),
                &format!("{pod} no longer reaching {host}"),
                || Ok((!reaches(pod)?).then_some(())),
            )?;
        }
        for (node, _) in NODES {
            let routes = self.node_exec(node, &["ip", "route", "show", "proto", "107"])?;
            if let Some(r) = routes.lines().find(|r| r.starts_with(&format!("{host} "))) {
                bail!("{node} still routes {host}: {r}");
            }
        }
        Ok(format!(
            "{host} on {loc}'s LAN, named by its leader {leader}: reached from {}, then not, and no route to it left",
            clients.join(", ")
        ))
    }

    /// The nodes whose kg says it leads its location (`kilo_leader 1`).
    fn leaders(&self) -> Result<Vec<String>> {
        let mut leaders = Vec::new();
        for pod in self.kilo_pods()? {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            if metric(&self.metrics(name)?, "kilo_leader") == Some(1.0) {
                leaders.push(
                    pod["spec"]["nodeName"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                );
            }
        }
        leaders.sort();
        Ok(leaders)
    }

    /// A kg pod's /metrics, through the API server's pod proxy.
    fn metrics(&self, pod: &str) -> Result<String> {
        self.kubectl(&[
            "get",
            "--raw",
            &format!("/api/v1/namespaces/kube-system/pods/{pod}:1107/proxy/metrics"),
        ])
    }

    fn wireguard_pods(&self) -> Result<Vec<Value>> {
        let pods = self.json(&[
            "-n",
            "kube-system",
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=kilo-wireguard",
        ])?;
        Ok(pods["items"].as_array().cloned().unwrap_or_default())
    }

    /// `PATH ID` per map and link pinned under [`PIN_DIR`] on `node` (the kernel's IDs: a map
    /// or link made anew gets a new one).
    fn pinned_ids(&self, node: &str) -> Result<Vec<String>> {
        let script = format!(
            r#"for f in $(find {PIN_DIR}/maps {PIN_DIR}/links -type f 2>/dev/null | sort); do
                 case $f in */maps/*) t=map ;; *) t=link ;; esac
                 echo "$f $(bpftool -j $t show pinned "$f" | grep -o '"id":[0-9]*' | head -n 1)"
               done"#
        );
        Ok(self
            .node_exec(node, &["sh", "-c", &script])?
            .lines()
            .map(str::to_owned)
            .collect())
    }

    /// `--bench`: kg deployed as for the checks, then both figures measured; their records
    /// written to `out` (JSON lines, `cargo xtask bench`'s format).
    fn bench(&self, mut report: Report, out: &Path) -> Result<()> {
        let ready = report.step("kubectl apply -k xtask/e2e", || self.deploy())
            && report.step("the DaemonSets rolled out", || self.rolled_out())
            && report.step("test pods", || self.test_pods())
            && report.step("every test pod reaches every other", || {
                self.adjacency(Duration::from_secs(120))
            });
        if !ready {
            self.dump_state();
            return report.finish();
        }
        let (mut peers, mut joins) = (Vec::new(), Vec::new());
        report.step(
            "Peer created (audit) -> on every leader's WireGuard device",
            || {
                peers = self.bench_peers()?;
                Ok(spread(&peers))
            },
        );
        report.step(
            "node registered (audit) -> a pod on it answers a pod in another location",
            || {
                joins = self.bench_nodes()?;
                Ok(spread(&joins))
            },
        );
        let records = bench_records(&peers, &joins);
        let text: String = records.iter().map(|r| format!("{r}\n")).collect();
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("e2e: figures in {}", out.display());
        report.finish()
    }

    /// Seconds from each Peer's creation (the audit log's ResponseComplete of the create) to
    /// the moment every leader's wireguard-go answers its UAPI `get` with the Peer's key
    /// (polled every 20 ms, on each node's socket).
    fn bench_peers(&self) -> Result<Vec<f64>> {
        let leaders = self.leaders()?;
        if leaders.is_empty() {
            bail!("no leader");
        }
        let mut samples = Vec::new();
        for i in 0..BENCH_REPETITIONS {
            let mut key = [0u8; 32];
            std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
            let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
            let name = format!("bench-{i}");
            self.apply(&json!({
                "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer", "metadata": {"name": name},
                "spec": {"allowedIPs": [format!("10.6.0.{}/32", i + 1)], "publicKey": base64(&key)},
            }))?;
            let mut pending = leaders.clone();
            poll(
                Duration::from_secs(120),
                Duration::from_millis(20),
                &format!("{name} on {leaders:?}"),
                || {
                    pending.retain(|node| {
                        let socket = self
                            .work
                            .join(format!("nodes/{node}/run/wireguard/kilo0.sock"));
                        !uapi_get(&socket)
                            .is_ok_and(|dev| dev.contains(&format!("public_key={hex}\n")))
                    });
                    Ok(pending.is_empty().then_some(()))
                },
            )?;
            let seen = now();
            samples.push(seen - self.audit_created("peers", &name)?);
            self.kubectl(&["delete", "peer", &name])?;
        }
        Ok(samples)
    }

    /// Seconds from each node's registration (the audit log's ResponseComplete of the Node's
    /// create) to a pod on it, placed there by the scheduler (created as the node registers),
    /// answering a ping from a probe pod in another location (pinging in a loop). Each node
    /// is stopped and deleted after.
    fn bench_nodes(&self) -> Result<Vec<f64>> {
        let mut samples = Vec::new();
        for (node, loc) in BENCH_NODES {
            run(Command::new("bash").arg(&self.script).args([
                "add-node",
                WORK,
                &format!("{node}:{loc}"),
            ]))?;
            let name = format!("join-{node}");
            let mut pod = busybox_pod(&name, "join", node, &["sleep", "86400"]);
            let spec = pod["spec"].as_object_mut().expect("a pod spec");
            spec.remove("nodeName");
            spec.insert(
                "nodeSelector".into(),
                json!({"kubernetes.io/hostname": node}),
            );
            self.apply(&pod)?;
            let ip = poll(
                Duration::from_secs(300),
                Duration::from_millis(300),
                &name,
                || {
                    let p = self.json(&["get", "pod", &name])?;
                    Ok(p["status"]["podIP"].as_str().map(str::to_owned))
                },
            )?;
            let (from, _) = NODES
                .iter()
                .find(|(_, l)| l != loc)
                .context("another location")?;
            let wait = format!("until ping -c 1 -W 1 {ip} >/dev/null 2>&1; do sleep 0.1; done");
            self.kubectl(&[
                "exec",
                &format!("probe-{from}"),
                "--",
                "timeout",
                "300",
                "sh",
                "-c",
                &wait,
            ])?;
            let seen = now();
            samples.push(seen - self.audit_created("nodes", node)?);
            self.kubectl(&["delete", "pod", &name, "--wait=false"])?;
            run(Command::new("bash")
                .arg(&self.script)
                .args(["stop-node", WORK, node]))?;
            self.kubectl(&["delete", "node", node])?;
        }
        Ok(samples)
    }

    /// When the API server completed the create of `resource` `name` (seconds since the epoch),
    /// from its audit log.
    fn audit_created(&self, resource: &str, name: &str) -> Result<f64> {
        let log = self.work.join("logs/audit.log");
        wait_for(
            Duration::from_secs(10),
            &format!("the audit event of {resource}/{name}'s create"),
            || {
                let text = std::fs::read_to_string(&log)?;
                let event = text.lines().rev().find_map(|l| {
                    let e: Value = serde_json::from_str(l).ok()?;
                    let ours = e["verb"] == "create"
                        && e["stage"] == "ResponseComplete"
                        && e["objectRef"]["resource"] == resource
                        && e["objectRef"]["name"] == name
                        && e["responseStatus"]["code"] == 201;
                    ours.then_some(e)
                });
                let Some(e) = event else { return Ok(None) };
                let at: jiff::Timestamp = e["stageTimestamp"]
                    .as_str()
                    .context("stageTimestamp")?
                    .parse()?;
                Ok(Some(at.as_nanosecond() as f64 / 1e9))
            },
        )
    }

    fn pod_cidr(&self, node: &str) -> Result<String> {
        let n = self.json(&["get", "node", node])?;
        n["spec"]["podCIDR"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("{node} has no pod CIDR"))
    }

    fn check_capabilities(&self) -> Result<String> {
        let allowed: u64 = KILO_CAPS.iter().map(|(_, bit)| 1u64 << bit).sum();
        let mut seen = Vec::new();
        for pod in self.kilo_pods()? {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
            let container = pod["spec"]["containers"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["name"] == "kilo"))
                .with_context(|| format!("{name}: no kilo container"))?;
            let sc = &container["securityContext"];
            if sc["privileged"] == true {
                bail!("{name}: privileged");
            }
            let mut add: Vec<&str> = sc["capabilities"]["add"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            add.sort_unstable();
            let mut want: Vec<&str> = KILO_CAPS.iter().map(|(n, _)| *n).collect();
            want.sort_unstable();
            if add != want || sc["capabilities"]["drop"] != json!(["ALL"]) {
                bail!("{name}: capabilities {}", sc["capabilities"]);
            }
            // The process itself, found through its node's containerd.
            let id = pod["status"]["containerStatuses"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["name"] == "kilo"))
                .and_then(|c| c["containerID"].as_str())
                .and_then(|id| id.strip_prefix("containerd://"))
                .with_context(|| format!("{name}: no containerd container ID"))?
                .to_owned();
            let tasks = self.node_exec(node, &["ctr", "-n", "k8s.io", "tasks", "ls"])?;
            let pid = tasks
                .lines()
                .find_map(|l| {
                    let mut f = l.split_whitespace();
                    (f.next() == Some(id.as_str())).then(|| f.next()).flatten()
                })
                .with_context(|| format!("{name}: no task {id} on {node}"))?;
            let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
            let cap = |key: &str| -> Result<u64> {
                let hex = status
                    .lines()
                    .find_map(|l| l.strip_prefix(key))
                    .with_context(|| format!("{key} in /proc/{pid}/status"))?;
                Ok(u64::from_str_radix(hex.trim(), 16)?)
            };
            let (eff, bnd) = (cap("CapEff:")?, cap("CapBnd:")?);
            if bnd & !allowed != 0 || eff & !allowed != 0 || eff & (1 << 12) == 0 {
                bail!("{name}: kg (PID {pid}) has CapEff {eff:016x}, CapBnd {bnd:016x}");
            }
            seen.push(format!("{name}: CapEff {eff:x} CapBnd {bnd:x}"));
        }
        Ok(seen.join("; "))
    }

    /// One busybox pod per node; each address inside its node's pod CIDR.
    fn test_pods(&self) -> Result<String> {
        for (node, _) in NODES {
            let name = format!("probe-{node}");
            self.apply(&busybox_pod(&name, "probe", node, &["sleep", "86400"]))?;
        }
        let mut seen = Vec::new();
        for (node, _) in NODES {
            let name = format!("probe-{node}");
            let ip = wait_for(Duration::from_secs(120), &name, || {
                let p = self.json(&["get", "pod", &name])?;
                let running = p["status"]["phase"] == "Running";
                Ok(running
                    .then(|| p["status"]["podIP"].as_str().map(str::to_owned))
                    .flatten())
            })?;
            let cidr = self.pod_cidr(node)?;
            if !in_cidr(&ip, &cidr) {
                bail!("{name} has {ip}, outside {node}'s pod CIDR {cidr}");
            }
            seen.push(format!("{name} {ip} in {cidr}"));
        }
        Ok(seen.join(", "))
    }

    fn probe_ips(&self) -> Result<Vec<(String, String)>> {
        let pods = self.json(&["get", "pods", "-l", "app=probe"])?;
        Ok(pods["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| {
                Some((
                    p["metadata"]["name"].as_str()?.to_owned(),
                    p["status"]["podIP"].as_str()?.to_owned(),
                ))
            })
            .collect())
    }

    /// Every probe pod pings every other one; the mesh gets `settle` to converge first.
    fn adjacency(&self, settle: Duration) -> Result<String> {
        let pods = self.probe_ips()?;
        if pods.len() != NODES.len() {
            bail!(
                "{} probe pods with an address, not {}",
                pods.len(),
                NODES.len()
            );
        }
        let mut pairs = 0;
        for (from, _) in &pods {
            let targets: Vec<&str> = pods
                .iter()
                .filter(|(to, _)| to != from)
                .map(|(_, ip)| ip.as_str())
                .collect();
            // Prints the targets that did not answer `count` pings out of `count`.
            let ping = |count: u32| {
                let script = format!(
                    "for ip in {}; do ping -q -c {count} -W 2 $ip >/dev/null || echo $ip; done",
                    targets.join(" ")
                );
                self.kubectl(&["exec", from, "--", "sh", "-c", &script])
                    .map(|out| {
                        out.split_whitespace()
                            .map(str::to_owned)
                            .collect::<Vec<_>>()
                    })
            };
            wait_for(settle, &format!("{from} -> {targets:?}"), || {
                let failed = ping(1)?;
                if failed.is_empty() {
                    Ok(Some(()))
                } else {
                    bail!("no answer from {failed:?}")
                }
            })?;
            let failed = ping(3)?;
            if !failed.is_empty() {
                bail!("{from}: pings lost to {failed:?} after the mesh had converged");
            }
            pairs += targets.len();
        }
        Ok(format!("{pairs} ordered pairs, 3 of 3 pings each"))
    }

    /// What to read when the DaemonSet does not come up: pods and their events.
    fn dump_state(&self) {
        for args in [
            &["-n", "kube-system", "get", "pods", "-o", "wide"][..],
            &[
                "-n",
                "kube-system",
                "describe",
                "pods",
                "-l",
                "app.kubernetes.io/part-of=kilo",
            ][..],
        ] {
            match self.kubectl(args) {
                Ok(out) => eprintln!("{out}"),
                Err(e) => eprintln!("{e:#}"),
            }
        }
        eprintln!("e2e: logs of every component: {WORK}/logs");
    }
}

/// A busybox pod on `node` (the scheduler is not asked), labelled `app: APP`.
fn busybox_pod(name: &str, app: &str, node: &str, command: &[&str]) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": app, "image": "local/busybox:debian", "imagePullPolicy": "Never",
                "command": command,
            }],
        },
    })
}

/// A wireguard-go device's state as its UAPI socket gives it (`get=1`).
fn uapi_get(socket: &Path) -> Result<String> {
    let mut conn = UnixStream::connect(socket)?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.write_all(b"get=1\n\n")?;
    let mut state = Vec::new();
    let mut buf = [0u8; 4096];
    while !state.ends_with(b"\n\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        state.extend_from_slice(&buf[..n]);
    }
    Ok(String::from_utf8_lossy(&state).into_owned())
}

/// Seconds since the epoch.
fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Median and worst of `samples`, in seconds.
fn spread(samples: &[f64]) -> String {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    let worst = sorted.last().copied().unwrap_or(f64::NAN);
    format!(
        "median {median:.2} s, worst {worst:.2} s over {} ({})",
        sorted.len(),
        samples
            .iter()
            .map(|s| format!("{s:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// `--bench`'s records in `cargo xtask bench`'s format: one table, a cell per figure.
fn bench_records(peers: &[f64], joins: &[f64]) -> Vec<Value> {
    const TABLE: &str = "e2e";
    let cell = |row: &str, values: &[f64]| json!({"type": "cell", "table": TABLE, "row": row, "col": "seconds", "values": values});
    vec![
        json!({
            "type": "table", "table": TABLE, "unit": "s",
            "title": "Control-plane latency on the e2e cluster (userspace WireGuard)",
        }),
        cell(
            "a Peer created -> on every leader's WireGuard device",
            peers,
        ),
        cell(
            "a node registered -> its pod answers a pod in another location",
            joins,
        ),
        json!({"type": "note", "table": TABLE, "text": format!(
            "From the API server's audit timestamp of the create (ResponseComplete) to: every \
             leader's wireguard-go listing the Peer's key (UAPI polled every 20 ms); a ping from \
             a probe pod in another location answered by a pod the scheduler put on the new node \
             (created as it registered; kube-proxy, kg's and wireguard-go's pods, the CNI \
             configuration kg writes and the pod itself start in that time). {} nodes in {} locations on this machine's 2 \
             shared cores; the nodes join one after another.",
            NODES.len(),
            NODES.iter().map(|(_, l)| l).collect::<BTreeSet<_>>().len(),
        )}),
        json!({"type": "meta", "key": "Kubernetes", "value": crate::pins::KUBE_APISERVER}),
        json!({"type": "meta", "key": "repetitions", "value": format!(
            "{BENCH_REPETITIONS} Peers, {} nodes", BENCH_NODES.len()
        )}),
    ]
}

fn uids(pods: &[Value]) -> Vec<String> {
    let mut uids: Vec<String> = pods
        .iter()
        .filter_map(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
        .collect();
    uids.sort();
    uids
}

/// The value of the sample `series` (name and labels, as exposed) in Prometheus' text format.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

fn ready_nodes(nodes: &Value) -> Vec<String> {
    nodes["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| {
            n["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
        .filter_map(|n| n["metadata"]["name"].as_str().map(str::to_owned))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_rfc_4648() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded);
        }
    }

    #[test]
    fn cidr_containment() {
        assert!(in_cidr("10.42.3.7", "10.42.3.0/24"));
        assert!(!in_cidr("10.42.4.7", "10.42.3.0/24"));
        assert!(in_cidr("1.2.3.4", "0.0.0.0/0"));
        assert!(!in_cidr("10.42.3.7", "not a cidr"));
    }
}
