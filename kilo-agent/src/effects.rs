//! What the reconcilers share, below all of them (`reconcile`, `datapath` and `nft` import it, it
//! imports none of them): the write counts ([`Writes`]), the devices by name ([`Devices`]), the
//! datapath as the reconciler drives it ([`DatapathSync`], its stats for the metrics), and a
//! synchronous netlink socket ([`netlink_socket`]).
use std::{collections::BTreeMap, fmt, io, ops::AddAssign, sync::Arc};

use ipnet::IpNet;
use kilo_common::Counter;

use crate::plan::{DatapathPlan, Device, IpipPlan};

/// Passes between full reads of what the agent keeps in the kernel (the datapath's maps, its
/// nftables table, links, addresses, routes and rules), which in between trust their record of
/// what they wrote: every 10 minutes at the default 30 s resync. A read-back of the maps costs
/// about a microsecond of kernel time per entry, so at 10,000 entries this keeps an idle
/// resync's average under a millisecond.
pub const READ_BACK_EVERY: u32 = 20;

/// Writes made to the kernel (or a backend), counted by kind (`map_insert`, `route_add`, ...).
/// A reconcile with nothing to do returns an empty `Writes`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Writes(BTreeMap<&'static str, u64>);

impl Writes {
    pub fn add(&mut self, kind: &'static str, n: u64) {
        if n > 0 {
            *self.0.entry(kind).or_default() += n;
        }
    }

    pub fn get(&self, kind: &str) -> u64 {
        self.0.get(kind).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.0.iter().map(|(k, v)| (*k, *v))
    }
}

impl AddAssign for Writes {
    fn add_assign(&mut self, rhs: Self) {
        for (k, v) in rhs.0 {
            self.add(k, v);
        }
    }
}

impl fmt::Display for Writes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no writes");
        }
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&parts.join(" "))
    }
}

/// The names of the devices a plan refers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Devices {
    pub wireguard: String,
    pub private: Option<String>,
    /// The device of the routes through `Device::Tunnel`: the CNI's (`flannel.1`,
    /// `cilium_tunl`), or `None`: the datapath encapsulates at egress of the private interface,
    /// so those routes go out of it, with its MTU minus the 20 bytes of the outer header.
    pub tunnel: Option<String>,
}

impl Devices {
    pub fn name(&self, device: Device) -> Option<&str> {
        match device {
            Device::WireGuard => Some(&self.wireguard),
            Device::Private => self.private.as_deref(),
            Device::Tunnel => self.tunnel.as_deref(),
        }
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.wireguard.as_str())
            .chain(self.private.as_deref())
            .chain(self.tunnel.as_deref())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DatapathSyncError {
    #[error("datapath: {0}")]
    Failed(String),
    #[error(transparent)]
    Other(#[from] Box<dyn std::error::Error + Send + Sync>),
}

/// The eBPF datapath as the agent sees it; the datapath module provides the real one.
pub trait DatapathSync {
    /// Makes the maps (and the static NAT rule) match the plan; writes only the difference.
    /// `links`: every link's index by name, as just read from the kernel (a name not in it is
    /// not there); `None` to ask the kernel.
    fn sync(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
        links: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathSyncError>;
    /// Lines describing what `sync` would change (for `--dry-run`).
    fn describe(
        &mut self,
        _plan: &DatapathPlan,
        _ipip: &IpipPlan,
    ) -> Result<Vec<String>, DatapathSyncError> {
        Ok(Vec::new())
    }
    /// Removes map entries, programs, pins and the NAT rule.
    fn clean_up(&mut self) -> Result<Writes, DatapathSyncError>;
    /// Whether the kernel keeps the realm of the routes it encapsulates (so the encapsulation
    /// may skip packets routed otherwise); writes only a change.
    fn route_realm(&mut self, _hold: bool) -> Result<Writes, DatapathSyncError> {
        Ok(Writes::default())
    }
    /// A reader of the datapath's traffic counters and map occupancy, for the metrics (read at
    /// scrape time, never writing). `None` when there is nothing to read.
    fn stats_source(&self) -> Option<Arc<dyn DatapathStatsSource>> {
        None
    }
}

impl DatapathSync for Box<dyn DatapathSync> {
    fn sync(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
        links: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathSyncError> {
        (**self).sync(plan, ipip, links)
    }
    fn describe(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
    ) -> Result<Vec<String>, DatapathSyncError> {
        (**self).describe(plan, ipip)
    }
    fn clean_up(&mut self) -> Result<Writes, DatapathSyncError> {
        (**self).clean_up()
    }
    fn route_realm(&mut self, hold: bool) -> Result<Writes, DatapathSyncError> {
        (**self).route_realm(hold)
    }
    fn stats_source(&self) -> Option<Arc<dyn DatapathStatsSource>> {
        (**self).stats_source()
    }
}

/// A datapath that does nothing (no eBPF available, or tests of the other reconcilers).
#[derive(Debug, Default)]
pub struct NoDatapath;

impl DatapathSync for NoDatapath {
    fn sync(
        &mut self,
        _: &DatapathPlan,
        _: &IpipPlan,
        _: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathSyncError> {
        Ok(Writes::default())
    }
    fn clean_up(&mut self) -> Result<Writes, DatapathSyncError> {
        Ok(Writes::default())
    }
}

/// Reads [`DatapathStats`]; only reads, so any thread may call it at any time.
pub trait DatapathStatsSource: std::fmt::Debug + Send + Sync {
    fn read(&self) -> Result<DatapathStats, DatapathSyncError>;
}

/// Traffic counters and map occupancy, labelled for the metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DatapathStats {
    /// Per decision (`kilo_common::Decision::name`), every decision present.
    pub decisions: Vec<(&'static str, Counter)>,
    /// Per map entry.
    pub entries: Vec<EntryStats>,
    /// Entries and capacity per role (by `datapath::Role::label`; mesh and masquerade
    /// destinations share one trie and its capacity), and of the per-entry
    /// counter slots (`entry_counters`).
    pub maps: Vec<MapUsage>,
}

/// How full one map is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapUsage {
    pub map: &'static str,
    pub entries: u64,
    pub capacity: u64,
}

/// One map entry's traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryStats {
    /// `datapath::Role::label`.
    pub role: &'static str,
    pub cidr: IpNet,
    /// The plan's entry kind (`node`, `local_pods`, ...), `unknown` for a code the agent does
    /// not know.
    pub kind: &'static str,
    /// The node, segment, peer or flag the plan gives the entry ("" for an entry it does not
    /// know, e.g. left over from an adopted topology).
    pub owner: String,
    pub counter: Counter,
}

/// A netlink socket of `protocol`, bound, whose reads give up after 5 s (a reply never comes
/// only on a kernel bug; the agent must not hang on it).
pub fn netlink_socket(protocol: isize) -> io::Result<netlink_sys::Socket> {
    let mut sock = netlink_sys::Socket::new(protocol)?;
    sock.bind_auto()?;
    socket2::SockRef::from(&sock).set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    Ok(sock)
}
