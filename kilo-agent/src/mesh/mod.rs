//! Typed mesh state: Nodes and Peers parsed from Kubernetes-shaped objects
//! (`kilo.squat.ai/*` annotations, the Peer CRD), with Kilo's validation.
mod crd;
mod endpoint;
mod key;

use std::collections::BTreeMap;

pub use crd::{DnsOrIp, Peer, PeerEndpoint, PeerSpec};
pub use endpoint::{Endpoint, EndpointError, Host};
pub use k8s_openapi::api::core::v1::Node as KubeNode;
pub use key::{Key, KeyError};

/// The raw objects a backend has seen, keyed by name: the input of everything pure.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub nodes: BTreeMap<String, KubeNode>,
    pub peers: BTreeMap<String, Peer>,
}
