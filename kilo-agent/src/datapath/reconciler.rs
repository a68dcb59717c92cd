//! The datapath as one of the agent's reconcilers: the [`DatapathOps`] trait the reconciler
//! drives, the stats the metrics read ([`DatapathStatsSource`]), and [`DatapathReconciler`], the
//! real one over a loaded [`Datapath`]: keeps the static masquerade rule and the fast-path flag,
//! syncs the maps with the plan, attaches the NAT program to the WireGuard and pod-facing
//! interfaces as they appear (only to maps that have held a whole plan once), and the IPIP
//! programs to the private interface while the plan has a location neighbour. Each step writes
//! only when the kernel differs. [`NoDatapath`] does nothing; `fake.rs` has one in memory.
//!
//! The stats source reads the counters at scrape time from the same maps (under a mutex an apply
//! holds while it writes), labelled with the owners of the last plan applied, the entries taken
//! from the apply's record (no system call per entry).
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex, MutexGuard},
};

use ipnet::IpNet;
use kilo_common::Counter;

use super::{
    Datapath, DatapathError, Hook, Role, Trie, ifindex, maps::DatapathMaps as _, plans::Plans,
    tries::Counters,
};
use crate::{
    plan::{DatapathPlan, Device, Devices, IpipPlan},
    writes::Writes,
};

#[derive(Debug, thiserror::Error)]
pub enum DatapathOpsError {
    #[error("datapath: {0}")]
    Failed(String),
    #[error(transparent)]
    Other(#[from] Box<dyn std::error::Error + Send + Sync>),
}

/// The eBPF datapath as the agent sees it; the datapath module provides the real one.
pub trait DatapathOps {
    /// Makes the maps (and the static NAT rule) match the plan; writes only the difference.
    /// `links`: every link's index by name, as just read from the kernel (a name not in it is
    /// not there); `None` to ask the kernel.
    fn apply(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
        links: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathOpsError>;
    /// Lines describing what `apply` would change (for `--dry-run`).
    fn describe(
        &mut self,
        _plan: &DatapathPlan,
        _ipip: &IpipPlan,
    ) -> Result<Vec<String>, DatapathOpsError> {
        Ok(Vec::new())
    }
    /// Removes map entries, programs, pins and the NAT rule.
    fn clean_up(&mut self) -> Result<Writes, DatapathOpsError>;
    /// Whether the kernel keeps the realm of the routes it encapsulates (so the encapsulation
    /// may skip packets routed otherwise); writes only a change.
    fn route_realm(&mut self, _hold: bool) -> Result<Writes, DatapathOpsError> {
        Ok(Writes::default())
    }
    /// A reader of the datapath's traffic counters and map occupancy, for the metrics (read at
    /// scrape time, never writing). `None` when there is nothing to read.
    fn stats_source(&self) -> Option<Arc<dyn DatapathStatsSource>> {
        None
    }
}

impl DatapathOps for Box<dyn DatapathOps> {
    fn apply(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
        links: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathOpsError> {
        (**self).apply(plan, ipip, links)
    }
    fn describe(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
    ) -> Result<Vec<String>, DatapathOpsError> {
        (**self).describe(plan, ipip)
    }
    fn clean_up(&mut self) -> Result<Writes, DatapathOpsError> {
        (**self).clean_up()
    }
    fn route_realm(&mut self, hold: bool) -> Result<Writes, DatapathOpsError> {
        (**self).route_realm(hold)
    }
    fn stats_source(&self) -> Option<Arc<dyn DatapathStatsSource>> {
        (**self).stats_source()
    }
}

/// A datapath that does nothing (no eBPF available, or tests of the other reconcilers).
#[derive(Debug, Default)]
pub struct NoDatapath;

impl DatapathOps for NoDatapath {
    fn apply(
        &mut self,
        _: &DatapathPlan,
        _: &IpipPlan,
        _: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathOpsError> {
        Ok(Writes::default())
    }
    fn clean_up(&mut self) -> Result<Writes, DatapathOpsError> {
        Ok(Writes::default())
    }
}

/// Reads [`DatapathStats`]; only reads, so any thread may call it at any time.
pub trait DatapathStatsSource: std::fmt::Debug + Send + Sync {
    fn read(&self) -> Result<DatapathStats, DatapathOpsError>;
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

/// What the reconciler and the metrics share.
struct Shared {
    /// `None` once cleaned up.
    datapath: Option<Datapath>,
    /// The last plan synced (for the owner labels).
    plan: DatapathPlan,
    ipip: IpipPlan,
}

/// Reads the shared datapath's counters (see [`DatapathStatsSource`]).
#[derive(Clone)]
struct Stats(Arc<Mutex<Shared>>);

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DatapathReconciler stats")
    }
}

impl Stats {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panic while holding the lock leaves the maps as they were: keep going.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl DatapathStatsSource for Stats {
    fn read(&self) -> Result<DatapathStats, DatapathOpsError> {
        let shared = self.lock();
        let datapath = shared
            .datapath
            .as_ref()
            .ok_or_else(|| DatapathOpsError::Failed("the datapath was cleaned up".into()))?;
        let counters = datapath.counters().map_err(failed)?;
        Ok(stats(
            &counters,
            Plans {
                nat: &shared.plan,
                ipip: &shared.ipip,
            },
        ))
    }
}

/// The datapath's counters, labelled with the owners `plan` gives the entries.
pub fn stats<'a>(counters: &'a Counters, plan: impl Into<Plans<'a>>) -> DatapathStats {
    let entries = counters
        .labelled(plan)
        .map(|(e, owner)| EntryStats {
            role: e.role.label(),
            cidr: e.net,
            kind: super::encode::kind_label(e.kind),
            owner: owner.to_string(),
            counter: e.counter,
        })
        .collect();
    DatapathStats {
        decisions: counters
            .decisions
            .iter()
            .map(|(d, c)| (d.name(), *c))
            .collect(),
        entries,
        maps: Role::ALL
            .into_iter()
            .map(|r| MapUsage {
                map: r.label(),
                entries: counters.fill.get(&r).copied().unwrap_or(0) as u64,
                capacity: counters.capacity as u64,
            })
            .chain([MapUsage {
                map: "entry_counters",
                entries: u64::from(counters.slots_used),
                capacity: u64::from(counters.slots),
            }])
            .collect(),
    }
}

/// The loaded datapath plus what the agent attaches it to.
pub struct DatapathReconciler {
    shared: Stats,
    /// The WireGuard interface first, then the pod-facing ones.
    interfaces: Vec<String>,
    devices: Devices,
    fast_path: bool,
    /// Interfaces this process attached to, with the ifindex it saw (a recreated device has a new one).
    attached: BTreeMap<String, u32>,
    /// Interfaces whose pinned link went with its pin and that are not attached again yet.
    lost: BTreeSet<String>,
    /// The private interface's index while the IPIP programs are attached there; `None` before
    /// the first apply (a pinned attachment of an earlier run may exist).
    ipip: Option<Option<u32>>,
}

impl DatapathReconciler {
    pub fn new(
        datapath: Datapath,
        devices: Devices,
        pod_interfaces: &[String],
        fast_path: bool,
    ) -> Self {
        let mut interfaces = vec![devices.wireguard.clone()];
        interfaces.extend(
            pod_interfaces
                .iter()
                .filter(|i| **i != devices.wireguard)
                .cloned(),
        );
        DatapathReconciler {
            shared: Stats(Arc::new(Mutex::new(Shared {
                datapath: Some(datapath),
                plan: DatapathPlan::default(),
                ipip: IpipPlan::default(),
            }))),
            interfaces,
            devices,
            fast_path,
            attached: BTreeMap::new(),
            lost: BTreeSet::new(),
            ipip: None,
        }
    }

    /// Attaches the IPIP programs to the private interface when `want`s and they are not (or
    /// the device was recreated); detaches them when it does not.
    fn attach_ipip(
        &mut self,
        datapath: &mut Datapath,
        want: bool,
        links: Links,
    ) -> Result<Writes, DatapathError> {
        let mut writes = Writes::default();
        let Some(private) = self.devices.private.as_deref() else {
            return Ok(writes);
        };
        let index = links.index(private).filter(|_| want);
        if self.ipip == Some(index) {
            return Ok(writes);
        }
        // Detached in the reverse order: the clsact qdisc (netlink mode) is the first one's.
        match index {
            Some(_) => {
                for hook in [Hook::Decap, Hook::Encap] {
                    writes += datapath.attach_hook(private, hook)?;
                }
            }
            None => {
                for hook in [Hook::Encap, Hook::Decap] {
                    writes += datapath.detach_hook(private, hook)?;
                }
            }
        }
        self.ipip = Some(index);
        Ok(writes)
    }

    /// The shared state, locked (held only for the duration of one call).
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock()
    }
}

/// The links an apply sees: those read with the plan ([`DatapathOps::apply`]), or the kernel's.
#[derive(Clone, Copy)]
struct Links<'a>(Option<&'a BTreeMap<String, u32>>);

impl Links<'_> {
    fn index(self, name: &str) -> Option<u32> {
        match self.0 {
            Some(links) => links.get(name).copied(),
            None => ifindex(name).ok(),
        }
    }
}

fn loaded(shared: &mut Shared) -> Result<&mut Datapath, DatapathOpsError> {
    shared
        .datapath
        .as_mut()
        .ok_or_else(|| DatapathOpsError::Failed("the datapath was cleaned up".into()))
}

pub(super) fn failed(e: DatapathError) -> DatapathOpsError {
    DatapathOpsError::Other(Box::new(e))
}

impl DatapathOps for DatapathReconciler {
    fn apply(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
        links: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathOpsError> {
        let links = Links(links);
        let mut writes = Writes::default();
        let shared = self.shared.clone();
        let mut shared = shared.lock();
        let datapath = loaded(&mut shared)?;
        writes += datapath.ensure_masquerade().map_err(failed)?;
        writes += datapath.set_fast_path(self.fast_path).map_err(failed)?;
        // Each device resolved once per apply, not once per entry.
        let index = [Device::WireGuard, Device::Private, Device::Tunnel]
            .map(|d| (d, self.devices.name(d).and_then(|n| links.index(n))));
        let resolver = |device: Device| index.iter().find(|(d, _)| *d == device)?.1;
        let synced = datapath
            .apply(Plans { nat: plan, ipip }, &resolver)
            .map_err(failed);
        // Attached only to maps that have held a whole plan: a program bound to fresh maps
        // (first start, or pins replaced by an upgrade) never decides on empty or half-written
        // ones, and one already attached keeps its maps until then.
        let ready = datapath.synced();
        // Pins gone with an unmounted bpffs took their links, and the program, with them:
        // attached again (pinned if the directory is a bpffs again, else held by this process).
        let lost: Vec<String> = (self.attached.keys())
            .filter(|name| datapath.lost_attachment(name))
            .cloned()
            .collect();
        for name in &lost {
            self.attached.remove(name);
            self.lost.insert(name.clone());
        }
        let pin_dir = datapath.config().pin_dir.clone().unwrap_or_default();
        let mut not_yet = Vec::new();
        for name in self.interfaces.iter().filter(|_| ready) {
            match links.index(name) {
                Some(index) if self.attached.get(name) != Some(&index) => {
                    match datapath.attach(name) {
                        Ok(w) => {
                            writes += w;
                            self.attached.insert(name.clone(), index);
                            self.lost.remove(name);
                        }
                        // The old link lingers (and runs) while another mount of that bpffs
                        // still holds its pin: tried again at the next apply.
                        Err(e) if self.lost.contains(name) => not_yet.push(format!("{name} ({e})")),
                        Err(e) => return Err(failed(e)),
                    }
                }
                Some(_) => {}
                // Not there (yet): attached on the reconcile after it appears.
                None => {
                    self.attached.remove(name);
                }
            }
        }
        let ipip_attached = if ready {
            self.attach_ipip(datapath, !ipip.is_empty(), links)
                .map_err(failed)
        } else {
            Ok(Writes::default())
        };
        // Label what the maps now hold (all of the new plan's entries, or some on a failure).
        if shared.plan != *plan {
            shared.plan = plan.clone();
        }
        if shared.ipip != *ipip {
            shared.ipip = ipip.clone();
        }
        writes += synced?;
        writes += ipip_attached?;
        if !lost.is_empty() || !not_yet.is_empty() {
            let mut message = format!(
                "pins under {} are gone (bpffs unmounted?)",
                pin_dir.display()
            );
            if !lost.is_empty() {
                message += &format!(", and its program's links to {} with them", lost.join(", "));
            }
            if not_yet.is_empty() {
                message += ": attached again";
            } else {
                message += &format!("; not attached again yet: {}", not_yet.join(", "));
            }
            return Err(DatapathOpsError::Failed(message));
        }
        Ok(writes)
    }

    fn describe(
        &mut self,
        plan: &DatapathPlan,
        ipip: &IpipPlan,
    ) -> Result<Vec<String>, DatapathOpsError> {
        let mut shared = self.lock();
        let maps = loaded(&mut shared)?.maps();
        let mut lines = Vec::new();
        for trie in Trie::ALL {
            let have: BTreeSet<ipnet::IpNet> = maps
                .entries(trie)
                .map_err(failed)?
                .into_iter()
                .map(|(net, _)| net)
                .collect();
            let mut want = BTreeSet::new();
            for (net, w) in (Plans { nat: plan, ipip }).wants(trie) {
                if !have.contains(&net) {
                    lines.push(format!("+ datapath {} {net} ({})", w.role, w.entry.owner));
                }
                want.insert(net);
            }
            for net in have.difference(&want) {
                lines.push(format!("- datapath {trie} {net}"));
            }
        }
        Ok(lines)
    }

    fn route_realm(&mut self, hold: bool) -> Result<Writes, DatapathOpsError> {
        let shared = self.shared.clone();
        let mut shared = shared.lock();
        loaded(&mut shared)?.set_route_realm(hold).map_err(failed)
    }

    fn clean_up(&mut self) -> Result<Writes, DatapathOpsError> {
        self.attached.clear();
        self.lost.clear();
        self.ipip = None;
        let taken = self.lock().datapath.take();
        match taken {
            Some(datapath) => datapath.clean_up().map_err(failed),
            None => Ok(Writes::default()),
        }
    }

    fn stats_source(&self) -> Option<Arc<dyn DatapathStatsSource>> {
        Some(Arc::new(self.shared.clone()))
    }
}
