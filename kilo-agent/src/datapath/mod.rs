//! The eBPF datapath from userspace, one of the reconcilers (it uses [`crate::effects`] and
//! nothing else of them): loads, attaches, pins and adopts the TC programs, syncs their LPM
//! tries and reads their counters.
//!
//! - [`Datapath`] (kernel.rs): the embedded `kilo-ebpf` object, attached to named interfaces
//!   (TCX on kernels >= 6.6, clsact + netlink below, rtnl.rs), maps and links pinned under a
//!   bpffs directory and adopted on start, so forwarding goes on while the agent is down.
//! - [`MapSync`] (sync.rs): the diff between the plan and the tries (see there), behind the
//!   [`DatapathMaps`] trait (kernel maps, or [`FakeMaps`] in memory); keys.rs: plan entries as
//!   keys and values; counters.rs: the mapped counters.
//! - [`AgentDatapath`] and [`FakeDatapath`] (agent.rs): the datapath behind the reconcilers'
//!   [`DatapathSync`](crate::effects::DatapathSync) trait, real and in memory.
//! - [`logs`]: the program's aya-log records as `tracing` events.
//!
//! The static masquerade rule is [`crate::nft`]'s; [`Datapath`] keeps it with the mark it uses.
//! Nothing here starts a process.
mod agent;
mod counters;
mod kernel;
mod keys;
pub mod logs;
mod rtnl;
mod sync;

use std::{io, path::PathBuf};

use ipnet::IpNet;
pub use kilo_common::{Counter, Decision};

pub use agent::{AgentDatapath, FakeDatapath};
pub use kernel::{
    AttachMode, Datapath, DatapathConfig, Framing, Hook, KernelMaps, OBJECT, framing, ifindex,
    is_bpffs,
};
pub use sync::{
    Counters, DatapathMaps, EntryCounter, FakeMaps, MapSync, NoResolver, Plans, READ_BACK_EVERY,
    Resolver, read_counters, sync_maps,
};

/// What an entry stands for (Kilo's rule it replaces): a metrics label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// `mesh_destinations`: never masqueraded (fast path candidates).
    Mesh,
    /// `nat_sources`: masqueraded unless the destination is in the mesh.
    NatSource,
    /// `masquerade_destinations`: this location's allowed-location IPs.
    MasqueradeDestination,
    /// `ipip.encapsulate`: wrapped in IPIP at egress of the private interface.
    Encapsulate,
    /// `ipip.sources`: outer sources whose IPIP is accepted.
    IpipSource,
    /// `ipip.decapsulate`: inner destinations this node serves.
    Decapsulate,
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::Mesh,
        Role::NatSource,
        Role::MasqueradeDestination,
        Role::Encapsulate,
        Role::IpipSource,
        Role::Decapsulate,
    ];

    /// The trie its entries live in.
    pub const fn trie(self) -> Trie {
        match self {
            Role::Mesh | Role::MasqueradeDestination => Trie::Destination,
            Role::NatSource => Trie::NatSource,
            Role::Encapsulate => Trie::Encapsulate,
            Role::IpipSource => Trie::IpipSource,
            Role::Decapsulate => Trie::Decapsulate,
        }
    }

    /// A metrics label.
    pub const fn label(self) -> &'static str {
        match self {
            Role::Mesh => "mesh_destination",
            Role::NatSource => "nat_source",
            Role::MasqueradeDestination => "masquerade_destination",
            Role::Encapsulate => "encapsulate",
            Role::IpipSource => "ipip_source",
            Role::Decapsulate => "decapsulate",
        }
    }
}

/// The program's LPM tries. [`Trie::Destination`] holds two roles: mesh and masquerade
/// destinations (see kilo-common's `MAP_DST`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Trie {
    Destination,
    NatSource,
    Encapsulate,
    IpipSource,
    Decapsulate,
}

impl Trie {
    pub const ALL: [Trie; 5] = [
        Trie::Destination,
        Trie::NatSource,
        Trie::Encapsulate,
        Trie::IpipSource,
        Trie::Decapsulate,
    ];

    /// The map (and pin) name.
    pub const fn map_name(self) -> &'static str {
        match self {
            Trie::Destination => kilo_common::MAP_DST,
            Trie::NatSource => kilo_common::MAP_NAT_SRC,
            Trie::Encapsulate => kilo_common::MAP_ENCAP,
            Trie::IpipSource => kilo_common::MAP_IPIP_SRC,
            Trie::Decapsulate => kilo_common::MAP_DECAP,
        }
    }

    /// A metrics label: the role of its entries, `destination` for the shared trie.
    pub const fn label(self) -> &'static str {
        match self {
            Trie::Destination => "destination",
            Trie::NatSource => Role::NatSource.label(),
            Trie::Encapsulate => Role::Encapsulate.label(),
            Trie::IpipSource => Role::IpipSource.label(),
            Trie::Decapsulate => Role::Decapsulate.label(),
        }
    }
}

impl std::fmt::Display for Trie {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error("loading the eBPF object: {0}")]
    Load(#[from] Box<aya::EbpfError>),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: Box<aya::maps::MapError>,
    },
    #[error("map {name} holds an invalid key (prefix length {prefix_len}, family {family})")]
    BadKey {
        name: &'static str,
        prefix_len: u32,
        family: u32,
    },
    #[error("map {name} is full ({capacity} entries)")]
    Full { name: &'static str, capacity: usize },
    #[error("{role} entry {net} (owner {owner:?}): {source}")]
    Entry {
        role: Role,
        net: IpNet,
        owner: String,
        #[source]
        source: Box<DatapathError>,
    },
    #[error("stale {trie} entry {net}: {source}")]
    Stale {
        trie: Trie,
        net: IpNet,
        #[source]
        source: Box<DatapathError>,
    },
    #[error("interface {name}: {reason}")]
    Interface { name: String, reason: String },
    #[error("link of interface {name}: {source}")]
    Link {
        name: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("invalid datapath config: {0}")]
    Config(String),
    #[error("nftables: {0}")]
    Nft(#[from] crate::nft::NftError),
}

impl DatapathError {
    pub(crate) fn map(name: &'static str, source: aya::maps::MapError) -> Self {
        DatapathError::Map {
            name,
            source: Box::new(source),
        }
    }

    pub(crate) fn program(name: &'static str, source: aya::programs::ProgramError) -> Self {
        DatapathError::Program {
            name,
            source: Box::new(source),
        }
    }
}
