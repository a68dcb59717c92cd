//! The e2e scenario: a rolling update of kg's DaemonSet under traffic.
use super::*;

impl Cluster {
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
        let (sent, received, gap) = ping_loss(&log, 0.2)?;
        let new = self.kilo_pods()?;
        let replaced = uids(&new).iter().filter(|u| !old.contains(u)).count();
        if replaced != NODES.len() {
            bail!("{replaced} of {} kg pods replaced", NODES.len());
        }
        if uids(&self.wireguard_pods()?) != wireguard {
            bail!("wireguard-go's pods were replaced too");
        }
        if sent < 10 || received != sent {
            bail!(
                "{from} -> {to} ({ip}): {received} of {sent} pings answered (longest outage {gap:.1} s)"
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
                "{replaced} kg pods replaced, wireguard-go's kept; {from} -> {to}: {received} of {sent} pings answered; \
                 heartbeats expired during the rollout (oldest last-seen: {}), so the others \
                 dropped those nodes and took them back, rewriting entries and IPIP links: of the \
                 {maps} pins, every map kept its ID",
                expired.join(", ")
            ));
        }
        Ok(format!(
            "{replaced} kg pods replaced, wireguard-go's kept; {from} -> {to}: {received} of {sent} pings answered; the {maps} pinned maps and links kept their IDs, no map entry inserted nor program attached anew"
        ))
    }
}
