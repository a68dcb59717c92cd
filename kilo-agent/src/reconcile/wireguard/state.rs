//! The WireGuard device's state as observed or desired, built from the plan, and the pure
//! per-peer diff between the two.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::SocketAddr,
    time::SystemTime,
};

use ipnet::IpNet;

use crate::{
    mesh::{Host, Key},
    plan::WireGuardPlan,
    writes::{Write, Writes},
};

/// One peer as configured on (or wanted for) the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerState {
    pub preshared_key: Option<Key>,
    pub endpoint: Option<SocketAddr>,
    pub allowed_ips: BTreeSet<IpNet>,
    /// Seconds, 0 = off.
    pub keepalive: u16,
}

/// Runtime statistics of a peer (only observed, never compared).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerStats {
    pub last_handshake: Option<SystemTime>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// The peer's allowed IPs as the device holds them (for wg-exporter's `allowed_ips` label).
    pub allowed_ips: Vec<IpNet>,
}

/// The device as observed or desired.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct DeviceState {
    pub private_key: Option<Key>,
    pub listen_port: u16,
    pub peers: BTreeMap<Key, PeerState>,
    pub stats: BTreeMap<Key, PeerStats>,
}

impl fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Key's Debug hides the bytes; list peers by their public key.
        f.debug_struct("DeviceState")
            .field("private_key", &self.private_key.map(|_| "(set)"))
            .field("listen_port", &self.listen_port)
            .field(
                "peers",
                &self
                    .peers
                    .iter()
                    .map(|(k, p)| (k.to_string(), p))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A change to one existing peer: only the fields that differ are set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerChange {
    /// `Some(None)` = unset the preshared key.
    pub preshared_key: Option<Option<Key>>,
    pub endpoint: Option<SocketAddr>,
    pub allowed_ips: Option<BTreeSet<IpNet>>,
    pub keepalive: Option<u16>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WgDiff {
    pub private_key: Option<Key>,
    pub listen_port: Option<u16>,
    pub add: Vec<(Key, PeerState)>,
    pub update: Vec<(Key, PeerChange)>,
    pub remove: Vec<Key>,
}

impl WgDiff {
    pub fn is_empty(&self) -> bool {
        self.private_key.is_none()
            && self.listen_port.is_none()
            && self.add.is_empty()
            && self.update.is_empty()
            && self.remove.is_empty()
    }
}

impl fmt::Display for WgDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.private_key.is_some() {
            writeln!(f, "~ wireguard private key (not shown)")?;
        }
        if let Some(p) = self.listen_port {
            writeln!(f, "~ wireguard listen port {p}")?;
        }
        for k in &self.remove {
            writeln!(f, "- wireguard peer {k}")?;
        }
        for (k, p) in &self.add {
            let ips: Vec<String> = p.allowed_ips.iter().map(|n| n.to_string()).collect();
            write!(f, "+ wireguard peer {k} allowed-ips {}", ips.join(","))?;
            if let Some(e) = p.endpoint {
                write!(f, " endpoint {e}")?;
            }
            if p.keepalive > 0 {
                write!(f, " keepalive {}", p.keepalive)?;
            }
            writeln!(f)?;
        }
        for (k, c) in &self.update {
            write!(f, "~ wireguard peer {k}")?;
            if let Some(ips) = &c.allowed_ips {
                let ips: Vec<String> = ips.iter().map(|n| n.to_string()).collect();
                write!(f, " allowed-ips {}", ips.join(","))?;
            }
            if let Some(e) = c.endpoint {
                write!(f, " endpoint {e}")?;
            }
            if let Some(k) = c.keepalive {
                write!(f, " keepalive {k}")?;
            }
            if c.preshared_key.is_some() {
                f.write_str(" preshared-key")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// Resolves DNS endpoints; returns every address the name has (empty when it does not resolve).
pub type DnsLookup = dyn Fn(&str, u16) -> Vec<SocketAddr> + Send + Sync;

/// The system resolver (getaddrinfo; no process).
pub fn system_resolver(name: &str, port: u16) -> Vec<SocketAddr> {
    use std::net::ToSocketAddrs;
    (name, port)
        .to_socket_addrs()
        .map(|it| it.collect())
        .unwrap_or_default()
}

/// Builds the desired device state. A DNS endpoint keeps the observed address when that is one of
/// the name's current addresses (no churn with round-robin DNS); one that does not resolve is
/// reported and the peer is configured without an endpoint change.
pub fn desired(
    plan: &WireGuardPlan,
    private_key: Key,
    observed: Option<&DeviceState>,
    resolve: &DnsLookup,
    problems: &mut Vec<String>,
) -> DeviceState {
    let mut peers = BTreeMap::new();
    for p in &plan.peers {
        let current = observed.and_then(|o| o.peers.get(&p.public_key));
        let endpoint = match &p.endpoint {
            None => None,
            Some(e) => match &e.host {
                Host::Ip(ip) => Some(SocketAddr::new(*ip, e.port)),
                Host::Dns(name) => {
                    let addrs = resolve(name, e.port);
                    match current.and_then(|c| c.endpoint) {
                        Some(cur) if addrs.contains(&cur) => Some(cur),
                        _ => {
                            if addrs.is_empty() {
                                problems.push(format!(
                                    "wireguard peer {}: endpoint {e} does not resolve",
                                    p.public_key
                                ));
                            }
                            addrs.first().copied()
                        }
                    }
                }
            },
        };
        if peers.contains_key(&p.public_key) {
            problems.push(format!(
                "wireguard peer {}: listed twice in the plan, first one kept",
                p.public_key
            ));
            continue;
        }
        peers.insert(
            p.public_key,
            PeerState {
                preshared_key: p.preshared_key,
                endpoint,
                allowed_ips: p.allowed_ips.iter().map(|n| n.trunc()).collect(),
                keepalive: p.persistent_keepalive,
            },
        );
    }
    DeviceState {
        private_key: Some(private_key),
        listen_port: plan.listen_port,
        peers,
        stats: BTreeMap::new(),
    }
}

/// Per-peer diff. An endpoint the plan leaves unset is left as the device has it
/// (WireGuard learns it from the peer's packets).
pub fn diff(desired: &DeviceState, observed: &DeviceState) -> WgDiff {
    let mut d = WgDiff::default();
    if desired.private_key.is_some() && desired.private_key != observed.private_key {
        d.private_key = desired.private_key;
    }
    if desired.listen_port != observed.listen_port {
        d.listen_port = Some(desired.listen_port);
    }
    for (k, want) in &desired.peers {
        match observed.peers.get(k) {
            None => d.add.push((*k, want.clone())),
            Some(have) => {
                let mut c = PeerChange::default();
                if want.preshared_key != have.preshared_key {
                    c.preshared_key = Some(want.preshared_key);
                }
                if want.endpoint.is_some() && want.endpoint != have.endpoint {
                    c.endpoint = want.endpoint;
                }
                if want.allowed_ips != have.allowed_ips {
                    c.allowed_ips = Some(want.allowed_ips.clone());
                }
                if want.keepalive != have.keepalive {
                    c.keepalive = Some(want.keepalive);
                }
                if c != PeerChange::default() {
                    d.update.push((*k, c));
                }
            }
        }
    }
    d.remove = observed
        .peers
        .keys()
        .filter(|k| !desired.peers.contains_key(k))
        .copied()
        .collect();
    d
}

/// Counts the writes a diff makes, by kind.
pub fn count(diff: &WgDiff) -> Writes {
    let mut w = Writes::default();
    w.add(
        Write::WireguardDeviceSet,
        u64::from(diff.private_key.is_some() || diff.listen_port.is_some()),
    );
    w.add(Write::WireguardPeerAdd, diff.add.len() as u64);
    w.add(Write::WireguardPeerUpdate, diff.update.len() as u64);
    w.add(Write::WireguardPeerRemove, diff.remove.len() as u64);
    w
}
