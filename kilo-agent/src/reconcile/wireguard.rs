//! The WireGuard device reconciler: observe the device, diff per peer, apply only the changed
//! peers (never `replace_peers`, which drops every session: Kilo's
//! <https://github.com/squat/kilo/issues/82> and <https://github.com/squat/kilo/issues/273>).
//!
//! The real implementation talks to a kernel device over generic netlink or to an existing
//! userspace device (wireguard-go) over its UAPI socket, through `wireguard-control`. It never
//! lets that library start `wireguard-go` itself (it would exec): a missing userspace socket is
//! an error. The metrics read the same device's per-peer statistics at scrape time through
//! [`PeerStatsSource`] (a read, never a write).
//!
//! The pure part (device state, [`desired`], [`diff`], [`count`]) is in `state.rs`, the real
//! device in `device.rs`, the in-memory one in `fake.rs`.
mod device;
#[cfg(any(test, feature = "testing"))]
mod fake;
mod state;

use std::{collections::BTreeMap, sync::Arc};

pub use device::{WgApi, WgControl, uapi_socket};
#[cfg(any(test, feature = "testing"))]
pub use fake::FakeWireGuard;
pub use state::{
    DeviceState, DnsLookup, PeerChange, PeerState, PeerStats, WgDiff, count, desired, diff,
    system_resolver,
};

use crate::{mesh::Key, writes::Writes};

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
    /// The device's name (wg-exporter's `interface` label).
    fn interface(&self) -> &str {
        ""
    }
}

#[cfg(test)]
mod tests;
