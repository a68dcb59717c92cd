//! Which watch events matter: a Node update makes a new snapshot only when what the mesh reads
//! of it changed (status heartbeats and `last-seen` refreshes, kg's copy too, do not), objects are trimmed on
//! arrival, and the ServiceCIDRs that still hold ClusterIPs.
use std::collections::BTreeMap;

use ipnet::IpNet;
use k8s_openapi::api::{
    core::v1::{NodeCondition, NodeStatus},
    networking::v1::ServiceCIDR,
};

use crate::mesh::{
    KubeNode,
    annotations::{KG_LAST_SEEN, LAST_SEEN},
};

/// The parts of a Node the mesh depends on; an update that leaves them equal is dropped.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct NodeView {
    pub(super) labels: BTreeMap<String, String>,
    pub(super) annotations: BTreeMap<String, String>,
    pub(super) pod_cidr: Option<String>,
    pub(super) pod_cidrs: Vec<String>,
    pub(super) ready: Option<String>,
}

pub(super) fn view(n: &KubeNode) -> NodeView {
    let mut annotations = n.metadata.annotations.clone().unwrap_or_default();
    annotations.remove(LAST_SEEN);
    annotations.remove(KG_LAST_SEEN);
    let spec = n.spec.as_ref();
    NodeView {
        labels: n.metadata.labels.clone().unwrap_or_default(),
        annotations,
        pod_cidr: spec.and_then(|s| s.pod_cidr.clone()),
        pod_cidrs: spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default(),
        ready: ready_condition(n).map(|c| c.status.clone()),
    }
}

pub(super) fn ready_condition(n: &KubeNode) -> Option<&NodeCondition> {
    n.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
}

/// Whether `new` differs from `old` in a way the snapshot must show (a heartbeat does not). Pure.
pub fn node_changed(old: Option<&KubeNode>, new: &KubeNode) -> bool {
    old.is_none_or(|old| view(old) != view(new))
}

/// Drops what the agent never reads (managed fields, images, heartbeat timestamps).
pub fn trim_node(mut n: KubeNode) -> KubeNode {
    n.metadata.managed_fields = None;
    if let Some(status) = n.status.take() {
        let conditions = status.conditions.map(|cs| {
            cs.into_iter()
                .filter(|c| c.type_ == "Ready")
                .map(|c| NodeCondition {
                    last_heartbeat_time: None,
                    ..c
                })
                .collect()
        });
        n.status = Some(NodeStatus {
            addresses: status.addresses,
            conditions,
            ..NodeStatus::default()
        });
    }
    n
}

/// Whether a ServiceCIDR's ranges hold ClusterIPs: it is Ready, or it is being deleted (the
/// Services allocated from it keep their addresses until they are gone).
pub(super) fn holds_cluster_ips(s: &ServiceCIDR) -> bool {
    s.metadata.deletion_timestamp.is_some()
        || s.status
            .as_ref()
            .and_then(|st| st.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The service CIDRs of `objects` (those `holds_cluster_ips` keeps), each once, and one error per value
/// that is not a CIDR (naming the object and the field).
pub fn service_cidrs(objects: &BTreeMap<String, ServiceCIDR>) -> (Vec<IpNet>, Vec<String>) {
    let (mut cidrs, mut errors) = (Vec::new(), Vec::new());
    for (name, s) in objects.iter().filter(|(_, s)| holds_cluster_ips(s)) {
        let values = s.spec.as_ref().and_then(|spec| spec.cidrs.as_deref());
        for (i, value) in values.unwrap_or_default().iter().enumerate() {
            match crate::mesh::parse_cidr(value) {
                Ok(c) if !cidrs.contains(&c.trunc()) => cidrs.push(c.trunc()),
                Ok(_) => {}
                Err(e) => errors.push(format!("ServiceCIDR {name}: spec.cidrs[{i}]: {e}")),
            }
        }
    }
    (cidrs, errors)
}

/// Whether a ServiceCIDR changed in a way [`service_cidrs`] sees.
pub(super) fn service_cidr_changed(old: Option<&ServiceCIDR>, new: &ServiceCIDR) -> bool {
    old.is_none_or(|o| o.spec != new.spec || holds_cluster_ips(o) != holds_cluster_ips(new))
}
