//! `kgctl connect`'s plan (pure): this machine as the Peer `name` of the mesh, with Kilo's
//! `PeerConf(name)` as its WireGuard peers and Kilo's `PeerRoutes` through its interface.
use std::{collections::BTreeSet, net::IpAddr};

use ipnet::IpNet;

use super::{Cluster, KgctlError};
use crate::{
    mesh::{Key, MeshPeer, Peer},
    plan::{Device, MAIN_TABLE, Plan, Route, WireGuardPlan, normalize_wireguard},
};

/// What `kgctl connect` is asked for.
#[derive(Debug, Clone)]
pub struct Connect {
    /// The Peer's name.
    pub name: String,
    /// `--allowed-ip`: this machine's address in the mesh (the Peer's allowed IP).
    pub allowed_ip: IpNet,
    /// `--allowed-ips`: more of the cluster's CIDRs to route here (e.g. the service CIDR).
    pub allowed_ips: Vec<IpNet>,
    /// `--persistent-keepalive`, seconds.
    pub persistent_keepalive: u16,
    /// The WireGuard listen port (kgctl's `--port`).
    pub port: u16,
}

impl Connect {
    /// The Peer object this machine is, with `public_key`.
    pub fn peer(&self, public_key: Key) -> Peer {
        MeshPeer {
            name: self.name.clone(),
            allowed_ips: vec![self.allowed_ip],
            public_key,
            endpoint: None,
            persistent_keepalive: self.persistent_keepalive,
            preshared_key: None,
        }
        .to_crd()
    }

    /// The plan for this machine's interface: its address, the mesh as WireGuard peers and the
    /// mesh's CIDRs routed through it. Kilo's choices: the topology is seen from the last ready
    /// node, and `--allowed-ips` are added to the first node's allowed location IPs.
    pub fn plan(&self, cluster: &Cluster) -> Result<Plan, KgctlError> {
        let mut c = cluster.clone();
        let me = c
            .peers
            .get(&self.name)
            .ok_or_else(|| KgctlError::PeerNotFound(self.name.clone()))?
            .clone();
        if let Some(first) = c.nodes.values_mut().next() {
            first
                .allowed_location_ips
                .extend(self.allowed_ips.iter().copied());
        }
        let host = c.any_host().name.clone();
        let t = c.topology(&host, me.persistent_keepalive)?;
        let mut routes = Vec::new();
        // A gateway of the other family is dropped (the WireGuard IPs are of one family).
        let via = |dst: IpNet, gateway: Option<IpAddr>| {
            let gateway = gateway.filter(|g| g.is_ipv4() == dst.addr().is_ipv4());
            Route {
                dst: dst.trunc(),
                gateway,
                src: None,
                device: Device::WireGuard,
                onlink: gateway.is_some(),
                table: MAIN_TABLE,
            }
        };
        for s in &t.segments {
            let gw = Some(s.wireguard_ip);
            routes.extend(s.cidrs().map(|c| via(c, gw)));
            routes.extend(s.private_ips().map(|ip| via(IpNet::from(ip), gw)));
            routes.extend(s.allowed_location_ips.iter().map(|&n| via(n, gw)));
            routes.push(via(IpNet::from(s.wireguard_ip), None));
        }
        for p in t.peers.iter().filter(|p| p.name != self.name) {
            routes.extend(p.allowed_ips.iter().map(|&n| via(n, None)));
        }
        if let Some(first) = t.segments.first() {
            let gw = Some(first.wireguard_ip);
            routes.extend(self.allowed_ips.iter().map(|&n| via(n, gw)));
        }
        // One route per destination, the first in Kilo's order (the kernel keeps one).
        let mut seen = BTreeSet::new();
        routes.retain(|r| seen.insert(r.dst));
        routes.sort();
        Ok(Plan {
            addresses: vec![self.allowed_ip],
            wireguard: WireGuardPlan {
                listen_port: self.port,
                peers: normalize_wireguard(t.peer_conf(&self.name)),
            },
            routes,
            ..Plan::default()
        })
    }
}
