//! The eBPF datapath from userspace, one of the agent's reconcilers: loads, attaches, pins and
//! adopts the TC programs, syncs their LPM tries with the plan and reads their counters. Nothing
//! here starts a process; the raw system calls are [`crate::sys`]'s.
//!
//! ```text
//! kernel.rs      what the programs need of the kernel, each with its release; probed at start
//! config.rs      DatapathConfig: what the datapath is loaded with, the program's config value
//! load.rs        Datapath: the object loaded, maps pinned and adopted, layout migration, clean-up
//! attach.rs      Hook, Framing: programs attached to interfaces (TCX links, clsact + netlink)
//! rtnl.rs        the link type and clsact qdisc queries attaching needs
//! maps.rs        DatapathMaps: the maps as the diff sees them; KernelMaps: the kernel's, with
//!                CounterArray (the counters array, mapped)
//! encode.rs      plan entries as trie keys and values; Resolver: devices to interface indices
//! plans.rs       Plans: what each trie should hold
//! pins.rs        the bpf filesystem: checked, mounted, pins listed and removed
//! tries.rs       Tries: the diff between the plans and the tries, from a record of the writes
//! counters.rs    Counters: every counter read from the maps, labelled with its entry
//! netfilter.rs   nf_tables over netlink: wire constants, messages, parser, socket
//! nft.rs         the static masquerade rule (nftables), kept with the program's mark
//! forward.rs     --iptables-forward-rules: ACCEPTs in iptables-nft's FORWARD chain (nftables)
//! reconciler.rs  DatapathOps: the datapath as the reconciler drives it; DatapathReconciler
//! fake.rs        FakeMaps, FakeDatapath: the same in memory, for fast tests
//! logs.rs        the program's aya-log records as `tracing` events
//! ```
mod attach;
mod config;
mod counters;
mod encode;
#[cfg(any(test, feature = "testing"))]
mod fake;
pub mod forward;
pub mod kernel;
mod load;
pub mod logs;
mod maps;
mod netfilter;
pub mod nft;
mod pins;
mod plans;
mod reconciler;
mod rtnl;
mod tries;

use std::{
    io,
    path::{Path, PathBuf},
};

use ipnet::IpNet;
pub use kilo_common::{Counter, Decision};

pub use attach::{AttachMode, Framing, Hook, framing, ifindex};
pub use config::DatapathConfig;
pub use encode::{NoResolver, Resolver, entry_key};
#[cfg(any(test, feature = "testing"))]
pub use fake::{FakeDatapath, FakeMaps};
pub use load::{Datapath, OBJECT};
pub use maps::{DatapathMaps, KernelMaps};
pub use pins::is_bpffs;
pub use plans::Plans;
pub use reconciler::{
    DatapathOps, DatapathOpsError, DatapathReconciler, DatapathStats, DatapathStatsSource,
    EntryStats, MapUsage, NoDatapath, stats,
};
pub use tries::{Counters, EntryCounter, Tries};

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
    Nft(#[from] nft::NftError),
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

/// A `map_err` for a file system call on `path`.
fn io_err(path: &Path) -> impl FnOnce(io::Error) -> DatapathError + '_ {
    move |source| DatapathError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A `map_err` for a link of interface `name`.
fn link_err<E: std::error::Error + Send + Sync + 'static>(
    name: &str,
) -> impl FnOnce(E) -> DatapathError + '_ {
    move |e| DatapathError::Link {
        name: name.to_owned(),
        source: Box::new(e),
    }
}
