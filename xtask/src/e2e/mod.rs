//! `cargo xtask e2e [--keep | --down | --bench FILE]`: kg deployed by kubelet on a real cluster on
//! this machine.
//!
//! It builds or takes from the cache what the cluster needs (the Kubernetes binaries from
//! Debian's source package, containerd and the CNI plugins from Debian, the project image and
//! the test images), starts a control plane and kubelet nodes in network namespaces
//! (`xtask/scripts/e2e-cluster.sh`), applies `xtask/e2e` as `kubectl apply -k` would (the
//! userspace overlay, images renamed only; rendered by the pinned kubectl's kustomize, applied by
//! the cluster release's kubectl), then runs each check as a step that
//! reports PASS or FAIL. The cluster is removed at the end (every process it started, by PID,
//! with the containers, cgroups, mounts and namespaces), unless `--keep`.
//!
//! `--bench FILE` measures instead of checking, on the same cluster: the time from a Peer's
//! creation (the API server's audit timestamp) to every leader's WireGuard device carrying it,
//! and from a node's registration (same) to a pod on it answering a pod in another location.
//! FILE gets `cargo xtask bench`'s JSON lines (see xtask's `bench` module): one table, one cell
//! per figure with every repetition's value.
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
mod allowed_location_ips;
mod bench;
mod checks;
mod delete;
mod failover;
mod forward;
mod granularity;
mod node_deleted;
mod peer;
mod rolling_update;
mod round_trip;
mod service;
mod webhook;

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
const KILO_CAPS: &[(&str, u32)] = &[
    ("NET_ADMIN", 12),
    ("NET_RAW", 13),
    ("PERFMON", 38),
    ("BPF", 39),
];

/// kg's pins (`--clean-up=false` leaves them, see `deleted`).
const PIN_DIR: &str = "/sys/fs/bpf/kilo";

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
    let kilo = round_trip::kilo_git();
    if let Some(git) = &kilo {
        tars.push(round_trip::kilo_image(git)?);
    }
    eprintln!("e2e: prerequisites ready after {:?}", start.elapsed());

    let cluster = Cluster {
        script,
        work: PathBuf::from(WORK),
        keep,
        kilo,
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

/// Kilo's readiness: a node's last-seen younger than two check-in periods of 30 s.
pub(super) const HEARTBEAT_EXPIRY_SECS: i64 = 60;

/// The running cluster; dropping it removes it (unless kept).
struct Cluster {
    script: PathBuf,
    work: PathBuf,
    keep: bool,
    /// Kilo's source, for the round trip Kilo -> kg -> Kilo (`round_trip`).
    kilo: Option<PathBuf>,
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

    /// `xtask/e2e` as the pinned kubectl's kustomize renders it (`pins::KUBECTL`): the
    /// manifests use kustomize's current fields, which the cluster release's kubectl predates.
    /// Applying the result is what `kubectl apply -k` does with a current kubectl.
    fn kustomized(&self) -> Result<String> {
        crate::install::install_kubectl()?;
        let kubectl = crate::install::kubectl_dir().join("usr/bin/kubectl");
        output(
            Command::new(kubectl)
                .current_dir(root_dir())
                .args(["kustomize", "xtask/e2e"]),
        )
    }

    fn apply(&self, object: &Value) -> Result<String> {
        self.kubectl_in(&["apply", "-f", "-"], Some(&object.to_string()))
    }

    fn json(&self, args: &[&str]) -> Result<Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl(&all)?).context("kubectl's JSON")
    }

    /// This build's kgctl (the image's), in the control plane's namespace, on the cluster.
    fn kgctl(&self) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg("--net=/run/netns/krs-e2e-cp")
            .arg(root_dir().join(format!("target/{}/release/kgctl", pins::IMAGE_TARGET)))
            .arg("--kubeconfig")
            .arg(self.work.join("admin.kubeconfig"));
        cmd
    }

    /// `pod`'s `kilo` container (kg) on `node`: its containerd ID and its host PID, through the
    /// node's containerd.
    fn kilo_task(&self, pod: &Value, node: &str) -> Result<(String, String)> {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let id = pod["status"]["containerStatuses"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == "kilo"))
            .and_then(|c| c["containerID"].as_str())
            .and_then(|id| id.strip_prefix("containerd://"))
            .with_context(|| format!("{name}: no containerd container ID"))?;
        let tasks = self.node_exec(node, &["ctr", "-n", "k8s.io", "tasks", "ls"])?;
        let pid = tasks
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(id)).then(|| f.next()).flatten()
            })
            .with_context(|| format!("{name}: no task {id} on {node}"))?;
        Ok((id.to_owned(), pid.to_owned()))
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

    /// kube-system's pods with `selector`.
    fn pods(&self, selector: &str) -> Result<Vec<Value>> {
        let pods = self.json(&["-n", "kube-system", "get", "pods", "-l", selector])?;
        Ok(pods["items"].as_array().cloned().unwrap_or_default())
    }

    fn kilo_pods(&self) -> Result<Vec<Value>> {
        self.pods("app.kubernetes.io/name=kilo")
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
        self.pods("app.kubernetes.io/name=kilo-wireguard")
    }

    /// Runs `f` while reading every node's `kilo.squat.ai/last-seen` every 2 s; returns its
    /// result and the oldest heartbeat age (s) seen per node.
    pub(super) fn heartbeat_ages<T>(&self, f: impl FnOnce() -> T) -> (T, BTreeMap<String, i64>) {
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut oldest = BTreeMap::new();
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(nodes) = self.json(&["get", "nodes"]) {
                        let now = now() as i64;
                        for n in nodes["items"].as_array().into_iter().flatten() {
                            let seen = n["metadata"]["annotations"]["kilo.squat.ai/last-seen"]
                                .as_str()
                                .and_then(|v| v.parse::<i64>().ok());
                            if let (Some(name), Some(seen)) = (n["metadata"]["name"].as_str(), seen)
                            {
                                let age = oldest.entry(name.to_owned()).or_insert(0);
                                *age = (*age).max(now - seen);
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_secs(2));
                }
                oldest
            });
            let out = f();
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            (out, reader.join().unwrap_or_default())
        })
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

    fn pod_cidr(&self, node: &str) -> Result<String> {
        let n = self.json(&["get", "node", node])?;
        n["spec"]["podCIDR"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("{node} has no pod CIDR"))
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

/// Sent, received, and the longest run of unanswered pings in seconds, from a busybox `ping -i
/// INTERVAL` log that ended with its summary. busybox prints the summary as soon as it is
/// stopped, so the last ping sent may still be on its way: unanswered, it is not counted as sent.
fn ping_loss(log: &str, interval: f64) -> Result<(u64, u64, f64)> {
    let summary = log
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .with_context(|| format!("no ping summary in {log:?}"))?;
    let nums: Vec<u64> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let (mut sent, received) = (nums[0], nums[1]);
    // The answered sequence numbers, with the first and one past the last sent around them.
    let mut seqs = vec![-1i64];
    seqs.extend(
        log.split("seq=")
            .skip(1)
            .filter_map(|r| r.split_whitespace().next()?.parse::<i64>().ok()),
    );
    if sent > 0 && !seqs.contains(&(sent as i64 - 1)) {
        sent -= 1;
    }
    seqs.push(sent as i64);
    let gap = seqs.windows(2).map(|w| w[1] - w[0] - 1).max().unwrap_or(0);
    Ok((sent, received, gap.max(0) as f64 * interval))
}

/// Seconds since the epoch.
fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
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
    fn ping_loss_counts_the_longest_gap_at_either_end() {
        let log = "PING 10.0.0.2 (10.0.0.2): 56 data bytes
64 bytes from 10.0.0.2: seq=1 ttl=64 time=0.1 ms
64 bytes from 10.0.0.2: seq=2 ttl=64 time=0.1 ms
64 bytes from 10.0.0.2: seq=6 ttl=64 time=0.1 ms

--- 10.0.0.2 ping statistics ---
10 packets transmitted, 3 packets received, 70% packet loss
";
        let (sent, received, gap) = ping_loss(log, 0.2).unwrap();
        // seq 9 was in flight when ping stopped; 3 to 5 unanswered: the longest run (7 and 8
        // at the end are shorter).
        assert_eq!((sent, received), (9, 3));
        assert!((gap - 0.6).abs() < 1e-9, "{gap}");
        assert!(ping_loss("no summary", 0.2).is_err());
        // Only the last one unanswered: in flight, no loss.
        let log = "64 bytes from 10.0.0.2: seq=0 ttl=64 time=0.1 ms
64 bytes from 10.0.0.2: seq=1 ttl=64 time=0.1 ms
3 packets transmitted, 2 packets received, 33% packet loss
";
        assert_eq!(ping_loss(log, 0.2).unwrap(), (2, 2, 0.0));
        // The middle one unanswered: a loss.
        let log = "64 bytes from 10.0.0.2: seq=0 ttl=64 time=0.1 ms
64 bytes from 10.0.0.2: seq=2 ttl=64 time=0.1 ms
3 packets transmitted, 2 packets received, 33% packet loss
";
        let (sent, received, gap) = ping_loss(log, 0.2).unwrap();
        assert_eq!((sent, received), (3, 2));
        assert!((gap - 0.2).abs() < 1e-9, "{gap}");
    }

    #[test]
    fn cidr_containment() {
        assert!(in_cidr("10.42.3.7", "10.42.3.0/24"));
        assert!(!in_cidr("10.42.4.7", "10.42.3.0/24"));
        assert!(in_cidr("1.2.3.4", "0.0.0.0/0"));
        assert!(!in_cidr("10.42.3.7", "not a cidr"));
    }
}
