//! One pass of the loop: the snapshot from the backend, the nodes alive in it, the plan (reused
//! while the snapshot is the same), the reconcilers, and what the pass counts and logs.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use ipnet::IpNet;

use super::{Agent, AgentError, PlanOutcome, Planner};
use crate::{
    backend::Update,
    datapath::DatapathOps,
    mesh::Snapshot,
    plan::PlanError,
    reconcile::{Kernel, Report, wireguard::WireGuard},
};

impl<P: Planner, K: Kernel, W: WireGuard, D: DatapathOps> Agent<P, K, W, D> {
    /// Records the heartbeats and connection state of `update`. A change of the latter is a
    /// debug line: the backend names the outage and its end.
    fn observe(&mut self, update: &Update, now: i64) {
        match self
            .liveness
            .observe(&update.last_seen, update.connected, now)
        {
            Some(false) => {
                self.metrics.error("backend");
                self.metrics.set_backend_connected(false);
                tracing::debug!(
                    "backend disconnected: keeping the last applied state; no node expires until it delivers again"
                );
            }
            Some(true) => {
                self.metrics.set_backend_connected(true);
                tracing::debug!("backend connected: liveness judged again");
            }
            None => {}
        }
    }

    /// Whether the nodes alive now differ from those the last plan kept.
    pub(super) fn liveness_changed(&mut self, update: &Update) -> bool {
        let now = self.settings.clock.now_ms();
        self.observe(update, now);
        self.liveness.down(&update.snapshot.nodes, now) != self.planned_down
    }

    /// The snapshot without the nodes that are not alive now.
    fn alive(&mut self, update: &Update) -> Arc<Snapshot> {
        let now = self.settings.clock.now_ms();
        self.observe(update, now);
        let down = self.liveness.down(&update.snapshot.nodes, now);
        if down != self.planned_down {
            tracing::info!(?down, "nodes left out as not alive");
        }
        let snapshot = if down.is_empty() {
            update.snapshot.clone()
        } else {
            let mut alive = (*update.snapshot).clone();
            alive.nodes.retain(|name, _| !down.contains(name));
            Arc::new(alive)
        };
        self.planned_down = down;
        snapshot
    }

    fn plan(&mut self, snapshot: &Arc<Snapshot>) -> Arc<PlanOutcome> {
        if let Some((last, outcome)) = &self.last_plan
            && Arc::ptr_eq(last, snapshot)
        {
            return outcome.clone();
        }
        let outcome = Arc::new(self.planner.plan(snapshot));
        self.last_plan = Some((snapshot.clone(), outcome.clone()));
        if self.service_cidrs.as_ref() != Some(&outcome.service_cidrs) {
            self.service_cidrs_changed(&outcome.service_cidrs);
        }
        // Without a plan the roles stay as they were.
        if outcome.plan.is_some() {
            self.metrics.nodes.set(outcome.ready_nodes as i64);
            self.metrics.peers.set(outcome.ready_peers as i64);
            self.metrics.leader.set(i64::from(outcome.leader));
            self.metrics.set_graph(outcome.graph.clone());
            self.metrics.set_peer_names(outcome.peer_names.clone());
            self.metrics.set_location_leaders(&outcome.location_leaders);
            self.set_duty(&outcome.duty, outcome.failover_blocked.as_ref());
        }
        let mut now = BTreeSet::new();
        for e in &outcome.errors {
            let text = e.to_string();
            // Each error is told once: when it first appears.
            if !now.insert(text.clone()) || self.invalid.contains(&text) {
                continue;
            }
            self.metrics.error("validate");
            tracing::warn!(error = %text, "invalid value in the mesh's objects");
            if let PlanError::Object(o) = e {
                self.metrics.invalid_field(&o.kind.to_string(), &o.field);
            }
        }
        self.invalid = now;
        outcome
    }

    /// Logs the service CIDRs planned with (a warning saying the consequence when there are
    /// none) and shows them in `kilo_service_cidrs` and `/ready`.
    fn service_cidrs_changed(&mut self, cidrs: &[IpNet]) {
        self.metrics.set_service_cidrs(cidrs);
        if cidrs.is_empty() {
            tracing::warn!("{}", crate::telemetry::NO_SERVICE_CIDRS);
        } else {
            let cidrs: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
            tracing::info!(service_cidrs = %cidrs.join(","), "service CIDRs");
        }
        self.service_cidrs = Some(cidrs.to_vec());
    }

    /// One pass: plan from the latest snapshot, publish, reconcile. The duration of a pass that
    /// reached the reconcilers (one `kilo_reconciles_total` counts) is observed in
    /// `kilo_reconcile_duration_seconds`.
    pub async fn pass(&mut self) -> Result<Report, AgentError> {
        let (start, reconciles) = (std::time::Instant::now(), self.stats.reconciles);
        let result = self.plan_and_apply().await;
        if self.stats.reconciles != reconciles {
            self.metrics
                .reconcile_duration
                .observe(start.elapsed().as_secs_f64());
        }
        result
    }

    async fn plan_and_apply(&mut self) -> Result<Report, AgentError> {
        self.refresh_cni_compatibility_ip().await;
        let update = self.backend.updates().borrow().clone();
        if update.generation != self.seen_generation {
            self.seen_generation = update.generation;
            for e in &update.errors {
                self.metrics.error("backend");
                tracing::warn!(error = %e, "invalid object skipped");
            }
        }
        let alive = self.alive(&update);
        let snapshot = self.with_own_annotations(alive);
        let outcome = self.plan(&snapshot);
        let Some(plan) = outcome.plan.as_ref() else {
            self.publish(&update.snapshot, &outcome, false, &BTreeMap::new())
                .await;
            return Err(AgentError::NoPlan(outcome.errors.first().map_or_else(
                || "the planner made none".into(),
                ToString::to_string,
            )));
        };
        self.metrics.reconciles.inc();
        self.stats.reconciles += 1;
        let report = match self.reconciler.reconcile(plan).await {
            Ok(r) => r,
            Err(e) => {
                self.publish(&update.snapshot, &outcome, true, &BTreeMap::new())
                    .await;
                return Err(e.into());
            }
        };
        self.publish(
            &update.snapshot,
            &outcome,
            true,
            &report.handshaken_endpoints,
        )
        .await;
        if self.settings.knock {
            super::probe::knock(&report.new_peers).await;
        }
        self.metrics.record_writes(&report.writes);
        // Counted at every pass, logged when it appears: a failure retried with backoff (or at
        // every resync) is one warning, not one per attempt.
        for p in &report.problems {
            self.metrics.error("apply");
            if self.stats.last_problems.contains(p) {
                tracing::debug!(problem = %p, "still cannot apply");
            } else {
                tracing::warn!(problem = %p, "could not apply");
            }
        }
        if !report.writes.is_empty() {
            tracing::info!(writes = %report.writes, "reconciled");
        }
        self.stats.writes += report.writes.clone();
        self.stats.last = report.writes.clone();
        self.stats.last_problems = report.problems.clone();
        self.metrics.set_ready(true);
        self.watch_malformed();
        Ok(report)
    }

    /// Warns when the datapath's malformed count grew (see [`super::malformed`]).
    fn watch_malformed(&mut self) {
        let now = self.settings.clock.now_ms();
        if !self.malformed.due(now) {
            return;
        }
        let Some(Ok(stats)) = self.reconciler.datapath().stats_source().map(|s| s.read()) else {
            return;
        };
        let name = kilo_common::Decision::Malformed.name();
        let total = (stats.decisions.iter())
            .find(|(d, _)| *d == name)
            .map_or(0, |(_, c)| c.packets);
        if let Some(grew) = self.malformed.observe(total, now) {
            tracing::warn!(
                packets = grew,
                total,
                kernel = %crate::datapath::kernel::release(),
                "the datapath dropped packets as malformed: legitimate traffic never is, so the \
                 kernel may refuse what a program asks of it (see the kernel requirements in \
                 docs/datapath.md)"
            );
        }
    }

    /// The per-node check (`/check`): what differs between the current plan and the kernel
    /// now, changing nothing (empty when they match); `Err` when there is no plan yet.
    pub async fn check(&mut self) -> Result<String, String> {
        let outcome = self.last_plan.as_ref().map(|(_, o)| o.clone());
        let Some(plan) = outcome.as_ref().and_then(|o| o.plan.as_ref()) else {
            return Err(format!("node {} has no plan yet", self.local.hostname));
        };
        match self.reconciler.dry_run(plan).await {
            Ok(diff) => Ok(diff.to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The difference between the plan and the kernel, changing nothing.
    pub async fn dry_run(&mut self) -> Result<String, AgentError> {
        let update = self.backend.updates().borrow().clone();
        let snapshot = self.alive(&update);
        let outcome = self.plan(&snapshot);
        let mut out = String::new();
        for e in &update.errors {
            out.push_str(&format!("! {e}\n"));
        }
        let plan = outcome.plan.as_ref().ok_or_else(|| {
            AgentError::NoPlan(if outcome.errors.is_empty() {
                format!(
                    "node {} is not in the backend yet (a dry run does not publish it)",
                    self.local.hostname
                )
            } else {
                let errors: Vec<String> = outcome.errors.iter().map(ToString::to_string).collect();
                errors.join("; ")
            })
        })?;
        out.push_str(&self.reconciler.dry_run(plan).await?.to_string());
        Ok(out)
    }
}
