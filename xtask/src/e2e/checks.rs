//! The checks `cargo xtask e2e` runs on the cluster, each a step that reports PASS or FAIL: the
//! deployment, the pods' reach in both granularities, a Service, a Peer, the webhook, a rolling
//! update, a node deleted, `allowed-location-ips` and `kubectl delete -k`.
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
    pub(super) fn deleted(&self) -> Result<String> {
        self.kubectl(&["delete", "-k", "xtask/e2e"])?;
        wait_for(
            Duration::from_secs(120),
            "kg's and wireguard-go's pods gone",
            || {
                Ok(self
                    .pods("app.kubernetes.io/part-of=kilo")?
                    .is_empty()
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
    pub(super) fn service_across_locations(&self) -> Result<String> {
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
    pub(super) fn webhook(&self) -> Result<String> {
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
    pub(super) fn peer(&self) -> Result<String> {
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
    pub(super) fn rolling_update(&self) -> Result<String> {
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
            now() as u64
        );
        let (rolled, ages) = self.heartbeat_ages(|| {
            self.kubectl(&[
                "-n",
                "kube-system",
                "patch",
                "daemonset",
                "kilo",
                "-p",
                &patch,
            ])
            .and_then(|_| self.rollout("kilo"))
        });
        // A node whose kg was away for two check-in periods is not ready in Kilo's sense: the
        // others drop it and take it back (as Kilo does), which rewrites entries and IPIP links.
        let expired: Vec<String> = ages
            .iter()
            .filter(|(_, age)| **age >= HEARTBEAT_EXPIRY_SECS - 2)
            .map(|(node, age)| format!("{node} ({age} s)"))
            .collect();
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
            let changed: Vec<&String> = after
                .iter()
                .filter(|p| !before.contains(p))
                .filter(|p| expired.is_empty() || !p.contains("/links/"))
                .collect();
            if !changed.is_empty() || after.len() != before.len() {
                anew.push(format!(
                    "{node}: pinned anew {changed:?} (before: {before:?})"
                ));
            }
        }
        // After an expiry, the new kg rewrote what the topology's change asked for.
        for pod in new.iter().filter(|_| expired.is_empty()) {
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
        if !expired.is_empty() {
            return Ok(format!(
                "{replaced} kg pods replaced, wireguard-go's kept; {from} -> {to}: {summary}; \
                 heartbeats expired during the rollout (oldest last-seen: {}), so the others \
                 dropped those nodes and took them back, rewriting entries and IPIP links: of the \
                 {maps} pins, every map kept its ID",
                expired.join(", ")
            ));
        }
        Ok(format!(
            "{replaced} kg pods replaced, wireguard-go's kept; {from} -> {to}: {summary}; the {maps} pinned maps and links kept their IDs, no map entry inserted nor program attached anew"
        ))
    }

    /// The last node goes away (its kubelet, containers and containerd stopped) and is deleted:
    /// no other node keeps a route to its pod CIDR, nor its public key among its WireGuard peers.
    pub(super) fn node_deleted(&self) -> Result<String> {
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

    /// Kilo's e2e in full granularity: `--mesh-granularity=full` added to kg's args, every pod
    /// reaches every other; then the args as the overlay has them, and again.
    pub(super) fn full_granularity(&self) -> Result<String> {
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
    pub(super) fn allowed_location_ips(&self) -> Result<String> {
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
    pub(super) fn test_pods(&self) -> Result<String> {
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
}
