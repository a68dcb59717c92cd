//! Telemetry: Prometheus metrics (Kilo's names plus ours), health and readiness, served on
//! `--listen` ([`serve`], over [`crate::http`]). `/metrics` answers in OpenMetrics when the
//! client asks for it (Prometheus does) and in Prometheus' text format 0.0.4 otherwise, as Go's
//! client does.
//!
//! Metrics: Kilo's (`kilo_nodes`, `kilo_peers`, `kilo_leader`, `kilo_reconciles_total`,
//! `kilo_errors_total`, the Go client's process metrics) and ours (the loop, the cluster, and
//! per-peer WireGuard and datapath counters read at scrape time, never written); each with its
//! labels and meaning in `docs/metrics.md`. Nothing here ever exports a private key.
//!
//! Endpoints: `/metrics`, `/health` (200 while the process runs), `/ready` (200 once a
//! reconcile succeeded, 503 before and while the backend is disconnected; its body's second
//! line gives the service CIDRs once planned), `/graph` (Kilo's).
use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use ipnet::IpNet;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::{
    datapath::DatapathStatsSource, mesh::Key, reconcile::wireguard::PeerStatsSource, writes::Writes,
};

mod datapath;
mod endpoints;
mod process;
mod wireguard;
pub use endpoints::{CheckRequest, graph_response, serve};
pub use process::ProcessStats;

/// What it means that no service CIDR is known, for the log and `/ready`.
pub const NO_SERVICE_CIDRS: &str = "no service CIDR known: traffic from pods to ClusterIPs whose \
    endpoints are in other locations is masqueraded (NetworkPolicies matching the source pods \
    then refuse it); set --service-cidr to the cluster's service CIDRs (kube-apiserver's \
    --service-cluster-ip-range), or run Kubernetes 1.33 or later, whose ServiceCIDR objects kg \
    reads";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    pub event: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FieldLabel {
    pub kind: String,
    pub field: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocationLabel {
    pub location: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LeaderLabel {
    pub location: String,
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    cause: &'static str,
}

/// What asked for a reconcile (the `cause` of `kilo_reconcile_triggers_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// The agent started with a complete view of the backend.
    Start,
    Backend,
    /// A netlink notification about our links, addresses, routes or rules.
    Kernel,
    Resync,
    /// A node crossed its heartbeat expiry.
    Liveness,
    /// A check-in found the local node not published yet.
    CheckIn,
    /// The last pass failed to apply or to publish: tried again after a backoff.
    Retry,
}

impl Trigger {
    pub const ALL: [Trigger; 7] = [
        Trigger::Start,
        Trigger::Backend,
        Trigger::Kernel,
        Trigger::Resync,
        Trigger::Liveness,
        Trigger::CheckIn,
        Trigger::Retry,
    ];

    pub const fn label(self) -> &'static str {
        match self {
            Trigger::Start => "start",
            Trigger::Backend => "backend",
            Trigger::Kernel => "kernel",
            Trigger::Resync => "resync",
            Trigger::Liveness => "liveness",
            Trigger::CheckIn => "check_in",
            Trigger::Retry => "retry",
        }
    }
}

/// Upper bounds of `kilo_reconcile_duration_seconds`' buckets: 1 ms to 10 s.
const DURATION_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Upper bounds of `kilo_leader_failover_seconds`' buckets: from the leader's last answer to its
/// demotion written.
const FAILOVER_BUCKETS: [f64; 9] = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 10.0, 30.0];

/// The agent's metrics; cheap to clone (shared counters).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    pub nodes: Gauge,
    pub peers: Gauge,
    pub leader: Gauge,
    pub reconciles: Counter,
    pub reconcile_duration: Histogram,
    triggers: Family<CauseLabel, Counter>,
    pub errors: Family<EventLabel, Counter>,
    pub writes: Family<KindLabel, Counter>,
    pub invalid_objects: Family<FieldLabel, Counter>,
    /// Failed attempts to reach the Kubernetes API server (the backend counts them).
    pub backend_retries: Counter,
    /// Leaders this node demoted, by location.
    pub failovers: Family<LocationLabel, Counter>,
    /// Demotions this node lifted from itself, by location.
    pub recoveries: Family<LocationLabel, Counter>,
    pub failover_duration: Histogram,
    /// 1 for the leader of each location, as the latest plan chose them.
    location_leaders: Family<LeaderLabel, Gauge>,
    service_cidrs: Gauge,
    /// The service CIDRs of the last plan, for `/ready` (`None` before the first).
    service_cidr_list: Arc<Mutex<Option<Vec<IpNet>>>>,
    ready: Arc<AtomicBool>,
    /// Cleared while the backend cannot deliver (see [`Metrics::set_backend_connected`]).
    backend_connected: Arc<AtomicBool>,
    datapath: datapath::Slot,
    wireguard: wireguard::Slot,
    /// The latest plan's graph, for `/graph`.
    graph: Arc<Mutex<Option<Graph>>>,
}

/// Renders the latest plan's topology as DOT: only when `/graph` is asked, since a large
/// mesh's graph (every pair of locations) is far bigger than its plan.
#[derive(Clone)]
pub struct Graph(Arc<dyn Fn() -> String + Send + Sync>);

impl Graph {
    pub fn new(render: impl Fn() -> String + Send + Sync + 'static) -> Self {
        Graph(Arc::new(render))
    }

    pub fn render(&self) -> String {
        (self.0)()
    }
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        let m = Metrics {
            registry: Arc::new(Registry::default()),
            nodes: Gauge::default(),
            peers: Gauge::default(),
            leader: Gauge::default(),
            reconciles: Counter::default(),
            reconcile_duration: Histogram::new(DURATION_BUCKETS),
            triggers: Family::default(),
            errors: Family::default(),
            writes: Family::default(),
            invalid_objects: Family::default(),
            backend_retries: Counter::default(),
            failovers: Family::default(),
            recoveries: Family::default(),
            failover_duration: Histogram::new(FAILOVER_BUCKETS),
            location_leaders: Family::default(),
            service_cidrs: Gauge::default(),
            service_cidr_list: Arc::default(),
            ready: Arc::new(AtomicBool::new(false)),
            backend_connected: Arc::new(AtomicBool::new(true)),
            datapath: datapath::Slot::default(),
            wireguard: wireguard::Slot::default(),
            graph: Arc::default(),
        };
        // Every cause from the start, so that rates over them exist before the first trigger.
        for t in Trigger::ALL {
            let _ = m.triggers.get_or_create(&CauseLabel { cause: t.label() });
        }
        r.register(
            "kilo_nodes",
            "Number of nodes in the mesh that are ready",
            m.nodes.clone(),
        );
        r.register("kilo_peers", "Number of peers in the mesh", m.peers.clone());
        r.register(
            "kilo_leader",
            "Leadership status of the node (1 = leader)",
            m.leader.clone(),
        );
        r.register(
            "kilo_reconciles",
            "Number of reconciliation attempts",
            m.reconciles.clone(),
        );
        r.register(
            "kilo_reconcile_duration_seconds",
            "Duration of a reconcile: plan, publish and apply",
            m.reconcile_duration.clone(),
        );
        r.register(
            "kilo_reconcile_triggers",
            "Events that asked for a reconcile, by cause (a burst coalesces into one reconcile)",
            m.triggers.clone(),
        );
        r.register(
            "kilo_errors",
            "Number of errors that occurred, by event",
            m.errors.clone(),
        );
        r.register(
            "kilo_writes",
            "Kernel writes made by reconciles, by kind",
            m.writes.clone(),
        );
        r.register(
            "kilo_invalid_objects",
            "Invalid fields of nodes and peers, by kind and field",
            m.invalid_objects.clone(),
        );
        r.register(
            "kilo_service_cidrs",
            "Number of service CIDRs (--service-cidr and the cluster's ServiceCIDRs); 0: traffic \
             to ClusterIPs whose endpoints are in other locations is masqueraded",
            m.service_cidrs.clone(),
        );
        r.register(
            "kilo_backend_retries",
            "Failed attempts to reach the Kubernetes API server, each made again after a backoff",
            m.backend_retries.clone(),
        );
        r.register(
            "kilo_leader_failovers",
            "Location leaders this node demoted when they stopped answering its probes, by location",
            m.failovers.clone(),
        );
        r.register(
            "kilo_leader_recoveries",
            "Demotions this node lifted from itself once healthy again, by location",
            m.recoveries.clone(),
        );
        r.register(
            "kilo_leader_failover_seconds",
            "Time from a location leader's last answer to its demotion written",
            m.failover_duration.clone(),
        );
        r.register(
            "kilo_location_leader",
            "The leader of each location as this node's latest plan chose it (1)",
            m.location_leaders.clone(),
        );
        r.register_collector(Box::new(datapath::Collector(m.datapath.clone())));
        r.register_collector(Box::new(wireguard::Collector(m.wireguard.clone())));
        r.register_collector(Box::new(process::ProcessCollector));
        Metrics {
            registry: Arc::new(r),
            ..m
        }
    }

    /// Where the datapath metrics are read from at each scrape (`None`: no datapath metrics).
    pub fn set_datapath(&self, source: Option<Arc<dyn DatapathStatsSource>>) {
        *self.datapath.lock().unwrap_or_else(|e| e.into_inner()) = source;
    }

    /// Where the per-peer WireGuard metrics are read from at each scrape (`None`: none).
    pub fn set_wireguard(&self, source: Option<Arc<dyn PeerStatsSource>>) {
        self.wireguard.lock().source = source;
    }

    /// The names of the WireGuard peers, by public key (the latest plan's), for their `name`
    /// label.
    pub fn set_peer_names(&self, names: BTreeMap<Key, String>) {
        self.wireguard.lock().names = names;
    }

    /// Counts an event that asked for a reconcile.
    pub fn trigger(&self, cause: Trigger) {
        self.triggers
            .get_or_create(&CauseLabel {
                cause: cause.label(),
            })
            .inc();
    }

    pub fn error(&self, event: &str) {
        self.errors
            .get_or_create(&EventLabel {
                event: event.into(),
            })
            .inc();
    }

    /// Counts an invalid field; indices are dropped from the label (`spec.allowedIPs[1]` counts
    /// as `spec.allowedIPs`).
    pub fn invalid_field(&self, kind: &str, field: &str) {
        let field = field.split('[').next().unwrap_or(field);
        self.invalid_objects
            .get_or_create(&FieldLabel {
                kind: kind.into(),
                field: field.into(),
            })
            .inc();
    }

    pub fn record_writes(&self, w: &Writes) {
        for (kind, n) in w.iter() {
            self.writes
                .get_or_create(&KindLabel {
                    kind: kind.name().into(),
                })
                .inc_by(n);
        }
    }

    /// The leader of each location, as (location, node) pairs.
    pub fn set_location_leaders(&self, leaders: &[(String, String)]) {
        self.location_leaders.clear();
        for (location, node) in leaders {
            self.location_leaders
                .get_or_create(&LeaderLabel {
                    location: location.clone(),
                    node: node.clone(),
                })
                .set(1);
        }
    }

    /// The service CIDRs planned with.
    pub fn set_service_cidrs(&self, cidrs: &[IpNet]) {
        self.service_cidrs.set(cidrs.len() as i64);
        *self
            .service_cidr_list
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(cidrs.to_vec());
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// While the backend cannot deliver (the API server unreachable, the backend directory
    /// gone), `/ready` answers 503 saying so; the last applied state is kept meanwhile.
    pub fn set_backend_connected(&self, connected: bool) {
        self.backend_connected.store(connected, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The graph `/graph` serves; `None` until a plan exists.
    pub fn set_graph(&self, graph: Option<Graph>) {
        *self.graph.lock().unwrap_or_else(|e| e.into_inner()) = graph;
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry)
            .expect("encode to string");
        s
    }
}

#[cfg(test)]
mod tests;
