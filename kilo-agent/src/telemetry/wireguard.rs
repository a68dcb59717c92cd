//! The per-peer WireGuard metrics, read from the device at each scrape (a read, never a write):
//! ours, labelled with the peer's public key and the name the latest plan gives it, and
//! wg-exporter's (`wireguard_sent_bytes_total`, `wireguard_received_bytes_total`,
//! `wireguard_latest_handshake_seconds`, labelled `interface`, `public_key`, `allowed_ips`), which
//! Kilo's Grafana dashboard reads.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, MutexGuard},
    time::UNIX_EPOCH,
};

use prometheus_client::{
    collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

use crate::{
    mesh::Key,
    reconcile::wireguard::{PeerStats, PeerStatsSource},
};

#[derive(Default)]
pub(super) struct State {
    pub source: Option<Arc<dyn PeerStatsSource>>,
    pub names: BTreeMap<Key, String>,
}

/// What the agent sets and the collector reads.
#[derive(Clone, Default)]
pub(super) struct Slot(Arc<Mutex<State>>);

impl Slot {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    public_key: String,
    name: String,
}

/// wg-exporter's labels (its default: no friendly name, no remote address).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExporterLabels {
    interface: String,
    public_key: String,
    /// Comma-separated, as `wg show DEVICE dump` prints them.
    allowed_ips: String,
}

/// Encodes the per-peer series; nothing without a source or when the device cannot be read
/// (logged).
pub(super) struct Collector(pub Slot);

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WireGuard collector")
    }
}

impl collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (source, names) = {
            let state = self.0.lock();
            (state.source.clone(), state.names.clone())
        };
        let Some((interface, stats)) = source.and_then(|s| {
            s.peer_stats()
                .map_err(|e| tracing::debug!("reading WireGuard peers: {e}"))
                .ok()
                .map(|stats| (s.interface().to_string(), stats))
        }) else {
            return Ok(());
        };
        let labels = |k: &Key| PeerLabels {
            public_key: k.to_string(),
            name: names.get(k).cloned().unwrap_or_default(),
        };
        type Bytes = fn(&PeerStats) -> u64;
        let counters: [(&str, &str, Bytes); 2] = [
            (
                "kilo_wireguard_peer_receive_bytes",
                "Bytes received from each WireGuard peer",
                |s| s.rx_bytes,
            ),
            (
                "kilo_wireguard_peer_transmit_bytes",
                "Bytes sent to each WireGuard peer",
                |s| s.tx_bytes,
            ),
        ];
        for (name, help, value) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (k, s) in &stats {
                ConstCounter::new(value(s)).encode(family.encode_family(&labels(k))?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "kilo_wireguard_peer_last_handshake_timestamp_seconds",
            "Unix time of the latest handshake with each WireGuard peer (0: none yet)",
            None,
            MetricType::Gauge,
        )?;
        let handshake = |s: &PeerStats| {
            s.last_handshake
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0.0, |d| d.as_secs_f64())
        };
        for (k, s) in &stats {
            ConstGauge::new(handshake(s)).encode(family.encode_family(&labels(k))?)?;
        }
        // wg-exporter's series, for Kilo's dashboard.
        let exporter = |k: &Key, s: &PeerStats| ExporterLabels {
            interface: interface.clone(),
            public_key: k.to_string(),
            allowed_ips: s
                .allowed_ips
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
        };
        let counters: [(&str, &str, Bytes); 2] = [
            ("wireguard_sent_bytes", "Bytes sent to the peer", |s| {
                s.tx_bytes
            }),
            (
                "wireguard_received_bytes",
                "Bytes received from the peer",
                |s| s.rx_bytes,
            ),
        ];
        for (name, help, value) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (k, s) in &stats {
                ConstCounter::new(value(s)).encode(family.encode_family(&exporter(k, s))?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "wireguard_latest_handshake_seconds",
            "Unix time of the latest handshake with the peer (0: none yet)",
            None,
            MetricType::Gauge,
        )?;
        for (k, s) in &stats {
            ConstGauge::new(handshake(s)).encode(family.encode_family(&exporter(k, s))?)?;
        }
        Ok(())
    }
}
