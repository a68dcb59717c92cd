//! The WireGuard device reconciler: observe the device, diff per peer, apply only the changed
//! peers (never `replace_peers`, which drops every session: Kilo issues #82 and #273).
//!
//! The real implementation talks to a kernel device over generic netlink or to an existing
//! userspace device (wireguard-go) over its UAPI socket, through `wireguard-control`. It never
//! lets that library start `wireguard-go` itself (it would exec): a missing userspace socket is
//! an error. The metrics read the same device's per-peer statistics at scrape time through
//! [`PeerStatsSource`] (a read, never a write).
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use ipnet::IpNet;
use wireguard_control as wgc;

use crate::writes::Writes;
use crate::{
    mesh::{Host, Key},
    plan::WireGuardPlan,
};

#[derive(Debug, thiserror::Error)]
pub enum WgError {
    #[error("WireGuard interface {0:?}: invalid name")]
    Name(String),
    #[error(
        "WireGuard interface {interface}: no userspace UAPI socket at {path} (start wireguard-go first)"
    )]
    NoSocket { interface: String, path: String },
    #[error("WireGuard interface {interface}: {op}: {source}")]
    Io {
        interface: String,
        op: &'static str,
        source: std::io::Error,
    },
}

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
pub type Resolver = dyn Fn(&str, u16) -> Vec<SocketAddr> + Send + Sync;

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
    resolve: &Resolver,
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
        "wireguard_device_set",
        u64::from(diff.private_key.is_some() || diff.listen_port.is_some()),
    );
    w.add("wireguard_peer_add", diff.add.len() as u64);
    w.add("wireguard_peer_update", diff.update.len() as u64);
    w.add("wireguard_peer_remove", diff.remove.len() as u64);
    w
}

/// A WireGuard device the agent configures.
pub trait WireGuard {
    /// The device's configuration, or `None` when it does not exist.
    fn observe(&mut self) -> Result<Option<DeviceState>, WgError>;
    /// Applies the diff in one transaction; returns the writes made.
    fn apply(&mut self, diff: &WgDiff) -> Result<Writes, WgError>;
    /// A reader of the device's per-peer statistics for the metrics; `None`: no such metrics.
    fn stats_source(&self) -> Option<Arc<dyn PeerStatsSource>> {
        None
    }
}

/// Reads the per-peer statistics of a device (empty when it does not exist); only reads, so
/// any thread may call it at any time.
pub trait PeerStatsSource: Send + Sync {
    fn peer_stats(&self) -> Result<BTreeMap<Key, PeerStats>, WgError>;
}

/// Which API the device is driven through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgApi {
    /// The kernel module, over generic netlink.
    Kernel,
    /// An existing userspace device (wireguard-go) over its UAPI socket.
    Userspace,
}

/// The real device, through `wireguard-control`.
#[derive(Clone)]
pub struct WgControl {
    name: String,
    iface: wgc::InterfaceName,
    /// `None`: chosen at each operation, so a wireguard-go started after kg is used.
    api: Option<WgApi>,
}

/// Where wireguard-go puts its UAPI sockets (the first directory that exists).
pub fn uapi_socket(name: &str) -> PathBuf {
    for dir in ["/var/run/wireguard", "/run/wireguard"] {
        if Path::new(dir).exists() {
            return Path::new(dir).join(format!("{name}.sock"));
        }
    }
    Path::new("/var/run/wireguard").join(format!("{name}.sock"))
}

impl WgControl {
    pub fn new(name: &str, api: WgApi) -> Result<Self, WgError> {
        Self::with(name, Some(api))
    }

    /// Userspace whenever a UAPI socket exists for the name, else the kernel; checked at every
    /// operation, since a userspace device (a sidecar) may start after kg or be replaced.
    pub fn detect(name: &str) -> Result<Self, WgError> {
        Self::with(name, None)
    }

    fn with(name: &str, api: Option<WgApi>) -> Result<Self, WgError> {
        let iface = name.parse().map_err(|_| WgError::Name(name.into()))?;
        Ok(WgControl {
            name: name.into(),
            iface,
            api,
        })
    }

    /// The API the next operation goes through.
    pub fn api(&self) -> WgApi {
        self.api.unwrap_or_else(|| {
            if uapi_socket(&self.name).exists() {
                WgApi::Userspace
            } else {
                WgApi::Kernel
            }
        })
    }

    fn backend(api: WgApi) -> wgc::Backend {
        match api {
            WgApi::Kernel => wgc::Backend::Kernel,
            WgApi::Userspace => wgc::Backend::Userspace,
        }
    }

    fn socket_live(&self) -> bool {
        std::os::unix::net::UnixStream::connect(uapi_socket(&self.name)).is_ok()
    }

    fn io(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> WgError + '_ {
        move |source| WgError::Io {
            interface: self.name.clone(),
            op,
            source,
        }
    }
}

fn to_wgc(k: &Key) -> wgc::Key {
    wgc::Key(k.0)
}

fn nonzero(k: &wgc::Key) -> Option<Key> {
    (k.0 != [0; 32]).then_some(Key(k.0))
}

fn allowed(ips: &BTreeSet<IpNet>) -> Vec<wgc::AllowedIp> {
    ips.iter()
        .map(|n| wgc::AllowedIp {
            address: n.addr(),
            cidr: n.prefix_len(),
        })
        .collect()
}

impl WgControl {
    fn read(&self) -> Result<Option<DeviceState>, WgError> {
        let api = self.api();
        let dev = match wgc::Device::get(&self.iface, Self::backend(api)) {
            Ok(d) => d,
            // No device: no module or link (kernel), no socket or nobody behind it (userspace).
            Err(e)
                if matches!(
                    (api, e.raw_os_error()),
                    (WgApi::Kernel, Some(libc::ENODEV | libc::ENOENT))
                        | (WgApi::Userspace, Some(libc::ENOENT | libc::ECONNREFUSED))
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(self.io("read device")(e)),
        };
        let mut state = DeviceState {
            private_key: dev.private_key.as_ref().and_then(nonzero),
            listen_port: dev.listen_port.unwrap_or(0),
            ..DeviceState::default()
        };
        for p in dev.peers {
            let key = Key(p.config.public_key.0);
            state.peers.insert(
                key,
                PeerState {
                    preshared_key: p.config.preshared_key.as_ref().and_then(nonzero),
                    endpoint: p.config.endpoint,
                    allowed_ips: p
                        .config
                        .allowed_ips
                        .iter()
                        .filter_map(|a| IpNet::new(a.address, a.cidr).ok())
                        .map(|n| n.trunc())
                        .collect(),
                    keepalive: p.config.persistent_keepalive_interval.unwrap_or(0),
                },
            );
            state.stats.insert(
                key,
                PeerStats {
                    last_handshake: p.stats.last_handshake_time,
                    rx_bytes: p.stats.rx_bytes,
                    tx_bytes: p.stats.tx_bytes,
                },
            );
        }
        Ok(Some(state))
    }
}

impl PeerStatsSource for WgControl {
    fn peer_stats(&self) -> Result<BTreeMap<Key, PeerStats>, WgError> {
        Ok(self.read()?.map(|d| d.stats).unwrap_or_default())
    }
}

impl WireGuard for WgControl {
    fn observe(&mut self) -> Result<Option<DeviceState>, WgError> {
        self.read()
    }

    fn stats_source(&self) -> Option<Arc<dyn PeerStatsSource>> {
        Some(Arc::new(self.clone()))
    }

    fn apply(&mut self, diff: &WgDiff) -> Result<Writes, WgError> {
        if diff.is_empty() {
            return Ok(Writes::default());
        }
        // wireguard-control would exec wireguard-go when the socket is missing: refuse instead.
        let api = self.api();
        if api == WgApi::Userspace && !self.socket_live() {
            return Err(WgError::NoSocket {
                interface: self.name.clone(),
                path: uapi_socket(&self.name).display().to_string(),
            });
        }
        let mut update = wgc::DeviceUpdate::new();
        if let Some(k) = &diff.private_key {
            update = update.set_private_key(to_wgc(k));
        }
        if let Some(p) = diff.listen_port {
            update = update.set_listen_port(p);
        }
        for k in &diff.remove {
            update = update.remove_peer_by_key(&to_wgc(k));
        }
        for (k, p) in &diff.add {
            let mut b = wgc::PeerConfigBuilder::new(&to_wgc(k))
                .replace_allowed_ips()
                .add_allowed_ips(&allowed(&p.allowed_ips));
            if let Some(psk) = &p.preshared_key {
                b = b.set_preshared_key(to_wgc(psk));
            }
            if let Some(e) = p.endpoint {
                b = b.set_endpoint(e);
            }
            if p.keepalive > 0 {
                b = b.set_persistent_keepalive_interval(p.keepalive);
            }
            update = update.add_peer(b);
        }
        for (k, c) in &diff.update {
            let mut b = wgc::PeerConfigBuilder::new(&to_wgc(k));
            if let Some(ips) = &c.allowed_ips {
                b = b.replace_allowed_ips().add_allowed_ips(&allowed(ips));
            }
            match &c.preshared_key {
                Some(Some(psk)) => b = b.set_preshared_key(to_wgc(psk)),
                Some(None) => b = b.unset_preshared_key(),
                None => {}
            }
            if let Some(e) = c.endpoint {
                b = b.set_endpoint(e);
            }
            if let Some(ka) = c.keepalive {
                b = b.set_persistent_keepalive_interval(ka);
            }
            update = update.add_peer(b);
        }
        update
            .apply(&self.iface, Self::backend(api))
            .map_err(self.io("configure device"))?;
        Ok(count(diff))
    }
}

/// An in-memory device for fast tests: applies diffs to its state and counts writes.
#[derive(Debug, Default)]
pub struct FakeWireGuard {
    pub device: Option<DeviceState>,
    pub writes: Writes,
}

impl WireGuard for FakeWireGuard {
    fn observe(&mut self) -> Result<Option<DeviceState>, WgError> {
        Ok(self.device.clone())
    }

    fn apply(&mut self, diff: &WgDiff) -> Result<Writes, WgError> {
        let dev = self.device.get_or_insert_with(DeviceState::default);
        if let Some(k) = diff.private_key {
            dev.private_key = Some(k);
        }
        if let Some(p) = diff.listen_port {
            dev.listen_port = p;
        }
        for k in &diff.remove {
            dev.peers.remove(k);
        }
        for (k, p) in &diff.add {
            dev.peers.insert(*k, p.clone());
        }
        for (k, c) in &diff.update {
            let p = dev.peers.get_mut(k).expect("update of a known peer");
            if let Some(psk) = c.preshared_key {
                p.preshared_key = psk;
            }
            if let Some(e) = c.endpoint {
                p.endpoint = Some(e);
            }
            if let Some(ips) = &c.allowed_ips {
                p.allowed_ips = ips.clone();
            }
            if let Some(ka) = c.keepalive {
                p.keepalive = ka;
            }
        }
        let w = count(diff);
        self.writes += w.clone();
        Ok(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{mesh::Endpoint, plan::WireGuardPeer};

    fn peer(n: u8, ip: &str, endpoint: Option<&str>) -> WireGuardPeer {
        WireGuardPeer {
            public_key: Key([n; 32]),
            preshared_key: None,
            endpoint: endpoint.map(|e| e.parse::<Endpoint>().unwrap()),
            allowed_ips: vec![ip.parse().unwrap()],
            persistent_keepalive: 0,
        }
    }

    fn no_dns(_: &str, _: u16) -> Vec<SocketAddr> {
        vec![]
    }

    #[test]
    fn second_pass_is_empty_and_one_change_touches_one_peer() {
        let mut plan = WireGuardPlan {
            listen_port: 51820,
            peers: vec![
                peer(1, "10.2.1.0/24", Some("192.0.2.1:51820")),
                peer(2, "10.2.2.0/24", Some("192.0.2.2:51820")),
            ],
        };
        let mut fake = FakeWireGuard::default();
        let mut problems = vec![];
        let want = desired(&plan, Key([9; 32]), None, &no_dns, &mut problems);
        let d = diff(&want, &fake.observe().unwrap().unwrap_or_default());
        let w = fake.apply(&d).unwrap();
        assert_eq!(w.get("wireguard_peer_add"), 2);
        let observed = fake.observe().unwrap().unwrap();
        assert!(diff(&want, &observed).is_empty());

        plan.peers[1]
            .allowed_ips
            .push("10.2.3.0/24".parse().unwrap());
        plan.peers.push(peer(3, "10.2.4.0/24", None));
        let want = desired(&plan, Key([9; 32]), Some(&observed), &no_dns, &mut problems);
        let d = diff(&want, &observed);
        assert_eq!(d.add.len(), 1);
        assert_eq!(d.update.len(), 1);
        assert_eq!(d.update[0].0, Key([2; 32]));
        assert!(d.update[0].1.endpoint.is_none() && d.update[0].1.keepalive.is_none());
        assert!(d.remove.is_empty() && d.private_key.is_none() && d.listen_port.is_none());
        assert!(problems.is_empty());
    }

    #[test]
    fn dns_endpoint_keeps_current_address_and_reports_failures() {
        let plan = WireGuardPlan {
            listen_port: 1,
            peers: vec![peer(1, "10.0.0.0/8", Some("node-a.example:51820"))],
        };
        let rr = |_: &str, port: u16| -> Vec<SocketAddr> {
            vec![
                SocketAddr::new("192.0.2.1".parse().unwrap(), port),
                SocketAddr::new("192.0.2.2".parse().unwrap(), port),
            ]
        };
        let mut observed = DeviceState::default();
        observed.peers.insert(
            Key([1; 32]),
            PeerState {
                preshared_key: None,
                endpoint: Some("192.0.2.2:51820".parse().unwrap()),
                allowed_ips: ["10.0.0.0/8".parse().unwrap()].into(),
                keepalive: 0,
            },
        );
        let mut problems = vec![];
        let want = desired(&plan, Key([9; 32]), Some(&observed), &rr, &mut problems);
        assert_eq!(
            want.peers[&Key([1; 32])].endpoint,
            Some("192.0.2.2:51820".parse().unwrap())
        );
        desired(&plan, Key([9; 32]), Some(&observed), &no_dns, &mut problems);
        assert_eq!(problems.len(), 1, "{problems:?}");
    }

    #[test]
    fn display_never_prints_the_private_key() {
        let d = WgDiff {
            private_key: Some(Key([7; 32])),
            ..WgDiff::default()
        };
        assert!(!d.to_string().contains(&Key([7; 32]).to_string()));
        let s = DeviceState {
            private_key: Some(Key([7; 32])),
            ..DeviceState::default()
        };
        assert!(!format!("{s:?}").contains(&Key([7; 32]).to_string()));
    }
}
