//! The e2e scenario: a node whose FORWARD policy is DROP (as Docker sets it; Kilo #241, #244)
//! forwards its pods' traffic again once kg runs with `--iptables-forward-rules`.
use super::*;

/// The node whose policy is DROP, and the pod it forwards for (to another location's pod).
const NODE: &str = "n1";

impl Cluster {
    pub(super) fn forward_drop(&self) -> Result<String> {
        let pods = self.probe_ips()?;
        let pod = |name: &str| {
            pods.iter()
                .find(|(n, _)| n == name)
                .context(name.to_owned())
        };
        let (from, _) = pod("probe-n1")?;
        let (_, to) = pod("probe-n3")?;
        self.node_exec(NODE, &["iptables", "-P", "FORWARD", "DROP"])?;
        let tested = (|| {
            self.await_reach(from, to, false)
                .context("the policy DROP did not stop the forwarding")?;
            let (i, args) = self.kg_args()?;
            let mut with = args.as_array().cloned().unwrap_or_default();
            with.push(json!("--iptables-forward-rules=true"));
            self.set_kg_args(i, &Value::Array(with))?;
            let reached = self.await_reach(from, to, true);
            let rules = self.node_exec(
                NODE,
                &[
                    "sh",
                    "-c",
                    "iptables-save -t filter | grep 'kilo-rs: forward' || true",
                ],
            );
            self.set_kg_args(i, &args)?;
            reached?;
            let rules = rules?;
            let n = rules.lines().count();
            if n == 0 {
                bail!("{NODE} reaches, but has no FORWARD rule of kg's");
            }
            Ok(n)
        })();
        self.node_exec(NODE, &["iptables", "-P", "FORWARD", "ACCEPT"])?;
        let n = tested?;
        Ok(format!(
            "{from} -> {to} dropped by {NODE}'s FORWARD policy, then forwarded through kg's {n} ACCEPT rules; the flag removed again"
        ))
    }
}
