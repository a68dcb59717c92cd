//! The e2e scenario: the deployed webhook refuses a malformed Peer.
use super::*;

impl Cluster {
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
}
