//! Telemetry: Prometheus metrics (Kilo's names plus ours), health and readiness, over a minimal
//! HTTP/1.1 server on `--listen`. `/metrics` answers in OpenMetrics when the client asks for it
//! (Prometheus does) and in Prometheus' text format 0.0.4 otherwise, as Go's client does.
//!
//! Metrics (see also the README):
//! - Kilo's: `kilo_nodes`, `kilo_peers`, `kilo_leader` (gauges), `kilo_reconciles_total`,
//!   `kilo_errors_total{event}`; the process metrics of Prometheus' Go client ([`process`]:
//!   `process_cpu_seconds_total`, `process_resident_memory_bytes`,
//!   `process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds`,
//!   `process_start_time_seconds`) and `kilo_child_processes` (processes kg started that still
//!   run, counted in `/proc`: 0).
//! - The cluster: `kilo_service_cidrs` (gauge: the service CIDRs planned with, `--service-cidr`'s
//!   and the cluster's ServiceCIDRs; 0 is [`NO_SERVICE_CIDRS`]), `kilo_backend_retries_total`
//!   (attempts to reach the Kubernetes API server that failed and are made again).
//! - The loop: `kilo_reconcile_duration_seconds` (histogram: plan, publish and apply, of each
//!   pass `kilo_reconciles_total` counts),
//!   `kilo_reconcile_triggers_total{cause}` (events that asked for a reconcile: `start`,
//!   `backend`, `kernel` (a netlink notification about our objects), `resync`, `liveness` (a
//!   node crossed its heartbeat expiry), `check_in` (the local node is not published yet), `retry` (the
//!   last pass failed to apply or publish: again after 1 s, doubling to 30 s); a
//!   burst coalesces into one reconcile), `kilo_writes_total{kind}` (kernel writes: flat while
//!   nothing changes), `kilo_invalid_objects_total{kind,field}`.
//! - WireGuard, read from the device at scrape time ([`Metrics::set_wireguard`], no write), per
//!   peer `{public_key,name}` (`name`: the segment's leader node or the Peer; never a private
//!   key): `kilo_wireguard_peer_receive_bytes_total`, `kilo_wireguard_peer_transmit_bytes_total`,
//!   `kilo_wireguard_peer_last_handshake_timestamp_seconds` (unix time, 0 = never, as
//!   `wg show latest-handshakes`; the age is `time() - ...`).
//! - The datapath, read at scrape time ([`Metrics::set_datapath`]: the agent's record of the
//!   map entries plus one pass over the mapped counters): `kilo_datapath_packets_total{decision}`,
//!   `kilo_datapath_bytes_total{decision}` (every packet the program saw),
//!   `kilo_datapath_entry_packets_total{role,cidr,kind,owner}`,
//!   `kilo_datapath_entry_bytes_total{...}` (traffic that matched each map entry),
//!   `kilo_datapath_map_entries{map}` and `kilo_datapath_map_capacity{map}` (each role's
//!   entries in its trie, and `entry_counters`: the per-entry counter slots).
//!
//! Endpoints: `/metrics`, `/health` (200 while the process runs), `/ready` (200 once a
//! reconcile succeeded, 503 before and while the backend is disconnected; its body's second
//! line gives the service CIDRs once planned), `/graph` (Kilo's).
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _},
    metrics::{
        MetricType,
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::Histogram,
    },
    registry::Registry,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use ipnet::IpNet;

use crate::{
    mesh::Key,
    reconcile::{DatapathStats, DatapathStatsSource, Writes, wireguard::PeerStatsSource},
};

mod process;
mod wireguard;
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
struct DecisionLabel {
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabel {
    map: &'static str,
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EntryLabels {
    role: &'static str,
    cidr: String,
    kind: &'static str,
    owner: String,
}

type SourceSlot = Arc<Mutex<Option<Arc<dyn DatapathStatsSource>>>>;

/// Encodes the datapath metrics from a [`DatapathStatsSource`] read at each scrape; nothing
/// when there is no source or it cannot be read (logged).
#[derive(Debug)]
struct DatapathCollector(SourceSlot);

impl DatapathCollector {
    fn read(&self) -> Option<DatapathStats> {
        let source = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
        source
            .read()
            .map_err(|e| tracing::debug!("reading datapath counters: {e}"))
            .ok()
    }
}

fn encode_counters<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl Iterator<Item = (L, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in series {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for DatapathCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stats) = self.read() else {
            return Ok(());
        };
        type Field = fn(&crate::reconcile::Counter) -> u64;
        let fields: [(&str, &str, Field); 2] = [
            ("packets", "Packets", |c| c.packets),
            ("bytes", "Bytes", |c| c.bytes),
        ];
        for (unit, what, value) in fields {
            encode_counters(
                &mut encoder,
                &format!("kilo_datapath_{unit}"),
                &format!("{what} the eBPF program saw, by decision"),
                stats
                    .decisions
                    .iter()
                    .map(|(d, c)| (DecisionLabel { decision: d }, value(c))),
            )?;
        }
        for (unit, what, value) in fields {
            encode_counters(
                &mut encoder,
                &format!("kilo_datapath_entry_{unit}"),
                &format!("{what} that matched a datapath map entry"),
                stats.entries.iter().map(|e| {
                    let labels = EntryLabels {
                        role: e.role,
                        cidr: e.cidr.to_string(),
                        kind: e.kind,
                        owner: e.owner.clone(),
                    };
                    (labels, value(&e.counter))
                }),
            )?;
        }
        type Usage = fn(&crate::reconcile::MapUsage) -> u64;
        let gauges: [(&str, &str, Usage); 2] = [
            (
                "kilo_datapath_map_entries",
                "Entries in each datapath map",
                |m| m.entries,
            ),
            (
                "kilo_datapath_map_capacity",
                "Entries each datapath map can hold",
                |m| m.capacity,
            ),
        ];
        for (name, help, value) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for m in &stats.maps {
                ConstGauge::new(value(m) as i64)
                    .encode(family.encode_family(&MapLabel { map: m.map })?)?;
            }
        }
        Ok(())
    }
}

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
    service_cidrs: Gauge,
    /// The service CIDRs of the last plan, for `/ready` (`None` before the first).
    service_cidr_list: Arc<Mutex<Option<Vec<IpNet>>>>,
    ready: Arc<AtomicBool>,
    /// Cleared while the backend cannot deliver (see [`Metrics::set_backend_connected`]).
    backend_connected: Arc<AtomicBool>,
    datapath: SourceSlot,
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
            service_cidrs: Gauge::default(),
            service_cidr_list: Arc::default(),
            ready: Arc::new(AtomicBool::new(false)),
            backend_connected: Arc::new(AtomicBool::new(true)),
            datapath: SourceSlot::default(),
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
        r.register_collector(Box::new(DatapathCollector(m.datapath.clone())));
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
                .get_or_create(&KindLabel { kind: kind.into() })
                .inc_by(n);
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

    /// `/ready`'s body: `status`, then the service CIDRs once planned.
    fn ready_body(&self, status: &str) -> String {
        let cidrs = self
            .service_cidr_list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match cidrs {
            None => format!("{status}\n"),
            Some(c) if c.is_empty() => format!("{status}\nwarning: {NO_SERVICE_CIDRS}\n"),
            Some(c) => {
                let c: Vec<String> = c.iter().map(ToString::to_string).collect();
                format!("{status}\nservice CIDRs: {}\n", c.join(", "))
            }
        }
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

    /// Answers one request for `path` whose `Accept` header is `accept` ("" when absent):
    /// (status, content type, body).
    pub fn respond(&self, path: &str, accept: &str) -> (u16, &'static str, String) {
        match path.split('?').next().unwrap_or_default() {
            "/metrics" if accept.contains("application/openmetrics-text") => (
                200,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                self.encode(),
            ),
            "/metrics" => (
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                text_format(&self.encode()),
            ),
            "/graph" => {
                let query = path.split_once('?').map_or("", |(_, q)| q);
                let graph = self.graph.lock().unwrap_or_else(|e| e.into_inner()).clone();
                graph_response(graph.map(|g| g.render()).as_deref(), query)
            }
            "/health" | "/healthz" => (200, "text/plain", "ok\n".into()),
            "/ready" | "/readyz" if !self.is_ready() => (
                503,
                "text/plain",
                self.ready_body("not ready: no successful reconcile yet"),
            ),
            "/ready" | "/readyz" if !self.backend_connected.load(Ordering::Relaxed) => (
                503,
                "text/plain",
                self.ready_body("not ready: backend disconnected; keeping the last applied state"),
            ),
            "/ready" | "/readyz" => (200, "text/plain", self.ready_body("ready")),
            _ => (404, "text/plain", "not found\n".into()),
        }
    }
}

/// Prometheus' text format 0.0.4 of an OpenMetrics exposition: a counter's `# HELP` and
/// `# TYPE` name its `_total` series, and there is no `# UNIT` or `# EOF`. The samples are the
/// same (this registry has no exemplars, `_created` series or OpenMetrics-only types).
fn text_format(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?.split_once(' ')?)));
        match meta {
            Some((p, (name, rest))) if counters.contains(name) => {
                out.push_str(&format!("{p}{name}_total {rest}"));
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Kilo's `/graph` answers for `query`: 500 for an unknown format or layout, as Kilo answers.
/// Graphviz's raster formats, which Kilo renders by exec, are unsupported here. Public for the
/// fuzz target (`kilo-agent/fuzz`, `graph`).
pub fn graph_response(dot: Option<&str>, query: &str) -> (u16, &'static str, String) {
    let param = |k: &str| {
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find_map(|(key, v)| (key == k).then_some(v))
            .unwrap_or("")
    };
    let Some(dot) = dot else {
        return (
            500,
            "text/plain",
            "did not find any valid Kilo nodes in the cluster\n".into(),
        );
    };
    match param("format") {
        "dot" | "gv" => return (200, "text/plain; charset=utf-8", dot.into()),
        "" | "svg" => {}
        _ => return (500, "text/plain", "unsupported format\n".into()),
    }
    if !matches!(
        param("layout"),
        "" | "circo" | "dot" | "neato" | "twopi" | "fdp"
    ) {
        return (500, "text/plain", "unsupported layout\n".into());
    }
    match crate::graph::render_svg(dot) {
        Ok(svg) => (200, "image/svg+xml", svg),
        Err(e) => (500, "text/plain", format!("unable to render graph: {e}\n")),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("listening on {addr}: {source}")]
pub struct ServeError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// A listening socket on `addr`; the unspecified IPv6 address (`[::]`, Go's `:PORT`) accepts
/// IPv4 as well, and falls back to `0.0.0.0` where the kernel has no IPv6.
fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let dual = addr.is_ipv6() && addr.ip().is_unspecified();
    let socket = match Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)) {
        Err(e) if dual && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            return listen(SocketAddr::from(([0, 0, 0, 0], addr.port())));
        }
        s => s?,
    };
    if dual {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    socket.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(socket.into())
}

/// Binds `addr` and serves until the task is dropped. Returns the bound address (port 0 = any).
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ServeError> {
    let listener = listen(addr).map_err(|source| ServeError { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| ServeError { addr, source })?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let mut buf = Vec::with_capacity(1024);
                let mut chunk = [0u8; 1024];
                // Read the request head (bounded).
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
                    match tokio::time::timeout(
                        std::time::Duration::from_secs(10),
                        stream.read(&mut chunk),
                    )
                    .await
                    {
                        Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                        _ => return,
                    }
                }
                let head = String::from_utf8_lossy(&buf);
                let mut lines = head.lines();
                let mut parts = lines.next().unwrap_or_default().split_whitespace();
                let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
                let accept = lines
                    .filter_map(|l| l.split_once(':'))
                    .find(|(k, _)| k.trim().eq_ignore_ascii_case("accept"))
                    .map_or("", |(_, v)| v.trim());
                let (status, ctype, body) = if method == "GET" || method == "HEAD" {
                    metrics.respond(path, accept)
                } else {
                    (405, "text/plain", "method not allowed\n".into())
                };
                let reason = match status {
                    200 => "OK",
                    404 => "Not Found",
                    405 => "Method Not Allowed",
                    500 => "Internal Server Error",
                    _ => "Service Unavailable",
                };
                let mut resp = format!(
                    "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                if method != "HEAD" {
                    resp.push_str(&body);
                }
                let _ = stream.write_all(resp.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kilo_metric_names_are_exposed() {
        let m = Metrics::new();
        m.nodes.set(3);
        m.reconciles.inc();
        m.error("apply");
        let mut w = Writes::default();
        w.add("route_add", 2);
        m.record_writes(&w);
        m.trigger(Trigger::Kernel);
        m.reconcile_duration.observe(0.003);
        let text = m.encode();
        for needle in [
            "kilo_nodes 3",
            "kilo_peers 0",
            "kilo_leader 0",
            "kilo_reconciles_total 1",
            "kilo_errors_total{event=\"apply\"} 1",
            "kilo_writes_total{kind=\"route_add\"} 2",
            "\nprocess_cpu_seconds_total ",
            "\nprocess_resident_memory_bytes ",
            "\nprocess_open_fds ",
            "\nprocess_start_time_seconds ",
            "\nkilo_child_processes ",
            "kilo_reconcile_triggers_total{cause=\"kernel\"} 1",
            "kilo_reconcile_triggers_total{cause=\"resync\"} 0",
            "kilo_reconcile_duration_seconds_bucket{le=\"0.0025\"} 0",
            "kilo_reconcile_duration_seconds_bucket{le=\"0.005\"} 1",
            "kilo_reconcile_duration_seconds_count 1",
            "\nkilo_service_cidrs 0\n",
            "\nkilo_backend_retries_total 0\n",
        ] {
            assert!(text.contains(needle), "{needle} missing from\n{text}");
        }
        assert_eq!(m.respond("/ready", "").0, 503);
        m.set_ready(true);
        assert_eq!(m.respond("/ready", "").0, 200);
        m.set_backend_connected(false);
        let (status, _, body) = m.respond("/ready", "");
        assert_eq!(status, 503);
        assert!(body.contains("backend disconnected"), "{body}");
        m.set_backend_connected(true);
        assert_eq!(
            m.respond("/ready", ""),
            (200, "text/plain", "ready\n".into())
        );
        // The service CIDRs planned with, or what their absence means; the status unchanged.
        m.set_service_cidrs(&[]);
        let (status, _, body) = m.respond("/ready", "");
        assert_eq!(status, 200);
        assert!(
            body.starts_with("ready\nwarning: no service CIDR known: traffic"),
            "{body}"
        );
        let cidrs = [
            "10.96.0.0/12".parse().unwrap(),
            "fd00:10:96::/112".parse().unwrap(),
        ];
        m.set_service_cidrs(&cidrs);
        assert_eq!(
            m.respond("/ready", "").2,
            "ready\nservice CIDRs: 10.96.0.0/12, fd00:10:96::/112\n"
        );
        assert!(m.encode().contains("\nkilo_service_cidrs 2\n"));
        assert_eq!(m.respond("/health", "").0, 200);
        assert_eq!(m.respond("/nope", "").0, 404);
    }

    #[test]
    fn graph_like_kilo() {
        let m = Metrics::new();
        assert_eq!(m.respond("/graph", "").0, 500, "no graph before a plan");
        m.set_graph(Some(Graph::new(|| {
            "digraph kilo {\n\t\"n1\" [ label=\"n1\" ];\n}\n".into()
        })));
        let (status, ctype, body) = m.respond("/graph", "");
        assert_eq!((status, ctype), (200, "image/svg+xml"));
        roxmltree::Document::parse(&body).unwrap();
        assert!(body.contains(">n1<"), "{body}");
        assert_eq!(m.respond("/graph?layout=circo&format=svg", "").0, 200);
        let (status, _, body) = m.respond("/graph?format=dot", "");
        assert_eq!((status, body.starts_with("digraph kilo")), (200, true));
        assert_eq!(m.respond("/graph?format=gv", "").0, 200);
        assert_eq!(m.respond("/graph?format=png", "").0, 500);
        assert_eq!(m.respond("/graph?layout=sideways", "").0, 500);
    }

    #[derive(Debug)]
    struct Source(Mutex<u64>);

    impl DatapathStatsSource for Source {
        fn read(&self) -> Result<DatapathStats, crate::reconcile::DatapathSyncError> {
            // Each read sees more traffic, as the kernel's counters would.
            let mut n = self.0.lock().unwrap();
            *n += 1;
            let c = crate::reconcile::Counter {
                packets: *n,
                bytes: *n * 100,
            };
            Ok(DatapathStats {
                decisions: vec![("pass", Default::default()), ("masquerade", c)],
                entries: vec![crate::reconcile::EntryStats {
                    role: "nat_source",
                    cidr: "10.42.1.0/24".parse().unwrap(),
                    kind: "local_pods",
                    owner: "n1".into(),
                    counter: c,
                }],
                maps: vec![
                    crate::reconcile::MapUsage {
                        map: "mesh_destination",
                        entries: 4,
                        capacity: 64,
                    },
                    crate::reconcile::MapUsage {
                        map: "entry_counters",
                        entries: 1,
                        capacity: 16,
                    },
                ],
            })
        }
    }

    #[test]
    fn datapath_counters_are_read_at_each_scrape() {
        let m = Metrics::new();
        assert!(
            !m.encode().contains("kilo_datapath"),
            "no source, no series"
        );
        m.set_datapath(Some(Arc::new(Source(Mutex::new(0)))));
        let first = m.encode();
        for needle in [
            "# TYPE kilo_datapath_packets counter",
            "kilo_datapath_packets_total{decision=\"pass\"} 0",
            "kilo_datapath_packets_total{decision=\"masquerade\"} 1",
            "kilo_datapath_bytes_total{decision=\"masquerade\"} 100",
            "kilo_datapath_entry_packets_total{role=\"nat_source\",cidr=\"10.42.1.0/24\",kind=\"local_pods\",owner=\"n1\"} 1",
            "kilo_datapath_entry_bytes_total{role=\"nat_source\",cidr=\"10.42.1.0/24\",kind=\"local_pods\",owner=\"n1\"} 100",
            "# TYPE kilo_datapath_map_entries gauge",
            "kilo_datapath_map_entries{map=\"mesh_destination\"} 4",
            "kilo_datapath_map_capacity{map=\"mesh_destination\"} 64",
            "kilo_datapath_map_entries{map=\"entry_counters\"} 1",
            "kilo_datapath_map_capacity{map=\"entry_counters\"} 16",
        ] {
            assert!(first.contains(needle), "{needle} missing from\n{first}");
        }
        assert!(first.trim_end().ends_with("# EOF"), "{first}");
        let second = m.encode();
        assert!(
            second.contains("kilo_datapath_packets_total{decision=\"masquerade\"} 2"),
            "{second}"
        );
        m.set_datapath(None);
        assert!(!m.encode().contains("kilo_datapath"));
    }

    #[test]
    fn serves_over_http() {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let m = Metrics::new();
                m.peers.set(7);
                m.reconciles.inc();
                let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), m).await.unwrap();
                let get = |headers: &'static str| async move {
                    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                    let req = format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{headers}\r\n");
                    s.write_all(req.as_bytes()).await.unwrap();
                    let mut out = String::new();
                    s.read_to_string(&mut out).await.unwrap();
                    out
                };
                // Without an Accept header (curl, promtool's input): text format 0.0.4.
                let text = get("").await;
                assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
                for needle in [
                    "Content-Type: text/plain; version=0.0.4",
                    "kilo_peers 7",
                    "# HELP kilo_reconciles_total Number of reconciliation attempts.",
                    "# TYPE kilo_reconciles_total counter\nkilo_reconciles_total 1\n",
                    "# TYPE kilo_peers gauge\n",
                ] {
                    assert!(text.contains(needle), "{needle} missing from\n{text}");
                }
                assert!(!text.contains("# EOF"), "{text}");
                // Prometheus asks for OpenMetrics.
                let om = get(
                    "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n",
                )
                .await;
                for needle in [
                    "Content-Type: application/openmetrics-text; version=1.0.0",
                    "# TYPE kilo_reconciles counter\nkilo_reconciles_total 1\n",
                    "# EOF",
                ] {
                    assert!(om.contains(needle), "{needle} missing from\n{om}");
                }
                task.abort();
            });
    }

    /// A device with two peers, one that never completed a handshake.
    struct Device;

    impl PeerStatsSource for Device {
        fn peer_stats(
            &self,
        ) -> Result<
            BTreeMap<Key, crate::reconcile::wireguard::PeerStats>,
            crate::reconcile::wireguard::WgError,
        > {
            let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
            Ok(BTreeMap::from([
                (
                    Key([1; 32]),
                    crate::reconcile::wireguard::PeerStats {
                        last_handshake: Some(at),
                        rx_bytes: 1234,
                        tx_bytes: 5678,
                    },
                ),
                (Key([2; 32]), Default::default()),
            ]))
        }
    }

    #[test]
    fn wireguard_peers_are_read_at_each_scrape_with_their_names() {
        let m = Metrics::new();
        assert!(
            !m.encode().contains("kilo_wireguard"),
            "no source, no series"
        );
        m.set_wireguard(Some(Arc::new(Device)));
        m.set_peer_names(BTreeMap::from([(Key([1; 32]), "laptop".to_string())]));
        let text = m.encode();
        let one = format!("{{public_key=\"{}\",name=\"laptop\"}}", Key([1; 32]));
        let two = format!("{{public_key=\"{}\",name=\"\"}}", Key([2; 32]));
        for needle in [
            format!("kilo_wireguard_peer_receive_bytes_total{one} 1234"),
            format!("kilo_wireguard_peer_transmit_bytes_total{one} 5678"),
            format!("kilo_wireguard_peer_last_handshake_timestamp_seconds{one} 1700000000.0"),
            format!("kilo_wireguard_peer_last_handshake_timestamp_seconds{two} 0.0"),
            format!("kilo_wireguard_peer_receive_bytes_total{two} 0"),
        ] {
            assert!(text.contains(&needle), "{needle} missing from\n{text}");
        }
        m.set_wireguard(None);
        assert!(!m.encode().contains("kilo_wireguard"));
    }
}
