//! The agent's test setup, shared by the agent tests and `examples/bench_agent.rs`: a stand-in
//! planner (one WireGuard peer, one route and one mesh-destination entry per remote node and per
//! Peer, what a leader's real plan has per object), the reconciler settings and the local node.
use kilo_agent::{
    agent::{Local, PlanOutcome},
    mesh::{Key, ObjectError, ObjectKind, Snapshot, annotations::KEY as ANNOTATION_KEY},
    plan::{DatapathEntry, Device, Devices, EntryKind, MAIN_TABLE, Plan, Route, WireGuardPeer},
    reconcile::{DeviceSettings, wireguard::system_resolver},
    topology::TopologyError,
};

pub const ENDPOINT_ANNOTATION: &str = "kilo.squat.ai/endpoint";

/// The stand-in planner for node `me`. With `wait_for_self` it plans nothing (reporting why)
/// until `me` is in the snapshot, as the real planner does. Invalid nodes and peers are reported
/// by name and left out.
pub fn planner(me: &'static str, wait_for_self: bool) -> impl FnMut(&Snapshot) -> PlanOutcome {
    move |s: &Snapshot| {
        let mut out = PlanOutcome::default();
        if wait_for_self && !s.nodes.contains_key(me) {
            out.errors
                .push(TopologyError::LocalNodeMissing(me.to_string()).into());
            return out;
        }
        let mut plan = Plan {
            addresses: vec!["10.4.0.1/16".parse().unwrap()],
            ..Plan::default()
        };
        plan.wireguard.listen_port = 51820;
        plan.wireguard.peers.reserve(s.nodes.len() + s.peers.len());
        let mut add =
            |k: Key, cidr: ipnet::IpNet, endpoint: Option<&str>, keepalive, kind, owner| {
                plan.wireguard.peers.push(WireGuardPeer {
                    public_key: k,
                    preshared_key: None,
                    endpoint: endpoint.and_then(|e| e.parse().ok()),
                    allowed_ips: vec![cidr],
                    persistent_keepalive: keepalive,
                });
                plan.routes.push(Route {
                    dst: cidr,
                    gateway: None,
                    src: None,
                    device: Device::WireGuard,
                    onlink: false,
                    table: MAIN_TABLE,
                });
                plan.datapath.mesh_destinations.insert(
                    cidr,
                    DatapathEntry {
                        kind,
                        owner: String::from(owner),
                        next_hop: None,
                    },
                );
            };
        for (name, n) in s.nodes.iter().filter(|(n, _)| n.as_str() != me) {
            let a = n.metadata.annotations.as_ref();
            let k = a
                .and_then(|a| a.get(ANNOTATION_KEY))
                .and_then(|k| k.parse().ok());
            let cidr = n
                .spec
                .as_ref()
                .and_then(|s| s.pod_cidr.as_ref())
                .and_then(|c| c.parse().ok());
            let endpoint = a
                .and_then(|a| a.get(ENDPOINT_ANNOTATION))
                .map(String::as_str);
            match (k, cidr) {
                (Some(k), Some(c)) => add(k, c, endpoint, 0, EntryKind::Node, name),
                _ => out.errors.push(
                    ObjectError::new(ObjectKind::Node, name, "spec.podCIDR", "no key or podCIDR")
                        .into(),
                ),
            }
        }
        for (name, p) in &s.peers {
            let k = p.spec.public_key.parse::<Key>();
            let cidr = p.spec.allowed_ips.first().and_then(|c| c.parse().ok());
            let keepalive = p.spec.persistent_keepalive.unwrap_or(0) as u16;
            match (k, cidr) {
                (Ok(k), Some(c)) => add(k, c, None, keepalive, EntryKind::Peer, name),
                _ => {
                    let e = ObjectError::new(
                        ObjectKind::Peer,
                        name,
                        "spec.publicKey",
                        "invalid publicKey or allowedIPs",
                    );
                    out.errors.push(e.into());
                }
            }
        }
        plan.routes.sort();
        out.ready_nodes = s.nodes.len();
        out.ready_peers = s.peers.len();
        out.leader = true;
        out.wireguard_ip = Some("10.4.0.1/16".parse().unwrap());
        out.plan = Some(plan);
        out
    }
}

/// Reconciler settings for WireGuard interface `wireguard` (and the private interface
/// `private`), an MTU of 1420 and the system resolver.
pub fn settings(
    wireguard: &str,
    private: Option<&str>,
    create_interface: bool,
    private_key: Key,
) -> DeviceSettings {
    DeviceSettings {
        devices: Devices {
            wireguard: wireguard.into(),
            private: private.map(str::to_owned),
            tunnel: None,
        },
        create_interface,
        mtu: Some(1420),
        private_key,
        dns: Box::new(system_resolver),
    }
}

/// The local node `me` at 10.0.0.1.
pub fn local(me: &str, public_key: Key, granularity: &str) -> Local {
    Local {
        hostname: me.into(),
        public_key,
        endpoint: Some("10.0.0.1:51820".parse().unwrap()),
        internal_ip: Some("10.0.0.1/24".parse().unwrap()),
        granularity: granularity.into(),
        cni_compatibility_ip: None,
    }
}

/// A Peer object's YAML.
pub fn peer_yaml(name: &str, key: impl std::fmt::Display, cidr: &str) -> String {
    format!(
        "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: {name}\nspec:\n  allowedIPs: [{cidr}]\n  publicKey: \"{key}\"\n"
    )
}
