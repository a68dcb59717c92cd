//! A Kubernetes Node's Kilo view: the `kilo.squat.ai/*` annotations, the topology label and
//! the pod CIDRs, parsed and validated.
use std::{collections::BTreeMap, net::SocketAddr};

use ipnet::IpNet;

use super::{
    Endpoint, Granularity, Key, KubeNode, ObjectError, ObjectKind,
    annotations::{self, parse_discovered, parse_internal_ips, why},
    parse_cidr, space,
};

/// Kilo's check-in period; a node whose last-seen is older than twice this is not ready.
pub const CHECK_IN_PERIOD_SECS: i64 = 30;

/// A node as the mesh sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    /// `force-endpoint`, else `endpoint`.
    pub endpoint: Option<Endpoint>,
    /// `force-internal-ip`, else `internal-ip`: at most one per family, IPv4 first, host bits
    /// kept (the mask says which subnet the node is on, for `--encapsulate=crosssubnet`).
    pub internal_ips: Vec<IpNet>,
    /// `force-internal-ip` is `""` or `"-"`: the node has no internal IP on purpose.
    pub no_internal_ip: bool,
    pub cni_compatibility_ip: Option<IpNet>,
    pub key: Option<Key>,
    /// Unix seconds.
    pub last_seen: Option<i64>,
    /// The `leader` annotation is present (its value is ignored, as in Kilo).
    pub leader: bool,
    /// `location` annotation, else the topology label, else `""`.
    pub location: String,
    /// Seconds this node sends keepalives at; non-zero also marks it as behind NAT.
    pub persistent_keepalive: u16,
    /// `spec.podCIDRs`, else `spec.podCIDR`; truncated (no host bits).
    pub pod_cidrs: Vec<IpNet>,
    pub wireguard_ip: Option<IpNet>,
    /// Public key → endpoint observed by this node (NAT traversal).
    pub discovered_endpoints: BTreeMap<Key, SocketAddr>,
    pub allowed_location_ips: Vec<IpNet>,
    pub granularity: Option<Granularity>,
    /// `kg.kilo.squat.ai/demoted`: the node that demoted this one as its location's leader.
    pub demoted_by: Option<String>,
}

/// The largest annotation value read: Kubernetes' limit on all of an object's annotations
/// together (256 KiB), so only a file-backend object can exceed it.
pub const MAX_ANNOTATION_BYTES: usize = 256 * 1024;

impl Node {
    /// Kilo's `Node.Ready`: an endpoint, a non-zero key, a pod CIDR and, when `now` (unix
    /// seconds) is given, a last-seen younger than two check-in periods.
    pub fn ready(&self, now: Option<i64>) -> bool {
        self.endpoint.is_some()
            && self.key.is_some_and(|k| k != Key([0; 32]))
            && !self.pod_cidrs.is_empty()
            && match now {
                None => true,
                Some(now) => self
                    .last_seen
                    .is_some_and(|ls| now - ls < 2 * CHECK_IN_PERIOD_SECS),
            }
    }

    /// The first internal IP (IPv4 first): Kilo's single `InternalIP`.
    pub fn internal_ip(&self) -> Option<IpNet> {
        self.internal_ips.first().copied()
    }

    /// Parses a Kubernetes Node exactly as Kilo's `translateNode` does: nothing is trimmed,
    /// an empty value is an absent one, and an invalid value is ignored with Kilo's fallback
    /// (a bad `force-endpoint` falls back to `endpoint`, a bad keepalive counts as none, a bad
    /// `allowed-location-ips` item is skipped, a bad key or last-seen leaves the node not
    /// ready, ...) and returned as an error naming the field, the value and the fallback.
    /// The node itself is always returned.
    pub fn from_kube(kn: &KubeNode, topology_label: &str) -> (Node, Vec<ObjectError>) {
        let name = kn.metadata.name.clone().unwrap_or_default();
        let empty = BTreeMap::new();
        let all = kn.metadata.annotations.as_ref().unwrap_or(&empty);
        // A value larger than Kubernetes allows all of an object's annotations together is
        // refused (named below) rather than parsed.
        let ann = |k: &str| {
            all.get(k)
                .map(String::as_str)
                .filter(|v| v.len() <= MAX_ANNOTATION_BYTES)
        };
        let labels = kn.metadata.labels.as_ref().unwrap_or(&empty);
        let mut errs: Vec<_> = all
            .iter()
            .filter(|(k, v)| v.len() > MAX_ANNOTATION_BYTES && k.starts_with(annotations::PREFIX))
            .map(|(k, v)| {
                ObjectError::new(
                    ObjectKind::Node,
                    name.clone(),
                    format!("annotation {k}"),
                    format!(
                        "{} bytes, more than the {MAX_ANNOTATION_BYTES} Kubernetes allows all of \
                         an object's annotations; ignored",
                        v.len()
                    ),
                )
            })
            .collect();
        let mut err = |field: String, problem: String| {
            errs.push(ObjectError::new(
                ObjectKind::Node,
                name.clone(),
                field,
                problem,
            ))
        };
        let a = |k: &str| format!("annotation {k}");
        let get = |k: &str| ann(k).filter(|s| !s.is_empty());

        let mut endpoint = None;
        for (k, fallback) in [
            (
                annotations::FORCE_ENDPOINT,
                "falling back to the endpoint annotation",
            ),
            (
                annotations::ENDPOINT,
                "the node has no endpoint (not ready)",
            ),
        ] {
            let Some(v) = get(k) else { continue };
            match v.parse::<Endpoint>() {
                Ok(e) => {
                    endpoint = Some(e);
                    break;
                }
                Err(e) => err(
                    a(k),
                    format!("invalid endpoint {v:?} ({}); {fallback}", why(v, e)),
                ),
            }
        }

        let mut internal_ips = Vec::new();
        let force = ann(annotations::FORCE_INTERNAL_IP);
        let no_internal_ip = matches!(force, Some("") | Some("-"));
        let candidates = [
            (
                annotations::FORCE_INTERNAL_IP,
                force.filter(|_| !no_internal_ip),
                "falling back to the internal-ip annotation",
            ),
            (
                annotations::INTERNAL_IP,
                get(annotations::INTERNAL_IP).filter(|_| !no_internal_ip),
                "the node has no internal IP",
            ),
        ];
        for (k, v, fallback) in candidates {
            let Some(v) = v else { continue };
            match parse_internal_ips(v) {
                Ok(ips) => {
                    internal_ips = ips;
                    break;
                }
                Err(e) => err(a(k), format!("{e}; {fallback}")),
            }
        }

        let cni_compatibility_ip = get(annotations::CNI_COMPATIBILITY_IP).and_then(|v| {
            parse_cidr(v)
                .map_err(|e| {
                    err(
                        a(annotations::CNI_COMPATIBILITY_IP),
                        format!("{e}; ignored"),
                    )
                })
                .ok()
        });

        let key = get(annotations::KEY).and_then(|v| {
            v.parse::<Key>()
                .map_err(|e| {
                    err(
                        a(annotations::KEY),
                        format!(
                            "invalid WireGuard key {v:?} ({}); the node is not ready",
                            why(v, e)
                        ),
                    )
                })
                .ok()
        });

        let last_seen = get(annotations::LAST_SEEN).and_then(|v| {
            v.parse::<i64>()
                .map_err(|_| {
                    err(
                        a(annotations::LAST_SEEN),
                        format!(
                            "invalid unix time {v:?} ({}); the node is not ready",
                            why(v, "not a decimal integer")
                        ),
                    )
                })
                .ok()
        });

        let leader = ann(annotations::LEADER).is_some();
        let location = ann(annotations::LOCATION)
            .or_else(|| labels.get(topology_label).map(String::as_str))
            .unwrap_or_default()
            .to_string();

        // Go's `strconv.ParseInt` (an optional sign, decimal digits), as Kilo reads it; a value
        // WireGuard cannot carry (outside 0..=65535) also counts as none.
        let persistent_keepalive = match get(annotations::PERSISTENT_KEEPALIVE) {
            None => 0,
            Some(v) => match v.parse::<i64>() {
                Ok(k) => u16::try_from(k).unwrap_or_else(|_| {
                    err(
                        a(annotations::PERSISTENT_KEEPALIVE),
                        format!(
                            "keepalive {v:?} is outside 0..=65535 seconds, which WireGuard \
                             cannot carry; counted as none"
                        ),
                    );
                    0
                }),
                Err(_) => {
                    err(
                        a(annotations::PERSISTENT_KEEPALIVE),
                        format!(
                            "invalid keepalive {v:?} ({}); counted as none",
                            why(v, "not a decimal integer")
                        ),
                    );
                    0
                }
            },
        };

        let mut pod_cidrs = Vec::new();
        let spec = kn.spec.as_ref();
        let list = spec
            .and_then(|s| s.pod_cidrs.as_deref())
            .unwrap_or_default();
        if !list.is_empty() {
            for (i, c) in list.iter().enumerate() {
                match parse_cidr(c) {
                    Ok(n) => pod_cidrs.push(n.trunc()),
                    Err(e) => err(format!("spec.podCIDRs[{i}]"), format!("{e}; skipped")),
                }
            }
        } else if let Some(c) = spec
            .and_then(|s| s.pod_cidr.as_deref())
            .filter(|c| !c.is_empty())
        {
            match parse_cidr(c) {
                Ok(n) => pod_cidrs.push(n.trunc()),
                Err(e) => err("spec.podCIDR".into(), format!("{e}; the node is not ready")),
            }
        }

        let wireguard_ip = get(annotations::WIREGUARD_IP).and_then(|v| {
            parse_cidr(v)
                .map_err(|e| err(a(annotations::WIREGUARD_IP), format!("{e}; ignored")))
                .ok()
        });

        let mut discovered_endpoints = BTreeMap::new();
        if let Some(v) = get(annotations::DISCOVERED_ENDPOINTS) {
            match parse_discovered(v) {
                Ok(m) => discovered_endpoints = m,
                Err(e) => err(
                    a(annotations::DISCOVERED_ENDPOINTS),
                    format!("{e} in {v:?}; ignored"),
                ),
            }
        }

        // Kilo splits on commas and keeps each item that is exactly a CIDR.
        let mut allowed_location_ips = Vec::new();
        for item in get(annotations::ALLOWED_LOCATION_IPS)
            .into_iter()
            .flat_map(|v| v.split(','))
        {
            match parse_cidr(item) {
                Ok(n) => allowed_location_ips.push(n),
                Err(_) => {
                    let why = match space(item) {
                        _ if item.is_empty() => "empty",
                        Some(why) => why,
                        None => "not a CIDR",
                    };
                    err(
                        a(annotations::ALLOWED_LOCATION_IPS),
                        format!("item {item:?}: {why}, Kilo ignores this item"),
                    )
                }
            }
        }

        let granularity = get(annotations::GRANULARITY).and_then(|v| {
            v.parse::<Granularity>()
                .map_err(|e| err(a(annotations::GRANULARITY), format!("{e}; ignored")))
                .ok()
        });

        let demoted_by = get(annotations::DEMOTED).map(str::to_string);

        let node = Node {
            name,
            endpoint,
            internal_ips,
            no_internal_ip,
            cni_compatibility_ip,
            key,
            last_seen,
            leader,
            location,
            persistent_keepalive,
            pod_cidrs,
            wireguard_ip,
            discovered_endpoints,
            allowed_location_ips,
            granularity,
            demoted_by,
        };
        (node, errs)
    }
}

#[cfg(test)]
mod tests;
