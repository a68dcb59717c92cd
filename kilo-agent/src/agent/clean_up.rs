//! Clean-up on shutdown (`--clean-up`): the kernel state, then this node's annotations.
use super::{ANNOTATION_REMOVAL_TIMEOUT, Agent, AgentError, Planner};
use crate::{
    backend::{Annotations, BackendError},
    datapath::DatapathOps,
    mesh::annotations,
    reconcile::{Kernel, Report, wireguard::WireGuard},
};

impl<P: Planner, K: Kernel, W: WireGuard, D: DatapathOps> Agent<P, K, W, D> {
    /// Removes our kernel state and our annotations.
    pub async fn clean_up(&mut self) -> Result<Report, AgentError> {
        let report = self
            .reconciler
            .clean_up(self.settings.clean_up_interface)
            .await?;
        let remove: Annotations = annotations::OWN
            .iter()
            .map(|k| (k.to_string(), None))
            .collect();
        // Bounded, so that an unreachable API server cannot keep the process past its grace
        // period; the kernel state is already clean.
        let removed = tokio::time::timeout(
            ANNOTATION_REMOVAL_TIMEOUT,
            self.backend.publish(&self.local.hostname, &remove),
        )
        .await
        .unwrap_or_else(|_| {
            Err(BackendError::Kube(format!(
                "no answer within {ANNOTATION_REMOVAL_TIMEOUT:?}"
            )))
        });
        if let Err(e) = removed {
            self.metrics.error("cleanUp");
            let update = self.backend.updates().borrow().clone();
            let left: Vec<&str> = update
                .snapshot
                .nodes
                .get(&self.local.hostname)
                .and_then(|n| n.metadata.annotations.as_ref())
                .map(|a| {
                    annotations::OWN
                        .into_iter()
                        .filter(|k| a.contains_key(*k))
                        .collect()
                })
                .unwrap_or_default();
            tracing::warn!(
                node = %self.local.hostname,
                annotations = %left.join(","),
                error = %e,
                "could not remove this node's annotations; the node's kernel state is cleaned up"
            );
        }
        for p in &report.problems {
            self.metrics.error("cleanUp");
            tracing::warn!(problem = %p, "clean-up incomplete");
        }
        tracing::info!(writes = %report.writes, "cleaned up");
        Ok(report)
    }
}
