//! The e2e scenario: a node deleted with kubectl.
use super::*;

impl Cluster {
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
}
