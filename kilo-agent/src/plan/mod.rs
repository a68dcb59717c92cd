//! The plan: everything one node must have, derived purely from a topology.
//!
//! This is the contract between the pure core and the reconcilers. It holds no secrets (the
//! private key stays with the agent), is ordered deterministically (two equal plans compare and
//! print equal), and is what the reconcilers, `kg --dry-run`, the goldens and the benchmarks
//! consume.
//!
//! [`plan_for`] (the agent's entry point) and [`from_topology`] compute it with Kilo's
//! `Conf()`/`Routes()`/`Rules()` semantics; `compute.rs` and `datapath.rs` list the deliberate
//! differences from Kilo (truncated destinations, one route and one WireGuard peer per CIDR,
//! merged duplicate keys, IPv4-only IPIP). `Route`, `Rule` and `Device` print in the golden
//! files' layout (`Device` as Kilo's test names kilo0/eth0/tunl0) for tests and dry runs.
mod compute;
mod conf;
mod datapath;
mod settings;

use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, Ipv4Addr},
};

pub use compute::{from_topology, normalize_wireguard, plan_for, topology_for};
pub use datapath::ipip_sources;
pub use settings::{Compatibility, Encapsulation, KeepaliveSource, PlanError, Planned, Settings};

use ipnet::IpNet;

use crate::mesh::{Endpoint, Key};

/// Kilo's route table for the intra-location return path (`kiloTableIndex`).
pub const KILO_TABLE: u32 = 1107;
/// The kernel's main routing table.
pub const MAIN_TABLE: u32 = 254;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Addresses of the WireGuard interface (a leader's WireGuard IP, with the subnet's mask).
    pub addresses: Vec<IpNet>,
    pub wireguard: WireGuardPlan,
    /// Sorted and free of duplicates.
    pub routes: Vec<Route>,
    /// Sorted and free of duplicates.
    pub rules: Vec<Rule>,
    pub datapath: DatapathPlan,
    /// IPIP inside the location, done by the datapath instead of Kilo's `tunl0`.
    pub ipip: IpipPlan,
    /// The IPAM ranges of the bridge CNI configuration (`--cni`): the node's pod CIDRs. Empty
    /// without `--cni`.
    pub cni_ranges: Vec<IpNet>,
    /// What iptables' FORWARD chain must accept from and to (`--iptables-forward-rules` with
    /// `--cni`), in Kilo's order. Empty otherwise.
    pub forward: Vec<ForwardAccept>,
}

/// One of Kilo's `--iptables-forward-rules` pairs: traffic from `net` and traffic to `net` is
/// accepted in the FORWARD chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ForwardAccept {
    pub net: IpNet,
    pub what: ForwardWhat,
}

/// What a [`ForwardAccept`] is for, as Kilo's rule comments say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ForwardWhat {
    /// A leader: a pod CIDR of its location.
    PodSubnet,
    /// A leader: an allowed-location IP of its location.
    AllowedLocationIps,
    /// A leader: a private IP of its location (/32, /128).
    PrivateIps,
    /// Not a leader: its own pod CIDR.
    NodePodSubnet,
}

impl ForwardWhat {
    /// The end of Kilo's comment, `forward packets from <this>` / `to <this>`.
    pub const fn describe(self) -> &'static str {
        match self {
            ForwardWhat::PodSubnet => "the pod subnet",
            ForwardWhat::AllowedLocationIps => "allowed location IPs",
            ForwardWhat::PrivateIps => "private IPs",
            ForwardWhat::NodePodSubnet => "the node's pod subnet",
        }
    }
}

/// The WireGuard device's configuration, without the private key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WireGuardPlan {
    pub listen_port: u16,
    /// In Kilo's order (segments, then peers). Empty on a node that is not a leader.
    pub peers: Vec<WireGuardPeer>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireGuardPeer {
    pub public_key: Key,
    pub preshared_key: Option<Key>,
    pub endpoint: Option<Endpoint>,
    pub allowed_ips: Vec<IpNet>,
    /// Seconds; 0 = off.
    pub persistent_keepalive: u16,
}

/// Which interface a route or rule refers to; the reconciler resolves it to an ifindex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Device {
    /// The WireGuard interface (`--interface`, default kilo0).
    WireGuard,
    /// The interface that holds the node's private (internal) IP.
    Private,
    /// The IPIP encapsulation device (tunl0).
    Tunnel,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::WireGuard => "kilo0",
            Device::Private => "eth0",
            Device::Tunnel => "tunl0",
        })
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

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Route {
    pub dst: IpNet,
    pub gateway: Option<IpAddr>,
    pub src: Option<IpAddr>,
    pub device: Device,
    pub onlink: bool,
    pub table: u32,
}

/// `route DST [via GW] dev DEV [src SRC] [table T] [onlink]`, the golden files' layout without
/// the protocol (Device prints Kilo's test names: kilo0, eth0, tunl0).
impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "route {}", self.dst)?;
        if let Some(g) = self.gateway {
            write!(f, " via {g}")?;
        }
        write!(f, " dev {}", self.device)?;
        if let Some(s) = self.src {
            write!(f, " src {s}")?;
        }
        if self.table != MAIN_TABLE {
            write!(f, " table {}", self.table)?;
        }
        if self.onlink {
            f.write_str(" onlink")?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub src: Option<IpNet>,
    pub dst: Option<IpNet>,
    pub iif: Option<Device>,
    pub table: u32,
}

/// `ip rule [from SRC] [to DST] [iif DEV] lookup T`.
impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ip rule")?;
        if let Some(s) = self.src {
            write!(f, " from {s}")?;
        }
        if let Some(d) = self.dst {
            write!(f, " to {d}")?;
        }
        if let Some(i) = self.iif {
            write!(f, " iif {i}")?;
        }
        write!(f, " lookup {}", self.table)
    }
}

/// The datapath maps' desired contents: what Kilo keeps in iptables, as sets of CIDRs.
///
/// Every key is truncated (no host bits), so each is a valid LPM-trie key.
/// A packet is masqueraded when `(src ∈ nat_sources or dst ∈ masquerade_destinations)
/// and dst ∉ mesh_destinations` (prefix match everywhere): the datapath keeps the mesh and
/// masquerade destinations in one trie, marking the [covered](DatapathPlan::covering_mesh)
/// masquerade destinations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DatapathPlan {
    /// Kilo's `KILO-NAT -d X -j RETURN`: destinations inside the mesh (segment allowed IPs,
    /// WireGuard IPs, peer allowed IPs, service CIDRs), never masqueraded.
    pub mesh_destinations: BTreeMap<IpNet, DatapathEntry>,
    /// Kilo's `POSTROUTING -s X -j KILO-NAT`: the local pod CIDR and peer allowed IPs.
    pub nat_sources: BTreeMap<IpNet, DatapathEntry>,
    /// Kilo's `POSTROUTING -d X -j KILO-NAT`: this location's allowed-location IPs.
    pub masquerade_destinations: BTreeMap<IpNet, DatapathEntry>,
}

impl DatapathPlan {
    /// The longest mesh destination that holds `net` (`net` itself included). A masquerade
    /// destination it returns one for is *covered*: Kilo never masquerades a packet to it (the
    /// mesh destination returns first), so the datapath's one destination trie writes it as
    /// that mesh destination, and the longest match alone gives Kilo's decision.
    pub fn covering_mesh(&self, net: &IpNet) -> Option<(IpNet, &DatapathEntry)> {
        if self.mesh_destinations.is_empty() {
            return None;
        }
        (0..=net.prefix_len()).rev().find_map(|len| {
            let outer = IpNet::new(net.addr(), len).ok()?.trunc();
            self.mesh_destinations.get(&outer).map(|e| (outer, e))
        })
    }
}

/// The datapath's IPIP maps: Kilo's `tunl0` routes and `KILO-IPIP` chain, as sets of CIDRs
/// (IPv4 only; keys truncated). Empty with `--encapsulate=never`, without `--local`, with
/// `--compatibility` (the CNI's device encapsulates) and on a node with no location neighbour.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpipPlan {
    /// Destinations of the routes Kilo points at `tunl0`, each with its [`NextHop::Ipip`]:
    /// wrapped at egress of the private interface.
    pub encapsulate: BTreeMap<IpNet, DatapathEntry>,
    /// Kilo's `KILO-IPIP -s X -j ACCEPT`: the private IPs of the location's other nodes.
    pub sources: BTreeMap<IpNet, DatapathEntry>,
    /// Inner destinations this node serves (its own pod CIDRs and addresses; a leader also
    /// what it routes into WireGuard): IPIP to anything else is refused.
    pub decapsulate: BTreeMap<IpNet, DatapathEntry>,
}

impl IpipPlan {
    /// Whether anything may be encapsulated or decapsulated (else no program is attached).
    pub fn is_empty(&self) -> bool {
        self.encapsulate.is_empty() && self.sources.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DatapathEntry {
    pub kind: EntryKind,
    /// The node, segment, peer or flag the entry comes from (a metrics label).
    pub owner: String,
    /// Where the fast path may redirect traffic to this destination (mesh destinations only;
    /// never set for service CIDRs, which kube-proxy must DNAT first).
    pub next_hop: Option<NextHop>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EntryKind {
    /// A pod CIDR or internal IP of a node (a segment's allowed IPs).
    Node,
    /// A segment's WireGuard IP.
    WireGuardIp,
    /// A Peer's allowed IP.
    Peer,
    /// A `--service-cidr`.
    Service,
    /// The local pod CIDR (NAT source).
    LocalPods,
    /// An allowed-location IP of this location.
    AllowedLocation,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NextHop {
    /// Straight into the WireGuard interface (this node is a leader).
    WireGuard,
    /// To a gateway (the location's leader) through a device.
    Gateway { address: IpAddr, device: Device },
    /// Inside an outer IPv4 header from `local` (this node's private IP) to `remote` (the next
    /// hop's), out of the private interface.
    Ipip { local: Ipv4Addr, remote: Ipv4Addr },
}

#[cfg(test)]
mod tests;
