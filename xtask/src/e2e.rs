//! `cargo xtask e2e [--keep | --down]`: kg deployed by kubelet on a real cluster on this machine.
//!
//! It builds or takes from the cache what the cluster needs (the Kubernetes binaries from
//! Debian's source package, containerd and the CNI plugins from Debian, the project image and
//! the test images), starts a control plane and kubelet nodes in network namespaces
//! (`xtask/scripts/e2e-cluster.sh`), applies `xtask/e2e` with `kubectl apply -k` as a user
//! would (the userspace overlay, images renamed only), then runs each check as a step that
//! reports PASS or FAIL. The cluster is removed at the end (every process it started, by PID,
//! with the containers, cgroups, mounts and namespaces), unless `--keep`.
use std::{
    net::Ipv4Addr,
    path::PathBuf,
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

/// The capabilities the DaemonSet's kilo container adds (after `drop: [ALL]`).
const KILO_CAPS: &[(&str, u32)] = &[("NET_ADMIN", 12), ("PERFMON", 38), ("BPF", 39)];

pub fn e2e(keep: bool, down: bool) -> Result<()> {
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
fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
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
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// `cmd`'s standard output, `input` its standard input; fails when it does.
fn output_in(cmd: &mut Command, input: &str) -> Result<String> {
    use std::io::Write as _;
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
        if !report.step("DaemonSet rolled out on every node", || {
            wait_for(Duration::from_secs(300), "DaemonSet kilo ready", || {
                let ds = self.json(&["-n", "kube-system", "get", "daemonset", "kilo"])?;
                let s = &ds["status"];
                let want = NODES.len() as u64;
                let ok = [
                    "desiredNumberScheduled",
                    "numberReady",
                    "updatedNumberScheduled",
                ]
                .iter()
                .all(|k| s[k].as_u64() == Some(want));
                Ok(ok.then(|| format!("{want}/{want} ready: {s}")))
            })
        }) {
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
            "a ClusterIP Service's endpoint in another location sees the client pod's address",
            || self.service_across_locations(),
        );
        report.step(
            "a Peer applied with kubectl: `kgctl showconf peer` configures an outside host that then reaches every pod",
            || self.peer(),
        );
        report.step(
            "the deployed webhook refuses a Peer with a malformed CIDR, naming the field",
            || self.webhook(),
        );
        report.step(
            "a rolling update of the DaemonSet under pod-to-pod traffic loses no packet",
            || self.rolling_update(),
        );
        report.step(
            "a node deleted with kubectl leaves the others' routes",
            || self.node_deleted(),
        );
        report.step("kubectl delete -k leaves every node as before kg", || {
            self.deleted()
        });
    }

    /// After `kubectl delete -k`, what kg's pods left on each remaining node: routes (kg's
    /// protocol 107), rules, the WireGuard link, the nftables table, bpffs pins, TC filters on
    /// the pod bridge and the Node annotations.
    fn deleted(&self) -> Result<String> {
        self.kubectl(&["delete", "-k", "xtask/e2e"])?;
        wait_for(Duration::from_secs(120), "kg's pods gone", || {
            Ok(self.kilo_pods()?.is_empty().then_some(()))
        })?;
        let mut left = Vec::new();
        for (node, _) in &NODES[..NODES.len() - 1] {
            let probes: [(&str, &[&str]); 6] = [
                ("routes", &["ip", "route", "show", "proto", "107"]),
                (
                    "rules",
                    &["sh", "-c", "ip rule | grep -v -E '^(0|32766|32767):'"],
                ),
                (
                    "link kilo0",
                    &["sh", "-c", "ip -o link show kilo0 2>/dev/null"],
                ),
                ("nftables", &["sh", "-c", "nft list tables | grep kilo"]),
                // (progs.debug and maps.debug come with every bpffs mount)
                (
                    "bpffs pins",
                    &[
                        "find",
                        "/sys/fs/bpf",
                        "-mindepth",
                        "1",
                        "!",
                        "-name",
                        "*.debug",
                    ],
                ),
                (
                    "TC filters",
                    &["tc", "filter", "show", "dev", "kube-bridge", "ingress"],
                ),
            ];
            for (what, cmd) in probes {
                let out = self.node_exec(node, cmd).unwrap_or_default();
                if !out.trim().is_empty() {
                    left.push(format!("{node} {what}: {}", out.trim().replace('\n', "; ")));
                }
            }
            let n = self.json(&["get", "node", node])?;
            let ours: Vec<&String> = n["metadata"]["annotations"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, _)| k)
                .filter(|k| k.starts_with("kilo.squat.ai/"))
                .collect();
            if !ours.is_empty() {
                left.push(format!("{node} annotations: {ours:?}"));
            }
        }
        if !left.is_empty() {
            bail!("left behind:\n  {}", left.join("\n  "));
        }
        Ok("no route, rule, link, table, pin, filter or annotation of kg's".into())
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

    /// A changed pod annotation rolls the DaemonSet while one probe pod pings another in a
    /// different location five times a second.
    fn rolling_update(&self) -> Result<String> {
        let pods = self.probe_ips()?;
        let (from, _) = &pods[0];
        let (to, ip) = pods
            .iter()
            .rev()
            .find(|(n, _)| n != from)
            .context("two probe pods")?;
        let old: Vec<String> = self
            .kilo_pods()?
            .iter()
            .filter_map(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
            .collect();
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
            .and_then(|_| {
                self.kubectl(&[
                    "-n",
                    "kube-system",
                    "rollout",
                    "status",
                    "daemonset/kilo",
                    "--timeout=300s",
                ])
            });
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
        let replaced = self
            .kilo_pods()?
            .iter()
            .filter(|p| {
                p["metadata"]["uid"]
                    .as_str()
                    .is_some_and(|u| !old.iter().any(|o| o == u))
            })
            .count();
        if replaced != NODES.len() {
            bail!("{replaced} of {} kg pods replaced", NODES.len());
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
        Ok(format!(
            "{replaced} pods replaced; {from} -> {to}: {summary}"
        ))
    }

    /// The last node goes away (its kubelet, containers and containerd stopped) and is deleted:
    /// no other node keeps a route to its pod CIDR.
    fn node_deleted(&self) -> Result<String> {
        let (gone, _) = NODES[NODES.len() - 1];
        let cidr = self.pod_cidr(gone)?;
        run(Command::new("bash")
            .arg(&self.script)
            .args(["stop-node", WORK, gone]))?;
        self.kubectl(&["delete", "node", gone])?;
        for (node, _) in &NODES[..NODES.len() - 1] {
            wait_for(
                Duration::from_secs(60),
                &format!("{node}: no route to {cidr}"),
                || {
                    let routes = self.node_exec(node, &["ip", "route", "show", &cidr])?;
                    Ok(routes.trim().is_empty().then_some(()))
                },
            )?;
        }
        Ok(format!("{gone} ({cidr}) gone from the others' routes"))
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
                "app.kubernetes.io/name=kilo",
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
