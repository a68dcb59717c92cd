//! Telemetry: Prometheus metrics (Kilo's names plus ours), health and readiness, over a minimal
//! HTTP/1.1 server on `--listen`.
//!
//! Metrics: the process metrics of Prometheus' Go client ([`process`]), `kilo_nodes`, `kilo_peers`, `kilo_leader` (gauges), `kilo_reconciles_total`,
//! `kilo_errors_total{event}` (Kilo's), and `kilo_writes_total{kind}` (kernel writes by kind:
//! with nothing changing it stays flat), `kilo_invalid_objects_total{kind,field}` (invalid
//! fields of Nodes and Peers, each counted when it appears). Endpoints: `/metrics`, `/health` (200 while the process runs), `/ready` (200 once a
//! reconcile succeeded, 503 before).
//!
//! Datapath metrics, read from the eBPF maps at scrape time (see [`Metrics::set_datapath`]):
//! `kilo_datapath_packets_total{decision}` and `kilo_datapath_bytes_total{decision}` (every
//! packet the program saw, by decision), `kilo_datapath_entry_packets_total{role,cidr,kind,owner}`
//! and `kilo_datapath_entry_bytes_total{...}` (traffic that matched each map entry), and
//! `kilo_datapath_entries{role}` (map occupancy).
use std::{
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
    },
    registry::Registry,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::reconcile::{DatapathStats, DatapathStatsSource, Writes};

mod process;
pub use process::ProcessStats;

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
struct RoleLabel {
    role: &'static str,
}

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
        let mut family = encoder.encode_descriptor(
            "kilo_datapath_entries",
            "Entries in each datapath map",
            None,
            MetricType::Gauge,
        )?;
        for (role, n) in &stats.occupancy {
            ConstGauge::new(*n as i64).encode(family.encode_family(&RoleLabel { role })?)?;
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
    pub errors: Family<EventLabel, Counter>,
    pub writes: Family<KindLabel, Counter>,
    pub invalid_objects: Family<FieldLabel, Counter>,
    ready: Arc<AtomicBool>,
    datapath: SourceSlot,
    /// The latest plan's graph (DOT), for `/graph`.
    graph: Arc<Mutex<Option<String>>>,
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
            errors: Family::default(),
            writes: Family::default(),
            invalid_objects: Family::default(),
            ready: Arc::new(AtomicBool::new(false)),
            datapath: SourceSlot::default(),
            graph: Arc::default(),
        };
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
        r.register_collector(Box::new(DatapathCollector(m.datapath.clone())));
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

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The graph `/graph` serves (DOT); `None` until a plan exists.
    pub fn set_graph(&self, dot: Option<String>) {
        *self.graph.lock().unwrap_or_else(|e| e.into_inner()) = dot;
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry)
            .expect("encode to string");
        s
    }

    /// Answers one request path: (status, content type, body).
    pub fn respond(&self, path: &str) -> (u16, &'static str, String) {
        match path.split('?').next().unwrap_or_default() {
            "/metrics" => (
                200,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                self.encode(),
            ),
            "/graph" => {
                let query = path.split_once('?').map_or("", |(_, q)| q);
                let graph = self.graph.lock().unwrap_or_else(|e| e.into_inner());
                graph_response(graph.as_deref(), query)
            }
            "/health" | "/healthz" => (200, "text/plain", "ok\n".into()),
            "/ready" | "/readyz" if self.is_ready() => (200, "text/plain", "ready\n".into()),
            "/ready" | "/readyz" => (
                503,
                "text/plain",
                "not ready: no successful reconcile yet\n".into(),
            ),
            _ => (404, "text/plain", "not found\n".into()),
        }
    }
}

/// Kilo's `/graph` answers for `query`: 500 for an unknown format or layout, as Kilo answers.
/// Graphviz's raster formats, which Kilo renders by exec, are unsupported here.
fn graph_response(dot: Option<&str>, query: &str) -> (u16, &'static str, String) {
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
    match crate::kgctl::render_svg(dot) {
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
                let mut parts = head.lines().next().unwrap_or_default().split_whitespace();
                let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
                let (status, ctype, body) = if method == "GET" || method == "HEAD" {
                    metrics.respond(path)
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
        ] {
            assert!(text.contains(needle), "{needle} missing from\n{text}");
        }
        assert_eq!(m.respond("/ready").0, 503);
        m.set_ready(true);
        assert_eq!(m.respond("/ready").0, 200);
        assert_eq!(m.respond("/health").0, 200);
        assert_eq!(m.respond("/nope").0, 404);
    }

    #[test]
    fn graph_like_kilo() {
        let m = Metrics::new();
        assert_eq!(m.respond("/graph").0, 500, "no graph before a plan");
        m.set_graph(Some(
            "digraph kilo {\n\t\"n1\" [ label=\"n1\" ];\n}\n".into(),
        ));
        let (status, ctype, body) = m.respond("/graph");
        assert_eq!((status, ctype), (200, "image/svg+xml"));
        roxmltree::Document::parse(&body).unwrap();
        assert!(body.contains(">n1<"), "{body}");
        assert_eq!(m.respond("/graph?layout=circo&format=svg").0, 200);
        let (status, _, body) = m.respond("/graph?format=dot");
        assert_eq!((status, body.starts_with("digraph kilo")), (200, true));
        assert_eq!(m.respond("/graph?format=gv").0, 200);
        assert_eq!(m.respond("/graph?format=png").0, 500);
        assert_eq!(m.respond("/graph?layout=sideways").0, 500);
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
                occupancy: vec![("mesh_destination", 4), ("nat_source", 1)],
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
            "# TYPE kilo_datapath_entries gauge",
            "kilo_datapath_entries{role=\"mesh_destination\"} 4",
            "kilo_datapath_entries{role=\"nat_source\"} 1",
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
                let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), m).await.unwrap();
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    .await
                    .unwrap();
                let mut out = String::new();
                s.read_to_string(&mut out).await.unwrap();
                assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
                assert!(out.contains("kilo_peers 7"), "{out}");
                task.abort();
            });
    }
}
