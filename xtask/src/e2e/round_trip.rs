//! The e2e scenario: a cluster running Kilo 0.7 itself, from Kilo's own userspace manifest, moved
//! to kg node by node as docs/migrating.md says (leaders first, each node checked), then rolled
//! back to Kilo as its rollback section says, with pings between every pair of nodes' pods the
//! whole time and the loss reported per step. At the end Kilo is removed (with its own clean-up)
//! and the other checks deploy kg on the nodes it leaves.
//!
//! Kilo's image is built from its source (`xtask/scripts/kilo-image.sh`, cached), which none of
//! the registries the tests install from serves: the scenario needs a clone of
//! github.com/squat/kilo with its tags at `$KILO_GIT`, or at `kilo.git` in the cache directory,
//! and is skipped, saying so, without one.
//!
//! Both agents run with `--encapsulate=never`: this kernel has no `ipip` module, which Kilo's
//! default IPIP inside a location needs.
use std::path::Path;

use super::*;

/// Kilo's release, its userspace manifest and its CRDs (paths in Kilo's repository).
const KILO_TAG: &str = "0.7.0";
const KILO_MANIFEST: &str = "manifests/kilo-kubeadm-userspace.yaml";
const KILO_CRDS: &str = "manifests/crds.yaml";

/// The order docs/migrating.md asks for: each location's first node, annotated as its leader,
/// then the others.
const MOVE_ORDER: &[&str] = &["n1", "n3", "n5", "n2", "n4"];

/// kg's TC programs, by name: with the pins gone, [`LEFT_BEHIND`]'s check through them sees none.
const KG_PROGRAMS: (&str, &str) = (
    "kg's TC programs",
    "bpftool net show | grep -E 'kilo_(ingress|encap|decap)'",
);

/// What kg's clean-up removes from a node, each with a command that prints it: the first four of
/// [`LEFT_BEHIND`] (routes, rules, the nftables table, the pins) and its TC programs.
fn kg_state() -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    LEFT_BEHIND[..4].iter().chain(std::iter::once(&KG_PROGRAMS))
}

/// The Kilo source to build from, if there is one.
pub(super) fn kilo_git() -> Option<PathBuf> {
    std::env::var_os("KILO_GIT")
        .map(PathBuf::from)
        .or_else(|| Some(crate::install::cache_dir().join("kilo.git")))
        .filter(|p| p.exists())
}

/// Kilo's image as a docker-archive, built from `git` and cached, keyed on the tag's commit and
/// the script that builds it.
pub(super) fn kilo_image(git: &Path) -> Result<PathBuf> {
    let script = root_dir().join("xtask/scripts/kilo-image.sh");
    let commit = output(
        Command::new("git")
            .arg("--git-dir")
            .arg(git)
            .args(["rev-parse", &format!("{KILO_TAG}^{{commit}}")]),
    )?;
    // FNV-1a: a stable digest of the script, for the cache key only.
    let digest = std::fs::read(&script)?
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    let dir = crate::install::cache_dir().join(format!(
        "kilo-image-{KILO_TAG}-{}-{digest:016x}",
        &commit.trim()[..12.min(commit.trim().len())]
    ));
    let tar = dir.join("kilo.tar");
    if !tar.exists() {
        run(Command::new("bash").arg(&script).arg(git).arg(&dir))?;
    }
    Ok(tar)
}

/// Pings from every round-trip pod to every other, five a second, until [`Cluster::stop_pings`].
struct Pings(Vec<std::process::Child>);

/// What one step lost, over every pair.
struct Loss {
    sent: u64,
    lost: u64,
    /// Pairs that lost pings: `from -> to: lost (longest gap in s)`.
    pairs: Vec<String>,
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "lost {} of {} pings", self.lost, self.sent)?;
        match self.pairs.is_empty() {
            true => write!(f, " (no pair lost any)"),
            false => write!(f, " ({})", self.pairs.join(", ")),
        }
    }
}

impl Cluster {
    /// The round trip, one report step per stage; the cluster is left without Kilo or kg.
    pub(super) fn round_trip(&self, report: &mut Report, git: &Path) {
        let kilo = |path: &str| -> Result<String> {
            output(
                Command::new("git")
                    .arg("--git-dir")
                    .arg(git)
                    .args(["show", &format!("{KILO_TAG}:{path}")]),
            )
        };
        let up = report.step(
            "Kilo 0.7 from its own userspace manifest: its rules on every node",
            || self.kilo_up(&kilo(KILO_MANIFEST)?, &kilo(KILO_CRDS)?),
        );
        if !up {
            self.dump_state();
            return;
        }
        let mut pods = Vec::new();
        let reached = report.step("Kilo's mesh: every pod reaches every other", || {
            pods = self.round_trip_pods()?;
            Ok(format!(
                "{} pods, {} pairs",
                pods.len(),
                pods.len() * (pods.len() - 1)
            ))
        });
        if !reached {
            return;
        }
        let mut moved = report.step(
            "migration step 1: Kilo's DaemonSet confined (OnDelete), kilo-rs applied, no pod restarted",
            || self.under_pings(&pods, || self.confine_kilo()),
        );
        for node in MOVE_ORDER {
            if !moved {
                break;
            }
            moved = report.step(
                &format!("migration: {node} labelled for kg, its kg in sync (/check)"),
                || self.under_pings(&pods, || self.move_to_kg(node)),
            );
        }
        if !moved {
            self.dump_state();
        }
        let mut back = true;
        for node in MOVE_ORDER.iter().rev() {
            back &= report.step(
                &format!("rollback: {node} unlabelled, Kilo back, nothing of kg's left"),
                || self.under_pings(&pods, || self.back_to_kilo(node)),
            );
        }
        if back {
            report.step(
                "rollback: kg's DaemonSets deleted, Kilo's strategy and CRD restored",
                || self.under_pings(&pods, || self.restore_kilo(&kilo(KILO_CRDS)?)),
            );
        }
        report.step("Kilo removed with its own clean-up", || {
            self.kilo_down(&kilo(KILO_MANIFEST)?)
        });
    }

    fn kilo_up(&self, manifest: &str, crds: &str) -> Result<String> {
        // kubeadm's kube-proxy ConfigMap, which Kilo's manifest reads its kubeconfig from.
        let admin = std::fs::read_to_string(self.work.join("admin.kubeconfig"))?;
        let server = admin
            .split("server: \"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .context("the API server's address in admin.kubeconfig")?;
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: default\n  cluster:\n    \
             certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt\n    \
             server: {server}\ncontexts:\n- name: default\n  context: {{cluster: default, \
             namespace: default, user: default}}\ncurrent-context: default\nusers:\n- name: \
             default\n  user:\n    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n"
        );
        self.apply(&json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system"},
            "data": {"kubeconfig.conf": kubeconfig},
        }))?;
        self.kubectl_in(&["apply", "-f", "-"], Some(crds))?;
        self.kubectl_in(&["apply", "-f", "-"], Some(&kilo_manifest(manifest)?))?;
        self.rollout("kilo")?;
        let mut rules = Vec::new();
        for (node, _) in NODES {
            let n = wait_for(
                Duration::from_secs(60),
                &format!("{node}: Kilo's iptables rules"),
                || {
                    let n = self
                        .node_exec(node, &["sh", "-c", "iptables-save | grep -c KILO || true"])?;
                    Ok((n.trim() != "0").then(|| n.trim().to_owned()))
                },
            )?;
            rules.push(format!("{node} {n}"));
        }
        Ok(format!(
            "Kilo {KILO_TAG} ready on {} nodes; its iptables lines per node: {}",
            NODES.len(),
            rules.join(", ")
        ))
    }

    /// One pod per node, each reaching every other (given 120 s to converge).
    fn round_trip_pods(&self) -> Result<Vec<(String, String)>> {
        let pods: Vec<(String, String)> = self
            .pod_per_node("trip")?
            .into_iter()
            .map(|(_, name, ip)| (name, ip))
            .collect();
        self.all_reach(&pods, Duration::from_secs(120))?;
        Ok(pods)
    }

    /// Waits until every pod reaches every other.
    fn all_reach(&self, pods: &[(String, String)], limit: Duration) -> Result<()> {
        wait_for(limit, "every pod reaching every other", || {
            let mut missing = Vec::new();
            for (from, _) in pods {
                let script: String = pods
                    .iter()
                    .filter(|(p, _)| p != from)
                    .map(|(_, ip)| format!("ping -c 1 -W 2 {ip} >/dev/null || echo {ip}; "))
                    .collect();
                for ip in self
                    .kubectl(&["exec", from, "--", "sh", "-c", &script])?
                    .lines()
                {
                    missing.push(format!("{from} -> {ip}"));
                }
            }
            match missing.is_empty() {
                true => Ok(Some(())),
                false => bail!("unreachable: {}", missing.join(", ")),
            }
        })
    }

    /// Runs `step` with every pod pinging every other; once it is done and every pair answers
    /// again (within 120 s), returns its result with the step's loss.
    fn under_pings(
        &self,
        pods: &[(String, String)],
        step: impl FnOnce() -> Result<String>,
    ) -> Result<String> {
        let pings = self.start_pings(pods)?;
        std::thread::sleep(Duration::from_secs(2));
        let done = step().and_then(|d| self.all_reach(pods, Duration::from_secs(120)).map(|()| d));
        std::thread::sleep(Duration::from_secs(2));
        let loss = self.stop_pings(pods, pings)?;
        let detail = done.with_context(|| loss.to_string())?;
        Ok(format!("{detail}; {loss}"))
    }

    fn start_pings(&self, pods: &[(String, String)]) -> Result<Pings> {
        let mut children = Vec::new();
        for (from, _) in pods {
            let script: String = pods
                .iter()
                .filter(|(p, _)| p != from)
                .map(|(_, ip)| format!("ping -i 0.2 {ip} >/tmp/ping-{ip}.log 2>&1 & "))
                .collect();
            children.push(
                Command::new(self.work.join("kubectl"))
                    .args(["exec", from, "--", "sh", "-c"])
                    .arg(format!("rm -f /tmp/ping-*.log; {script} wait"))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()?,
            );
        }
        Ok(Pings(children))
    }

    fn stop_pings(&self, pods: &[(String, String)], pings: Pings) -> Result<Loss> {
        for (from, _) in pods {
            let _ = self.kubectl(&["exec", from, "--", "killall", "-INT", "ping"]);
        }
        for mut child in pings.0 {
            let _ = child.wait();
        }
        let mut loss = Loss {
            sent: 0,
            lost: 0,
            pairs: Vec::new(),
        };
        for (from, _) in pods {
            for (to, ip) in pods.iter().filter(|(p, _)| p != from) {
                let log =
                    self.kubectl(&["exec", from, "--", "cat", &format!("/tmp/ping-{ip}.log")])?;
                let (sent, received, gap) = ping_loss(&log, 0.2)?;
                loss.sent += sent;
                loss.lost += sent - received;
                if received < sent {
                    loss.pairs
                        .push(format!("{from} -> {to}: {} ({gap:.1} s)", sent - received));
                }
            }
        }
        Ok(loss)
    }

    /// docs/migrating.md, step 1, and the leaders it asks for.
    fn confine_kilo(&self) -> Result<String> {
        let before = uids(&self.kilo_pods()?);
        for node in ["n1", "n3", "n5"] {
            self.kubectl(&[
                "annotate",
                "--overwrite",
                "node",
                node,
                "kilo.squat.ai/leader=true",
            ])?;
        }
        self.kubectl(&[
            "-n",
            "kube-system",
            "patch",
            "daemonset",
            "kilo",
            "--patch-file",
            "manifests/migrate/finish/not-kg.yaml",
        ])?;
        let applied = self.kubectl_in(&["apply", "-f", "-"], Some(&self.migrate_kustomized()?))?;
        std::thread::sleep(Duration::from_secs(5));
        let ds = self.json(&["-n", "kube-system", "get", "daemonset", "kilo-rs"])?;
        let desired = ds["status"]["desiredNumberScheduled"].as_u64();
        if desired != Some(0) {
            bail!("kilo-rs wants {desired:?} pods before any node is labelled");
        }
        if uids(&self.kilo_pods()?) != before {
            bail!("Kilo's pods were replaced");
        }
        Ok(format!(
            "{} objects applied, Kilo's {} pods kept, kilo-rs 0 desired",
            applied.lines().count(),
            before.len()
        ))
    }

    /// docs/migrating.md's `manifests/migrate`, with its `resources` set to the userspace
    /// overlay as the document says to (in a copy of `manifests`), under the e2e's layer: the
    /// image names of `xtask/e2e`, and `--encapsulate=never`.
    fn migrate_kustomized(&self) -> Result<String> {
        let copy = self.work.join("manifests");
        let _ = std::fs::remove_dir_all(&copy);
        run(Command::new("cp")
            .arg("-r")
            .arg(root_dir().join("manifests"))
            .arg(&copy))?;
        let k = copy.join("migrate/kustomization.yaml");
        let text = std::fs::read_to_string(&k)?;
        if !text.contains("- ../overlays/kubeadm\n") {
            bail!("manifests/migrate names no ../overlays/kubeadm to change");
        }
        std::fs::write(
            &k,
            text.replace("- ../overlays/kubeadm\n", "- ../overlays/userspace\n"),
        )?;
        let layer = self.work.join("migrate-e2e");
        std::fs::create_dir_all(&layer)?;
        let images = std::fs::read_to_string(root_dir().join("xtask/e2e/kustomization.yaml"))?;
        let images = images
            .split_once("\nimages:\n")
            .context("xtask/e2e's images")?
            .1;
        std::fs::write(
            layer.join("kustomization.yaml"),
            format!(
                "resources:\n- ../manifests/migrate\npatches:\n- target: {{kind: DaemonSet, name: kilo-rs}}\n  \
                 patch: '[{{\"op\": \"add\", \"path\": \"/spec/template/spec/containers/0/args/-\", \
                 \"value\": \"--encapsulate=never\"}}]'\nimages:\n{images}"
            ),
        )?;
        crate::install::install_kubectl()?;
        output(
            Command::new(crate::install::kubectl_dir().join("usr/bin/kubectl"))
                .arg("kustomize")
                .arg(&layer),
        )
    }

    /// A node's pods of `selector` in kube-system.
    fn node_pods(&self, selector: &str, node: &str) -> Result<Vec<Value>> {
        let pods = self.json(&[
            "-n",
            "kube-system",
            "get",
            "pods",
            "-l",
            selector,
            "--field-selector",
            &format!("spec.nodeName={node}"),
        ])?;
        Ok(pods["items"].as_array().cloned().unwrap_or_default())
    }

    /// Waits until `node` runs one ready pod of `selector` and none of `gone`; returns its name.
    fn await_switch(&self, node: &str, selector: &str, gone: &str) -> Result<String> {
        wait_for(
            Duration::from_secs(180),
            &format!("{node}: {selector} ready, {gone} gone"),
            || {
                if !self.node_pods(gone, node)?.is_empty() {
                    return Ok(None);
                }
                let pods = self.node_pods(selector, node)?;
                Ok(pods
                    .iter()
                    .find(|p| {
                        p["status"]["conditions"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .any(|c| c["type"] == "Ready" && c["status"] == "True")
                    })
                    .and_then(|p| p["metadata"]["name"].as_str().map(str::to_owned)))
            },
        )
    }

    /// When the API server saw `pod` scheduled (the other agent's pod gone from the host's port),
    /// its agent container started and the pod ready, in seconds after `since` (whole seconds:
    /// the API's timestamps have no fraction).
    fn pod_times(&self, pod: &str, since: f64) -> Result<String> {
        let p = self.json(&["-n", "kube-system", "get", "pod", pod])?;
        let at = |v: &Value| -> Result<f64> {
            let t: jiff::Timestamp = v.as_str().context("a timestamp")?.parse()?;
            Ok(t.as_millisecond() as f64 / 1000.0 - since)
        };
        let condition = |kind: &str| {
            p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == kind)
                .map(|c| c["lastTransitionTime"].clone())
                .unwrap_or_default()
        };
        let started = p["status"]["containerStatuses"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["name"] == "kilo")
            .map(|c| c["state"]["running"]["startedAt"].clone())
            .unwrap_or_default();
        Ok(format!(
            "{pod} scheduled at +{:.0} s, started at +{:.0} s, ready at +{:.0} s",
            at(&condition("PodScheduled"))?,
            at(&started)?,
            at(&condition("Ready"))?
        ))
    }

    /// Sets (`label` `agent=kg`) or removes (`agent-`) the node's label and waits until `node`
    /// runs a ready pod of `selector` and none of `gone`; returns the pod, when the label changed
    /// and [`Cluster::pod_times`].
    fn relabel(
        &self,
        node: &str,
        label: &str,
        selector: &str,
        gone: &str,
    ) -> Result<(String, f64, String)> {
        let start = now();
        self.kubectl(&["label", "node", node, &format!("kilo.squat.ai/{label}")])?;
        let pod = self.await_switch(node, selector, gone)?;
        let times = self.pod_times(&pod, start)?;
        Ok((pod, start, times))
    }

    /// docs/migrating.md, steps 2 and 3: label the node, check it.
    fn move_to_kg(&self, node: &str) -> Result<String> {
        let (pod, start, times) = self.relabel(
            node,
            "agent=kg",
            "app.kubernetes.io/name=kilo-rs",
            "app.kubernetes.io/name=kilo",
        )?;
        let path = format!("/api/v1/namespaces/kube-system/pods/{pod}:1107/proxy/check");
        let check = wait_for(Duration::from_secs(60), &format!("{pod}: /check"), || {
            let answer = self.kubectl(&["get", "--raw", &path])?;
            Ok(answer.starts_with("in sync").then_some(answer))
        })?;
        Ok(format!(
            "after the label: {times}, /check at +{:.0} s: {}",
            now() - start,
            check.trim()
        ))
    }

    /// docs/migrating.md's rollback for one node: remove the label; kg cleans up.
    fn back_to_kilo(&self, node: &str) -> Result<String> {
        let (_, _, times) = self.relabel(
            node,
            "agent-",
            "app.kubernetes.io/name=kilo",
            "app.kubernetes.io/name in (kilo-rs, kilo-wireguard)",
        )?;
        let mut left = Vec::new();
        for (what, cmd) in kg_state() {
            let out = self.node_exec(node, &["sh", "-c", cmd]).unwrap_or_default();
            if !out.trim().is_empty() {
                left.push(format!("{what}: {}", out.trim().replace('\n', "; ")));
            }
        }
        if !left.is_empty() {
            bail!("{node} keeps kg's state:\n  {}", left.join("\n  "));
        }
        Ok(format!(
            "after the label's removal: {times}; none of kg's routes, rules, nftables table, pins or TC programs left"
        ))
    }

    /// The end of docs/migrating.md's rollback: kg's DaemonSets deleted, Kilo's DaemonSet back to
    /// rolling updates, Kilo's CRD re-applied.
    fn restore_kilo(&self, crds: &str) -> Result<String> {
        let before = uids(&self.kilo_pods()?);
        self.kubectl(&[
            "-n",
            "kube-system",
            "delete",
            "daemonset",
            "kilo-rs",
            "kilo-wireguard",
            "--ignore-not-found",
        ])?;
        self.kubectl(&[
            "-n",
            "kube-system",
            "patch",
            "daemonset",
            "kilo",
            "-p",
            r#"{"spec":{"updateStrategy":{"type":"RollingUpdate"}}}"#,
        ])?;
        self.kubectl_in(&["apply", "-f", "-"], Some(crds))?;
        for node in ["n1", "n3", "n5"] {
            self.kubectl(&["annotate", "node", node, "kilo.squat.ai/leader-"])?;
        }
        if uids(&self.kilo_pods()?) != before {
            bail!("Kilo's pods were replaced");
        }
        Ok(format!("Kilo's {} pods kept", before.len()))
    }

    fn kilo_down(&self, manifest: &str) -> Result<String> {
        self.kubectl(&["delete", "pods", "-l", "app=trip", "--wait=false"])?;
        self.kubectl_in(&["delete", "-f", "-"], Some(&kilo_manifest(manifest)?))?;
        self.kubectl(&["-n", "kube-system", "delete", "configmap", "kube-proxy"])?;
        wait_for(Duration::from_secs(120), "Kilo's pods gone", || {
            Ok(self.kilo_pods()?.is_empty().then_some(()))
        })?;
        let mut left = Vec::new();
        for (node, _) in NODES {
            let n = self.node_exec(node, &["sh", "-c", "iptables-save | grep -c KILO || true"])?;
            if n.trim() != "0" {
                left.push(format!("{node}: {} iptables lines", n.trim()));
            }
        }
        if !left.is_empty() {
            bail!("Kilo's clean-up left: {}", left.join(", "));
        }
        Ok("no KILO iptables rule left on any node".into())
    }
}

/// Kilo's manifest with the e2e's images, and without IPIP (this kernel has no `ipip` module).
fn kilo_manifest(manifest: &str) -> Result<String> {
    let edits = [
        ("image: squat/kilo:0.7.0", "image: local/kilo:0.7.0"),
        (
            "image: masipcat/wireguard-go:0.0.20230223:cc19859",
            "image: local/wireguard-go:debian",
        ),
        (
            "- --interface=kilo0\n",
            "- --interface=kilo0\n        - --encapsulate=never\n",
        ),
    ];
    let mut out = manifest.to_owned();
    for (from, to) in edits {
        if !out.contains(from) {
            bail!("Kilo's manifest has no {from:?}");
        }
        out = out.replace(from, to);
    }
    Ok(out)
}
