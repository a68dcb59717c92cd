//! The steps `cargo xtask e2e` runs on the cluster, in order, each reporting PASS or FAIL (the
//! table in [`Cluster::checks`]), and what several share: the deployment, the probe pods and
//! their adjacency. Each scenario has its own file.
use super::*;

impl Cluster {
    pub(super) fn checks(&self, report: &mut Report) {
        report.step("nodes NotReady before kg (no CNI configuration)", || {
            let nodes = self.json(&["get", "nodes"])?;
            let ready = ready_nodes(&nodes);
            if !ready.is_empty() {
                bail!("already Ready: {ready:?}");
            }
            Ok(format!("{} nodes registered, none Ready", NODES.len()))
        });
        match &self.kilo {
            Some(git) => self.round_trip(report, git),
            None => println!(
                "SKIP the round trip Kilo -> kg -> Kilo: no Kilo source (a clone of \
                 github.com/squat/kilo) at $KILO_GIT or {}",
                crate::install::cache_dir().join("kilo.git").display()
            ),
        }
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
            "a node with FORWARD policy DROP: its pods cut off, then forwarded with --iptables-forward-rules (kg's args patched, rolled out, and back)",
            || self.forward_drop(),
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
        self.failover(report);
        report.step(
            "a node deleted with kubectl leaves the others' routes and WireGuard peers",
            || self.node_deleted(),
        );
        report.step(
            "kubectl delete -k leaves on each node exactly what the README lists",
            || self.deleted(),
        );
    }

    /// The webhook's Secret (before, so its pod starts at once), `kubectl apply -k`, then the
    /// CA in the ValidatingWebhookConfiguration, as docs/deploying.md says without cert-manager.
    pub(super) fn deploy(&self) -> Result<String> {
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
        let applied = self.kubectl_in(&["apply", "-f", "-"], Some(&self.kustomized()?))?;
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

    pub(super) fn check_capabilities(&self) -> Result<String> {
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
            let (_, pid) = self.kilo_task(&pod, node)?;
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

    /// One busybox pod per node, `APP-NODE` labelled `app: APP`; each pod's node, name and
    /// address once it runs (120 s at most).
    pub(super) fn pod_per_node(&self, app: &str) -> Result<Vec<(&'static str, String, String)>> {
        for (node, _) in NODES {
            let name = format!("{app}-{node}");
            self.apply(&busybox_pod(&name, app, node, &["sleep", "86400"]))?;
        }
        let mut pods = Vec::new();
        for (node, _) in NODES {
            let name = format!("{app}-{node}");
            let ip = wait_for(Duration::from_secs(120), &name, || {
                let p = self.json(&["get", "pod", &name])?;
                Ok((p["status"]["phase"] == "Running")
                    .then(|| p["status"]["podIP"].as_str().map(str::to_owned))
                    .flatten())
            })?;
            pods.push((*node, name, ip));
        }
        Ok(pods)
    }

    /// One busybox pod per node; each address inside its node's pod CIDR.
    pub(super) fn test_pods(&self) -> Result<String> {
        let mut seen = Vec::new();
        for (node, name, ip) in self.pod_per_node("probe")? {
            let cidr = self.pod_cidr(node)?;
            if !in_cidr(&ip, &cidr) {
                bail!("{name} has {ip}, outside {node}'s pod CIDR {cidr}");
            }
            seen.push(format!("{name} {ip} in {cidr}"));
        }
        Ok(seen.join(", "))
    }

    /// Whether `pod` gets an answer to one ping to `ip` (within 2 s).
    pub(super) fn reaches(&self, pod: &str, ip: &str) -> Result<bool> {
        let script = format!("ping -c 1 -W 2 {ip} >/dev/null && echo yes || echo no");
        Ok(self
            .kubectl(&["exec", pod, "--", "sh", "-c", &script])?
            .trim()
            == "yes")
    }

    /// Waits (60 s at most) until `pod` reaches `ip`, or with `want` false, no longer does.
    pub(super) fn await_reach(&self, pod: &str, ip: &str, want: bool) -> Result<()> {
        let what = match want {
            true => format!("{pod} -> {ip}"),
            false => format!("{pod} no longer reaching {ip}"),
        };
        wait_for(Duration::from_secs(60), &what, || {
            Ok((self.reaches(pod, ip)? == want).then_some(()))
        })
    }

    /// Every probe pod pings every other one; the mesh gets `settle` to converge first.
    pub(super) fn adjacency(&self, settle: Duration) -> Result<String> {
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
            // Prints the targets that did not answer `count` pings out of `count`, all pinged
            // at once.
            let ping = |count: u32| {
                let script = format!(
                    "for ip in {}; do (ping -q -c {count} -i 0.2 -W 2 $ip >/dev/null || echo $ip) & done; wait",
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
}
