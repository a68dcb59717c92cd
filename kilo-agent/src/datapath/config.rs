//! What the datapath is loaded with ([`DatapathConfig`]) and the program's config map value it
//! gives ([`DatapathConfig::map_config`]).
use std::path::PathBuf;

use kilo_common::{
    CONFIG_FAST_PATH, CONFIG_ROUTE_REALM, CONFIG_SYNCED, Config, DEFAULT_COUNTER_SLOTS,
    DEFAULT_MARK, DEFAULT_MARK_MASK, DEFAULT_MAX_ENTRIES, LAYOUT, counter_stride,
};

use super::{AttachMode, DatapathError, nft::MasqueradeRule};

#[derive(Debug, Clone)]
pub struct DatapathConfig {
    /// Where maps and links are pinned (e.g. `/sys/fs/bpf/kilo`); `None` pins nothing.
    pub pin_dir: Option<PathBuf>,
    pub attach: AttachMode,
    /// Mark bits set on packets to masquerade, under `mask`.
    pub mark: u32,
    pub mask: u32,
    /// Redirect mesh traffic straight to its egress (bypasses netfilter's FORWARD chain).
    pub fast_path: bool,
    /// The kernel keeps the realm of our `tunl0` routes ([`CONFIG_ROUTE_REALM`]): the
    /// encapsulation looks up only packets routed by them. Set by the agent once it has seen it;
    /// kept from adopted maps that have it until then.
    pub route_realm: bool,
    /// Capacity of each table.
    pub max_entries: u32,
    /// Per-entry counter slots (entries without one are not counted).
    pub counter_slots: u32,
    /// The private nftables table (family inet) holding the masquerade rule.
    pub nft_table: String,
    /// The program's log level (0 off, 1 error ... 5 trace; see [`super::logs`]).
    pub log_level: u32,
}

impl Default for DatapathConfig {
    fn default() -> Self {
        DatapathConfig {
            pin_dir: Some(PathBuf::from("/sys/fs/bpf/kilo")),
            attach: AttachMode::Auto,
            mark: DEFAULT_MARK,
            mask: DEFAULT_MARK_MASK,
            fast_path: false,
            route_realm: false,
            max_entries: DEFAULT_MAX_ENTRIES,
            counter_slots: DEFAULT_COUNTER_SLOTS,
            nft_table: "kilo".into(),
            log_level: 0,
        }
    }
}

impl DatapathConfig {
    pub(super) fn masquerade_rule(&self) -> MasqueradeRule {
        MasqueradeRule {
            table: self.nft_table.clone(),
            mark: self.mark,
            mask: self.mask,
        }
    }

    pub(super) fn validate(&self) -> Result<(), DatapathError> {
        if self.mark == 0 || self.mark & !self.mask != 0 {
            return Err(DatapathError::Config(format!(
                "mark {:#x} must be non-zero and inside mask {:#x}",
                self.mark, self.mask
            )));
        }
        if self.max_entries == 0 || self.counter_slots == 0 {
            return Err(DatapathError::Config(
                "max_entries and counter_slots must be non-zero".into(),
            ));
        }
        Ok(())
    }

    /// Counters in the counters array: a region for each possible CPU.
    pub(super) fn counters_len(&self) -> Result<u32, DatapathError> {
        let cpus = aya::util::nr_cpus()
            .map_err(|(path, source)| DatapathError::Io {
                path: path.into(),
                source,
            })?
            .get() as u32;
        counter_stride(self.counter_slots)
            .checked_mul(cpus)
            .ok_or_else(|| {
                DatapathError::Config(format!(
                    "{} counter slots on {cpus} CPUs do not fit one array",
                    self.counter_slots
                ))
            })
    }

    /// The value of the program's config map (`synced`: see [`CONFIG_SYNCED`]).
    pub fn map_config(&self, synced: bool) -> Config {
        let flag = |on: bool, bit: u32| if on { bit } else { 0 };
        Config {
            layout: LAYOUT,
            flags: flag(self.fast_path, CONFIG_FAST_PATH)
                | flag(synced, CONFIG_SYNCED)
                | flag(self.route_realm, CONFIG_ROUTE_REALM),
            log_level: self.log_level,
            mark: self.mark,
            mask: self.mask,
            counter_stride: counter_stride(self.counter_slots),
        }
    }
}
