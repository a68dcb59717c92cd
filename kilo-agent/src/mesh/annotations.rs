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

/// Kilo's default `--topology-label`: a node's location when it has no `location` annotation.
pub const DEFAULT_TOPOLOGY_LABEL: &str = "topology.kubernetes.io/region";

/// Every annotation the agent writes on its own node (and removes on clean-up).
pub const OWN: [&str; 8] = [
    KEY,
    ENDPOINT,
    INTERNAL_IP,
    WIREGUARD_IP,
    GRANULARITY,
    LAST_SEEN,
    DISCOVERED_ENDPOINTS,
    CNI_COMPATIBILITY_IP,
];

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
