//! The e2e scenario: `allowed-location-ips` on a location's leader.
use super::*;

impl Cluster {
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
        for pod in &clients {
            if self.reaches(pod, &host)? {
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
            self.await_reach(pod, &host, true)?;
        }
        self.kubectl(&["annotate", "node", leader, &format!("{ANNOTATION}-")])?;
        for pod in &clients {
            self.await_reach(pod, &host, false)?;
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
}
