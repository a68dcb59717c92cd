//! The Kubernetes backend (`--backend kubernetes`): a Node watcher filtered to the changes that
//! matter, a Peer watcher, a ServiceCIDR watcher where the API server serves them, and a merge
//! patch of the local node's own annotations.
//!
//! Node filter: an update makes a new snapshot only when labels, annotations (other than
//! `kilo.squat.ai/last-seen`), `spec.podCIDR(s)` or the `Ready` condition changed. Status
//! heartbeats (kubelet) are stored but cost nothing; Kilo's `last-seen` refreshes only update
//! [`Update::last_seen`], which the agent's liveness tracker records without planning. The
//! Node watch failing, or a patch that cannot reach the API server, marks the backend
//! disconnected ([`Update::connected`]) until the watch delivers again. Objects are trimmed on
//! arrival (managed fields, images, most of status) to keep memory flat.
//!
//! Service CIDRs: where the API server serves `networking.k8s.io/v1` `servicecidrs` (Kubernetes
//! 1.33 on; asked once at start), the snapshot carries the CIDRs of every ServiceCIDR that is
//! Ready or being deleted (Services still hold ClusterIPs from it until then); the planner adds
//! them to `--service-cidr`'s. Elsewhere, and when RBAC refuses the list, there are none.
//!
//! Outages (`watches::Link`): losing the API server is one warning, its return one line saying for how
//! long and after how many retries; the failures in between are debug lines, counted in
//! `kilo_backend_retries_total`.
//!
//! Liveness (`--check-in-period`): Kilo agents drop a node whose `last-seen` is older than
//! 60 s, so during a migration kg keeps refreshing it every 30 s (every agent still *receives*
//! N updates per 30 s from the API server, each recorded without a plan or a reconcile). Once
//! no Kilo agent is left, `--check-in-period=0` stops the heartbeat: liveness is then
//! Kubernetes' own (the node lifecycle controller marks a node NotReady from its kubelet Lease
//! in `kube-node-lease`; that `Ready` transition passes the filter), and the steady-state cost
//! per agent is zero updates whatever N is.
use std::{
    ops::ControlFlow,
    sync::{Arc, Mutex},
};

use futures::{FutureExt, future::BoxFuture};
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

use super::{Annotations, Backend, BackendError, Update};
use crate::mesh::KubeNode;

mod filter;
mod watches;

pub use filter::{node_changed, service_cidrs, trim_node};
use watches::{
    NODES, PEERS, SERVICE_CIDRS, State, serves_service_cidrs, service_cidrs_refused, watch_forever,
};

/// The Kubernetes backend. Dropping it stops the watchers.
pub struct KubeBackend {
    client: Client,
    state: Arc<Mutex<State>>,
    tx: Arc<watch::Sender<Update>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for KubeBackend {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The client configuration from `--kubeconfig` (else `$KUBECONFIG`, `~/.kube/config`, or the
/// in-cluster service account), with `--master` overriding the server address.
pub async fn config(
    kubeconfig: Option<&std::path::Path>,
    master: Option<&str>,
) -> Result<kube::Config, BackendError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| {
                BackendError::Kube(format!(
                    "reading kubeconfig {}: {}",
                    path.display(),
                    error_chain(&e)
                ))
            })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| {
                    BackendError::Kube(format!(
                        "kubeconfig {}: {}",
                        path.display(),
                        error_chain(&e)
                    ))
                })?
        }
        None => kube::Config::infer().await.map_err(|e| {
            BackendError::Kube(format!(
                "no Kubernetes configuration: give --kubeconfig, set $KUBECONFIG, provide \
                 ~/.kube/config or run in a pod with a service account ({})",
                error_chain(&e)
            ))
        })?,
    };
    if let Some(m) = master {
        config.cluster_url = m
            .parse()
            .map_err(|e| BackendError::Kube(format!("--master {m:?}: {e}")))?;
    }
    Ok(config)
}

/// A client for `config`. TLS is rustls with the ring provider, installed here for the whole
/// process so that the choice never depends on which crypto features other crates enable.
///
/// kube's own retry layer is off: it follows the API server's `Retry-After`, which a restarted
/// server that is not ready yet sets to 10 s, so a watch would reconnect that much later. The
/// watches retry on `watches::watch_backoff` instead, and a failed publish is sent again by the
/// agent's next pass.
pub fn client(mut config: kube::Config) -> Result<Client, BackendError> {
    config.default_retry = false;
    // An error only says a provider is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = config.cluster_url.clone();
    Client::try_from(config)
        .map_err(|e| BackendError::Kube(format!("client for {url}: {}", error_chain(&e))))
}

/// An error with all its causes, `outer: inner: innermost` (a TLS or connection failure is
/// usually only named by the innermost one).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// What went wrong when `action` (e.g. "listing nodes") failed, in an operator's words: an
/// HTTP status from the API server with its message, or the cause of a connection failure.
pub fn describe(action: &str, e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 401 => format!(
            "{action}: 401 Unauthorized: the API server rejected the kubeconfig's credentials ({})",
            s.message
        ),
        kube::Error::Api(s) if s.code == 403 => format!(
            "{action}: 403 Forbidden: {} (the ClusterRole in manifests/base/rbac.yaml grants what kg needs)",
            s.message
        ),
        kube::Error::Api(s) => format!("{action}: {} {}: {}", s.code, s.reason, s.message),
        other => format!("{action}: {}", error_chain(other)),
    }
}

impl KubeBackend {
    /// Starts the Node, Peer and ServiceCIDR watchers, counting failed attempts in `retries`.
    /// The first update (generation 1) comes once all have listed everything; until then the
    /// agent does not reconcile (an empty view must never remove the mesh).
    pub fn start(client: Client, retries: Counter) -> Self {
        let mut backend = Self::unwatched(client);
        backend.state.lock().expect("state lock").link.retries = retries;
        let (state, tx, client) = (
            backend.state.clone(),
            backend.tx.clone(),
            backend.client.clone(),
        );
        let nodes = {
            let (state, tx) = (state.clone(), tx.clone());
            tokio::spawn(watch_forever(Api::all(client.clone()), move |ev| {
                let mut s = state.lock().expect("state lock");
                match s.on_event(&NODES, ev, &tx) {
                    Some(true) => s.connected = true,
                    Some(false) => {}
                    None => s.connected = false,
                }
                // Heartbeats and the connection state reach the agent without a snapshot.
                s.refresh(&tx);
                ControlFlow::Continue(())
            }))
        };
        let peers = {
            let (state, tx) = (state.clone(), tx.clone());
            tokio::spawn(watch_forever(Api::all(client.clone()), move |ev| {
                state.lock().expect("state lock").on_event(&PEERS, ev, &tx);
                ControlFlow::Continue(())
            }))
        };
        let services = tokio::spawn(async move {
            if serves_service_cidrs(&client, &state).await {
                watch_forever(Api::all(client), move |ev| {
                    let mut s = state.lock().expect("state lock");
                    if let Err(e) = &ev
                        && let Some(reason) = service_cidrs_refused(e)
                    {
                        tracing::warn!(
                            error = %reason,
                            "cannot list ServiceCIDRs: service CIDRs come from --service-cidr \
                             only (grant list and watch on servicecidrs.networking.k8s.io, as \
                             manifests/base/rbac.yaml does, and restart kg)"
                        );
                        s.service_cidrs.synced = true;
                        s.publish(&tx);
                        return ControlFlow::Break(());
                    }
                    s.on_event(&SERVICE_CIDRS, ev, &tx);
                    ControlFlow::Continue(())
                })
                .await;
            } else {
                let mut s = state.lock().expect("state lock");
                s.service_cidrs.synced = true;
                s.publish(&tx);
            }
        });
        backend.tasks = vec![nodes, peers, services];
        backend
    }

    /// A backend that watches nothing (yet).
    fn unwatched(client: Client) -> Self {
        KubeBackend {
            client,
            state: Arc::default(),
            tx: Arc::new(watch::channel(Update::default()).0),
            tasks: Vec::new(),
        }
    }
}

/// The merge patch that sets or removes annotations.
pub fn annotation_patch(annotations: &Annotations) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = annotations
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_ref().map_or(serde_json::Value::Null, |v| {
                    serde_json::Value::String(v.clone())
                }),
            )
        })
        .collect();
    serde_json::json!({ "metadata": { "annotations": map } })
}

impl Backend for KubeBackend {
    fn updates(&self) -> watch::Receiver<Update> {
        self.tx.subscribe()
    }

    /// The patched node the server answers with is applied as the watch would apply it (a
    /// later, older version from the watch is ignored). A patch that does not reach the API
    /// server also marks the backend disconnected (until the Node watch delivers again): a
    /// watch to an unreachable server may take minutes to fail, and no heartbeat arrives
    /// meanwhile.
    fn publish<'a>(
        &'a self,
        node: &'a str,
        annotations: &'a Annotations,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        async move {
            if annotations.is_empty() {
                return Ok(false);
            }
            let api: Api<KubeNode> = Api::all(self.client.clone());
            let patched = api
                .patch(
                    node,
                    &PatchParams::default(),
                    &Patch::Merge(annotation_patch(annotations)),
                )
                .await
                .map_err(|e| {
                    let error = describe(&format!("patching node {node}"), &e);
                    if !matches!(e, kube::Error::Api(_)) {
                        let mut s = self.state.lock().expect("state lock");
                        s.link.failed(&error);
                        s.connected = false;
                        s.refresh(&self.tx);
                    }
                    BackendError::Kube(error)
                })?;
            // The answer is the node as patched: held now, the next pass sees its own
            // annotations even while the watch lags behind.
            let mut s = self.state.lock().expect("state lock");
            s.on_event(
                &NODES,
                Ok(kube::runtime::watcher::Event::Apply(patched)),
                &self.tx,
            );
            s.refresh(&self.tx);
            Ok(true)
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests;
