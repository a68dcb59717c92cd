//! Telemetry: Prometheus metrics (Kilo's names plus ours), health and readiness, over a minimal
//! HTTP/1.1 server on `--listen`.
//!
//! Metrics: `kilo_nodes`, `kilo_peers`, `kilo_leader` (gauges), `kilo_reconciles_total`,
//! `kilo_errors_total{event}` (Kilo's), and `kilo_writes_total{kind}` (kernel writes by kind:
//! with nothing changing it stays flat), `kilo_invalid_objects` (objects the backend could not
//! read). Endpoints: `/metrics`, `/health` (200 while the process runs), `/ready` (200 once a
//! reconcile succeeded, 503 before).
use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::reconcile::Writes;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    pub event: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
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
    pub invalid_objects: Gauge,
    ready: Arc<AtomicBool>,
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
            invalid_objects: Gauge::default(),
            ready: Arc::new(AtomicBool::new(false)),
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
            "Nodes and peers the backend could not read",
            m.invalid_objects.clone(),
        );
        Metrics {
            registry: Arc::new(r),
            ..m
        }
    }

    pub fn error(&self, event: &str) {
        self.errors
            .get_or_create(&EventLabel {
                event: event.into(),
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

#[derive(Debug, thiserror::Error)]
#[error("listening on {addr}: {source}")]
pub struct ServeError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// Binds `addr` and serves until the task is dropped. Returns the bound address (port 0 = any).
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ServeError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError { addr, source })?;
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
