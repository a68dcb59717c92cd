//! `kg webhook`: Kilo's validating admission webhook for Peers. It answers AdmissionReview v1
//! requests on `POST /validate` over HTTPS (`--listen`, `--cert-file`, `--key-file`) with the
//! agent's own Peer validation ([`MeshPeer::from_crd`]), so a Peer the agents would skip (a
//! malformed CIDR or key, a bad endpoint or keepalive: what the CRD's schema cannot judge) is
//! refused when it is written, with a message naming the field. Metrics (Kilo's names:
//! `admission_requests_total{operation,response}`, `http_requests_total{handler,method}`,
//! `errors_total`) and `/health` are served over plain HTTP on `--listen-metrics`.
//!
//! Owns: the review ([`review`], pure), the HTTP handlers and the TLS set-up (served by
//! [`crate::http`]). The certificate
//! files are read again when they change (cert-manager renews them in place), at the next
//! connection.
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::SystemTime,
};

use http_body_util::{BodyExt as _, Limited};
use hyper::{Method, Request, Response, StatusCode};
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation},
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};

use crate::{
    http::{self, Body, ServeError, response as respond},
    mesh::{MeshPeer, Peer},
};

/// The path the ValidatingWebhookConfiguration calls (Kilo's).
pub const VALIDATE_PATH: &str = "/validate";
/// The largest review read: a Peer and its old version, with room to spare.
const MAX_BODY: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("not an AdmissionReview v1: {0}")]
    Malformed(String),
    #[error("{path}: {message}")]
    Certificate { path: PathBuf, message: String },
    #[error(transparent)]
    Listen(#[from] ServeError),
}

/// The answer to one review: allowed, or denied with every bad field.
#[derive(Debug)]
pub struct Reviewed {
    pub response: AdmissionResponse,
    pub operation: Operation,
}

/// Reviews one AdmissionReview v1 request body. Pure. A body that is not such a review is
/// `Err` (the handler answers 400); a review of anything but a Peer is denied, saying so.
pub fn review(body: &[u8]) -> Result<Reviewed, WebhookError> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| WebhookError::Malformed(e.to_string()))?;
    if review.types.api_version != "admission.k8s.io/v1" || review.types.kind != "AdmissionReview" {
        return Err(WebhookError::Malformed(format!(
            "apiVersion {:?}, kind {:?}",
            review.types.api_version, review.types.kind
        )));
    }
    let request: AdmissionRequest<DynamicObject> =
        review
            .try_into()
            .map_err(|e: kube::core::admission::ConvertAdmissionReviewError| {
                WebhookError::Malformed(e.to_string())
            })?;
    let response = AdmissionResponse::from(&request);
    let operation = request.operation.clone();
    let kind = &request.kind;
    if kind.group != "kilo.squat.ai" || kind.kind != "Peer" {
        let what = format!("{}/{} {}", kind.group, kind.version, kind.kind);
        return Ok(Reviewed {
            response: response.deny(format!(
                "this webhook validates kilo.squat.ai Peers only, not {}",
                what.trim_start_matches('/')
            )),
            operation,
        });
    }
    // A deletion carries no object: nothing to validate.
    let Some(object) = request.object else {
        return Ok(Reviewed {
            response,
            operation,
        });
    };
    let peer: Peer = match serde_json::to_value(object).and_then(serde_json::from_value) {
        Ok(p) => p,
        Err(e) => {
            return Ok(Reviewed {
                response: response.deny(format!("peer {:?}: spec: {e}", request.name)),
                operation,
            });
        }
    };
    let response = match MeshPeer::from_crd(&peer) {
        Ok((_, warnings)) if warnings.is_empty() => response,
        Ok((_, warnings)) => {
            let mut response = response;
            response.warnings = Some(warnings.iter().map(ToString::to_string).collect());
            response
        }
        Err(errors) => response.deny(
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        ),
    };
    Ok(Reviewed {
        response,
        operation,
    })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdmissionLabels {
    operation: String,
    response: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    handler: String,
    method: String,
}

/// The webhook's metrics, under Kilo's names.
pub struct WebhookMetrics {
    registry: Registry,
    admissions: Family<AdmissionLabels, Counter>,
    requests: Family<HttpLabels, Counter>,
    errors: Counter,
}

impl Default for WebhookMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let admissions = Family::<AdmissionLabels, Counter>::default();
        let requests = Family::<HttpLabels, Counter>::default();
        let errors = Counter::default();
        registry.register(
            "admission_requests",
            "Admission reviews answered, by operation and response (allowed or denied)",
            admissions.clone(),
        );
        registry.register(
            "http_requests",
            "HTTP requests to the webhook, by handler and method",
            requests.clone(),
        );
        registry.register(
            "errors",
            "Requests that could not be reviewed (malformed bodies, TLS failures)",
            errors.clone(),
        );
        WebhookMetrics {
            registry,
            admissions,
            requests,
            errors,
        }
    }
}

impl WebhookMetrics {
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String");
        out
    }
}

/// Which listener a request came in on: the webhook's (TLS) or the metrics' (plain HTTP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    Webhook,
    Metrics,
}

/// Answers one request: `POST /validate` on the webhook's port, `GET /metrics` on the metrics'
/// port, `GET /health` on both.
pub async fn handle<B>(req: Request<B>, metrics: &WebhookMetrics, port: Port) -> Response<Body>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let handler = match (port, req.uri().path()) {
        (Port::Webhook, VALIDATE_PATH) => "validate",
        (Port::Metrics, "/metrics") => "metrics",
        (_, "/health") => "health",
        _ => "other",
    };
    metrics
        .requests
        .get_or_create(&HttpLabels {
            handler: handler.into(),
            method: req.method().to_string(),
        })
        .inc();
    let text = "text/plain; charset=utf-8";
    match (handler, req.method()) {
        ("health", &Method::GET) => respond(StatusCode::OK, text, "ok\n"),
        ("metrics", &Method::GET) => respond(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        ("validate", &Method::POST) => {
            let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    metrics.errors.inc();
                    return respond(StatusCode::BAD_REQUEST, text, format!("{e}\n"));
                }
            };
            validate(&body, metrics)
        }
        ("other", _) => respond(StatusCode::NOT_FOUND, text, "not found\n"),
        _ => respond(StatusCode::METHOD_NOT_ALLOWED, text, ""),
    }
}

/// The answer to a review's body: the review (200) or why it is not one (400).
fn validate(body: &[u8], metrics: &WebhookMetrics) -> Response<Body> {
    match review(body) {
        Ok(Reviewed {
            response,
            operation,
        }) => {
            let verdict = if response.allowed {
                "allowed"
            } else {
                "denied"
            };
            tracing::info!(
                operation = ?operation,
                allowed = response.allowed,
                message = %response.result.message,
                "reviewed a Peer"
            );
            metrics
                .admissions
                .get_or_create(&AdmissionLabels {
                    operation: format!("{operation:?}").to_uppercase(),
                    response: verdict.into(),
                })
                .inc();
            let json = serde_json::to_vec(&response.into_review()).expect("a review serializes");
            respond(StatusCode::OK, "application/json", json)
        }
        Err(e) => {
            metrics.errors.inc();
            tracing::warn!(error = %e, "malformed admission request");
            respond(
                StatusCode::BAD_REQUEST,
                "text/plain; charset=utf-8",
                format!("{e}\n"),
            )
        }
    }
}

/// The TLS configuration from PEM files, made again when either file changes.
struct Certificates {
    cert: PathBuf,
    key: PathBuf,
    loaded: Mutex<(Option<SystemTime>, Arc<rustls::ServerConfig>)>,
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl Certificates {
    fn load(cert: &Path, key: &Path) -> Result<Self, WebhookError> {
        let config = Self::read(cert, key)?;
        Ok(Certificates {
            cert: cert.into(),
            key: key.into(),
            loaded: Mutex::new((Self::stamp(cert, key), config)),
        })
    }

    fn stamp(cert: &Path, key: &Path) -> Option<SystemTime> {
        modified(cert).max(modified(key))
    }

    fn read(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, WebhookError> {
        let bad = |path: &Path, message: String| WebhookError::Certificate {
            path: path.into(),
            message,
        };
        let chain = CertificateDer::pem_file_iter(cert)
            .and_then(Iterator::collect::<Result<Vec<_>, _>>)
            .map_err(|e| bad(cert, e.to_string()))?;
        if chain.is_empty() {
            return Err(bad(cert, "no certificate in the file".into()));
        }
        let private = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, e.to_string()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|b| b.with_no_client_auth().with_single_cert(chain, private))
            .map_err(|e| bad(cert, e.to_string()))?;
        Ok(Arc::new(config))
    }

    /// The current configuration; a renewed pair of files is read first (a broken one is
    /// logged and the previous configuration kept).
    fn current(&self) -> Arc<rustls::ServerConfig> {
        let mut loaded = self.loaded.lock().expect("certificate lock");
        let stamp = Self::stamp(&self.cert, &self.key);
        if stamp != loaded.0 {
            match Self::read(&self.cert, &self.key) {
                Ok(config) => {
                    tracing::info!(cert = %self.cert.display(), "certificate reloaded");
                    *loaded = (stamp, config);
                }
                Err(e) => tracing::warn!(error = %e, "keeping the previous certificate"),
            }
        }
        loaded.1.clone()
    }
}

/// What `kg webhook` listens on.
pub struct WebhookSettings {
    pub listen: SocketAddr,
    pub listen_metrics: SocketAddr,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// Binds both listeners and serves them in the background; returns the bound addresses (a
/// port 0 is chosen by the kernel) and the tasks.
pub async fn start(
    settings: &WebhookSettings,
) -> Result<(SocketAddr, SocketAddr, Vec<tokio::task::JoinHandle<()>>), WebhookError> {
    let certificates = Arc::new(Certificates::load(&settings.cert_file, &settings.key_file)?);
    let metrics = Arc::new(WebhookMetrics::default());
    let webhook = http::bind(settings.listen)?;
    let scrape = http::bind(settings.listen_metrics)?;
    let addrs = (
        webhook.local_addr().expect("bound"),
        scrape.local_addr().expect("bound"),
    );
    let handler = |port: Port| {
        let metrics = metrics.clone();
        move |req: Request<hyper::body::Incoming>| {
            let metrics = metrics.clone();
            async move { handle(req, &metrics, port).await }
        }
    };
    let handshakes = metrics.errors.clone();
    let tls = move |stream| {
        let acceptor = tokio_rustls::TlsAcceptor::from(certificates.current());
        let failures = handshakes.clone();
        async move {
            // A failed handshake counts as an error of the webhook.
            acceptor.accept(stream).await.inspect_err(|_| {
                failures.inc();
            })
        }
    };
    let tasks = vec![
        tokio::spawn(http::serve(webhook, tls, handler(Port::Webhook))),
        tokio::spawn(http::serve(scrape, http::plain, handler(Port::Metrics))),
    ];
    Ok((addrs.0, addrs.1, tasks))
}

#[cfg(test)]
mod tests {
    use http_body_util::Full;
    use hyper::body::Bytes;

    use super::*;

    const KEY: &str = "a2V5NQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

    /// An AdmissionReview v1 of `operation` on `object` (a `kind` of `group`).
    fn review_of(group: &str, kind: &str, operation: &str, object: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "0b7e-uid",
                "kind": {"group": group, "version": "v1alpha1", "kind": kind},
                "resource": {"group": group, "version": "v1alpha1", "resource": "peers"},
                "name": "p", "operation": operation, "userInfo": {"username": "admin"},
                "object": object,
            }
        }))
        .unwrap()
    }

    fn peer(spec: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer",
            "metadata": {"name": "p"}, "spec": spec,
        })
    }

    fn peer_review(spec: serde_json::Value) -> Vec<u8> {
        review_of("kilo.squat.ai", "Peer", "CREATE", peer(spec))
    }

    /// POSTs `body` to `path` on the webhook's port: the status and the body as text.
    async fn post(metrics: &WebhookMetrics, path: &str, body: Vec<u8>) -> (StatusCode, String) {
        let req = Request::post(path)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = handle(req, metrics, Port::Webhook).await;
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_valid_peer_is_allowed_and_the_uid_echoed() {
        let metrics = WebhookMetrics::default();
        let body =
            peer_review(serde_json::json!({"allowedIPs": ["10.5.0.1/32"], "publicKey": KEY}));
        let (status, text) = post(&metrics, VALIDATE_PATH, body).await;
        assert_eq!(status, StatusCode::OK);
        let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(answer["kind"], "AdmissionReview");
        assert_eq!(answer["response"]["uid"], "0b7e-uid");
        assert_eq!(answer["response"]["allowed"], true, "{answer}");
        let exposition = metrics.encode();
        assert!(
            exposition
                .contains("admission_requests_total{operation=\"CREATE\",response=\"allowed\"} 1"),
            "{exposition}"
        );
        assert!(
            exposition.contains("http_requests_total{handler=\"validate\",method=\"POST\"} 1"),
            "{exposition}"
        );
    }

    #[tokio::test]
    async fn an_invalid_peer_is_denied_naming_each_bad_field() {
        let metrics = WebhookMetrics::default();
        for (spec, fields) in [
            (
                serde_json::json!({"allowedIPs": ["10.5.0.1/33"], "publicKey": KEY}),
                &["spec.allowedIPs[0]"][..],
            ),
            (
                serde_json::json!({"allowedIPs": ["10.5.0.1/32", "10.5.0.300/32"], "publicKey": "bm9wZQ=="}),
                &["spec.allowedIPs[1]", "spec.publicKey"],
            ),
            (
                serde_json::json!({"allowedIPs": ["10.5.0.1/32"], "publicKey": KEY,
                    "endpoint": {"dnsOrIP": {"ip": "1.2.3"}, "port": 51820}}),
                &["spec.endpoint.dnsOrIP.ip"],
            ),
            (
                serde_json::json!({"allowedIPs": ["10.5.0.1/32"], "publicKey": KEY,
                    "persistentKeepalive": -1}),
                &["spec.persistentKeepalive"],
            ),
        ] {
            let (status, text) = post(&metrics, VALIDATE_PATH, peer_review(spec.clone())).await;
            assert_eq!(status, StatusCode::OK);
            let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(answer["response"]["allowed"], false, "{spec}: {answer}");
            let message = answer["response"]["status"]["message"].as_str().unwrap();
            for field in fields {
                assert!(
                    message.contains(&format!("peer \"p\": {field}: ")),
                    "{message}"
                );
            }
        }
        assert!(
            metrics
                .encode()
                .contains("admission_requests_total{operation=\"CREATE\",response=\"denied\"} 4")
        );
    }

    #[tokio::test]
    async fn a_malformed_review_is_a_400() {
        let metrics = WebhookMetrics::default();
        for body in [
            b"{not json".to_vec(),
            br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}"#.to_vec(),
            br#"{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}"#
                .to_vec(),
            br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": "p"}"#
                .to_vec(),
        ] {
            let (status, text) = post(&metrics, VALIDATE_PATH, body).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        }
        assert!(
            metrics.encode().contains("errors_total 4"),
            "{}",
            metrics.encode()
        );
        // Only POST on /validate; nothing else is served there.
        let get = Request::get(VALIDATE_PATH)
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = handle(get, &metrics, Port::Webhook).await;
        assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
        let (status, _) = post(&metrics, "/mutate", Vec::new()).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[test]
    fn another_kind_is_denied_and_a_deletion_allowed() {
        let node =
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "p"}});
        let r = review(&review_of("", "Node", "CREATE", node)).unwrap();
        assert!(!r.response.allowed);
        assert!(
            r.response
                .result
                .message
                .contains("Peers only, not v1alpha1 Node"),
            "{}",
            r.response.result.message
        );
        let mut deletion: serde_json::Value = serde_json::from_slice(&review_of(
            "kilo.squat.ai",
            "Peer",
            "DELETE",
            serde_json::Value::Null,
        ))
        .unwrap();
        deletion["request"]["oldObject"] =
            peer(serde_json::json!({"allowedIPs": ["x"], "publicKey": KEY}));
        let r = review(&serde_json::to_vec(&deletion).unwrap()).unwrap();
        assert!(r.response.allowed);
        assert_eq!(r.operation, Operation::Delete);
    }

    #[test]
    fn a_bad_preshared_key_is_a_warning() {
        let r = review(&peer_review(
            serde_json::json!({"allowedIPs": ["10.5.0.1/32"],
            "publicKey": KEY, "presharedKey": "zz"}),
        ))
        .unwrap();
        assert!(r.response.allowed);
        let warnings = r.response.warnings.unwrap();
        assert!(warnings[0].contains("spec.presharedKey"), "{warnings:?}");
    }

    #[test]
    fn the_metrics_port_serves_metrics_and_health_only() {
        let metrics = WebhookMetrics::default();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let get = |path: &str| {
            let req = Request::get(path).body(Full::new(Bytes::new())).unwrap();
            rt.block_on(handle(req, &metrics, Port::Metrics)).status()
        };
        assert_eq!(get("/metrics"), StatusCode::OK);
        assert_eq!(get("/health"), StatusCode::OK);
        assert_eq!(get(VALIDATE_PATH), StatusCode::NOT_FOUND);
    }
}
