//! `kgctl check` (pure): which agent pod to ask on each node, and what its `/check` answer
//! means. The binary lists the pods and asks each `/check` through the API server's pod proxy.
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

/// The agents' pods: kg's DaemonSet (`kilo`, the name Kilo's has too) and the migration's
/// (`kilo-rs`).
pub const AGENT_SELECTOR: &str = "app.kubernetes.io/name in (kilo, kilo-rs)";

/// kg's HTTP port (`--listen-address`'s default), when the pod's `kilo` container names none.
pub const DEFAULT_PORT: u16 = 1107;

/// The pod to ask about one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub node: String,
    pub pod: String,
    /// Its container `kilo`'s port named `metrics`.
    pub port: u16,
}

/// One target per node: the node's running agent pod that is not being deleted (the newest
/// when a switch leaves two). `nodes` limits them to those (each named one without such a pod
/// is returned in the second list); empty, every node with one.
pub fn targets(pods: &[Pod], nodes: &[String]) -> (Vec<Target>, Vec<String>) {
    let mut newest: BTreeMap<&str, &Pod> = BTreeMap::new();
    for pod in pods {
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        let (Some(node), true, None) = (node, running, &pod.metadata.deletion_timestamp) else {
            continue;
        };
        let created = |p: &Pod| p.metadata.creation_timestamp.clone();
        match newest.get(node) {
            Some(seen) if created(seen) >= created(pod) => {}
            _ => {
                newest.insert(node, pod);
            }
        }
    }
    let target = |node: &str, pod: &Pod| Target {
        node: node.to_owned(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        port: metrics_port(pod).unwrap_or(DEFAULT_PORT),
    };
    if nodes.is_empty() {
        let all = newest.iter().map(|(n, p)| target(n, p)).collect();
        return (all, Vec::new());
    }
    let mut found = Vec::new();
    let mut missing = Vec::new();
    for node in nodes {
        match newest.get(node.as_str()) {
            Some(pod) => found.push(target(node, pod)),
            None => missing.push(node.clone()),
        }
    }
    (found, missing)
}

fn metrics_port(pod: &Pod) -> Option<u16> {
    let spec = pod.spec.as_ref()?;
    let kilo = spec.containers.iter().find(|c| c.name == "kilo")?;
    let port = kilo
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))?;
    u16::try_from(port.container_port).ok()
}

/// A node's `/check` answer, read: in sync only on kg's 200.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    InSync(String),
    /// What kg says differs, or why it cannot tell.
    OutOfSync(String),
    /// No answer of kg's: Kilo's agent (which has no `/check`) or an error on the way.
    NoAnswer(String),
}

impl Answer {
    /// Reads an HTTP status and body from kg's `/check`, through the pod proxy.
    pub fn read(status: u16, body: &str) -> Self {
        let body = body.trim().to_owned();
        match status {
            200 => Self::InSync(body),
            503 if !body.starts_with('{') => Self::OutOfSync(body),
            404 => Self::NoAnswer(
                "no /check on the pod: not kg's agent (Kilo's has none), or kg older than it"
                    .into(),
            ),
            // The API server's own error (a Status object): its message.
            _ => {
                let status_message = serde_json::from_str::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v["message"].as_str().map(str::to_owned));
                Self::NoAnswer(format!("HTTP {status}: {}", status_message.unwrap_or(body)))
            }
        }
    }

    pub fn in_sync(&self) -> bool {
        matches!(self, Self::InSync(_))
    }

    /// One line per node (an out-of-sync answer's detail indented below).
    pub fn line(&self, target: &Target) -> String {
        let text = match self {
            Self::InSync(s) | Self::OutOfSync(s) | Self::NoAnswer(s) => s,
        };
        let mut lines = text.lines();
        let mut out = format!(
            "{} ({}): {}",
            target.node,
            target.pod,
            lines.next().unwrap_or_default()
        );
        for l in lines {
            out.push_str("\n    ");
            out.push_str(l);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, node: &str, phase: &str, created: i64, port: Option<i32>) -> Pod {
        let ports = port.map(|p| serde_json::json!([{"name": "metrics", "containerPort": p}]));
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "creationTimestamp": format!("2026-01-01T00:00:{created:02}Z"),
            },
            "spec": {"nodeName": node, "containers": [{"name": "kilo", "ports": ports}]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    #[test]
    fn one_running_pod_per_node_the_newest() {
        let mut leaving = pod("kilo-rs-old", "a", "Running", 1, Some(1107));
        leaving.metadata.deletion_timestamp = leaving.metadata.creation_timestamp.clone();
        let pods = [
            pod("kilo-a1", "a", "Running", 10, Some(9000)),
            pod("kilo-a0", "a", "Running", 5, None),
            leaving,
            pod("kilo-b", "b", "Pending", 10, None),
            pod("kilo-c", "c", "Running", 10, None),
        ];
        let (all, missing) = targets(&pods, &[]);
        let want = |node: &str, pod: &str, port| Target {
            node: node.into(),
            pod: pod.into(),
            port,
        };
        assert_eq!(
            all,
            [
                want("a", "kilo-a1", 9000),
                want("c", "kilo-c", DEFAULT_PORT)
            ]
        );
        assert!(missing.is_empty());
        let (some, missing) = targets(&pods, &["c".into(), "b".into()]);
        assert_eq!(some, [want("c", "kilo-c", DEFAULT_PORT)]);
        assert_eq!(missing, ["b"]);
    }

    #[test]
    fn only_kgs_200_is_in_sync() {
        let t = Target {
            node: "a".into(),
            pod: "kilo-x".into(),
            port: 1107,
        };
        let ok = Answer::read(200, "in sync: the kernel matches the plan\n");
        assert!(ok.in_sync());
        assert_eq!(
            ok.line(&t),
            "a (kilo-x): in sync: the kernel matches the plan"
        );
        let differs = Answer::read(503, "out of sync: the kernel differs\nroute 10.4.0.1/32\n");
        assert!(!differs.in_sync());
        assert_eq!(
            differs.line(&t),
            "a (kilo-x): out of sync: the kernel differs\n    route 10.4.0.1/32"
        );
        let kilo = Answer::read(404, "404 page not found");
        assert!(matches!(kilo, Answer::NoAnswer(ref s) if s.contains("Kilo's has none")));
        let proxy = Answer::read(
            500,
            r#"{"kind":"Status","message":"error trying to reach"}"#,
        );
        assert_eq!(
            proxy,
            Answer::NoAnswer("HTTP 500: error trying to reach".into())
        );
    }
}
