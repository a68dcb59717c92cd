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
//!
//! Files: `event_loop` (triggers, debounce, the reconcile step and its error policy), `pass`
//! (one pass: liveness, plan, reconcilers), `publish` (this node's annotations, the check-in),
//! `clean_up`, `clock`, `malformed` (the datapath's malformed count watched); start-up apart
//! from the loop: `caps`, `seccomp`, `config` (flags), `detect`, `key`, `planner`,
//! `prerequisites`.
pub mod caps;
mod clean_up;
mod clock;
pub mod config;
pub mod detect;
mod event_loop;
pub mod failover;
pub mod key_file;
pub mod liveness;
mod malformed;
mod pass;
pub mod planner;
pub mod prerequisites;
pub mod probe;
mod publish;
pub mod seccomp;
pub mod start;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use ipnet::IpNet;

pub use self::{
    clock::Clock,
    publish::{Local, annotation_changes, discovered_endpoints_json},
};
use crate::{
    backend::Backend,
    datapath::DatapathOps,
    mesh::{Key, Snapshot},
    plan::Plan,
    reconcile::{Kernel, Reconciler, netlink::EventFilter, wireguard::WireGuard},
    telemetry::Metrics,
    writes::Writes,
};

/// A change arriving this long after the previous one is reconciled at once; one arriving sooner
/// waits this long for the rest of its burst.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// How long the clean-up waits for the backend to remove this node's annotations.
pub const ANNOTATION_REMOVAL_TIMEOUT: Duration = Duration::from_secs(5);

/// What the planner made of a snapshot.
#[derive(Debug, Clone, Default)]
pub struct PlanOutcome {
    /// `None` when no plan can be made yet (e.g. the local node is not in the snapshot).
    pub plan: Option<Plan>,
    /// Invalid fields (each naming its object: a node's was ignored, a peer's left the peer
    /// out) and topology errors.
    pub errors: Vec<crate::plan::PlanError>,
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
    /// What this node watches for a leader failover.
    pub duty: failover::Duty,
    /// Why the local location keeps Kilo's leader whatever is demoted.
    pub failover_blocked: Option<String>,
    /// Each location's leader, as (location, node).
    pub location_leaders: Vec<(String, String)>,
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

/// How the loop behaves.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    pub debounce: Duration,
    pub resync: Option<Duration>,
    /// `--check-in-period`: also selects the liveness policy ([`liveness::Policy::from_check_in`]).
    pub check_in: Option<Duration>,
    pub clean_up: bool,
    pub clean_up_interface: bool,
    pub clock: Clock,
    /// Knock on new WireGuard peers ([`probe::knock`]): off where the kernel is a fake and
    /// the packets would leave through the host's own routes.
    pub knock: bool,
}

impl Default for LoopSettings {
    fn default() -> Self {
        let period = config::parse_duration(config::DEFAULT_PERIOD).ok();
        LoopSettings {
            debounce: DEBOUNCE,
            resync: period,
            check_in: period,
            clean_up: true,
            clean_up_interface: false,
            clock: Clock::default(),
            knock: false,
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
    requeue: event_loop::Requeue,
    /// The last snapshot planned and what the planner made of it: a pass on the same snapshot
    /// (a resync, a kernel notification) reuses it instead of planning again.
    last_plan: Option<(Arc<Snapshot>, Arc<PlanOutcome>)>,
    /// Reads the local node's `cni-compatibility-ip` at every pass.
    cni_probe: Option<CniProbe>,
    /// The service CIDRs of the last plan (`None` before the first).
    service_cidrs: Option<Vec<IpNet>>,
    /// The datapath's malformed count at the last look.
    malformed: malformed::MalformedWatch,
    /// `/check`s to answer ([`Agent::answer_checks`]).
    checks: Option<tokio::sync::mpsc::Receiver<crate::telemetry::CheckRequest>>,
    /// When the process started building the agent, until the first pass that left the kernel
    /// matching the plan ([`Agent::timed_from`]).
    start_up: Option<std::time::Instant>,
    /// The failover probe ([`Agent::with_probe`]); none: this node never fails over a leader.
    probe: Option<probe::Link>,
    failover: failover::Tracker,
    /// Why the local location cannot fail over, as last logged.
    failover_blocked: Option<String>,
    /// The last pass left the kernel matching the plan.
    healthy: bool,
}

/// The log target of the two start-up lines: the phases of building the agent, then the first
/// pass that leaves the kernel matching the plan.
pub const START_UP: &str = "kilo_agent::start_up";

/// Reads the local node's `cni-compatibility-ip` (`--compatibility=cilium`: `cilium_host`'s
/// IPv4 address); an error keeps the last value.
pub type CniProbe =
    Box<dyn FnMut() -> futures::future::BoxFuture<'static, Result<Option<IpNet>, String>> + Send>;

impl<P: Planner, K: Kernel, W: WireGuard, D: DatapathOps> Agent<P, K, W, D> {
    pub fn new(
        backend: Arc<dyn Backend>,
        planner: P,
        reconciler: Reconciler<K, W, D>,
        local: Local,
        settings: LoopSettings,
        metrics: Metrics,
    ) -> Self {
        metrics.set_datapath(reconciler.datapath().stats_source());
        metrics.set_wireguard(reconciler.wireguard().stats_source());
        let liveness = liveness::Tracker::new(
            liveness::Policy::from_check_in(settings.check_in),
            local.hostname.clone(),
        );
        Agent {
            backend,
            planner,
            reconciler,
            local,
            settings,
            metrics,
            stats: Stats::default(),
            last_seen_due: true,
            seen_generation: 0,
            invalid: Default::default(),
            liveness,
            planned_down: BTreeSet::new(),
            failing: None,
            publish_failed: false,
            requeue: event_loop::Requeue::default(),
            last_plan: None,
            cni_probe: None,
            service_cidrs: None,
            malformed: Default::default(),
            checks: None,
            start_up: None,
            probe: None,
            failover: failover::Tracker::default(),
            failover_blocked: None,
            healthy: false,
        }
    }

    /// Logs, at the first pass that leaves the kernel matching the plan, how long after `start`
    /// that was.
    pub fn timed_from(mut self, start: std::time::Instant) -> Self {
        self.start_up = Some(start);
        self
    }

    /// Answers the `/check`s that arrive on `checks` between passes (see [`Agent::check`]).
    pub fn answer_checks(
        mut self,
        checks: tokio::sync::mpsc::Receiver<crate::telemetry::CheckRequest>,
    ) -> Self {
        self.checks = Some(checks);
        self
    }

    /// What the kernel watcher ([`crate::reconcile::netlink::watch`]) reports: the
    /// reconciler's objects.
    pub fn event_filter(&self) -> Arc<Mutex<EventFilter>> {
        self.reconciler.event_filter()
    }
}
