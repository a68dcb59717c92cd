//! The settings that decide a node's plan besides the snapshot (`kg`'s flags), and what
//! planning returns.
use std::{collections::BTreeMap, fmt, net::SocketAddr, str::FromStr};

use ipnet::IpNet;

use super::Plan;
use crate::{
    mesh::{self, Granularity, ObjectError},
    topology::{Topology, TopologyError},
};

/// `--compatibility`: Kilo's encapsulator, which decides the gateway through which a node of
/// the location is reached (and `Device::Tunnel` is then the CNI's device: `flannel.1`,
/// Cilium's `cilium_tunl` or `tunl0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compatibility {
    /// Kilo's IPIP encapsulator: the node's private IP.
    #[default]
    None,
    /// Kilo's flannel encapsulator: the first address of the node's pod CIDR.
    Flannel,
    /// Kilo's cilium encapsulator: the node's `cni-compatibility-ip`, else as flannel.
    Cilium,
}

impl FromStr for Compatibility {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" => Ok(Compatibility::None),
            "flannel" => Ok(Compatibility::Flannel),
            "cilium" => Ok(Compatibility::Cilium),
            _ => Err(format!("unknown compatibility {s:?} (flannel, cilium)")),
        }
    }
}

/// `--encapsulate`: when traffic inside a location is IPIP-encapsulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encapsulation {
    Never,
    /// Only when the gateway is outside the local private subnet.
    CrossSubnet,
    #[default]
    Always,
}

impl FromStr for Encapsulation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "never" => Ok(Encapsulation::Never),
            "crosssubnet" => Ok(Encapsulation::CrossSubnet),
            "always" => Ok(Encapsulation::Always),
            _ => Err(format!(
                "unknown encapsulation {s:?} (never, crosssubnet, always)"
            )),
        }
    }
}

impl fmt::Display for Encapsulation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Encapsulation::Never => "never",
            Encapsulation::CrossSubnet => "crosssubnet",
            Encapsulation::Always => "always",
        })
    }
}

/// Where the keepalive the local node sends to its WireGuard peers comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepaliveSource {
    /// The local node's `kilo.squat.ai/persistent-keepalive` annotation (what `kg` does).
    #[default]
    LocalNode,
    /// A fixed value in seconds (Kilo's unit tests and goldens use 0).
    Fixed(u16),
}

/// Everything besides the snapshot that decides one node's plan.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The local node's name (`--hostname`).
    pub hostname: String,
    pub granularity: Granularity,
    /// `--subnet` (10.4.0.0/16).
    pub subnet: IpNet,
    /// `--port` (51820).
    pub port: u16,
    /// `--service-cidr` (none).
    pub service_cidrs: Vec<IpNet>,
    /// `--local` (true): manage routes inside the location.
    pub local: bool,
    /// `--encapsulate` (always).
    pub encapsulate: Encapsulation,
    /// `--compatibility` (none).
    pub compatibility: Compatibility,
    /// `--cni` (true): the local pod CIDR is a NAT source and the CNI configuration's range.
    pub cni: bool,
    /// `--iptables-forward-rules` (false): with `cni`, the plan's [`forward`](super::Plan::forward)
    /// accepts.
    pub iptables_forward_rules: bool,
    /// `--topology-label` (topology.kubernetes.io/region).
    pub topology_label: String,
    pub persistent_keepalive: KeepaliveSource,
    /// Unix seconds, for the last-seen freshness check of readiness; `None` skips that check
    /// (the caller reads the clock; this code stays pure).
    pub now: Option<i64>,
    /// Endpoints the agent observed on its WireGuard device for NAT-ed peers (Kilo's
    /// `discoverNATEndpoints`); they replace the local node's `discovered-endpoints`
    /// annotation. `None` uses the annotation.
    pub discovered_endpoints: Option<BTreeMap<mesh::Key, SocketAddr>>,
    /// The local node runs kg, whether or not the snapshot shows its heartbeat yet (the
    /// agent: true; `kgctl`, which plans for any node: false).
    pub runs_kg: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            hostname: String::new(),
            granularity: Granularity::Location,
            subnet: "10.4.0.0/16".parse().expect("valid default subnet"),
            port: 51820,
            service_cidrs: Vec::new(),
            local: true,
            encapsulate: Encapsulation::Always,
            compatibility: Compatibility::None,
            cni: true,
            iptables_forward_rules: false,
            topology_label: mesh::DEFAULT_TOPOLOGY_LABEL.to_string(),
            persistent_keepalive: KeepaliveSource::LocalNode,
            now: None,
            discovered_endpoints: None,
            runs_kg: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Object(#[from] ObjectError),
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

/// What [`plan_for`](super::plan_for) returns.
#[derive(Debug, Clone, Default)]
pub struct Planned {
    /// `None` when the local node is not in the snapshot, not ready, or the topology failed.
    pub plan: Option<Plan>,
    pub topology: Option<Topology>,
    /// Per-object problems (those objects were skipped) and topology errors.
    pub errors: Vec<PlanError>,
    /// Ready nodes and peers (Kilo's `kilo_nodes` / `kilo_peers`).
    pub ready_nodes: usize,
    pub ready_peers: usize,
}
