//! The e2e scenario: a cluster running Kilo 0.7 itself, from Kilo's own userspace manifest, moved
//! to kg as docs/migrating.md says, with pings between every pair of nodes' pods the whole time
//! and the loss reported per step: step 1; the full rollback's commands from step 1's state (no
//! node labelled, as every node's rollback leaves it) and step 1 again; each node labelled
//! (leaders first) and checked; the last one rolled back to Kilo (nothing of kg's left) and
//! moved again; step 4, each node handed from `kilo-rs` to kg's regular DaemonSet. The overlay's
//! apply that ends step 4 is the other checks' deployment ([`Cluster::deploy`]).
//!
//! Kilo's image is built from its source (`xtask/scripts/kilo-image.sh`, cached), which none of
//! the registries the tests install from serves: the scenario needs a clone of
//! github.com/squat/kilo with its tags at `$KILO_GIT`, or at `kilo.git` in the cache directory,
//! and is skipped, saying so, without one.
//!
//! Both agents run with `--encapsulate=never` until step 4's last apply: this kernel has no `ipip`
//! module, which Kilo's default IPIP inside a location needs (kg's IPIP, the datapath's, needs
//! none, and that apply brings it back).
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
    /// The round trip, one report step per stage, stopping at the first that fails; the cluster
    /// is left with kg's `kilo` DaemonSet of `manifests/migrate/finish` on every node, for
    /// [`Cluster::deploy`] to apply the overlay over it (step 4's last command).
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
        let mut pods = Vec::new();
        let mut ok = up
            && report.step("Kilo's mesh: every pod reaches every other", || {
                pods = self.round_trip_pods()?;
                Ok(format!(
                    "{} pods, {} pairs",
                    pods.len(),
                    pods.len() * (pods.len() - 1)
                ))
            });
        let mut step = |name: &str, f: &dyn Fn() -> Result<String>| {
            ok = ok && report.step(name, || self.under_pings(&pods, f));
        };
        step(
            "migration step 1: Kilo's DaemonSet confined (OnDelete), kilo-rs applied, no pod restarted",
            &|| self.confine_kilo(),
        );
        step(
            "full rollback from step 1's state (no node labelled): kg's DaemonSets deleted, Kilo's CRD restored, no pod restarted",
            &|| self.restore_kilo(&kilo(KILO_CRDS)?),
        );
        step("migration step 1 again", &|| self.confine_kilo());
        for node in MOVE_ORDER {
            step(
                &format!(
                    "migration: {node} labelled for kg, Kilo's rules gone, its kg in sync (kgctl check)"
                ),
                &|| self.move_to_kg(node),
            );
            if *node == "n5" {
                step(
                    "mixed cluster: n1 demoted by hand while n2 (east) runs Kilo: kg keeps Kilo's leader",
                    &|| self.mixed_keeps_kilos_leader(),
                );
            }
        }
        let last = MOVE_ORDER[MOVE_ORDER.len() - 1];
        step(
            &format!("rollback: {last} unlabelled, Kilo back, nothing of kg's left"),
            &|| self.back_to_kilo(last),
        );
        step(
            &format!("migration: {last} labelled for kg again, in sync"),
            &|| self.move_to_kg(last),
        );
        step(
            "migration step 4: Kilo's DaemonSet deleted, manifests/migrate/finish applied, no kg pod restarted",
            &|| self.finish(),
        );
        for node in MOVE_ORDER {
            step(
                &format!(
                    "migration step 4: {node} unlabelled, kilo-rs cleaned up, kg's `kilo` in sync"
                ),
                &|| self.hand_over(node),
            );
        }
        step("migration step 4: kilo-rs deleted", &|| {
            self.kubectl(&["-n", "kube-system", "delete", "daemonset", "kilo-rs"])
        });
        if !ok {
            self.dump_state();
        }
        self.round_trip_down(ok);
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
                loss.lost += sent.saturating_sub(received);
                if received < sent {
                    loss.pairs.push(format!(
                        "{from} -> {to}: {} ({gap:.1} s)",
                        sent.saturating_sub(received)
                    ));
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
        let kept = self.kept(&before, "Kilo's")?;
        let ds = self.json(&["-n", "kube-system", "get", "daemonset", "kilo-rs"])?;
        let desired = ds["status"]["desiredNumberScheduled"].as_u64();
        if desired != Some(0) {
            bail!("kilo-rs wants {desired:?} pods before any node is labelled");
        }
        Ok(format!(
            "{} objects applied, {kept}, kilo-rs 0 desired",
            applied.lines().count(),
        ))
    }

    /// docs/migrating.md's `manifests/migrate`, with its `resources` set to the userspace
    /// overlay as the document says to (in a copy of `manifests`), under the e2e's layer.
    fn migrate_kustomized(&self) -> Result<String> {
        self.kustomized_copy("migrate", "kilo-rs")
    }

    /// `manifests/DIR` rendered from a copy of `manifests` whose `DIR/kustomization.yaml` names
    /// the userspace overlay instead of kubeadm's, as docs/migrating.md says to edit it, under the
    /// e2e's layer: the image names of `xtask/e2e`, and `--encapsulate=never` for `daemonset`.
    fn kustomized_copy(&self, dir: &str, daemonset: &str) -> Result<String> {
        let copy = self.work.join("manifests");
        let _ = std::fs::remove_dir_all(&copy);
        run(Command::new("cp")
            .arg("-r")
            .arg(root_dir().join("manifests"))
            .arg(&copy))?;
        let k = copy.join(dir).join("kustomization.yaml");
        let text = std::fs::read_to_string(&k)?;
        if !text.contains("overlays/kubeadm\n") {
            bail!("manifests/{dir} names no overlays/kubeadm to change");
        }
        std::fs::write(
            &k,
            text.replace("overlays/kubeadm\n", "overlays/userspace\n"),
        )?;
        let layer = self.work.join("migrate-e2e");
        let _ = std::fs::remove_dir_all(&layer);
        std::fs::create_dir_all(&layer)?;
        let images = std::fs::read_to_string(root_dir().join("xtask/e2e/kustomization.yaml"))?;
        let images = images
            .split_once("\nimages:\n")
            .context("xtask/e2e's images")?
            .1;
        std::fs::write(
            layer.join("kustomization.yaml"),
            format!(
                "resources:\n- ../manifests/{dir}\npatches:\n- target: {{kind: DaemonSet, name: {daemonset}}}\n  \
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
        let kilo = self.node_exec(node, &["sh", "-c", "iptables-save | grep -c KILO || true"])?;
        if kilo.trim() != "0" {
            bail!("{node}: {} iptables lines of Kilo's left", kilo.trim());
        }
        let check = self.in_sync(node, &pod)?;
        Ok(format!(
            "after the label: {times}, no KILO iptables line, kgctl check at +{:.0} s: {check}",
            now() - start,
        ))
    }

    /// With n1, n3 and n5 on kg and n2, n4 on Kilo: `kg.kilo.squat.ai/demoted` on the east leader
    /// n1 (which Kilo's agent on n2 would ignore) changes nothing. n1's kg still leads, n3's kg
    /// still peers with it, and n1's kg has said why once. The annotation is removed after.
    fn mixed_keeps_kilos_leader(&self) -> Result<String> {
        let kg_pod = |node: &str| -> Result<String> {
            let pods = self.node_pods("app.kubernetes.io/name=kilo-rs", node)?;
            pods.first()
                .and_then(|p| p["metadata"]["name"].as_str())
                .map(str::to_owned)
                .with_context(|| format!("no kilo-rs pod on {node}"))
        };
        let (n1, n3) = (kg_pod("n1")?, kg_pod("n3")?);
        self.kubectl(&["annotate", "node", "n1", "kg.kilo.squat.ai/demoted=n2"])?;
        std::thread::sleep(Duration::from_secs(5));
        let checked = (|| -> Result<String> {
            let leader = metric(&self.metrics(&n1)?, "kilo_leader");
            if leader != Some(1.0) {
                bail!("n1's kg: kilo_leader {leader:?}");
            }
            let seen = r#"kilo_location_leader{location="east",node="n1"}"#;
            if metric(&self.metrics(&n3)?, seen) != Some(1.0) {
                bail!("n3's kg: no {seen} 1");
            }
            let log = self.kubectl(&["-n", "kube-system", "logs", &n1])?;
            // The reason kg gave last, which stands until it logs another.
            let why = log
                .lines()
                .rfind(|l| l.contains("keeps Kilo's choice of leader"))
                .context("n1's kg never said why it keeps Kilo's leader")?;
            if !why.contains("node n2 runs Kilo") {
                bail!("n1's kg: {why}");
            }
            Ok("n1 still leads for n1's and n3's kg; n1's kg logged \"node n2 runs Kilo\"".into())
        })();
        self.kubectl(&["annotate", "node", "n1", "kg.kilo.squat.ai/demoted-"])?;
        checked
    }

    /// Waits (60 s) until `kgctl check NODE` (asking kg's `/check` through the API server's pod
    /// proxy) says the node is in sync, the kernel matching kg's plan, and names `pod`.
    fn in_sync(&self, node: &str, pod: &str) -> Result<String> {
        let mut check = self.kgctl();
        check.args(["check", node]);
        wait_for(
            Duration::from_secs(60),
            &format!("kgctl check {node}"),
            || {
                let answer = output(&mut check)?;
                match answer.starts_with(&format!("{node} ({pod}): in sync")) {
                    true => Ok(Some(answer.trim().to_owned())),
                    false => bail!("kgctl check {node}: {answer}"),
                }
            },
        )
    }

    /// docs/migrating.md, step 4's start: Kilo's DaemonSet (on no node any more) deleted, then
    /// kg's regular DaemonSet applied, on no node until one is unlabelled. With the userspace
    /// overlay, `kilo-wireguard` loses the migration's affinity here and rolls.
    fn finish(&self) -> Result<String> {
        let kg = uids(&self.pods("app.kubernetes.io/name=kilo-rs")?);
        let wireguard = uids(&self.wireguard_pods()?);
        self.kubectl(&["-n", "kube-system", "delete", "daemonset", "kilo"])?;
        let applied = self.kubectl_in(
            &["apply", "-f", "-"],
            Some(&self.kustomized_copy("migrate/finish", "kilo")?),
        )?;
        self.rollout("kilo-wireguard")?;
        let ds = self.json(&["-n", "kube-system", "get", "daemonset", "kilo"])?;
        let desired = ds["status"]["desiredNumberScheduled"].as_u64();
        if desired != Some(0) {
            bail!("kg's `kilo` wants {desired:?} pods while every node is labelled");
        }
        if uids(&self.pods("app.kubernetes.io/name=kilo-rs")?) != kg {
            bail!("kilo-rs's pods were replaced");
        }
        let rolled = uids(&self.wireguard_pods()?)
            .iter()
            .filter(|u| !wireguard.contains(u))
            .count();
        Ok(format!(
            "{} objects applied, kilo-rs's {} pods kept, kg's `kilo` 0 desired; wireguard-go rolled on {rolled} nodes",
            applied.lines().count(),
            kg.len()
        ))
    }

    /// docs/migrating.md, step 4, per node: the label removed, `kilo-rs` cleans up and stops,
    /// kg's `kilo` starts there and converges.
    fn hand_over(&self, node: &str) -> Result<String> {
        let (pod, start, times) = self.relabel(
            node,
            "agent-",
            "app.kubernetes.io/name=kilo",
            "app.kubernetes.io/name=kilo-rs",
        )?;
        let check = self.in_sync(node, &pod)?;
        Ok(format!(
            "after the label's removal: {times}, kgctl check at +{:.0} s: {check}",
            now() - start,
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

    /// The end of docs/migrating.md's rollback: kg's DaemonSets deleted, Kilo's CRD re-applied.
    /// Kilo's DaemonSet keeps step 1's OnDelete: back on RollingUpdate, the controller would
    /// replace every Kilo pod started before step 1 (its template lacks the affinity).
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
        self.kubectl_in(&["apply", "-f", "-"], Some(crds))?;
        self.kept(&before, "Kilo's")
    }

    /// Fails if the pods of Kilo's DaemonSet are not `before`, once its controller has seen its
    /// last change and had 5 s more to act on it.
    fn kept(&self, before: &[String], whose: &str) -> Result<String> {
        wait_for(Duration::from_secs(30), "Kilo's DaemonSet observed", || {
            let ds = self.json(&["-n", "kube-system", "get", "daemonset", "kilo"])?;
            let seen = ds["status"]["observedGeneration"].as_u64();
            Ok((seen >= ds["metadata"]["generation"].as_u64()).then_some(()))
        })?;
        std::thread::sleep(Duration::from_secs(5));
        if uids(&self.kilo_pods()?) != before {
            bail!("{whose} pods were replaced");
        }
        Ok(format!("{whose} {} pods kept", before.len()))
    }

    /// What the round trip leaves that the other steps do not expect: its pods, the leader
    /// annotations and kube-proxy's ConfigMap; after a failure (`!done`), also every agent, so
    /// that [`Cluster::deploy`] starts from nodes without one.
    fn round_trip_down(&self, done: bool) {
        let mut left = vec![
            vec!["delete", "pods", "-l", "app=trip", "--wait=false"],
            vec!["-n", "kube-system", "delete", "configmap", "kube-proxy"],
        ];
        for node in ["n1", "n3", "n5"] {
            left.push(vec!["annotate", "node", node, "kilo.squat.ai/leader-"]);
        }
        if !done {
            left.push(vec![
                "-n",
                "kube-system",
                "delete",
                "daemonset",
                "--ignore-not-found",
                "kilo",
                "kilo-rs",
                "kilo-wireguard",
            ]);
        }
        for args in left {
            if let Err(e) = self.kubectl(&args) {
                eprintln!("e2e: the round trip's clean-up: {e:#}");
            }
        }
        if !done {
            let gone = wait_for(Duration::from_secs(120), "the agents' pods gone", || {
                Ok(self
                    .pods("app.kubernetes.io/part-of=kilo")?
                    .is_empty()
                    .then_some(()))
            });
            if let Err(e) = gone {
                eprintln!("e2e: the round trip's clean-up: {e:#}");
            }
        }
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
