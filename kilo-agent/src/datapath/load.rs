//! Loading the datapath ([`Datapath`]): the embedded object, its maps pinned under
//! `pin_dir/maps/<MAP>` (on a bpffs; `/sys/fs/bpf` is mounted if it is not one yet) and adopted
//! on start, so entries and counters survive restarts; pins of another definition or layout
//! replaced; the config map written only when it differs; the static masquerade rule kept
//! ([`super::nft`]); and clean-up. Without a `pin_dir` nothing is pinned and everything goes
//! with the value. Attaching is `attach.rs`'s.
use std::{borrow::Cow, collections::BTreeMap, fs, io};

use aya::{
    Ebpf, EbpfLoader,
    maps::MapError,
    programs::{SchedClassifier, tc::SchedClassifierLink},
};
use kilo_common::{
    CONFIG_ROUTE_REALM, CONFIG_SYNCED, LAYOUT, MAP_CONFIG, MAP_COUNTERS, MAP_DECAP, MAP_DST,
    MAP_ENCAP, MAP_IPIP_SRC, MAP_LOGS, MAP_NAT_SRC, PROG_DECAP, PROG_ENCAP, PROG_L2, PROG_L3,
};

use super::{
    DatapathConfig, DatapathError, Framing, KernelMaps, Trie,
    attach::{detach_pinned, program_mut},
    encode::Resolver,
    io_err,
    maps::DatapathMaps as _,
    nft,
    pins::{ensure_bpffs, list_dir, remove_pins},
    plans::Plans,
    tries::{Counters, Tries},
};
use crate::writes::{READ_BACK_EVERY, Write, Writes};

/// The `kilo-ebpf` object, built by build.rs.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/kilo-ebpf"));

/// The loaded datapath. Dropping it without [`Datapath::clean_up`] leaves pinned maps and links
/// (and netlink filters) working; a later [`Datapath::open`] with the same `pin_dir` adopts them.
pub struct Datapath {
    pub(super) config: DatapathConfig,
    pub(super) ebpf: Ebpf,
    pub(super) maps: KernelMaps,
    pub(super) tries: Tries,
    /// The tries have held a whole plan once ([`CONFIG_SYNCED`]).
    pub(super) synced: bool,
    /// Attachments this process holds (only without pins; pinned ones live on their own).
    pub(super) held: BTreeMap<String, SchedClassifierLink>,
    /// Pinned TCX links found at open running our programs on our maps, with their interface's
    /// index then: checked while kg still had the capabilities to read which program a link
    /// runs, so that adopting them after the drop writes nothing.
    pub(super) verified: BTreeMap<String, u32>,
    /// Keeps the masquerade rule.
    pub(super) nft: nft::Keeper,
}

impl Datapath {
    /// Loads the object (adopting pinned maps), loads the programs, and writes the config map
    /// if it differs. Attaches nothing: see [`Datapath::attach`].
    pub fn open(config: DatapathConfig) -> Result<Self, DatapathError> {
        let (datapath, _) = Self::open_counted(config)?;
        Ok(datapath)
    }

    /// Like [`Datapath::open`], also returning the writes (the config map).
    ///
    /// Pins are replaced rather than adopted when a map's definition differs (the kernel's
    /// check) or when the pinned config was written for another [`LAYOUT`] (what the maps
    /// mean changed); programs still attached keep the old maps until `attach` moves them.
    pub fn open_counted(mut config: DatapathConfig) -> Result<(Self, Writes), DatapathError> {
        config.validate()?;
        let pins = config.pin_dir.as_ref().map(|d| d.join("maps"));
        if let (Some(dir), Some(maps)) = (&config.pin_dir, &pins) {
            ensure_bpffs(dir)?;
            fs::create_dir_all(maps).map_err(io_err(maps))?;
        }
        let adopted = pins.as_ref().is_some_and(|m| m.join(MAP_CONFIG).exists());
        let replace = |why: &dyn std::fmt::Display| -> Result<_, DatapathError> {
            tracing::warn!(
                "datapath: pinned maps of {why}; replacing them (entries are written again, \
                 counters start from zero)"
            );
            remove_pins(pins.as_deref().expect("pinned"), &[])?;
            load(&config)
        };
        let (mut ebpf, mut maps) = match load(&config) {
            Err(DatapathError::Load(e))
                if pins.is_some()
                    && matches!(
                        *e,
                        aya::EbpfError::MapError(MapError::IncompatiblePinnedMap { .. })
                    ) =>
            {
                replace(&format_args!("another definition ({e})"))?
            }
            loaded => loaded?,
        };
        let mut pinned = maps.config()?;
        if adopted && pinned.layout != LAYOUT {
            drop((ebpf, maps));
            (ebpf, maps) = replace(&format_args!("layout {}, not {LAYOUT}", pinned.layout))?;
            pinned = maps.config()?;
        }
        if let Some(maps) = &pins {
            remove_pins(maps, &PINNED_MAPS)?;
        }
        for name in [PROG_L2, PROG_L3, PROG_ENCAP, PROG_DECAP] {
            program_mut(&mut ebpf, name)?
                .load()
                .map_err(|e| DatapathError::program(name, e))?;
        }
        tracing::info!(
            table_capacity = config.max_entries,
            counter_slots = maps.counter_slots(),
            "datapath: maps ready"
        );
        let current = pinned.layout == LAYOUT;
        let synced = current && pinned.flags & CONFIG_SYNCED != 0;
        // The running program keeps checking realms until the agent has looked at its routes.
        config.route_realm |= current && pinned.flags & CONFIG_ROUTE_REALM != 0;
        let nft = nft::Keeper::new(config.masquerade_rule(), READ_BACK_EVERY);
        let mut datapath = Datapath {
            config,
            ebpf,
            maps,
            tries: Tries::default(),
            synced,
            held: BTreeMap::new(),
            verified: BTreeMap::new(),
            nft,
        };
        datapath.verified = datapath.verify_pinned_links();
        let writes = datapath.write_config()?;
        Ok((datapath, writes))
    }

    pub fn config(&self) -> &DatapathConfig {
        &self.config
    }

    /// The maps, for reading counters or (in tests) writing raw entries.
    pub fn maps(&mut self) -> &mut KernelMaps {
        &mut self.maps
    }

    /// A loaded program (for `BPF_PROG_TEST_RUN`).
    pub fn program(&self, framing: Framing) -> &SchedClassifier {
        self.program_named(framing.program())
    }

    /// A loaded program by name (`kilo_common::PROG_*`).
    pub fn program_named(&self, name: &str) -> &SchedClassifier {
        self.ebpf
            .program(name)
            .and_then(|p| <&SchedClassifier>::try_from(p).ok())
            .expect("programs are loaded in open")
    }

    /// Makes the maps equal to `plan` (see [`Tries`]; a [`DatapathPlan`](crate::plan::DatapathPlan)
    /// alone clears the IPIP maps); the first apply to complete marks the maps
    /// [`CONFIG_SYNCED`] (one config write).
    pub fn apply<'a>(
        &mut self,
        plan: impl Into<Plans<'a>>,
        resolver: &dyn Resolver,
    ) -> Result<Writes, DatapathError> {
        let mut writes = self.tries.apply(&mut self.maps, plan, resolver)?;
        if !self.synced {
            self.synced = true;
            writes += self.write_config()?;
        }
        Ok(writes)
    }

    /// Whether the maps have held a whole plan once: until then a program attached to them
    /// could decide on a half-written topology.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Every counter, for the entries the last apply left (see [`Tries::counters`]).
    pub fn counters(&self) -> Result<Counters, DatapathError> {
        self.tries.counters(&self.maps)
    }

    /// Installs the static masquerade rule (in the network namespace of the first call) unless
    /// it is there already: read at the first call, after netfilter announced a change to its
    /// table by someone else, and every [`READ_BACK_EVERY`] calls ([`nft::Keeper`]).
    pub fn ensure_masquerade(&mut self) -> Result<Writes, DatapathError> {
        Ok(self.nft.ensure()?)
    }

    /// Sets the program's log level (one config write, none if unchanged; see [`super::logs`]).
    pub fn set_log_level(&mut self, level: u32) -> Result<Writes, DatapathError> {
        self.config.log_level = level;
        self.write_config()
    }

    /// The program's log records (once per load: the ring buffer is handed over). Pinned with
    /// the maps, so it also carries the records of an adopted program.
    pub fn logger<L: log::Log>(
        &mut self,
        to: L,
    ) -> Result<super::logs::ProgramLogger<L>, DatapathError> {
        aya_log::EbpfLogger::init_with_logger(&mut self.ebpf, to)
            .map_err(|e| DatapathError::Config(format!("the program's log buffer: {e}")))
    }

    /// Turns the fast path on or off (one config write, none if unchanged).
    pub fn set_fast_path(&mut self, on: bool) -> Result<Writes, DatapathError> {
        self.config.fast_path = on;
        self.write_config()
    }

    /// Tells the encapsulation whether route realms hold ([`DatapathConfig::route_realm`]; one
    /// config write, none if unchanged).
    pub fn set_route_realm(&mut self, on: bool) -> Result<Writes, DatapathError> {
        self.config.route_realm = on;
        self.write_config()
    }

    fn write_config(&mut self) -> Result<Writes, DatapathError> {
        let want = self.config.map_config(self.synced);
        let mut writes = Writes::default();
        if self.maps.config()? != want {
            self.maps.set_config(&want)?;
            writes.add(Write::MapConfig, 1);
        }
        Ok(writes)
    }

    /// Detaches from every interface, removes every pin and the pin directory, and deletes the
    /// nftables table (in the calling thread's network namespace). Consumes the datapath.
    pub fn clean_up(mut self) -> Result<Writes, DatapathError> {
        let mut writes = nft::remove_masquerade(&self.config.nft_table)?;
        let held: Vec<String> = self.held.keys().cloned().collect();
        for attachment in held {
            writes += self.detach_attachment(&attachment)?;
        }
        let Some(dir) = self.config.pin_dir.clone() else {
            return Ok(writes);
        };
        for sub in ["links", "netlink"] {
            // An interface's attachments in the reverse order of their making (its NAT
            // program, then `:decap`, then `:encap`), so the one that added a clsact qdisc goes
            // last and takes it along.
            let mut attachments = list_dir(&dir.join(sub))?;
            attachments.sort_by(|a, b| b.cmp(a));
            for attachment in attachments {
                writes += detach_pinned(&dir, &attachment)?;
            }
        }
        writes.add(Write::PinRemove, remove_pins(&dir.join("maps"), &[])?);
        drop(self);
        for sub in ["links", "netlink", "maps", ""] {
            let path = dir.join(sub);
            match fs::remove_dir(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err(&path)(e)),
                _ => {}
            }
        }
        Ok(writes)
    }
}

/// The maps pinned under `maps/`.
const PINNED_MAPS: [&str; 8] = [
    MAP_DST,
    MAP_NAT_SRC,
    MAP_ENCAP,
    MAP_IPIP_SRC,
    MAP_DECAP,
    MAP_CONFIG,
    MAP_COUNTERS,
    MAP_LOGS,
];

/// Loads the object (pinning its maps under `config`'s directory, adopting pins there) and
/// takes its maps; loads no program.
fn load(config: &DatapathConfig) -> Result<(Ebpf, KernelMaps), DatapathError> {
    let mut loader = EbpfLoader::new();
    for trie in Trie::ALL {
        loader.map_max_entries(trie.map_name(), config.max_entries);
    }
    loader.map_max_entries(MAP_COUNTERS, config.counters_len()?);
    if let Some(dir) = &config.pin_dir {
        for name in PINNED_MAPS {
            loader.map_pin_path(name, Cow::Owned(dir.join("maps").join(name)));
        }
    }
    let mut ebpf = loader.load(OBJECT).map_err(Box::new)?;
    let maps = KernelMaps::take(&mut ebpf, config)?;
    Ok((ebpf, maps))
}
