//! The datapath as the agent's reconciler drives it ([`DatapathSync`]): attaches the program to
//! the WireGuard interface and the pod-facing interfaces as they appear, keeps the static
//! masquerade rule and the fast-path flag, and syncs the maps with the plan. Each step writes
//! only when the kernel differs, so an idle reconcile writes nothing.
//!
//! Its [`DatapathStatsSource`] reads the counters at scrape time from the same maps (shared under
//! a mutex that a sync holds while it writes and a scrape while it reads; nothing else waits on
//! it), labelled with the owners of the last plan synced. An idle sync adds only a comparison of
//! that plan with the new one.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex, MutexGuard},
};

use super::{Datapath, DatapathError, DatapathMaps as _, Role, ifindex, sync::plan_role};
use crate::{
    plan::{DatapathPlan, Device},
    reconcile::{
        DatapathStats, DatapathStatsSource, DatapathSync, DatapathSyncError, Writes, state::Devices,
    },
};

/// What the reconciler and the metrics share.
struct Shared {
    /// `None` once cleaned up.
    datapath: Option<Datapath>,
    /// The last plan synced (for the owner labels).
    plan: DatapathPlan,
}

/// Reads the shared datapath's counters (see [`DatapathStatsSource`]).
#[derive(Clone)]
struct Stats(Arc<Mutex<Shared>>);

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AgentDatapath stats")
    }
}

impl Stats {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panic while holding the lock leaves the maps as they were: keep going.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl DatapathStatsSource for Stats {
    fn read(&self) -> Result<DatapathStats, DatapathSyncError> {
        let shared = self.lock();
        let datapath = shared
            .datapath
            .as_ref()
            .ok_or_else(|| DatapathSyncError::Failed("the datapath was cleaned up".into()))?;
        let counters = datapath.counters().map_err(failed)?;
        Ok(DatapathStats::labelled(&counters, &shared.plan))
    }
}

/// The loaded datapath plus what the agent attaches it to.
pub struct AgentDatapath {
    shared: Stats,
    /// The WireGuard interface first, then the pod-facing ones.
    interfaces: Vec<String>,
    devices: Devices,
    fast_path: bool,
    /// Interfaces this process attached to, with the ifindex it saw (a recreated device has a new one).
    attached: BTreeMap<String, u32>,
}

impl AgentDatapath {
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
        AgentDatapath {
            shared: Stats(Arc::new(Mutex::new(Shared {
                datapath: Some(datapath),
                plan: DatapathPlan::default(),
            }))),
            interfaces,
            devices,
            fast_path,
            attached: BTreeMap::new(),
        }
    }

    /// The shared state, locked (held only for the duration of one call).
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock()
    }
}

fn loaded(shared: &mut Shared) -> Result<&mut Datapath, DatapathSyncError> {
    shared
        .datapath
        .as_mut()
        .ok_or_else(|| DatapathSyncError::Failed("the datapath was cleaned up".into()))
}

fn failed(e: DatapathError) -> DatapathSyncError {
    DatapathSyncError::Other(Box::new(e))
}

impl DatapathSync for AgentDatapath {
    fn sync(&mut self, plan: &DatapathPlan) -> Result<Writes, DatapathSyncError> {
        let mut writes = Writes::default();
        let shared = self.shared.clone();
        let mut shared = shared.lock();
        let datapath = loaded(&mut shared)?;
        writes += datapath.ensure_masquerade().map_err(failed)?;
        writes += datapath.set_fast_path(self.fast_path).map_err(failed)?;
        let devices = &self.devices;
        let resolver = |device: Device| devices.name(device).and_then(|n| ifindex(n).ok());
        let synced = datapath.sync(plan, &resolver).map_err(failed);
        // Attached after the maps are filled (even partly, after a failure): a program bound to
        // fresh maps (first start, or pins replaced by an upgrade) never decides on empty ones.
        for name in &self.interfaces {
            match ifindex(name) {
                Ok(index) if self.attached.get(name) != Some(&index) => {
                    writes += datapath.attach(name).map_err(failed)?;
                    self.attached.insert(name.clone(), index);
                }
                Ok(_) => {}
                // Not there (yet): attached on the reconcile after it appears.
                Err(_) => {
                    self.attached.remove(name);
                }
            }
        }
        // Label what the maps now hold (all of the new plan's entries, or some on a failure).
        if shared.plan != *plan {
            shared.plan = plan.clone();
        }
        writes += synced?;
        Ok(writes)
    }

    fn describe(&mut self, plan: &DatapathPlan) -> Result<Vec<String>, DatapathSyncError> {
        let mut shared = self.lock();
        let maps = loaded(&mut shared)?.maps();
        let mut lines = Vec::new();
        for role in Role::ALL {
            let have: BTreeSet<ipnet::IpNet> = maps
                .entries(role)
                .map_err(failed)?
                .into_iter()
                .map(|(net, _)| net)
                .collect();
            let want = plan_role(plan, role);
            for (net, entry) in want {
                if !have.contains(net) {
                    lines.push(format!("+ datapath {role} {net} ({})", entry.owner));
                }
            }
            for net in have.iter().filter(|n| !want.contains_key(*n)) {
                lines.push(format!("- datapath {role} {net}"));
            }
        }
        Ok(lines)
    }

    fn clean_up(&mut self) -> Result<Writes, DatapathSyncError> {
        self.attached.clear();
        let taken = self.lock().datapath.take();
        match taken {
            Some(datapath) => datapath.cleanup().map_err(failed),
            None => Ok(Writes::default()),
        }
    }

    fn stats_source(&self) -> Option<Arc<dyn DatapathStatsSource>> {
        Some(Arc::new(self.shared.clone()))
    }
}
