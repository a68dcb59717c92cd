//! The real WireGuard device, through `wireguard-control`: the kernel's over generic netlink or
//! wireguard-go's over its UAPI socket.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::Arc,
};

use ipnet::IpNet;
use wireguard_control as wgc;

use super::{
    DeviceState, PeerState, PeerStats, PeerStatsSource, WgDiff, WgError, WireGuard, count,
};
use crate::{mesh::Key, writes::Writes};

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
            let allowed_ips: Vec<IpNet> = p
                .config
                .allowed_ips
                .iter()
                .filter_map(|a| IpNet::new(a.address, a.cidr).ok())
                .map(|n| n.trunc())
                .collect();
            state.peers.insert(
                key,
                PeerState {
                    preshared_key: p.config.preshared_key.as_ref().and_then(nonzero),
                    endpoint: p.config.endpoint,
                    allowed_ips: allowed_ips.iter().copied().collect(),
                    keepalive: p.config.persistent_keepalive_interval.unwrap_or(0),
                },
            );
            state.stats.insert(
                key,
                PeerStats {
                    last_handshake: p.stats.last_handshake_time,
                    rx_bytes: p.stats.rx_bytes,
                    tx_bytes: p.stats.tx_bytes,
                    allowed_ips,
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

    fn interface(&self) -> &str {
        &self.name
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
