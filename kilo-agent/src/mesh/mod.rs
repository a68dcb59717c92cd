//! Typed mesh state: Nodes and Peers parsed from Kubernetes-shaped objects
//! (`kilo.squat.ai/*` annotations, the Peer CRD), with Kilo's validation.
//!
//! Owns: the raw [`Snapshot`], its typed form ([`Node`], [`MeshPeer`]), the parsers and
//! their per-object errors ([`ObjectError`]), the resolution of duplicate identities and
//! conflicting claims ([`resolve_conflicts`]), objects as files hold them ([`objects`]), and
//! Kilo's annotation names ([`annotations`]). Pure: the backends read.
//!
//! Every value is read exactly as Kilo's `translateNode`, `Peer.Validate` and `translatePeer`
//! read it (Go's `net.ParseCIDR`, `net.ParseIP`, `strconv.ParseInt`, `wgtypes.ParseKey`,
//! `wireguard.ParseEndpoint`, `encoding/json`): nothing is trimmed, and what Kilo skips or
//! ignores is skipped or ignored with Kilo's fallback (a bad key leaves the node not ready, a
//! bad keepalive counts as none, a bad `force-endpoint` falls back to `endpoint`, an
//! `allowed-location-ips` item with a space is skipped) and a Peer failing `Validate` is left
//! out. Unlike Kilo, each skipped or ignored value is an [`ObjectError`] naming the object, the
//! field and the item, with the reason (`item " 10.9.1.0/24": leading space, Kilo ignores this
//! item`).
//!
//! Differences from Kilo (each covered by a test here or in `tests/golden*.rs`):
//! - A Peer endpoint with both `ip` and `dns` uses the IP, as the CRD documents; Kilo's
//!   translation code lets the DNS name win.
//! - `spec.podCIDRs` (dual-stack) is read; Kilo reads only `spec.podCIDR`. `internal-ip` and
//!   `force-internal-ip` may hold exactly one IPv4 and one IPv6 CIDR separated by a comma
//!   (`192.168.0.1/24,fd00::1/64`), which Kilo ignores (no internal IP).
//! - `granularity: cross` is kg's own; Kilo ignores it.
//! - A keepalive (node annotation or Peer) outside the 0..=65535 seconds WireGuard can carry
//!   counts as none; Kilo keeps a negative or larger value. The Peer stays, as in Kilo.
//! - An annotation over Kubernetes' 256 KiB limit (only possible from the file backend) is
//!   refused by name, unparsed.
//! - A `discovered-endpoints` entry no peer could use (no IP, a port outside 0..=65535) is
//!   dropped; Kilo keeps it.
pub mod annotations;
mod conflicts;
mod crd;
mod endpoint;
mod key;
mod node;
pub mod objects;
mod peer;

use std::{collections::BTreeMap, fmt, str::FromStr};

pub use annotations::DEFAULT_TOPOLOGY_LABEL;
pub use conflicts::resolve_conflicts;
#[cfg(test)]
pub(crate) use conflicts::tests::cloned_snapshot;
pub use crd::{DnsOrIp, Peer, PeerEndpoint, PeerSpec};
pub use endpoint::{Endpoint, EndpointError, Host};
pub use k8s_openapi::api::core::v1::Node as KubeNode;
pub use key::{Key, KeyError};
pub use node::{CHECK_IN_PERIOD_SECS, Node};
pub use peer::MeshPeer;

/// The raw objects a backend has seen, keyed by name: the input of everything pure.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub nodes: BTreeMap<String, KubeNode>,
    pub peers: BTreeMap<String, Peer>,
    /// The cluster's service CIDRs as its `ServiceCIDR` objects give them (none where the API
    /// server does not serve them, and from the file backend).
    pub service_cidrs: Vec<ipnet::IpNet>,
    /// The nodes that run kg ([`annotations::runs_kg`]), which alone may fail over their
    /// location's leader.
    pub kg_nodes: std::collections::BTreeSet<String>,
}

/// How finely the mesh is cut into WireGuard segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Granularity {
    /// Kilo's default: one segment (one leader, one WireGuard IP) per location.
    #[default]
    Location,
    /// Kilo's `full`: every node is its own segment.
    Full,
    /// Every node is its own segment, but nodes of the same location talk over the private
    /// network; only nodes of different locations have WireGuard tunnels (see `topology`).
    Cross,
}

impl Granularity {
    pub fn as_str(self) -> &'static str {
        match self {
            Granularity::Location => "location",
            Granularity::Full => "full",
            Granularity::Cross => "cross",
        }
    }
}

impl fmt::Display for Granularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("unknown granularity {0:?} (expected location, full or cross)")]
pub struct GranularityError(pub String);

impl FromStr for Granularity {
    type Err = GranularityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "location" => Ok(Granularity::Location),
            "full" => Ok(Granularity::Full),
            "cross" => Ok(Granularity::Cross),
            _ => Err(GranularityError(s.into())),
        }
    }
}

/// Which kind of object an [`ObjectError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    Node,
    Peer,
    /// A file that could not be read or parsed as an object (the file backend, `kgctl --backend file`).
    File,
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ObjectKind::Node => "node",
            ObjectKind::Peer => "peer",
            ObjectKind::File => "file",
        })
    }
}

/// One invalid value of one object, e.g.
/// `node "b": annotation kilo.squat.ai/internal-ip: invalid CIDR "x"`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, thiserror::Error)]
#[error("{kind} {name:?}: {field}: {problem}")]
pub struct ObjectError {
    pub kind: ObjectKind,
    /// The object's name (or the file's path).
    pub name: String,
    /// `annotation kilo.squat.ai/...`, `label ...`, `spec.podCIDR`, `spec.allowedIPs[1]`, ...
    pub field: String,
    pub problem: String,
}

impl ObjectError {
    pub fn new(
        kind: ObjectKind,
        name: impl Into<String>,
        field: impl Into<String>,
        problem: impl Into<String>,
    ) -> Self {
        ObjectError {
            kind,
            name: name.into(),
            field: field.into(),
            problem: problem.into(),
        }
    }
}

/// The typed form of a [`Snapshot`]: every object that parsed, and one error per bad value.
#[derive(Debug, Clone, Default)]
pub struct Parsed {
    pub nodes: BTreeMap<String, Node>,
    pub peers: BTreeMap<String, MeshPeer>,
    /// One per invalid field. A node's bad field was ignored with Kilo's fallback; a peer
    /// named here is absent from `peers`.
    pub errors: Vec<ObjectError>,
}

/// Parses every object of a snapshot. Every node is kept (its bad fields ignored, as Kilo does);
/// a Peer that fails Kilo's validation is skipped. Every bad field is reported.
pub fn parse_snapshot(snapshot: &Snapshot, topology_label: &str) -> Parsed {
    let mut errors = Vec::new();
    // Collected, then built in one go (the names mostly arrive sorted); a later object with
    // the same name replaces an earlier one, as an insert would.
    let mut nodes = Vec::with_capacity(snapshot.nodes.len());
    for (name, kn) in &snapshot.nodes {
        let (mut n, errs) = Node::from_kube(kn, topology_label);
        if n.name.is_empty() {
            n.name = name.clone();
        }
        nodes.push((n.name.clone(), n));
        errors.extend(errs);
    }
    let mut peers = Vec::with_capacity(snapshot.peers.len());
    for (name, p) in &snapshot.peers {
        match MeshPeer::from_crd(p) {
            Ok((mut mp, warnings)) => {
                if mp.name.is_empty() {
                    mp.name = name.clone();
                }
                peers.push((mp.name.clone(), mp));
                errors.extend(warnings);
            }
            Err(errs) => errors.extend(errs),
        }
    }
    Parsed {
        nodes: nodes.into_iter().collect(),
        peers: peers.into_iter().collect(),
        errors,
    }
}

/// Parses a CIDR exactly as Kilo's `normalizeIP` (Go's `net.ParseCIDR`) does: nothing is
/// trimmed, the prefix length is decimal digits only (leading zeros allowed), and the address
/// keeps its host bits (`10.5.0.1/24` stays `10.5.0.1/24`).
pub fn parse_cidr(s: &str) -> Result<ipnet::IpNet, String> {
    let bad = || match space(s) {
        Some(why) => format!("invalid CIDR {s:?} ({why})"),
        None => format!("invalid CIDR {s:?}"),
    };
    let (addr, len) = s.split_once('/').ok_or_else(bad)?;
    let addr = addr.parse::<std::net::IpAddr>().map_err(|_| bad())?;
    if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let len = len.parse::<u8>().map_err(|_| bad())?;
    ipnet::IpNet::new(addr, len).map_err(|_| bad())
}

/// Why Kilo, which never trims a value, refuses one that only surrounding whitespace spoils.
pub(crate) fn space(s: &str) -> Option<&'static str> {
    if s.starts_with(char::is_whitespace) {
        Some("leading space")
    } else if s.ends_with(char::is_whitespace) {
        Some("trailing space")
    } else {
        None
    }
}

#[cfg(test)]
mod proptests;
