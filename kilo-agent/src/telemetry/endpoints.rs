//! kg's HTTP endpoints (`/metrics`, `/health`, `/ready`, `/graph`), answered from [`Metrics`],
//! and `/check`, answered by the agent's loop ([`CheckRequest`]); served by [`crate::http`].
use std::{net::SocketAddr, sync::atomic::Ordering, time::Duration};

use hyper::{Method, Request, Response, StatusCode, body::Incoming, header};
use tokio::sync::{mpsc, oneshot};

use super::{Metrics, NO_SERVICE_CIDRS};
use crate::http::{self, Body, ServeError};

impl Metrics {
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

/// A `/check`: the agent answers with the difference between its current plan and the kernel
/// now (empty when they match), or why it cannot tell.
pub type CheckRequest = oneshot::Sender<Result<String, String>>;

/// How long `/check` waits for the agent, which answers between passes.
const CHECK_WAIT: Duration = Duration::from_secs(10);

/// `/check`'s answer: 200 when the kernel matches the plan, else 503 with what differs.
async fn check(checks: Option<&mpsc::Sender<CheckRequest>>) -> (u16, &'static str, String) {
    let Some(checks) = checks else {
        return (404, "text/plain", "not found\n".into());
    };
    let (tx, rx) = oneshot::channel();
    let asked = checks.send(tx).await.is_ok();
    match tokio::time::timeout(CHECK_WAIT, rx).await {
        Ok(Ok(Ok(diff))) if diff.is_empty() => (
            200,
            "text/plain",
            "in sync: the kernel matches the plan\n".into(),
        ),
        Ok(Ok(Ok(diff))) => (
            503,
            "text/plain",
            format!("out of sync: the kernel differs from the plan\n{diff}"),
        ),
        Ok(Ok(Err(why))) => (503, "text/plain", format!("cannot check: {why}\n")),
        _ if !asked => (503, "text/plain", "the agent has stopped\n".into()),
        _ => (
            503,
            "text/plain",
            format!("no answer within {CHECK_WAIT:?}: the agent is busy with a pass\n"),
        ),
    }
}

/// Answers one request: a GET or HEAD of [`Metrics::respond`]'s paths or of `/check`, then the
/// connection is closed.
async fn answer<B>(
    metrics: &Metrics,
    checks: Option<&mpsc::Sender<CheckRequest>>,
    req: &Request<B>,
) -> Response<Body> {
    let (status, content_type, body) = if matches!(*req.method(), Method::GET | Method::HEAD) {
        let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
        let accept = req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if req.uri().path() == "/check" {
            check(checks).await
        } else {
            metrics.respond(path, accept)
        }
    } else {
        (405, "text/plain", "method not allowed\n".into())
    };
    let status = StatusCode::from_u16(status).expect("a status code");
    let mut response = http::response(status, content_type, body);
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
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

/// Binds `addr` and serves until the task is dropped, `/check` through `checks` (none: 404).
/// Returns the bound address (port 0 = any).
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    checks: Option<mpsc::Sender<CheckRequest>>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ServeError> {
    let listener = http::bind(addr)?;
    let bound = listener.local_addr().expect("a bound socket");
    let handle = move |req: Request<Incoming>| {
        let (metrics, checks) = (metrics.clone(), checks.clone());
        async move { answer(&metrics, checks.as_ref(), &req).await }
    };
    Ok((
        bound,
        tokio::spawn(http::serve(listener, http::plain, handle)),
    ))
}
