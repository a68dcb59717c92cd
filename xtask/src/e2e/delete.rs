//! The e2e scenario: `kubectl delete -k`: what stays on each node and what goes.
use super::*;

impl Cluster {
    /// After `kubectl delete -k`, on each remaining node: what the README says stays
    /// ([`LEFT_BEHIND`], and kg's annotations) is there, and nothing of [`GONE`] is.
    pub(super) fn deleted(&self) -> Result<String> {
        self.kubectl_in(&["delete", "-f", "-"], Some(&self.kustomized()?))?;
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
}
