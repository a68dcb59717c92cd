//! kgctl's renderings (pure): `graph` (Graphviz DOT in Kilo's exact layout, or SVG: [`svg`]) and `showconf`
//! (WireGuard text in Kilo's `Conf.Bytes()` format, or a Peer object as JSON/YAML).
//! The `kgctl` binary only reads the backend and writes what these functions return.
//!
//! Deliberate differences from Kilo's kgctl (each has a test):
//! - `--as-peer -o json|yaml` writes `persistentKeepalive` in seconds (Kilo writes nanoseconds)
//!   and omits the endpoint when there is none (Kilo writes `ip: "<nil>"`).
//! - "is this node a leader" comes from the topology; Kilo looks for the node's key among all
//!   WireGuard peers, so a Peer sharing a non-leader's key made Kilo treat it as a leader.
//! - `--mesh-granularity` also accepts `cross`; `auto` accepts a `cross` annotation.
//! - Names containing `"` are escaped in DOT.
mod connect;
mod svg;

pub use connect::Connect;
pub use svg::{SvgError, render_svg};

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use ipnet::IpNet;

use crate::{
    mesh::{self, Endpoint, Granularity, Key, MeshPeer, Node, ObjectError, Snapshot},
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
pub struct Options {
    pub granularity: GranularityArg,
    pub port: u16,
    /// `--subnet`; by default the subnet of the nodes' `wireguard-ip` annotations, else 10.4.0.0/16.
    pub subnet: Option<IpNet>,
    pub topology_label: String,
    /// Unix seconds for readiness (`None`: no freshness check).
    pub now: Option<i64>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
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
}

/// Resolves the cluster from a snapshot the way Kilo's kgctl does.
pub fn cluster(snapshot: &Snapshot, opts: &Options) -> Result<Cluster, KgctlError> {
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
    Ok(render_dot(&c.topology(&h.name, h.persistent_keepalive)?))
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

fn esc(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\\\""))
}

/// A minimal model of the gographviz graph Kilo builds, written the way gographviz writes it.
#[derive(Default)]
struct Dot {
    attrs: BTreeMap<String, String>,
    /// subgraph id → (attrs, children)
    subgraphs: BTreeMap<String, (BTreeMap<String, String>, BTreeSet<String>)>,
    /// node id → attrs (one global table, as in gographviz: a later add extends the attrs)
    nodes: BTreeMap<String, BTreeMap<String, String>>,
    edges: Vec<(String, String, bool)>,
}

impl Dot {
    fn subgraph(&mut self, id: &str, label: &str) {
        let sg = self.subgraphs.entry(id.into()).or_default();
        sg.0.insert("label".into(), esc(label));
        sg.0.insert("style".into(), "\"dashed,rounded\"".into());
    }
    fn node(&mut self, sg: &str, id: &str, attrs: &[(&str, String)]) {
        let a = self.nodes.entry(id.into()).or_default();
        a.insert("shape".into(), "ellipse".into());
        for (k, v) in attrs {
            a.insert((*k).into(), v.clone());
        }
        self.subgraphs
            .entry(sg.into())
            .or_default()
            .1
            .insert(id.into());
    }
    fn render(&self) -> String {
        fn attrs(a: &BTreeMap<String, String>) -> String {
            a.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
        let mut o = String::from("digraph kilo {\n");
        for (k, v) in &self.attrs {
            let _ = writeln!(o, "\t{k}={v};");
        }
        for (s, d, dashed) in &self.edges {
            let style = if *dashed { ", style=dashed" } else { "" };
            let _ = writeln!(o, "\t{s}->{d}[ dir=both{style} ];");
        }
        for (id, (a, children)) in &self.subgraphs {
            let _ = writeln!(o, "\tsubgraph {id} {{");
            for (k, v) in a {
                let _ = writeln!(o, "\t{k}={v};");
            }
            for c in children {
                let _ = writeln!(o, "\t{c} [ {} ];", attrs(&self.nodes[c]));
            }
            o.push_str("\n}\n;\n");
        }
        o.push_str("\n}\n");
        o
    }
}

fn node_label(
    location: &str,
    n: &topology::SegmentNode,
    wg: Option<std::net::IpAddr>,
    ep: Option<&Endpoint>,
) -> String {
    let mut parts = vec![location.to_string(), n.name.clone()];
    if n.pod_cidrs.is_empty() {
        parts.push("<nil>".into());
    }
    parts.extend(n.pod_cidrs.iter().map(ToString::to_string));
    parts.extend(n.internal_ips.iter().map(|i| i.addr().to_string()));
    if let Some(w) = wg {
        parts.push(w.to_string());
    }
    if let Some(e) = ep {
        parts.push(e.to_string());
    }
    esc(&parts.join("\\n"))
}

/// Kilo's `Topology.Dot()`: a cluster per location, edges between leaders (within a location
/// from its leader to each node), dashed edges from every leader to every peer. In `cross`, a
/// cluster per location whose nodes all lead their own segment, edges between nodes of
/// different locations only.
pub fn render_dot(t: &Topology) -> String {
    let mut g = Dot::default();
    g.attrs
        .insert("label".into(), esc(&t.wireguard_cidr.trunc().to_string()));
    g.attrs.insert("labelloc".into(), "t".into());
    g.attrs.insert("outputorder".into(), "nodesfirst".into());
    g.attrs.insert("overlap".into(), "false".into());
    let mut leaders: Vec<(String, &str)> = Vec::new();
    let cross = t.granularity == Granularity::Cross;
    for s in &t.segments {
        let cluster_label = if cross { &s.group } else { &s.location };
        let sg = esc(&format!("cluster_location_{cluster_label}"));
        g.subgraph(&sg, cluster_label);
        let mut ids = Vec::new();
        for (j, n) in s.nodes.iter().enumerate() {
            let id = esc(&n.name);
            let lead = j == s.leader;
            let label = node_label(
                &s.location,
                n,
                lead.then_some(s.wireguard_ip),
                if lead { s.endpoint.as_ref() } else { None },
            );
            let mut a = vec![("label", label)];
            if lead {
                a.push(("rank", "1".into()));
            }
            g.node(&sg, &id, &a);
            ids.push(id);
        }
        // meshSubGraph: the segment's leader to each other node (names are sorted, as gographviz's).
        for (i, id) in ids.iter().enumerate() {
            if i != s.leader {
                g.edges.push((ids[s.leader].clone(), id.clone(), false));
            }
        }
        leaders.push((ids[s.leader].clone(), s.group.as_str()));
    }
    for i in 0..leaders.len() {
        for j in i + 1..leaders.len() {
            if !cross || leaders[i].1 != leaders[j].1 {
                g.edges
                    .push((leaders[i].0.clone(), leaders[j].0.clone(), false));
            }
        }
    }
    let psg = esc("cluster_peers");
    g.subgraph(&psg, "peers");
    let mut peer_ids = BTreeSet::new();
    for p in &t.peers {
        let id = esc(&p.name);
        let ep = p
            .endpoint
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        g.node(
            &psg,
            &id,
            &[("label", esc(&format!("{}\\n{ep}\n", p.name)))],
        );
        peer_ids.insert(id);
    }
    for (l, _) in &leaders {
        for p in &peer_ids {
            g.edges.push((l.clone(), p.clone(), true));
        }
    }
    g.render()
}

#[cfg(test)]
mod tests;
