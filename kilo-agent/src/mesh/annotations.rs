//! Kilo's node annotations and labels: every `kilo.squat.ai/*` name, which of them the agent
//! publishes, the default location label, and the parsers of the values that are more than a
//! scalar (`internal-ip`, `discovered-endpoints`). [`super::Node::from_kube`] reads a Node with
//! them.
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use ipnet::IpNet;

use super::{Key, parse_cidr, space};

/// What every Kilo annotation name starts with.
pub const PREFIX: &str = "kilo.squat.ai/";

pub const ENDPOINT: &str = "kilo.squat.ai/endpoint";
pub const FORCE_ENDPOINT: &str = "kilo.squat.ai/force-endpoint";
pub const INTERNAL_IP: &str = "kilo.squat.ai/internal-ip";
pub const FORCE_INTERNAL_IP: &str = "kilo.squat.ai/force-internal-ip";
pub const KEY: &str = "kilo.squat.ai/key";
pub const LAST_SEEN: &str = "kilo.squat.ai/last-seen";
pub const LEADER: &str = "kilo.squat.ai/leader";
pub const LOCATION: &str = "kilo.squat.ai/location";
pub const PERSISTENT_KEEPALIVE: &str = "kilo.squat.ai/persistent-keepalive";
pub const WIREGUARD_IP: &str = "kilo.squat.ai/wireguard-ip";
pub const DISCOVERED_ENDPOINTS: &str = "kilo.squat.ai/discovered-endpoints";
pub const ALLOWED_LOCATION_IPS: &str = "kilo.squat.ai/allowed-location-ips";
pub const GRANULARITY: &str = "kilo.squat.ai/granularity";
pub const CNI_COMPATIBILITY_IP: &str = "kilo.squat.ai/cni-compatibility-ip";

/// What kg's own annotations start with: Kilo reads none of them.
pub const KG_PREFIX: &str = "kg.kilo.squat.ai/";
/// kg's copy of `last-seen`, written in the same patch: a node whose `last-seen` differs from it
/// (or that lacks it) runs Kilo, or ran kg without a heartbeat (`-` when `--check-in-period=0`).
pub const KG_LAST_SEEN: &str = "kg.kilo.squat.ai/last-seen";
/// On a location leader that stopped forwarding: the name of the node that demoted it. kg then
/// chooses the location's leader among the other nodes (see `topology`); the demoted node
/// removes it once it is healthy again.
pub const DEMOTED: &str = "kg.kilo.squat.ai/demoted";

/// Kilo's default `--topology-label`: a node's location when it has no `location` annotation.
pub const DEFAULT_TOPOLOGY_LABEL: &str = "topology.kubernetes.io/region";

/// Every annotation the agent writes on its own node (and removes on clean-up).
pub const OWN: [&str; 10] = [
    KEY,
    ENDPOINT,
    INTERNAL_IP,
    WIREGUARD_IP,
    GRANULARITY,
    LAST_SEEN,
    DISCOVERED_ENDPOINTS,
    CNI_COMPATIBILITY_IP,
    KG_LAST_SEEN,
    DEMOTED,
];

/// Whether a node with these annotations runs kg: its `kg.kilo.squat.ai/last-seen` is there and
/// equals `kilo.squat.ai/last-seen`, or it has no `last-seen` (kg without a heartbeat). A Kilo
/// agent refreshes only `last-seen`, so a node taken over by Kilo stops counting within one
/// check-in.
pub fn runs_kg(annotations: &BTreeMap<String, String>) -> bool {
    annotations
        .get(KG_LAST_SEEN)
        .is_some_and(|kg| annotations.get(LAST_SEEN).is_none_or(|seen| seen == kg))
}

/// The nodes of `nodes` that run kg ([`runs_kg`]).
pub fn kg_nodes(nodes: &BTreeMap<String, super::KubeNode>) -> std::collections::BTreeSet<String> {
    nodes
        .iter()
        .filter(|(_, n)| n.metadata.annotations.as_ref().is_some_and(runs_kg))
        .map(|(name, _)| name.clone())
        .collect()
}

/// `internal-ip`: one CIDR as Kilo reads it, or (kg's dual-stack form, which Kilo ignores) one
/// IPv4 and one IPv6 CIDR separated by a comma; IPv4 first.
pub(super) fn parse_internal_ips(v: &str) -> Result<Vec<IpNet>, String> {
    let Some((a, b)) = v.split_once(',') else {
        return Ok(vec![parse_cidr(v)?]);
    };
    match (parse_cidr(a)?, parse_cidr(b)?) {
        (v4 @ IpNet::V4(_), v6 @ IpNet::V6(_)) | (v6 @ IpNet::V6(_), v4 @ IpNet::V4(_)) => {
            Ok(vec![v4, v6])
        }
        _ => Err(format!("at most one CIDR per family, got {v:?}")),
    }
}

/// Why a value Kilo refuses is refused: surrounding whitespace, else `e`.
pub(super) fn why(v: &str, e: impl std::fmt::Display) -> String {
    space(v).map_or_else(|| e.to_string(), str::to_string)
}

/// Kilo's reading of `discovered-endpoints`, a JSON object of Go `net.UDPAddr`s
/// (`{"IP":"1.2.3.4","Port":51820,"Zone":""}`, field names matched as Go does, ignoring case):
/// anything Go's decoder refuses (invalid JSON, an invalid IP, a port that is not an integer)
/// drops the whole map. An entry no WireGuard peer could use (a key that is not a WireGuard key,
/// no IP, a port outside 0..=65535) is dropped alone.
pub(super) fn parse_discovered(v: &str) -> Result<BTreeMap<Key, SocketAddr>, String> {
    let raw: BTreeMap<String, Option<serde_json::Map<String, serde_json::Value>>> =
        serde_json::from_str(v).map_err(|e| format!("invalid JSON ({e})"))?;
    let mut out = BTreeMap::new();
    for (k, addr) in raw {
        let Some(addr) = addr else { continue };
        // Go prefers the exact field name, else any that matches ignoring case.
        let field = |name: &str| {
            addr.get(name).or_else(|| {
                addr.iter()
                    .find(|(f, _)| f.eq_ignore_ascii_case(name))
                    .map(|(_, v)| v)
            })
        };
        let ip = match field("IP") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(ip)) if ip.is_empty() => None,
            Some(serde_json::Value::String(ip)) => Some(
                ip.parse::<IpAddr>()
                    .map_err(|_| format!("invalid IP {ip:?} for key {k:?}"))?,
            ),
            Some(other) => return Err(format!("invalid IP {other} for key {k:?}")),
        };
        let port = match field("Port") {
            None | Some(serde_json::Value::Null) => 0,
            Some(p) => p
                .as_i64()
                .ok_or_else(|| format!("invalid port {p} for key {k:?}"))?,
        };
        if let (Ok(key), Some(ip), Ok(port)) = (k.parse::<Key>(), ip, u16::try_from(port)) {
            out.insert(key, SocketAddr::new(ip, port));
        }
    }
    Ok(out)
}
