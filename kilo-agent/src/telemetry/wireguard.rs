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
        let ours = |k: &Key, _: &PeerStats| PeerLabels {
            public_key: k.to_string(),
            name: names.get(k).cloned().unwrap_or_default(),
        };
        encode_peers(&mut encoder, &OURS, &stats, ours)?;
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
        encode_peers(&mut encoder, &WG_EXPORTER, &stats, exporter)?;
        Ok(())
    }
}

/// One naming of the per-peer series, each a name and its help: bytes received and sent
/// (counters), and the unix time of the latest handshake (a gauge, 0 before the first).
struct SeriesNames {
    received: (&'static str, &'static str),
    sent: (&'static str, &'static str),
    handshake: (&'static str, &'static str),
}

const OURS: SeriesNames = SeriesNames {
    received: (
        "kilo_wireguard_peer_receive_bytes",
        "Bytes received from each WireGuard peer",
    ),
    sent: (
        "kilo_wireguard_peer_transmit_bytes",
        "Bytes sent to each WireGuard peer",
    ),
    handshake: (
        "kilo_wireguard_peer_last_handshake_timestamp_seconds",
        "Unix time of the latest handshake with each WireGuard peer (0: none yet)",
    ),
};

/// wg-exporter's names, which Kilo's Grafana dashboard reads.
const WG_EXPORTER: SeriesNames = SeriesNames {
    received: ("wireguard_received_bytes", "Bytes received from the peer"),
    sent: ("wireguard_sent_bytes", "Bytes sent to the peer"),
    handshake: (
        "wireguard_latest_handshake_seconds",
        "Unix time of the latest handshake with the peer (0: none yet)",
    ),
};

/// The per-peer series under `names`, each peer labelled by `labels`.
fn encode_peers<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    names: &SeriesNames,
    stats: &BTreeMap<Key, PeerStats>,
    labels: impl Fn(&Key, &PeerStats) -> L,
) -> Result<(), std::fmt::Error> {
    type Bytes = fn(&PeerStats) -> u64;
    let counters: [((&str, &str), Bytes); 2] = [
        (names.received, |s| s.rx_bytes),
        (names.sent, |s| s.tx_bytes),
    ];
    for ((name, help), value) in counters {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (k, s) in stats {
            ConstCounter::new(value(s)).encode(family.encode_family(&labels(k, s))?)?;
        }
    }
    let (name, help) = names.handshake;
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (k, s) in stats {
        let at = s
            .last_handshake
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        ConstGauge::new(at).encode(family.encode_family(&labels(k, s))?)?;
    }
    Ok(())
}
