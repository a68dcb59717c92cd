//! `cargo xtask e2e --bench`: how long a Peer takes to reach every leader's WireGuard device and
//! a new node's pods to be reachable, measured on the cluster, as `cargo xtask bench` records.
use super::*;

/// How many times `--bench` measures each figure.
const BENCH_REPETITIONS: usize = 5;
/// Nodes joined one after the other for the node figure (then stopped and deleted).
const BENCH_NODES: &[(&str, &str)] = &[("n6", "east"), ("n7", "west"), ("n8", "east")];

impl Cluster {
    /// `--bench`: kg deployed as for the checks, then both figures measured; their records
    /// written to `out` (JSON lines, `cargo xtask bench`'s format).
    pub(super) fn bench(&self, mut report: Report, out: &Path) -> Result<()> {
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
    pub(super) fn bench_peers(&self) -> Result<Vec<f64>> {
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
    pub(super) fn bench_nodes(&self) -> Result<Vec<f64>> {
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
    pub(super) fn audit_created(&self, resource: &str, name: &str) -> Result<f64> {
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
             configuration kg writes and the pod itself start in that time). {} nodes in {} locations on the 2 shared cores \
             of the machine the figures were measured on; the nodes join one after another.",
            NODES.len(),
            NODES.iter().map(|(_, l)| l).collect::<BTreeSet<_>>().len(),
        )}),
        json!({"type": "meta", "key": "Kubernetes", "value": crate::pins::KUBE_APISERVER}),
        json!({"type": "meta", "key": "repetitions", "value": format!(
            "{BENCH_REPETITIONS} Peers, {} nodes", BENCH_NODES.len()
        )}),
    ]
}
