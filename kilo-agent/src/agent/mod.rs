//! The agent: one event loop that turns backend updates, kernel notifications about our objects
//! and the `--resync-period` timer into reconciles (the first change after a quiet
//! [`DEBOUNCE`] is reconciled at once, what follows it within the window coalesces into one
//! more pass), publishes the local node's annotations when they differ from what the backend
//! shows, refreshes Kilo's `last-seen` heartbeat, and cleans up on shutdown.
//!
//! Liveness ([`liveness`]) is judged here, before planning: heartbeats that change nothing else
//! are recorded without a plan, and the loop re-plans when a node crosses the live/dead
//! boundary, on a timer set to the earliest expiry. A failure to plan changes nothing (no
//! teardown, no role change) and is reported once.
//!
//! The planner is injected ([`Planner`]): the agent never computes topology itself.
pub mod caps;
pub mod config;
pub mod detect;
pub mod key;
pub mod liveness;
pub mod planner;
pub mod seccomp;

use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use ipnet::IpNet;
use tokio::sync::mpsc;

use crate::{
    backend::{Annotations, Backend, Update},
    datapath::DatapathSync,
    mesh::{Key, Snapshot},
    plan::Plan,
    reconcile::{Kernel, Reconciler, Report, netlink::EventFilter, wireguard::WireGuard},
    telemetry::{Metrics, Trigger},
    writes::Writes,
};

/// A change arriving this long after the previous one is reconciled at once; one arriving sooner
/// waits this long for the rest of its burst.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// How long the clean-up waits for the backend to remove this node's annotations.
pub const ANNOTATION_REMOVAL_TIMEOUT: Duration = Duration::from_secs(5);

pub const ANNOTATION_KEY: &str = "kilo.squat.ai/key";
pub const ANNOTATION_ENDPOINT: &str = "kilo.squat.ai/endpoint";
pub const ANNOTATION_INTERNAL_IP: &str = "kilo.squat.ai/internal-ip";
pub const ANNOTATION_WIREGUARD_IP: &str = "kilo.squat.ai/wireguard-ip";
pub const ANNOTATION_GRANULARITY: &str = "kilo.squat.ai/granularity";
pub const ANNOTATION_LAST_SEEN: &str = "kilo.squat.ai/last-seen";
pub const ANNOTATION_DISCOVERED_ENDPOINTS: &str = "kilo.squat.ai/discovered-endpoints";
pub const ANNOTATION_CNI_COMPATIBILITY_IP: &str = "kilo.squat.ai/cni-compatibility-ip";

/// Every annotation the agent writes (and removes on clean-up).
pub const OWN_ANNOTATIONS: [&str; 8] = [
    ANNOTATION_KEY,
    ANNOTATION_ENDPOINT,
    ANNOTATION_INTERNAL_IP,
    ANNOTATION_WIREGUARD_IP,
    ANNOTATION_GRANULARITY,
    ANNOTATION_LAST_SEEN,
    ANNOTATION_DISCOVERED_ENDPOINTS,
    ANNOTATION_CNI_COMPATIBILITY_IP,
];

/// What the planner made of a snapshot.
#[derive(Debug, Clone, Default)]
pub struct PlanOutcome {
    /// `None` when no plan can be made yet (e.g. the local node is not in the snapshot).
    pub plan: Option<Plan>,
    /// Invalid fields (each naming its object) and topology errors.
    pub errors: Vec<String>,
    /// The invalid fields among `errors`: a node's was ignored, a peer's left the peer out.
    pub invalid: Vec<crate::mesh::ObjectError>,
    /// The topology, rendered on `/graph`.
    pub graph: Option<crate::telemetry::Graph>,
    pub ready_nodes: usize,
    pub ready_peers: usize,
    pub leader: bool,
    /// The local node's WireGuard IP (leaders only), published as `kilo.squat.ai/wireguard-ip`.
    pub wireguard_ip: Option<IpNet>,
    /// Public keys of the nodes and peers behind NAT (non-zero persistent keepalive): their
    /// observed endpoints are published as `kilo.squat.ai/discovered-endpoints`.
    pub nat_keys: std::collections::BTreeSet<Key>,
    /// The names of the WireGuard peers (a segment's leader, a Peer), for the metrics.
    pub peer_names: BTreeMap<Key, String>,
    /// The service CIDRs planned with: `--service-cidr`'s and the cluster's.
    pub service_cidrs: Vec<IpNet>,
}

/// Turns a snapshot into a plan (the topology/plan builder, injected).
pub trait Planner {
    fn plan(&mut self, snapshot: &Snapshot) -> PlanOutcome;
}

impl<F: FnMut(&Snapshot) -> PlanOutcome> Planner for F {
    fn plan(&mut self, snapshot: &Snapshot) -> PlanOutcome {
        self(snapshot)
    }
}

/// What the agent publishes about its own node.
#[derive(Debug, Clone)]
pub struct Local {
    pub hostname: String,
    pub public_key: Key,
    pub endpoint: Option<SocketAddr>,
    pub internal_ip: Option<IpNet>,
    pub granularity: String,
    /// `--compatibility=cilium`: the IPv4 address of `cilium_host`, published as
    /// `kilo.squat.ai/cni-compatibility-ip` (empty otherwise, as Kilo publishes it).
    pub cni_compatibility_ip: Option<IpNet>,
}

impl Local {
    /// The annotations this node should carry (without `last-seen`).
    pub fn annotations(&self, wireguard_ip: Option<IpNet>) -> BTreeMap<String, String> {
        BTreeMap::from([
            (ANNOTATION_KEY.into(), self.public_key.to_string()),
            (
                ANNOTATION_ENDPOINT.into(),
                self.endpoint.map(|e| e.to_string()).unwrap_or_default(),
            ),
            (
                ANNOTATION_INTERNAL_IP.into(),
                self.internal_ip.map(|i| i.to_string()).unwrap_or_default(),
            ),
            (
                ANNOTATION_WIREGUARD_IP.into(),
                wireguard_ip.map(|i| i.to_string()).unwrap_or_default(),
            ),
            (ANNOTATION_GRANULARITY.into(), self.granularity.clone()),
            (
                ANNOTATION_CNI_COMPATIBILITY_IP.into(),
                self.cni_compatibility_ip
                    .map(|i| i.to_string())
                    .unwrap_or_default(),
            ),
        ])
    }
}

/// The annotations to publish so that `current` carries `want`. Pure.
pub fn annotation_changes(
    current: Option<&BTreeMap<String, String>>,
    want: &BTreeMap<String, String>,
) -> Annotations {
    want.iter()
        .filter(|(k, v)| current.and_then(|c| c.get(*k)) != Some(*v))
        .map(|(k, v)| (k.clone(), Some(v.clone())))
        .collect()
}

/// Kilo's format for `kilo.squat.ai/discovered-endpoints`: Go's JSON of
/// `map[string]*net.UDPAddr`, keyed by public key.
pub fn discovered_endpoints_json(endpoints: &BTreeMap<&Key, &SocketAddr>) -> String {
    let map: serde_json::Map<String, serde_json::Value> = endpoints
        .iter()
        .map(|(k, a)| {
            (
                k.to_string(),
                serde_json::json!({"IP": a.ip().to_string(), "Port": a.port(), "Zone": ""}),
            )
        })
        .collect();
    serde_json::Value::Object(map).to_string()
}

/// The wall clock the loop reads, in unix milliseconds: the system's, or a test's.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> i64 + Send + Sync>);

impl Clock {
    pub fn new(now_ms: impl Fn() -> i64 + Send + Sync + 'static) -> Self {
        Clock(Arc::new(now_ms))
    }

    pub fn now_ms(&self) -> i64 {
        (self.0)()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or_default()
        })
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

/// How the loop behaves.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    pub debounce: Duration,
    pub resync: Option<Duration>,
    /// `--check-in-period`: also selects the liveness rule ([`liveness::Rule::from_check_in`]).
    pub check_in: Option<Duration>,
    pub clean_up: bool,
    pub clean_up_interface: bool,
    pub clock: Clock,
}

impl Default for LoopSettings {
    fn default() -> Self {
        LoopSettings {
            debounce: DEBOUNCE,
            resync: Some(Duration::from_secs(30)),
            check_in: Some(Duration::from_secs(30)),
            clean_up: true,
            clean_up_interface: false,
            clock: Clock::default(),
        }
    }
}

/// What the loop did, for tests and benchmarks.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub reconciles: u64,
    pub writes: Writes,
    pub last: Writes,
    pub publishes: u64,
    pub last_problems: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Kernel(#[from] crate::reconcile::KernelError),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error("no plan: {0}")]
    NoPlan(String),
}

impl AgentError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            AgentError::Kernel(_) => "apply",
            AgentError::Backend(_) => "local",
            AgentError::NoPlan(_) => "plan",
        }
    }
}

/// The agent: a backend, a planner, the reconcilers.
pub struct Agent<P, K, W, D> {
    pub backend: Arc<dyn Backend>,
    pub planner: P,
    pub reconciler: Reconciler<K, W, D>,
    pub local: Local,
    pub settings: LoopSettings,
    pub metrics: Metrics,
    /// Shared with the kernel watcher ([`crate::reconcile::netlink::watch`]).
    pub filter: Arc<Mutex<EventFilter>>,
    pub stats: Stats,
    last_seen_due: bool,
    /// The generation of the snapshot last planned.
    seen_generation: u64,
    /// Objects the planner rejected last time (so each is counted once, when it appears).
    invalid: BTreeSet<String>,
    liveness: liveness::Tracker,
    /// The nodes the last plan left out as not alive.
    planned_down: BTreeSet<String>,
    /// The planning failure last reported (reported again only when it changes).
    failing: Option<String>,
    /// A publish of this pass failed.
    publish_failed: bool,
    retry: Retry,
    /// The last snapshot planned and what the planner made of it: a pass on the same snapshot
    /// (a resync, a kernel notification) reuses it instead of planning again.
    last_plan: Option<(Arc<Snapshot>, Arc<PlanOutcome>)>,
    /// Reads the local node's `cni-compatibility-ip` at every pass.
    cni_probe: Option<CniProbe>,
    /// The service CIDRs of the last plan (`None` before the first).
    service_cidrs: Option<Vec<IpNet>>,
}

/// Reads the local node's `cni-compatibility-ip` (`--compatibility=cilium`: `cilium_host`'s
/// IPv4 address); an error keeps the last value.
pub type CniProbe =
    Box<dyn FnMut() -> futures::future::BoxFuture<'static, Result<Option<IpNet>, String>> + Send>;

/// When a pass that failed to apply or publish is tried again: after 1 s, doubling up to 30 s,
/// so a failure that cannot be fixed costs a pass every 30 s, never a loop.
#[derive(Debug)]
struct Retry {
    at: Option<tokio::time::Instant>,
    delay: Duration,
}

impl Retry {
    const FIRST: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(30);

    fn after(&mut self, failed: bool) {
        if failed {
            self.at = Some(tokio::time::Instant::now() + self.delay);
            self.delay = (self.delay * 2).min(Self::MAX);
        } else {
            *self = Retry::default();
        }
    }
}

impl Default for Retry {
    fn default() -> Self {
        Retry {
            at: None,
            delay: Self::FIRST,
        }
    }
}

impl<P: Planner, K: Kernel, W: WireGuard, D: DatapathSync> Agent<P, K, W, D> {
    pub fn new(
        backend: Arc<dyn Backend>,
        planner: P,
        reconciler: Reconciler<K, W, D>,
        local: Local,
        settings: LoopSettings,
        metrics: Metrics,
    ) -> Self {
        let devices = &reconciler.settings.devices;
        let filter = EventFilter {
            names: devices.names().map(str::to_owned).collect(),
            ..EventFilter::default()
        };
        metrics.set_datapath(reconciler.datapath.stats_source());
        metrics.set_wireguard(reconciler.wireguard.stats_source());
        let liveness = liveness::Tracker::new(
            liveness::Rule::from_check_in(settings.check_in),
            local.hostname.clone(),
        );
        Agent {
            backend,
            planner,
            reconciler,
            local,
            settings,
            metrics,
            filter: Arc::new(Mutex::new(filter)),
            stats: Stats::default(),
            last_seen_due: true,
            seen_generation: 0,
            invalid: Default::default(),
            liveness,
            planned_down: BTreeSet::new(),
            failing: None,
            publish_failed: false,
            retry: Retry::default(),
            last_plan: None,
            cni_probe: None,
            service_cidrs: None,
        }
    }

    /// Re-reads the local node's `cni-compatibility-ip` with `probe` at every pass, as Kilo
    /// re-reads `cilium_host` whenever it handles its own node: a new address is published
    /// and planned with at once.
    pub fn with_cni_compatibility_probe(mut self, probe: CniProbe) -> Self {
        self.cni_probe = Some(probe);
        self
    }

    async fn refresh_cni_compatibility_ip(&mut self) {
        let Some(probe) = self.cni_probe.as_mut() else {
            return;
        };
        match probe().await {
            Ok(ip) if ip != self.local.cni_compatibility_ip => {
                tracing::info!(old = ?self.local.cni_compatibility_ip, new = ?ip, "cni-compatibility-ip changed");
                self.local.cni_compatibility_ip = ip;
            }
            Ok(_) => {}
            Err(e) => {
                self.metrics.error("local");
                tracing::warn!(error = %e, "reading the cni-compatibility-ip failed; keeping the last one");
            }
        }
    }

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
    fn liveness_changed(&mut self, update: &Update) -> bool {
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

    /// `snapshot` as it will be once this node's own annotations are published (all but the
    /// WireGuard IP, which the plan decides): planned so, this node is ready (its key,
    /// endpoint, internal IP) from the first pass, and the first publish already carries its
    /// WireGuard IP instead of a second patch after the first one comes back.
    fn with_own_annotations(&self, snapshot: Arc<Snapshot>) -> Arc<Snapshot> {
        let Some(node) = snapshot.nodes.get(&self.local.hostname) else {
            return snapshot;
        };
        let mut want = self.local.annotations(None);
        want.remove(ANNOTATION_WIREGUARD_IP);
        let current = node.metadata.annotations.as_ref();
        if annotation_changes(current, &want).is_empty() {
            return snapshot;
        }
        let mut node = node.clone();
        node.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .extend(want);
        let mut snapshot = (*snapshot).clone();
        snapshot.nodes.insert(self.local.hostname.clone(), node);
        Arc::new(snapshot)
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
        }
        let now: BTreeSet<String> = outcome.errors.iter().cloned().collect();
        for e in now.difference(&self.invalid) {
            self.metrics.error("validate");
            tracing::warn!(error = %e, "invalid value in the mesh's objects");
        }
        for e in &outcome.invalid {
            if !self.invalid.contains(&e.to_string()) {
                self.metrics.invalid_field(&e.kind.to_string(), &e.field);
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

    /// Publishes the local annotations that differ from what the backend shows. Without a plan
    /// (`planned` false) the WireGuard IP is left as it is.
    async fn publish(
        &mut self,
        snapshot: &Snapshot,
        outcome: &PlanOutcome,
        planned: bool,
        endpoints: &BTreeMap<Key, SocketAddr>,
    ) {
        let mut want = self.local.annotations(outcome.wireguard_ip);
        if !planned {
            want.remove(ANNOTATION_WIREGUARD_IP);
        }
        let discovered: BTreeMap<&Key, &SocketAddr> = endpoints
            .iter()
            .filter(|(k, _)| outcome.nat_keys.contains(k))
            .collect();
        if !discovered.is_empty() {
            want.insert(
                ANNOTATION_DISCOVERED_ENDPOINTS.into(),
                discovered_endpoints_json(&discovered),
            );
        }
        if self.settings.check_in.is_some() && self.last_seen_due {
            want.insert(ANNOTATION_LAST_SEEN.into(), self.unix_seconds());
        }
        let current = snapshot
            .nodes
            .get(&self.local.hostname)
            .and_then(|n| n.metadata.annotations.as_ref());
        let changes = annotation_changes(current, &want);
        if changes.is_empty() {
            self.last_seen_due = false;
            return;
        }
        match self.backend.publish(&self.local.hostname, &changes).await {
            Ok(wrote) => {
                self.last_seen_due = false;
                if wrote {
                    self.stats.publishes += 1;
                    tracing::debug!(changed = changes.len(), "published local annotations");
                }
            }
            Err(e) => {
                self.publish_failed = true;
                self.metrics.error("local");
                self.log_publish_failure("local annotations", &e);
            }
        }
    }

    /// A warning, or a debug line while the backend is disconnected (it reports the outage).
    fn log_publish_failure(&self, what: &str, e: &crate::backend::BackendError) {
        if self.backend.updates().borrow().connected {
            tracing::warn!(error = %e, "publishing {what} failed");
        } else {
            tracing::debug!(error = %e, "publishing {what} failed");
        }
    }

    fn unix_seconds(&self) -> String {
        (self.settings.clock.now_ms() / 1000).to_string()
    }

    /// The check-in: refreshes `last-seen` alone (no plan, no reconcile). Returns whether a
    /// full pass is needed instead, because the local node is not published yet.
    async fn check_in(&mut self) -> bool {
        let published = self
            .backend
            .updates()
            .borrow()
            .snapshot
            .nodes
            .contains_key(&self.local.hostname);
        if !published {
            self.last_seen_due = true;
            return true;
        }
        let changes = Annotations::from([(ANNOTATION_LAST_SEEN.into(), Some(self.unix_seconds()))]);
        match self.backend.publish(&self.local.hostname, &changes).await {
            Ok(wrote) => self.stats.publishes += u64::from(wrote),
            Err(e) => {
                self.metrics.error("checkin");
                self.log_publish_failure("the heartbeat", &e);
            }
        }
        false
    }

    /// One pass: plan from the latest snapshot, publish, reconcile. The duration of a pass that
    /// reached the reconcilers (one `kilo_reconciles_total` counts) is observed in
    /// `kilo_reconcile_duration_seconds`.
    pub async fn reconcile_once(&mut self) -> Result<Report, AgentError> {
        let (start, reconciles) = (std::time::Instant::now(), self.stats.reconciles);
        let result = self.pass().await;
        if self.stats.reconciles != reconciles {
            self.metrics
                .reconcile_duration
                .observe(start.elapsed().as_secs_f64());
        }
        result
    }

    async fn pass(&mut self) -> Result<Report, AgentError> {
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
            return Err(AgentError::NoPlan(
                outcome
                    .errors
                    .first()
                    .cloned()
                    .unwrap_or_else(|| "the planner made none".into()),
            ));
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
        {
            let mut f = self.filter.lock().expect("filter lock");
            f.indexes = report.links.values().map(|l| l.index).collect();
            f.wireguard_index = report
                .links
                .get(&self.reconciler.settings.devices.wireguard)
                .map(|l| l.index);
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
        Ok(report)
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
                outcome.errors.join("; ")
            })
        })?;
        out.push_str(&self.reconciler.dry_run(plan).await?.to_string());
        Ok(out)
    }

    /// Removes our kernel state and our annotations.
    pub async fn clean_up(&mut self) -> Result<Report, AgentError> {
        let report = self
            .reconciler
            .clean_up(self.settings.clean_up_interface)
            .await?;
        let remove: Annotations = OWN_ANNOTATIONS
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
            Err(crate::backend::BackendError::Kube(format!(
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
                    OWN_ANNOTATIONS
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

    /// Runs until `shutdown` completes, then cleans up when `--clean-up` is set.
    pub async fn run(
        &mut self,
        mut kernel_events: Option<mpsc::Receiver<()>>,
        shutdown: impl Future<Output = ()>,
    ) -> Stats {
        tokio::pin!(shutdown);
        let mut updates = self.backend.updates();
        let mut resync = self.settings.resync.map(|p| {
            let mut i = tokio::time::interval_at(tokio::time::Instant::now() + p, p);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        let mut check_in = self.settings.check_in.map(|p| {
            let mut i = tokio::time::interval_at(tokio::time::Instant::now() + p, p);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        // No reconcile before the backend has a complete view: an empty snapshot must never
        // tear the mesh down.
        let mut pending = updates.borrow_and_update().generation > 0;
        if pending {
            self.metrics.trigger(Trigger::Start);
        }
        // Backend and kernel changes come in bursts: the first of a quiet period is reconciled
        // at once, the rest of the burst waits out the debounce window. A timer's pass (resync,
        // retry, expiry, check-in) starts at once.
        let mut coalesce = false;
        let mut last_change: Option<tokio::time::Instant> = None;
        let mut stop = false;
        while !stop {
            if pending {
                // Coalesce a burst: absorb whatever else arrives within the debounce window.
                let window = tokio::time::sleep(self.settings.debounce);
                tokio::pin!(window);
                while coalesce && !stop {
                    tokio::select! {
                        _ = &mut window => break,
                        r = updates.changed() => if r.is_err() {
                            stop = true;
                        } else {
                            updates.borrow_and_update();
                            last_change = Some(tokio::time::Instant::now());
                            self.metrics.trigger(Trigger::Backend);
                        },
                        Some(()) = recv(&mut kernel_events) => {
                            last_change = Some(tokio::time::Instant::now());
                            self.metrics.trigger(Trigger::Kernel);
                        }
                        _ = &mut shutdown => stop = true,
                    }
                }
                if stop {
                    break;
                }
                pending = false;
                if updates.borrow_and_update().generation == 0 {
                    continue;
                }
                self.publish_failed = false;
                let failed = match self.reconcile_once().await {
                    Ok(report) => {
                        self.failing = None;
                        !report.problems.is_empty()
                    }
                    // A plan fails again until the backend changes, which triggers by itself.
                    Err(e @ AgentError::NoPlan(_)) => {
                        self.report(&e);
                        false
                    }
                    Err(e) => {
                        self.report(&e);
                        true
                    }
                };
                self.retry.after(failed || self.publish_failed);
            }
            // The earliest instant a node alive now would expire: re-plan then, not before.
            let now = self.settings.clock.now_ms();
            let expiry = self.liveness.next_expiry(now).map(|at| {
                tokio::time::Instant::now() + Duration::from_millis((at - now).unsigned_abs())
            });
            let cause = tokio::select! {
                r = updates.changed() => {
                    if r.is_err() { tracing::error!("backend stopped"); break; }
                    let update = updates.borrow_and_update().clone();
                    // A new snapshot is planned; heartbeats alone only when a node revives.
                    pending = update.generation != self.seen_generation
                        || self.liveness_changed(&update);
                    Some(Trigger::Backend)
                }
                Some(()) = recv(&mut kernel_events) => { pending = true; Some(Trigger::Kernel) }
                _ = tick(&mut resync) => { pending = true; Some(Trigger::Resync) }
                _ = sleep_until(self.retry.at) => {
                    self.retry.at = None;
                    pending = true;
                    Some(Trigger::Retry)
                }
                _ = tick(&mut check_in) => {
                    pending = self.check_in().await;
                    Some(Trigger::CheckIn)
                }
                _ = sleep_until(expiry) => {
                    let update = updates.borrow().clone();
                    pending = self.liveness_changed(&update);
                    Some(Trigger::Liveness)
                }
                _ = &mut shutdown => { stop = true; None }
            };
            if pending && let Some(cause) = cause {
                self.metrics.trigger(cause);
                let now = tokio::time::Instant::now();
                let change = matches!(cause, Trigger::Backend | Trigger::Kernel);
                coalesce = change && last_change.is_some_and(|t| now - t < self.settings.debounce);
                if change {
                    last_change = Some(now);
                }
            }
        }
        if self.settings.clean_up {
            if let Err(e) = self.clean_up().await {
                self.metrics.error("cleanUp");
                tracing::error!(error = %e, "clean-up failed");
            }
        } else {
            tracing::info!("--clean-up=false: leaving the mesh and datapath running");
        }
        self.stats.clone()
    }
}

impl<P, K, W, D> Agent<P, K, W, D> {
    /// Counts and logs a failed pass. The same failure again is only a debug line; the same
    /// planning failure is not counted again either (it lasts until the backend changes).
    fn report(&mut self, e: &AgentError) {
        let message = e.to_string();
        let again = self.failing.as_ref() == Some(&message);
        self.failing = Some(message);
        if again && matches!(e, AgentError::NoPlan(_)) {
            tracing::debug!(error = %e, "still no plan");
            return;
        }
        self.metrics.error(e.metric_label());
        if again {
            tracing::debug!(error = %e, "reconcile still failing");
        } else {
            tracing::warn!(error = %e, "reconcile failed");
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn recv(rx: &mut Option<mpsc::Receiver<()>>) -> Option<()> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn tick(i: &mut Option<tokio::time::Interval>) {
    match i {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovered_endpoints_in_kilo_format() {
        let k = Key([1; 32]);
        let a: SocketAddr = "192.0.2.7:4500".parse().unwrap();
        let json = discovered_endpoints_json(&BTreeMap::from([(&k, &a)]));
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            v[k.to_string()],
            serde_json::json!({"IP": "192.0.2.7", "Port": 4500, "Zone": ""})
        );
    }

    #[test]
    fn only_differing_annotations_are_published() {
        let local = Local {
            hostname: "a".into(),
            public_key: Key([1; 32]),
            endpoint: Some("10.0.0.1:51820".parse().unwrap()),
            internal_ip: Some("10.0.0.1/24".parse().unwrap()),
            granularity: "location".into(),
            cni_compatibility_ip: None,
        };
        let want = local.annotations(None);
        assert_eq!(want[ANNOTATION_WIREGUARD_IP], "");
        assert_eq!(want[ANNOTATION_CNI_COMPATIBILITY_IP], "");
        let all = annotation_changes(None, &want);
        assert_eq!(all.len(), 6);
        let cilium = Local {
            cni_compatibility_ip: Some("10.0.1.77/32".parse().unwrap()),
            ..local.clone()
        };
        assert_eq!(
            cilium.annotations(None)[ANNOTATION_CNI_COMPATIBILITY_IP],
            "10.0.1.77/32"
        );
        let mut current = want.clone();
        current.insert("kilo.squat.ai/leader".into(), "true".into());
        assert!(annotation_changes(Some(&current), &want).is_empty());
        let want2 = local.annotations(Some("10.4.0.1/16".parse().unwrap()));
        let c = annotation_changes(Some(&current), &want2);
        assert_eq!(
            c,
            Annotations::from([(ANNOTATION_WIREGUARD_IP.into(), Some("10.4.0.1/16".into()))])
        );
    }

    /// A backend the test drives: it sends updates and records what the agent publishes.
    struct Driven {
        tx: tokio::sync::watch::Sender<Update>,
        published: Mutex<Vec<Annotations>>,
        /// Publishing fails while set.
        failing: std::sync::atomic::AtomicBool,
    }

    impl Backend for Driven {
        fn updates(&self) -> tokio::sync::watch::Receiver<Update> {
            self.tx.subscribe()
        }

        fn publish<'a>(
            &'a self,
            _node: &'a str,
            annotations: &'a Annotations,
        ) -> futures::future::BoxFuture<'a, Result<bool, crate::backend::BackendError>> {
            if self.failing.load(std::sync::atomic::Ordering::Relaxed) {
                return Box::pin(async {
                    Err(crate::backend::BackendError::Kube("unreachable".into()))
                });
            }
            self.published.lock().unwrap().push(annotations.clone());
            Box::pin(async { Ok(true) })
        }
    }

    use testing::{Plans, Running, T0, planned, spawn};

    /// A backend's first update: `snapshot`, complete.
    fn first_update(snapshot: Arc<Snapshot>) -> Update {
        Update {
            snapshot,
            generation: 1,
            connected: true,
            ..Update::default()
        }
    }

    fn start(
        update: Update,
        outcome: impl Fn() -> PlanOutcome + Send + 'static,
    ) -> (Arc<Driven>, Running) {
        let (tx, _) = tokio::sync::watch::channel(update);
        let backend = Arc::new(Driven {
            tx,
            published: Mutex::default(),
            failing: Default::default(),
        });
        let settings = LoopSettings {
            resync: Some(Duration::from_secs(8)),
            check_in: Some(Duration::from_secs(10)),
            ..LoopSettings::default()
        };
        (backend.clone(), spawn(backend, settings, outcome))
    }

    fn nodes(names: &[&str]) -> Arc<Snapshot> {
        let nodes = names
            .iter()
            .map(|n| {
                let node = serde_json::from_value(serde_json::json!({"metadata": {"name": n}}));
                (n.to_string(), node.unwrap())
            })
            .collect();
        Arc::new(Snapshot {
            nodes,
            ..Snapshot::default()
        })
    }

    fn beats(b: &[(&str, i64)]) -> Arc<BTreeMap<String, i64>> {
        Arc::new(b.iter().map(|(n, t)| (n.to_string(), T0 + t)).collect())
    }

    /// Sleeps (paused clock) until `ms` after the start.
    async fn at(begin: tokio::time::Instant, ms: u64) {
        tokio::time::sleep_until(begin + Duration::from_millis(ms)).await;
    }

    /// When the first plan at or after `from` without (or with) `node` came.
    fn first(plans: &Plans, from: u128, node: &str, with: bool) -> Option<u128> {
        let plans = plans.lock().unwrap();
        plans
            .iter()
            .find(|(t, n)| *t >= from && n.iter().any(|n| n == node) == with)
            .map(|(t, _)| *t)
    }

    /// The first change after a quiet period is planned the instant it arrives; the rest of its
    /// burst coalesces into one more plan after the debounce window, whatever the period between
    /// bursts (shorter or longer than the window, or than the resync period).
    #[tokio::test(start_paused = true)]
    async fn first_change_at_once_rest_of_burst_coalesced() {
        let begin = tokio::time::Instant::now();
        let (backend, agent) = start(first_update(nodes(&["me"])), planned);
        let debounce = DEBOUNCE.as_millis();
        for (start, gap, count) in [(1_000u64, 5u64, 20u64), (3_000, 1, 60), (20_000, 30, 3)] {
            at(begin, start).await;
            let before = agent.plans.lock().unwrap().len();
            let mut names = vec!["me".to_string()];
            for i in 0..count {
                at(begin, start + i * gap).await;
                names.push(format!("n{start}-{i}"));
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let now_s = i64::try_from(start / 1000).unwrap();
                let alive: Vec<(&str, i64)> = refs.iter().map(|n| (*n, now_s)).collect();
                backend.tx.send_modify(|u| {
                    u.snapshot = nodes(&refs);
                    u.last_seen = beats(&alive);
                    u.generation += 1;
                });
            }
            at(begin, start + count * gap + 2 * debounce as u64).await;
            let plans = agent.plans.lock().unwrap();
            let burst = &plans[before..];
            assert_eq!(
                burst.first().map(|(t, _)| *t),
                Some(u128::from(start)),
                "the burst at {start} ms was not planned at once: {burst:?}"
            );
            assert!(
                burst.len() <= 2,
                "a burst of {count} cost {} plans",
                burst.len()
            );
            assert_eq!(
                burst.last().map(|(_, n)| n.len()),
                Some(names.len()),
                "the burst at {start} ms ended unapplied"
            );
        }
    }

    /// `--compatibility=cilium`: the local `cni-compatibility-ip` is read at every pass; a new
    /// address (or none) is planned with and published at once.
    #[tokio::test]
    async fn cni_compatibility_ip_is_read_at_every_pass() {
        let (tx, _) = tokio::sync::watch::channel(first_update(nodes(&["me"])));
        let backend = Arc::new(Driven {
            tx,
            published: Mutex::default(),
            failing: Default::default(),
        });
        let planned_with: Arc<Mutex<Vec<String>>> = Arc::default();
        let recorded = planned_with.clone();
        let planner = move |s: &Snapshot| {
            let a = s.nodes["me"].metadata.annotations.as_ref();
            let ip = a.and_then(|a| a.get(ANNOTATION_CNI_COMPATIBILITY_IP));
            recorded
                .lock()
                .unwrap()
                .push(ip.cloned().unwrap_or_default());
            planned()
        };
        let address: Arc<Mutex<Option<&str>>> = Arc::new(Mutex::new(Some("10.0.1.77/32")));
        let read = address.clone();
        let mut agent = Agent::new(
            backend.clone(),
            planner,
            testing::reconciler(),
            testing::local(),
            LoopSettings::default(),
            Metrics::new(),
        )
        .with_cni_compatibility_probe(Box::new(move || {
            let ip = read.lock().unwrap().map(|a| a.parse().unwrap());
            Box::pin(async move { Ok(ip) })
        }));
        for next in [Some("10.0.1.78/32"), None, None] {
            agent.reconcile_once().await.unwrap();
            *address.lock().unwrap() = next;
        }
        let want = ["10.0.1.77/32", "10.0.1.78/32", ""];
        assert_eq!(*planned_with.lock().unwrap(), want);
        let published: Vec<String> = backend
            .published
            .lock()
            .unwrap()
            .iter()
            .map(|a| a[ANNOTATION_CNI_COMPATIBILITY_IP].clone().unwrap())
            .collect();
        assert_eq!(
            published, want,
            "the backend never shows them: each pass publishes"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn nodes_expire_at_their_instant_not_at_resync_ticks() {
        let begin = tokio::time::Instant::now();
        let (backend, agent) = start(
            Update {
                snapshot: nodes(&["me", "a", "b"]),
                generation: 1,
                // a vouched for until 21 s, b until 26 s; `me` has no heartbeat yet.
                last_seen: beats(&[("a", 0), ("b", 5)]),
                connected: true,
                ..Update::default()
            },
            planned,
        );
        // A heartbeat from b (until 33 s): recorded, no plan.
        at(begin, 12_000).await;
        let planned = agent.plans.lock().unwrap().len();
        backend
            .tx
            .send_modify(|u| u.last_seen = beats(&[("a", 0), ("b", 12)]));
        at(begin, 15_000).await;
        assert_eq!(
            agent.plans.lock().unwrap().len(),
            planned,
            "a heartbeat made a plan"
        );
        // a revives at 41 s.
        at(begin, 41_000).await;
        backend
            .tx
            .send_modify(|u| u.last_seen = beats(&[("a", 41), ("b", 12)]));
        at(begin, 50_000).await;
        let debounce = DEBOUNCE.as_millis();
        let dropped_a = first(&agent.plans, 0, "a", false).unwrap();
        assert!(
            (21_000..=21_000 + debounce).contains(&dropped_a),
            "{dropped_a}"
        );
        let dropped_b = first(&agent.plans, 0, "b", false).unwrap();
        assert!(
            (33_000..=33_000 + debounce).contains(&dropped_b),
            "{dropped_b}"
        );
        let back = first(&agent.plans, dropped_a, "a", true).unwrap();
        assert!((41_000..=41_000 + debounce).contains(&back), "{back}");
        // Resync ticks (8, 16, 24, 32, 40, 48 s) plan at once, the same nodes as the plan before.
        let plans_seen = agent.plans.lock().unwrap().clone();
        let ticks: Vec<u128> = plans_seen
            .iter()
            .map(|(t, _)| *t)
            .filter(|t| t % 8_000 == 0 && *t > 0)
            .collect();
        assert_eq!(ticks, [8_000, 16_000, 24_000, 32_000, 40_000, 48_000]);
        for w in plans_seen.windows(2) {
            if w[1].0 % 8_000 == 0 {
                assert_eq!(w[0].1, w[1].1, "the resync at {} changed the nodes", w[1].0);
            }
        }
        assert!(
            plans_seen
                .iter()
                .all(|(_, n)| n.contains(&"me".to_string()))
        );
        // Check-ins at 10, 20, 30, 40 s wrote the heartbeat alone.
        let published = backend.published.lock().unwrap().clone();
        let beats_only = published
            .iter()
            .filter(|a| a.len() == 1 && a.contains_key(ANNOTATION_LAST_SEEN))
            .count();
        assert!(beats_only >= 4, "{published:?}");
        // Each reconcile counted under its cause: two expiries, the revival, the resync ticks;
        // heartbeats and check-ins asked for none.
        let text = agent.metrics.encode();
        let triggers = |cause: &str| {
            let series = format!("kilo_reconcile_triggers_total{{cause=\"{cause}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&series)?.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {series} in {text}"))
        };
        assert_eq!(triggers("liveness"), 2, "{text}");
        assert_eq!(triggers("start"), 1, "{text}");
        assert_eq!(triggers("backend"), 1, "{text}");
        assert_eq!(triggers("check_in"), 0, "{text}");
        assert!(triggers("resync") >= 5, "{text}");
        agent.stop.send(()).unwrap();
        agent.run.await.unwrap();
    }

    /// Nodes `names`, `me` carrying the annotations the test agent publishes (as a backend
    /// shows them once published).
    fn published(names: &[&str]) -> Arc<Snapshot> {
        let mut snapshot = (*nodes(names)).clone();
        let mut want = testing::local().annotations(None);
        want.remove(ANNOTATION_WIREGUARD_IP);
        snapshot.nodes.get_mut("me").unwrap().metadata.annotations = Some(want);
        Arc::new(snapshot)
    }

    /// A pass over the snapshot already planned (a resync, a kernel notification) reuses the
    /// plan: planning a large mesh is most of an idle resync's cost.
    #[tokio::test(start_paused = true)]
    async fn an_unchanged_snapshot_is_planned_once() {
        let begin = tokio::time::Instant::now();
        let (backend, agent) = start(first_update(published(&["me"])), planned);
        at(begin, 30_000).await;
        assert_eq!(agent.plans.lock().unwrap().len(), 1);
        assert!(
            agent.metrics.reconciles.get() >= 4,
            "resyncs at 8, 16, 24 s"
        );
        backend.tx.send_modify(|u| {
            u.snapshot = published(&["me", "a"]);
            u.generation = 2;
            u.last_seen = beats(&[("a", 30)]);
        });
        at(begin, 31_000).await;
        let plans = agent.plans.lock().unwrap().clone();
        assert_eq!(plans.len(), 2, "{plans:?}");
        assert_eq!(plans[1].1, ["a", "me"]);
        agent.stop.send(()).unwrap();
        agent.run.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_expires_while_the_backend_is_disconnected() {
        let begin = tokio::time::Instant::now();
        let (backend, agent) = start(
            Update {
                snapshot: nodes(&["me", "a"]),
                generation: 1,
                last_seen: beats(&[("a", 0)]), // until 21 s
                connected: true,
                ..Update::default()
            },
            planned,
        );
        at(begin, 5_000).await;
        backend.tx.send_modify(|u| u.connected = false);
        // Resyncs keep planning, with a, long past its heartbeat.
        at(begin, 100_000).await;
        assert_eq!(first(&agent.plans, 0, "a", false), None);
        backend.tx.send_modify(|u| u.connected = true);
        // Back: a gets a whole window from now, and then expires.
        at(begin, 130_000).await;
        let dropped = first(&agent.plans, 0, "a", false).unwrap();
        assert!(
            (120_000..=120_000 + DEBOUNCE.as_millis()).contains(&dropped),
            "{dropped}"
        );
        assert!(
            agent
                .plans
                .lock()
                .unwrap()
                .iter()
                .filter(|(t, _)| *t < 120_000)
                .count()
                > 10
        );
        agent.stop.send(()).unwrap();
        agent.run.await.unwrap();
    }

    /// A heartbeat that cannot be published counts as Kilo's `checkin` error.
    #[tokio::test(start_paused = true)]
    async fn a_failed_heartbeat_is_a_checkin_error() {
        let begin = tokio::time::Instant::now();
        let (backend, agent) = start(first_update(nodes(&["me"])), planned);
        at(begin, 1_000).await;
        backend
            .failing
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // Two check-ins (every 10 s) fail.
        at(begin, 25_000).await;
        agent.stop.send(()).unwrap();
        agent.run.await.unwrap();
        let text = agent.metrics.encode();
        assert!(
            text.contains("kilo_errors_total{event=\"checkin\"} 2"),
            "{text}"
        );
    }

    /// A publish that fails is tried again after 1 s, 2 s, 4 s..., not only at the next resync.
    #[tokio::test(start_paused = true)]
    async fn a_failed_publish_is_retried_with_backoff() {
        let begin = tokio::time::Instant::now();
        let (tx, _) = tokio::sync::watch::channel(first_update(nodes(&["me"])));
        let backend = Arc::new(Driven {
            tx,
            published: Mutex::default(),
            failing: true.into(),
        });
        let settings = LoopSettings {
            resync: Some(Duration::from_secs(60)),
            check_in: None,
            ..LoopSettings::default()
        };
        let agent = spawn(backend.clone(), settings, planned);
        // Fails at 0.1 s, 1.1 s and 3.1 s; the server is back at 5 s; the retry at 7.1 s lands.
        at(begin, 5_000).await;
        assert!(backend.published.lock().unwrap().is_empty());
        backend
            .failing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        at(begin, 7_000).await;
        assert!(backend.published.lock().unwrap().is_empty());
        at(begin, 7_500).await;
        assert_eq!(backend.published.lock().unwrap().len(), 1);
        // Then nothing more until the resync: the retry is over.
        at(begin, 59_000).await;
        agent.stop.send(()).unwrap();
        let stats = agent.run.await.unwrap();
        assert_eq!(stats.reconciles, 4);
        let text = agent.metrics.encode();
        assert!(
            text.contains("kilo_reconcile_triggers_total{cause=\"retry\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("kilo_errors_total{event=\"local\"} 3"),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_to_plan_keeps_the_role_and_is_reported_once() {
        let begin = tokio::time::Instant::now();
        let failing = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let fail = failing.clone();
        let (backend, agent) = start(first_update(nodes(&["me"])), move || {
            if fail.load(std::sync::atomic::Ordering::Relaxed) {
                return PlanOutcome::default();
            }
            PlanOutcome {
                leader: true,
                wireguard_ip: Some("10.4.0.1/16".parse().unwrap()),
                ready_nodes: 1,
                ..planned()
            }
        });
        at(begin, 1_000).await;
        failing.store(true, std::sync::atomic::Ordering::Relaxed);
        // Five resyncs without a plan.
        at(begin, 41_000).await;
        agent.stop.send(()).unwrap();
        let stats = agent.run.await.unwrap();
        assert_eq!(stats.reconciles, 1);
        let text = agent.metrics.encode();
        let metric = |series: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
                .unwrap_or_else(|| panic!("no {series} in {text}"))
        };
        assert_eq!(metric("kilo_errors_total{event=\"plan\"}"), "1", "{text}");
        assert_eq!(metric("kilo_leader"), "1", "{text}");
        assert_eq!(metric("kilo_nodes"), "1", "{text}");
        let published = backend.published.lock().unwrap().clone();
        let ips: Vec<_> = published
            .iter()
            .filter_map(|a| a.get(ANNOTATION_WIREGUARD_IP)?.as_deref())
            .collect();
        // Set once; never cleared without a plan (the `None` is the clean-up at the end).
        assert_eq!(ips, ["10.4.0.1/16"], "{published:?}");
    }

    /// Duplicate identities reach the invalid-objects counter once each, labelled with the
    /// losing object's kind and field, however many resyncs see them.
    #[tokio::test(start_paused = true)]
    async fn conflicts_are_counted_once_with_kind_and_field() {
        let begin = tokio::time::Instant::now();
        let settings = crate::plan::Settings {
            hostname: "a".into(),
            ..crate::plan::Settings::default()
        };
        let snapshot = crate::mesh::cloned_snapshot();
        let (_backend, agent) = start(first_update(nodes(&["a"])), move || {
            planner::outcome(crate::plan::plan_for(&snapshot, &settings))
        });
        // Three resyncs (every 8 s).
        at(begin, 25_000).await;
        agent.stop.send(()).unwrap();
        agent.run.await.unwrap();
        let text = agent.metrics.encode();
        for field in ["annotation kilo.squat.ai/key", "spec.podCIDR"] {
            let series = format!("kilo_invalid_objects_total{{kind=\"node\",field=\"{field}\"}} 1");
            assert!(text.lines().any(|l| l == series), "no {series} in {text}");
        }
        assert!(text.contains("kilo_nodes 1"), "{text}");
    }
}

/// The loop under tokio's paused clock with the in-memory kernel, for the tests here and in the
/// backends.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Unix seconds at a test's start.
    pub const T0: i64 = 1_000_000;

    /// Each plan: its time (ms since the start) and the nodes it was given.
    pub type Plans = Arc<Mutex<Vec<(u128, Vec<String>)>>>;

    pub struct Running {
        pub plans: Plans,
        pub stop: tokio::sync::oneshot::Sender<()>,
        pub run: tokio::task::JoinHandle<Stats>,
        pub metrics: Metrics,
    }

    /// The test loop's node, `me`.
    pub fn local() -> Local {
        Local {
            hostname: "me".into(),
            public_key: Key([1; 32]),
            endpoint: None,
            internal_ip: None,
            granularity: "location".into(),
            cni_compatibility_ip: None,
        }
    }

    /// A plan (empty).
    pub fn planned() -> PlanOutcome {
        PlanOutcome {
            plan: Some(Plan::default()),
            ..PlanOutcome::default()
        }
    }

    /// The unix clock of a test: [`T0`] at the start, then tokio's (paused) time.
    pub fn clock(begin: tokio::time::Instant) -> Clock {
        Clock::new(move || T0 * 1000 + begin.elapsed().as_millis() as i64)
    }

    pub type FakeReconciler = Reconciler<
        crate::reconcile::FakeKernel,
        crate::reconcile::wireguard::FakeWireGuard,
        crate::datapath::FakeDatapath,
    >;

    /// Reconcilers on fakes, with the WireGuard device kilo0 and no other.
    pub fn reconciler() -> FakeReconciler {
        Reconciler::new(
            crate::reconcile::FakeKernel::default(),
            crate::reconcile::wireguard::FakeWireGuard::default(),
            crate::datapath::FakeDatapath::default(),
            crate::reconcile::Settings {
                devices: crate::plan::Devices {
                    wireguard: "kilo0".into(),
                    private: None,
                    tunnel: None,
                },
                create_interface: true,
                mtu: None,
                private_key: Key([7; 32]),
                resolver: Box::new(crate::reconcile::wireguard::system_resolver),
            },
        )
    }

    /// Spawns the loop of node `me` on `backend` with `settings` (and [`clock`]); the planner
    /// records each plan and answers `outcome()`.
    pub fn spawn(
        backend: Arc<dyn Backend>,
        settings: LoopSettings,
        outcome: impl Fn() -> PlanOutcome + Send + 'static,
    ) -> Running {
        let begin = tokio::time::Instant::now();
        let plans = Plans::default();
        let recorded = plans.clone();
        let planner = move |s: &Snapshot| {
            recorded.lock().unwrap().push((
                begin.elapsed().as_millis(),
                s.nodes.keys().cloned().collect(),
            ));
            outcome()
        };
        let reconciler = reconciler();
        let local = local();
        let settings = LoopSettings {
            clock: clock(begin),
            ..settings
        };
        let metrics = Metrics::new();
        let mut agent = Agent::new(
            backend,
            planner,
            reconciler,
            local,
            settings,
            metrics.clone(),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(async move {
            agent
                .run(None, async {
                    let _ = stopped.await;
                })
                .await
        });
        Running {
            plans,
            stop,
            run,
            metrics,
        }
    }
}
