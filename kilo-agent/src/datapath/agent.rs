//! The datapath as the agent's reconciler drives it ([`DatapathSync`]): attaches the program to
//! the WireGuard interface and the pod-facing interfaces as they appear, keeps the static
//! masquerade rule and the fast-path flag, and syncs the maps with the plan. Each step writes
//! only when the kernel differs, so an idle reconcile writes nothing.
use std::collections::{BTreeMap, BTreeSet};

use super::{Datapath, DatapathError, DatapathMaps as _, Role, ifindex, sync::plan_role};
use crate::{
    plan::{DatapathPlan, Device},
    reconcile::{DatapathSync, DatapathSyncError, Writes, state::Devices},
};

/// The loaded datapath plus what the agent attaches it to.
pub struct AgentDatapath {
    datapath: Option<Datapath>,
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
            datapath: Some(datapath),
            interfaces,
            devices,
            fast_path,
            attached: BTreeMap::new(),
        }
    }

    fn datapath(&mut self) -> Result<&mut Datapath, DatapathSyncError> {
        self.datapath
            .as_mut()
            .ok_or_else(|| DatapathSyncError::Failed("the datapath was cleaned up".into()))
    }
}

fn failed(e: DatapathError) -> DatapathSyncError {
    DatapathSyncError::Other(Box::new(e))
}

impl DatapathSync for AgentDatapath {
    fn sync(&mut self, plan: &DatapathPlan) -> Result<Writes, DatapathSyncError> {
        let mut writes = Writes::default();
        let interfaces = self.interfaces.clone();
        for name in interfaces {
            match ifindex(&name) {
                Ok(index) if self.attached.get(&name) != Some(&index) => {
                    writes += self.datapath()?.attach(&name).map_err(failed)?;
                    self.attached.insert(name, index);
                }
                Ok(_) => {}
                // Not there (yet): attached on the reconcile after it appears.
                Err(_) => {
                    self.attached.remove(&name);
                }
            }
        }
        let fast_path = self.fast_path;
        let devices = self.devices.clone();
        let datapath = self.datapath()?;
        writes += datapath.ensure_masquerade().map_err(failed)?;
        writes += datapath.set_fast_path(fast_path).map_err(failed)?;
        let resolver = |device: Device| devices.name(device).and_then(|n| ifindex(n).ok());
        writes += datapath.sync(plan, &resolver).map_err(failed)?;
        Ok(writes)
    }

    fn describe(&mut self, plan: &DatapathPlan) -> Result<Vec<String>, DatapathSyncError> {
        let maps = self.datapath()?.maps();
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
        match self.datapath.take() {
            Some(datapath) => datapath.cleanup().map_err(failed),
            None => Ok(Writes::default()),
        }
    }
}
