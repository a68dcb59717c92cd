//! kgctl's renderings (pure): `graph` (the topology kgctl sees, drawn by [`crate::graph`]),
//! `showconf` (WireGuard text in Kilo's `Conf.Bytes()` format, or a Peer object as JSON/YAML)
//! and `check` ([`check`]: the pod to ask per node, and its answer read).
//! The `kgctl` binary only reads the backend and writes what these functions return.
//!
//! Deliberate differences from Kilo's kgctl (each has a test):
//! - `--as-peer -o json|yaml` writes `persistentKeepalive` in seconds (Kilo writes nanoseconds)
//!   and omits the endpoint when there is none (Kilo writes `ip: "<nil>"`).
//! - "is this node a leader" comes from the topology; Kilo looks for the node's key among all
//!   WireGuard peers, so a Peer sharing a non-leader's key made Kilo treat it as a leader.
//! - `--mesh-granularity` also accepts `cross`; `auto` accepts a `cross` annotation.
pub mod check;
mod connect;

pub use connect::Connect;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use ipnet::IpNet;

use crate::{
    mesh::{self, Granularity, Key, MeshPeer, Node, ObjectError, Snapshot},
    plan::WireGuardPeer,
    topology::{self, Topology, TopologyError},
};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KgctlError {
    #[error("did not find any valid Kilo nodes in the cluster")]
    NoNodes,
    #[error("could not get any nodes")]
    NoNodesForAuto,
    #[error("mesh granularity {0:?} is not supported")]
    UnsupportedGranularity(String),
    #[error("did not find any node named {0:?} in the cluster")]
    NodeNotFound(String),
    #[error("did not find any peer named {0:?} in the cluster")]
    PeerNotFound(String),
    #[error("failed to create topology: {0}")]
    Topology(#[from] TopologyError),
    #[error("failed to encode: {0}")]
    Encode(String),
}

/// `--mesh-granularity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GranularityArg {
    /// Read `kilo.squat.ai/granularity` of the first node.
    #[default]
    Auto,
    Fixed(Granularity),
}

impl std::str::FromStr for GranularityArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(GranularityArg::Auto);
        }
        s.parse()
            .map(GranularityArg::Fixed)
            .map_err(|e: mesh::GranularityError| e.to_string())
    }
}

/// kgctl's global options.
#[derive(Debug, Clone)]
pub struct GlobalOptions {
    pub granularity: GranularityArg,
    pub port: u16,
    /// `--subnet`; by default the subnet of the nodes' `wireguard-ip` annotations, else 10.4.0.0/16.
    pub subnet: Option<IpNet>,
    pub topology_label: String,
    /// Unix seconds for readiness (`None`: no freshness check).
    pub now: Option<i64>,
}

impl Default for GlobalOptions {
    fn default() -> Self {
        GlobalOptions {
            granularity: GranularityArg::Auto,
            port: 51820,
            subnet: None,
            topology_label: mesh::DEFAULT_TOPOLOGY_LABEL.into(),
            now: None,
        }
    }
}

/// The cluster as kgctl sees it: ready nodes and peers, granularity and subnet resolved.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub nodes: BTreeMap<String, Node>,
    pub peers: BTreeMap<String, MeshPeer>,
    pub granularity: Granularity,
    pub subnet: IpNet,
    pub port: u16,
    /// Invalid fields: a node's was ignored, a peer's left the peer out.
    pub errors: Vec<ObjectError>,
    /// The nodes that run kg: their location leaders follow kg's failover, as kg's do.
    pub kg_nodes: std::collections::BTreeSet<String>,
}

/// Resolves the cluster from a snapshot the way Kilo's kgctl does.
pub fn cluster(snapshot: &Snapshot, opts: &GlobalOptions) -> Result<Cluster, KgctlError> {
    let parsed = mesh::parse_snapshot(snapshot, &opts.topology_label);
    let granularity = match opts.granularity {
        GranularityArg::Fixed(g) => g,
        GranularityArg::Auto => {
            let first = snapshot
                .nodes
                .keys()
                .next()
                .ok_or(KgctlError::NoNodesForAuto)?;
            match parsed.nodes.get(first).and_then(|n| n.granularity) {
                Some(g) => g,
                None => return Err(KgctlError::UnsupportedGranularity("auto".into())),
            }
        }
    };
    let mut subnet = "10.4.0.0/16".parse::<IpNet>().expect("valid");
    for n in parsed.nodes.values() {
        if let Some(w) = n.wireguard_ip {
            subnet = w;
        }
    }
    let subnet = opts.subnet.unwrap_or(subnet).trunc();
    let mut nodes: BTreeMap<_, _> = parsed
        .nodes
        .into_iter()
        .filter(|(_, n)| n.ready(opts.now))
        .collect();
    let mut peers = parsed.peers;
    peers.retain(|_, p| p.ready());
    // kgctl knows no service CIDRs: only the conflicts between nodes and Peers apply.
    let mut errors = parsed.errors;
    errors.extend(mesh::resolve_conflicts(&mut nodes, &mut peers, &[], subnet));
    if nodes.is_empty() {
        return Err(KgctlError::NoNodes);
    }
    Ok(Cluster {
        nodes,
        peers,
        granularity,
        subnet,
        port: opts.port,
        errors,
        kg_nodes: mesh::annotations::kg_nodes(&snapshot.nodes),
    })
}

impl Cluster {
    /// The topology seen from `hostname` with the given keepalive.
    pub fn topology(&self, hostname: &str, keepalive: u16) -> Result<Topology, KgctlError> {
        let opts = topology::Options {
            granularity: self.granularity,
            hostname: hostname.into(),
            port: self.port,
            subnet: self.subnet,
            service_cidrs: Vec::new(),
            persistent_keepalive: keepalive,
            kg_nodes: self.kg_nodes.clone(),
        };
        Ok(Topology::new(&self.nodes, &self.peers, &opts)?)
    }

    /// Kilo's kgctl uses the last ready node as the point of view for graph and peer configs.
    fn any_host(&self) -> &Node {
        self.nodes.values().next_back().expect("cluster has nodes")
    }
}

/// `kgctl graph`.
pub fn graph(c: &Cluster) -> Result<String, KgctlError> {
    let h = c.any_host();
    Ok(crate::graph::render_dot(
        &c.topology(&h.name, h.persistent_keepalive)?,
    ))
}

/// `-o`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    #[default]
    WireGuard,
    Json,
    Yaml,
}

impl std::str::FromStr for OutputFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "wireguard" => Ok(OutputFormat::WireGuard),
            "json" => Ok(OutputFormat::Json),
            "yaml" => Ok(OutputFormat::Yaml),
            _ => Err(format!(
                "output format {s} unknown; posible values are: json, wireguard, yaml"
            )),
        }
    }
}

/// `showconf` flags.
#[derive(Debug, Clone, Default)]
pub struct ShowOptions {
    pub as_peer: bool,
    pub output: OutputFormat,
    /// `--allowed-ips`, added to the allowed IPs with `--as-peer`.
    pub allowed_ips: Vec<IpNet>,
}

/// What a showconf command writes (exit code 0 in both cases).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shown {
    pub stdout: String,
    pub stderr: String,
}

/// The `[Interface]` section of a rendered configuration.
#[derive(Debug, Clone, Copy)]
pub struct Interface<'a> {
    /// Omitted when `None` (kgctl never knows a node's private key).
    pub private_key: Option<&'a Key>,
    pub listen_port: u16,
}

/// Kilo's `Conf.Bytes()`.
pub fn render_wireguard(interface: Option<Interface<'_>>, peers: &[WireGuardPeer]) -> String {
    let mut o = String::new();
    if let Some(i) = interface {
        o.push_str("[Interface]\n");
        if let Some(k) = i.private_key.filter(|k| **k != Key([0; 32])) {
            let _ = writeln!(o, "PrivateKey = {k}");
        }
        let _ = writeln!(o, "ListenPort = {}", i.listen_port);
    }
    for (n, p) in peers.iter().enumerate() {
        if n > 0 || interface.is_some() {
            o.push('\n');
        }
        o.push_str("[Peer]\n");
        if !p.allowed_ips.is_empty() {
            let ips: Vec<String> = p.allowed_ips.iter().map(ToString::to_string).collect();
            let _ = writeln!(o, "AllowedIPs = {}", ips.join(", "));
        }
        if let Some(e) = &p.endpoint {
            let _ = writeln!(o, "Endpoint = {e}");
        }
        let _ = writeln!(o, "PersistentKeepalive = {}", p.persistent_keepalive);
        if let Some(k) = p.preshared_key.filter(|k| *k != Key([0; 32])) {
            let _ = writeln!(o, "PresharedKey = {k}");
        }
        if p.public_key != Key([0; 32]) {
            let _ = writeln!(o, "PublicKey = {}", p.public_key);
        }
    }
    o
}

fn dedup_text(ips: &mut Vec<IpNet>) {
    let mut seen = BTreeSet::new();
    ips.retain(|i| seen.insert(i.to_string()));
}

fn encode_peer(p: &MeshPeer, format: OutputFormat) -> Result<String, KgctlError> {
    let obj = p.to_crd();
    match format {
        OutputFormat::Json => serde_json::to_string_pretty(&obj)
            .map(|s| s + "\n")
            .map_err(|e| KgctlError::Encode(e.to_string())),
        _ => serde_yaml::to_string(&obj).map_err(|e| KgctlError::Encode(e.to_string())),
    }
}

fn as_mesh_peer(name: &str, w: &WireGuardPeer) -> MeshPeer {
    MeshPeer {
        name: name.into(),
        allowed_ips: w.allowed_ips.clone(),
        public_key: w.public_key,
        endpoint: w.endpoint.clone(),
        persistent_keepalive: w.persistent_keepalive,
        preshared_key: w.preshared_key,
    }
}

fn as_wireguard_peer(p: &MeshPeer) -> WireGuardPeer {
    WireGuardPeer {
        public_key: p.public_key,
        preshared_key: p.preshared_key,
        endpoint: p.endpoint.clone(),
        allowed_ips: p.allowed_ips.clone(),
        persistent_keepalive: p.persistent_keepalive,
    }
}

/// `--as-peer`: `p` with the `--allowed-ips` added (each once), as a WireGuard `[Peer]`
/// section or a Peer object named `name`.
fn show_as_peer(name: &str, mut p: WireGuardPeer, o: &ShowOptions) -> Result<String, KgctlError> {
    p.allowed_ips.extend(&o.allowed_ips);
    dedup_text(&mut p.allowed_ips);
    match o.output {
        OutputFormat::WireGuard => Ok(render_wireguard(None, &[p])),
        f => encode_peer(&as_mesh_peer(name, &p), f),
    }
}

/// `kgctl showconf node NAME`.
pub fn showconf_node(c: &Cluster, name: &str, o: &ShowOptions) -> Result<Shown, KgctlError> {
    let node = c
        .nodes
        .get(name)
        .ok_or_else(|| KgctlError::NodeNotFound(name.into()))?;
    let t = c.topology(name, node.persistent_keepalive)?;
    if !t.leader {
        return Ok(Shown {
            stdout: String::new(),
            stderr: format!("Node {name:?} is not a leader node\n"),
        });
    }
    let stdout = if !o.as_peer {
        render_wireguard(
            Some(Interface {
                private_key: None,
                listen_port: c.port,
            }),
            &t.conf(),
        )
    } else {
        let p = t.as_peer().expect("a leader has a local segment");
        show_as_peer(name, p, o)?
    };
    Ok(Shown {
        stdout,
        ..Shown::default()
    })
}

/// `kgctl showconf peer NAME`.
pub fn showconf_peer(c: &Cluster, name: &str, o: &ShowOptions) -> Result<Shown, KgctlError> {
    let peer = c
        .peers
        .get(name)
        .ok_or_else(|| KgctlError::PeerNotFound(name.into()))?;
    let stdout = if !o.as_peer {
        let t = c.topology(&c.any_host().name.clone(), peer.persistent_keepalive)?;
        render_wireguard(None, &t.peer_conf(name))
    } else {
        show_as_peer(&peer.name, as_wireguard_peer(peer), o)?
    };
    Ok(Shown {
        stdout,
        ..Shown::default()
    })
}

#[cfg(test)]
mod tests;
