//! The e2e scenario: a ClusterIP Service across locations keeps the client pod's address.
use super::*;

impl Cluster {
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
}
