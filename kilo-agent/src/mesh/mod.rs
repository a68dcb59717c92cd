//! Typed mesh state: Nodes and Peers parsed from Kubernetes-shaped objects
//! (`kilo.squat.ai/*` annotations, the Peer CRD), with Kilo's validation.
mod endpoint;
mod key;

pub use endpoint::{Endpoint, EndpointError, Host};
pub use key::{Key, KeyError};
