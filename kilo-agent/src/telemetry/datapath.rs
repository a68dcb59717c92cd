//! The datapath metrics, read at each scrape from a [`DatapathStatsSource`] (the agent's record
//! of the map entries plus one pass over the mapped counters).
use std::sync::{Arc, Mutex};

use prometheus_client::{
    collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

use crate::datapath::{DatapathStats, DatapathStatsSource};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabel {
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabel {
    map: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EntryLabels {
    role: &'static str,
    cidr: String,
    kind: &'static str,
    owner: String,
}

/// What the agent sets and the collector reads.
pub(super) type Slot = Arc<Mutex<Option<Arc<dyn DatapathStatsSource>>>>;

/// Encodes the datapath metrics from a [`DatapathStatsSource`] read at each scrape; nothing
/// when there is no source or it cannot be read (logged).
#[derive(Debug)]
pub(super) struct Collector(pub Slot);

impl Collector {
    fn read(&self) -> Option<DatapathStats> {
        let source = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
        source
            .read()
            .map_err(|e| tracing::debug!("reading datapath counters: {e}"))
            .ok()
    }
}

fn encode_counters<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl Iterator<Item = (L, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in series {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stats) = self.read() else {
            return Ok(());
        };
        type Field = fn(&crate::datapath::Counter) -> u64;
        let fields: [(&str, &str, Field); 2] = [
            ("packets", "Packets", |c| c.packets),
            ("bytes", "Bytes", |c| c.bytes),
        ];
        for (unit, what, value) in fields {
            encode_counters(
                &mut encoder,
                &format!("kilo_datapath_{unit}"),
                &format!("{what} the eBPF program saw, by decision"),
                stats
                    .decisions
                    .iter()
                    .map(|(d, c)| (DecisionLabel { decision: d }, value(c))),
            )?;
        }
        for (unit, what, value) in fields {
            encode_counters(
                &mut encoder,
                &format!("kilo_datapath_entry_{unit}"),
                &format!("{what} that matched a datapath map entry"),
                stats.entries.iter().map(|e| {
                    let labels = EntryLabels {
                        role: e.role,
                        cidr: e.cidr.to_string(),
                        kind: e.kind,
                        owner: e.owner.clone(),
                    };
                    (labels, value(&e.counter))
                }),
            )?;
        }
        type Usage = fn(&crate::datapath::MapUsage) -> u64;
        let gauges: [(&str, &str, Usage); 2] = [
            (
                "kilo_datapath_map_entries",
                "Entries in each datapath map",
                |m| m.entries,
            ),
            (
                "kilo_datapath_map_capacity",
                "Entries each datapath map can hold",
                |m| m.capacity,
            ),
        ];
        for (name, help, value) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for m in &stats.maps {
                ConstGauge::new(value(m) as i64)
                    .encode(family.encode_family(&MapLabel { map: m.map })?)?;
            }
        }
        Ok(())
    }
}
