//! The kernel side of the datapath: the embedded object, its maps, attachment and pins.
//!
//! Pin layout under `pin_dir` (on a bpffs; `/sys/fs/bpf` is mounted if it is not one yet):
//! `maps/<MAP>` for every map (adopted on start: entries and counters survive restarts),
//! `links/<attachment>` for TCX links (the program stays attached while the agent is down), and
//! an empty directory `netlink/<attachment>` marking a netlink (clsact) attachment, which
//! outlives the process by itself. An attachment is named `<ifname>` for the NAT program at
//! ingress, `<ifname>:encap` and `<ifname>:decap` for the IPIP programs ([`Hook`]; interface
//! names never hold a colon). Without a `pin_dir` nothing is pinned and everything goes with the value.
use std::{
    borrow::Cow,
    collections::BTreeMap,
    fs, io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, IterableMap as _, MapData, MapError,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttach, TcHandle},
    },
    util::KernelVersion,
};
use ipnet::IpNet;
use kilo_common::{
    CONFIG_FAST_PATH, CONFIG_ROUTE_REALM, CONFIG_SYNCED, Config, Counter, DEFAULT_COUNTER_SLOTS,
    DEFAULT_MARK, DEFAULT_MARK_MASK, DEFAULT_MAX_ENTRIES, EntryValue, LAYOUT, LpmData, MAP_CONFIG,
    MAP_COUNTERS, MAP_DECAP, MAP_DST, MAP_ENCAP, MAP_IPIP_SRC, MAP_LOGS, MAP_NAT_SRC, PROG_DECAP,
    PROG_ENCAP, PROG_L2, PROG_L3, counter_stride,
};

use super::{
    DatapathError, Trie,
    counters::CounterArray,
    keys, rtnl,
    sync::{Counters, DatapathMaps, MapSync, Plans, READ_BACK_EVERY, Resolver},
};
use crate::{
    effects::Writes,
    nft::{self, MasqueradeRule},
};

/// The `kilo-ebpf` object, built by build.rs.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/kilo-ebpf"));

/// Priority and handle of the netlink (clsact) filter, fixed so a restart can replace it.
const NL_PRIORITY: u16 = 1107;
const NL_HANDLE: TcHandle = TcHandle::new(0, 1);
/// Inside a device's `netlink/<ifname>` marker: the clsact qdisc was added by us.
const QDISC_MARK: &str = "qdisc";

/// How programs are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttachMode {
    /// TCX on kernels >= 6.6, netlink (clsact) below.
    #[default]
    Auto,
    Tcx,
    Netlink,
}

/// Whether an interface's packets start with an Ethernet header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Ethernet (veth, bridge, NIC): the `kilo_ingress` program.
    L2,
    /// Raw IP (WireGuard, TUN, IP tunnels): the `kilo_ingress_l3` program.
    L3,
}

impl Framing {
    const fn program(self) -> &'static str {
        match self {
            Framing::L2 => PROG_L2,
            Framing::L3 => PROG_L3,
        }
    }
}

/// Which program an attachment runs, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// Ingress of the WireGuard or a pod-facing interface: the NAT decision (program by framing).
    Nat,
    /// Egress of the private interface (Ethernet): IPIP encapsulation.
    Encap,
    /// Ingress of the private interface (Ethernet): IPIP decapsulation and filter, before any
    /// other program there.
    Decap,
}

impl Hook {
    /// The attachment's name (its pin): see the module doc.
    pub fn attachment(self, ifname: &str) -> String {
        match self {
            Hook::Nat => ifname.to_owned(),
            Hook::Encap => format!("{ifname}:encap"),
            Hook::Decap => format!("{ifname}:decap"),
        }
    }

    /// The interface and hook of an attachment's name.
    fn parse(attachment: &str) -> (&str, Hook) {
        match attachment.split_once(':') {
            Some((ifname, "encap")) => (ifname, Hook::Encap),
            Some((ifname, "decap")) => (ifname, Hook::Decap),
            _ => (attachment, Hook::Nat),
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Encap => TcAttachType::Egress,
            Hook::Nat | Hook::Decap => TcAttachType::Ingress,
        }
    }

    /// The netlink filter's priority (lower runs first).
    fn priority(self) -> u16 {
        match self {
            Hook::Decap => NL_PRIORITY - 1,
            Hook::Nat | Hook::Encap => NL_PRIORITY,
        }
    }

    fn program(self, framing: Framing) -> Result<&'static str, String> {
        match (self, framing) {
            (Hook::Nat, f) => Ok(f.program()),
            (Hook::Encap, Framing::L2) => Ok(PROG_ENCAP),
            (Hook::Decap, Framing::L2) => Ok(PROG_DECAP),
            (_, Framing::L3) => Err("IPIP needs an Ethernet private interface".into()),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DatapathConfig {
    /// Where maps and links are pinned (e.g. `/sys/fs/bpf/kilo`); `None` pins nothing.
    pub pin_dir: Option<PathBuf>,
    pub attach: AttachMode,
    /// Mark bits set on packets to masquerade, under `mask`.
    pub mark: u32,
    pub mask: u32,
    /// Redirect mesh traffic straight to its egress (bypasses netfilter's FORWARD chain).
    pub fast_path: bool,
    /// The kernel keeps the realm of our `tunl0` routes ([`CONFIG_ROUTE_REALM`]): the
    /// encapsulation looks up only packets routed by them. Set by the agent once it has seen it;
    /// kept from adopted maps that have it until then.
    pub route_realm: bool,
    /// Capacity of each table.
    pub max_entries: u32,
    /// Per-entry counter slots (entries without one are not counted).
    pub counter_slots: u32,
    /// The private nftables table (family inet) holding the masquerade rule.
    pub nft_table: String,
    /// The program's log level (0 off, 1 error ... 5 trace; see [`super::logs`]).
    pub log_level: u32,
}

impl Default for DatapathConfig {
    fn default() -> Self {
        DatapathConfig {
            pin_dir: Some(PathBuf::from("/sys/fs/bpf/kilo")),
            attach: AttachMode::Auto,
            mark: DEFAULT_MARK,
            mask: DEFAULT_MARK_MASK,
            fast_path: false,
            route_realm: false,
            max_entries: DEFAULT_MAX_ENTRIES,
            counter_slots: DEFAULT_COUNTER_SLOTS,
            nft_table: "kilo".into(),
            log_level: 0,
        }
    }
}

impl DatapathConfig {
    fn masquerade_rule(&self) -> MasqueradeRule {
        MasqueradeRule {
            table: self.nft_table.clone(),
            mark: self.mark,
            mask: self.mask,
        }
    }

    fn validate(&self) -> Result<(), DatapathError> {
        if self.mark == 0 || self.mark & !self.mask != 0 {
            return Err(DatapathError::Config(format!(
                "mark {:#x} must be non-zero and inside mask {:#x}",
                self.mark, self.mask
            )));
        }
        if self.max_entries == 0 || self.counter_slots == 0 {
            return Err(DatapathError::Config(
                "max_entries and counter_slots must be non-zero".into(),
            ));
        }
        Ok(())
    }

    /// Counters in the counters array: a region for each possible CPU.
    fn counters_len(&self) -> Result<u32, DatapathError> {
        let cpus = aya::util::nr_cpus()
            .map_err(|(path, source)| DatapathError::Io {
                path: path.into(),
                source,
            })?
            .get() as u32;
        counter_stride(self.counter_slots)
            .checked_mul(cpus)
            .ok_or_else(|| {
                DatapathError::Config(format!(
                    "{} counter slots on {cpus} CPUs do not fit one array",
                    self.counter_slots
                ))
            })
    }

    /// The value of the program's config map (`synced`: see [`CONFIG_SYNCED`]).
    pub fn map_config(&self, synced: bool) -> Config {
        let flag = |on: bool, bit: u32| if on { bit } else { 0 };
        Config {
            layout: LAYOUT,
            flags: flag(self.fast_path, CONFIG_FAST_PATH)
                | flag(synced, CONFIG_SYNCED)
                | flag(self.route_realm, CONFIG_ROUTE_REALM),
            log_level: self.log_level,
            mark: self.mark,
            mask: self.mask,
            counter_stride: counter_stride(self.counter_slots),
        }
    }
}

type TrieMap = LpmTrie<MapData, LpmData, EntryValue>;

/// The program's maps, opened from the loaded object: the tries, the config and the counters.
pub struct KernelMaps {
    /// In [`Trie::ALL`]'s order.
    tries: [TrieMap; 5],
    config: Array<MapData, Config>,
    counters: CounterArray,
    capacity: usize,
}

impl KernelMaps {
    fn take(ebpf: &mut Ebpf, config: &DatapathConfig) -> Result<Self, DatapathError> {
        fn take<T: TryFrom<aya::maps::Map, Error = MapError>>(
            ebpf: &mut Ebpf,
            name: &'static str,
        ) -> Result<T, DatapathError> {
            let map = ebpf
                .take_map(name)
                .ok_or_else(|| DatapathError::Config(format!("object has no map {name}")))?;
            T::try_from(map).map_err(|e| DatapathError::map(name, e))
        }
        let [a, b, c, d, e] = Trie::ALL.map(|t| take(ebpf, t.map_name()));
        Ok(KernelMaps {
            tries: [a?, b?, c?, d?, e?],
            config: take(ebpf, MAP_CONFIG)?,
            counters: CounterArray::new(
                ebpf.take_map(MAP_COUNTERS),
                counter_stride(config.counter_slots),
            )?,
            capacity: config.max_entries as usize,
        })
    }
}

/// Every entry of `trie` through BPF_MAP_LOOKUP_BATCH: one system call per 1,024 entries
/// instead of two per entry (get_next_key, lookup).
fn lookup_batch(trie: &TrieMap) -> io::Result<Vec<(Key<LpmData>, EntryValue)>> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    /// The `batch` member of `union bpf_attr`.
    #[repr(C)]
    struct Batch {
        in_batch: u64,
        out_batch: u64,
        keys: u64,
        values: u64,
        count: u32,
        map_fd: u32,
        elem_flags: u64,
        flags: u64,
    }
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    const CHUNK: usize = 1024;
    let fd = trie.map().fd().as_fd().as_raw_fd();
    let zero = LpmData {
        family: 0,
        addr: [0; 16],
    };
    let mut keys = vec![Key::new(0, zero); CHUNK];
    // SAFETY: EntryValue is plain integers and bytes, for which zero is a value.
    let mut values = vec![unsafe { std::mem::zeroed::<EntryValue>() }; CHUNK];
    // Where the kernel's walk stopped (a key), given back to resume it.
    let mut token = Key::new(0, zero);
    let mut out = Vec::new();
    loop {
        let mut attr = Batch {
            in_batch: if out.is_empty() {
                0
            } else {
                &raw const token as u64
            },
            out_batch: &raw mut token as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd as u32,
            elem_flags: 0,
            flags: 0,
        };
        // SAFETY: the attribute points at buffers of `count` keys and values of the map's sizes
        // and at a key-sized token, all alive for the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &raw mut attr,
                size_of::<Batch>(),
            )
        };
        let error = (rc < 0).then(io::Error::last_os_error);
        let n = (attr.count as usize).min(CHUNK);
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        match error {
            None if n > 0 => {}
            // ENOENT: the walk is done (with the last entries in `count`).
            None => return Ok(out),
            Some(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            Some(e) => return Err(e),
        }
    }
}

fn errno(e: &MapError) -> Option<i32> {
    match e {
        MapError::SyscallError(s) => s.io_error.raw_os_error(),
        _ => None,
    }
}

impl DatapathMaps for KernelMaps {
    fn entries(&self, trie: Trie) -> Result<Vec<(IpNet, EntryValue)>, DatapathError> {
        let name = trie.map_name();
        let trie = &self.tries[trie as usize];
        let items = match lookup_batch(trie) {
            Ok(items) => items,
            // Kernels without batch lookups on LPM tries: two system calls per entry.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::EOPNOTSUPP | 524)
                ) =>
            {
                let mut items = Vec::new();
                for item in trie.iter() {
                    match item {
                        Ok(kv) => items.push(kv),
                        // Deleted between get_next_key and lookup: skip.
                        Err(MapError::KeyNotFound) => {}
                        Err(e) => return Err(DatapathError::map(name, e)),
                    }
                }
                items
            }
            Err(io_error) => {
                let call = "bpf_map_lookup_batch";
                let e = MapError::SyscallError(aya::sys::SyscallError { call, io_error });
                return Err(DatapathError::map(name, e));
            }
        };
        items
            .into_iter()
            .map(|(key, value)| {
                let net = keys::net_from_key(&key).ok_or(DatapathError::BadKey {
                    name,
                    prefix_len: key.prefix_len(),
                    family: key.data().family,
                })?;
                Ok((net, value))
            })
            .collect()
    }

    fn insert(&mut self, trie: Trie, net: IpNet, value: &EntryValue) -> Result<(), DatapathError> {
        let capacity = self.capacity;
        let name = trie.map_name();
        self.tries[trie as usize]
            .insert(&keys::entry_key(&net), value, 0)
            .map_err(|e| match errno(&e) {
                Some(libc::ENOSPC) | Some(libc::E2BIG) | Some(libc::ENOMEM) => {
                    DatapathError::Full { name, capacity }
                }
                _ => DatapathError::map(name, e),
            })
    }

    fn remove(&mut self, trie: Trie, net: IpNet) -> Result<(), DatapathError> {
        let name = trie.map_name();
        match self.tries[trie as usize].remove(&keys::entry_key(&net)) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) if errno(&e) == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(DatapathError::map(name, e)),
        }
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn counter_slots(&self) -> u32 {
        self.counters.entry_slots()
    }

    fn entry_counter(&self, slot: u32) -> Result<Counter, DatapathError> {
        self.counters.entry(slot)
    }

    fn reset_entry_counter(&mut self, slot: u32) -> Result<(), DatapathError> {
        self.counters.reset_entry(slot)
    }

    fn decision_counters(&self) -> Result<Vec<Counter>, DatapathError> {
        Ok(self.counters.decisions())
    }

    fn config(&self) -> Result<Config, DatapathError> {
        self.config
            .get(&0, 0)
            .map_err(|e| DatapathError::map(MAP_CONFIG, e))
    }

    fn set_config(&mut self, config: &Config) -> Result<(), DatapathError> {
        self.config
            .set(0, config, 0)
            .map_err(|e| DatapathError::map(MAP_CONFIG, e))
    }
}

/// The loaded datapath. Dropping it without [`Datapath::cleanup`] leaves pinned maps and links
/// (and netlink filters) working; a later [`Datapath::open`] with the same `pin_dir` adopts them.
pub struct Datapath {
    config: DatapathConfig,
    ebpf: Ebpf,
    maps: KernelMaps,
    sync: MapSync,
    /// The tries have held a whole plan once ([`CONFIG_SYNCED`]).
    synced: bool,
    /// Attachments this process holds (only without pins; pinned ones live on their own).
    held: BTreeMap<String, SchedClassifierLink>,
    /// Pinned TCX links found at open running our programs on our maps, with their interface's
    /// index then: checked while kg still had the capabilities to read which program a link
    /// runs, so that adopting them after the drop writes nothing.
    verified: BTreeMap<String, u32>,
    /// Keeps the masquerade rule.
    nft: nft::Keeper,
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
            fs::create_dir_all(maps).map_err(io(maps))?;
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
            sync: MapSync::default(),
            synced,
            held: BTreeMap::new(),
            verified: BTreeMap::new(),
            nft,
        };
        datapath.verified = datapath.verify_pinned_links();
        let writes = datapath.write_config()?;
        Ok((datapath, writes))
    }

    /// The pinned TCX links that run our programs on our maps now (see `verified`).
    fn verify_pinned_links(&mut self) -> BTreeMap<String, u32> {
        let Some(dir) = self.config.pin_dir.as_ref().map(|d| d.join("links")) else {
            return BTreeMap::new();
        };
        if self.mode() != AttachMode::Tcx {
            return BTreeMap::new();
        }
        let mut verified = BTreeMap::new();
        for attachment in list_dir(&dir).unwrap_or_default() {
            let (ifname, hook) = Hook::parse(&attachment);
            let Ok(ifindex) = ifindex(ifname) else {
                continue;
            };
            let Some(prog_name) = framing(ifname).ok().and_then(|f| hook.program(f).ok()) else {
                continue;
            };
            let Ok(prog) = program_mut(&mut self.ebpf, prog_name) else {
                continue;
            };
            let pin = dir.join(&attachment);
            if let Ok(PinnedRuns::Ours) = runs_ours(prog, ifname, ifindex, hook.attach_type(), &pin)
            {
                verified.insert(attachment, ifindex);
            }
        }
        verified
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

    /// Makes the maps equal to `plan` (see [`MapSync`]; a [`DatapathPlan`](crate::plan::DatapathPlan)
    /// alone clears the IPIP maps); the first sync to complete marks the maps
    /// [`CONFIG_SYNCED`] (one config write).
    pub fn sync<'a>(
        &mut self,
        plan: impl Into<Plans<'a>>,
        resolver: &dyn Resolver,
    ) -> Result<Writes, DatapathError> {
        let mut writes = self.sync.sync(&mut self.maps, plan, resolver)?;
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

    /// Every counter, for the entries the last sync left (see [`MapSync::counters`]).
    pub fn counters(&self) -> Result<Counters, DatapathError> {
        self.sync.counters(&self.maps)
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
            writes.add("map_config", 1);
        }
        Ok(writes)
    }

    fn mode(&self) -> AttachMode {
        match self.config.attach {
            AttachMode::Auto => match KernelVersion::current() {
                Ok(v) if v >= KernelVersion::new(6, 6, 0) => AttachMode::Tcx,
                _ => AttachMode::Netlink,
            },
            m => m,
        }
    }

    /// Whether the NAT program's TCX link to `ifname` was pinned and the pin is gone: the bpffs
    /// was unmounted under us, and the kernel released the link (the program no longer runs
    /// there). Links this process holds are never lost.
    pub fn lost_attachment(&self, ifname: &str) -> bool {
        let attachment = Hook::Nat.attachment(ifname);
        self.mode() == AttachMode::Tcx
            && !self.held.contains_key(&attachment)
            && self
                .config
                .pin_dir
                .as_ref()
                .is_some_and(|d| !d.join("links").join(&attachment).exists())
    }

    /// Attaches the NAT program at ingress of `ifname` (see [`Datapath::attach_hook`]).
    pub fn attach(&mut self, ifname: &str) -> Result<Writes, DatapathError> {
        self.attach_hook(ifname, Hook::Nat)
    }

    /// Attaches `hook`'s program to `ifname` (in the calling thread's network namespace),
    /// choosing the NAT program by the device's framing. Idempotent: an attachment pinned by an
    /// earlier run is adopted (and moved to this run's program, atomically, only if the program
    /// differs).
    pub fn attach_hook(&mut self, ifname: &str, hook: Hook) -> Result<Writes, DatapathError> {
        let ifindex = ifindex(ifname)?;
        let prog_name =
            hook.program(framing(ifname)?)
                .map_err(|reason| DatapathError::Interface {
                    name: ifname.to_owned(),
                    reason,
                })?;
        let prog_err = |e| DatapathError::program(prog_name, e);
        let attachment = hook.attachment(ifname);
        let (attach_type, priority) = (hook.attach_type(), hook.priority());
        let tcx = self.mode() == AttachMode::Tcx;
        let pin_dir = self.config.pin_dir.clone();
        let link_pin = pin_dir.as_ref().map(|d| d.join("links").join(&attachment));
        let verified = self.verified.remove(&attachment) == Some(ifindex);
        let prog = program_mut(&mut self.ebpf, prog_name)?;
        let mut writes = Writes::default();
        if let Some(pin) = link_pin.as_ref().filter(|p| tcx && p.exists()) {
            if verified {
                return Ok(writes);
            }
            if let Some(adopted) = adopt_tcx(prog, prog_name, ifname, ifindex, attach_type, pin)? {
                return Ok(adopted);
            }
        }
        // Netlink: the clsact qdisc first (EEXIST when it is there already: any real problem
        // fails the attach), then our filter replaced in place if it is there.
        let created_qdisc = !tcx && tc::qdisc_add_clsact(ifindex).is_ok();
        let existing = match tcx {
            true => None,
            false => Some(
                SchedClassifierLink::attached(
                    ifindex,
                    attach_type.into(),
                    priority,
                    NL_HANDLE,
                    None,
                )
                .map_err(link_err(ifname))?,
            ),
        };
        let id = match existing.map(|l| prog.attach_to_link(l)) {
            Some(Ok(id)) => {
                writes.add("link_update", 1);
                id
            }
            _ => {
                let how = match tcx {
                    true => TcAttach::Tcx {
                        attach_type,
                        order: match hook {
                            Hook::Decap => LinkOrder::first(),
                            _ => LinkOrder::default(),
                        },
                    },
                    false => TcAttach::Netlink {
                        parent: attach_type.into(),
                        options: NlOptions {
                            priority,
                            handle: NL_HANDLE,
                            classid: None,
                        },
                    },
                };
                writes.add("link_attach", 1);
                prog.attach(ifindex, how).map_err(prog_err)?
            }
        };
        let link = prog.take_link(id).map_err(prog_err)?;
        // A pin directory no longer on a bpffs (unmounted under us) cannot hold a TCX link: this
        // process holds it instead, so the program stays attached.
        let pinnable = pin_dir.as_deref().is_some_and(|d| ensure_bpffs(d).is_ok());
        match (pin_dir, link_pin) {
            (_, Some(pin)) if tcx && pinnable => {
                let dir = pin.parent().expect("links dir");
                fs::create_dir_all(dir).map_err(io(dir))?;
                let fd = FdLink::try_from(link).map_err(link_err(ifname))?;
                fd.pin(&pin).map_err(link_err(ifname))?;
            }
            (None, _) | (_, None) => {
                self.held.insert(attachment, link);
            }
            (Some(_), Some(_)) if tcx => {
                self.held.insert(attachment, link);
            }
            (Some(dir), _) => {
                // The filter outlives us by itself; remember it (and whether the qdisc is ours)
                // for clean-up.
                let marker = dir.join("netlink").join(&attachment);
                let marker = match created_qdisc {
                    true => marker.join(QDISC_MARK),
                    false => marker,
                };
                fs::create_dir_all(&marker).map_err(io(&marker))?;
                std::mem::forget(link);
            }
        }
        Ok(writes)
    }

    /// Detaches the NAT program from `ifname` and removes its pin.
    pub fn detach(&mut self, ifname: &str) -> Result<Writes, DatapathError> {
        self.detach_attachment(&Hook::Nat.attachment(ifname))
    }

    /// Detaches `hook`'s program from `ifname` and removes its pin.
    pub fn detach_hook(&mut self, ifname: &str, hook: Hook) -> Result<Writes, DatapathError> {
        self.detach_attachment(&hook.attachment(ifname))
    }

    fn detach_attachment(&mut self, attachment: &str) -> Result<Writes, DatapathError> {
        let mut writes = Writes::default();
        if self.held.remove(attachment).is_some() {
            writes.add("link_detach", 1);
        }
        if let Some(dir) = self.config.pin_dir.clone() {
            writes += detach_pinned(&dir, attachment)?;
        }
        Ok(writes)
    }

    /// Detaches from every interface, removes every pin and the pin directory, and deletes the
    /// nftables table (in the calling thread's network namespace). Consumes the datapath.
    pub fn cleanup(mut self) -> Result<Writes, DatapathError> {
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
        writes.add("pin_remove", remove_pins(&dir.join("maps"), &[])?);
        drop(self);
        for sub in ["links", "netlink", "maps", ""] {
            let path = dir.join(sub);
            match fs::remove_dir(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io(&path)(e)),
                _ => {}
            }
        }
        Ok(writes)
    }
}

/// Adopts the TCX link pinned at `pin`, moving it to `prog` (atomically) when it runs another
/// program or the same one bound to other maps (pins replaced), or when the programs attached
/// cannot be read (by-id lookups take CAP_SYS_ADMIN, which kg drops after start-up); `None` when
/// the pin is stale (its device gone or recreated), then removed.
fn adopt_tcx(
    prog: &mut SchedClassifier,
    prog_name: &'static str,
    ifname: &str,
    ifindex: u32,
    attach_type: TcAttachType,
    pin: &Path,
) -> Result<Option<Writes>, DatapathError> {
    let mut writes = Writes::default();
    let stale = || {
        tracing::info!(ifname, "datapath: stale link pin, attaching anew");
        fs::remove_file(pin).map_err(io(pin))?;
        Ok(None)
    };
    let current = runs_ours(prog, ifname, ifindex, attach_type, pin)?;
    let link = FdLink::from(PinnedLink::from_pin(pin).map_err(link_err(ifname))?);
    match current {
        PinnedRuns::Ours => return Ok(Some(writes)),
        PinnedRuns::Detached => return stale(),
        PinnedRuns::Other | PinnedRuns::Unreadable => {}
    }
    let link = SchedClassifierLink::try_from(link).map_err(link_err(ifname))?;
    match prog.attach_to_link(link) {
        Ok(id) => {
            // Still pinned: dropping our handle keeps the link.
            drop(prog.take_link(id));
            writes.add("link_update", 1);
            Ok(Some(writes))
        }
        // Unread, the device may be gone: the kernel says so.
        Err(ProgramError::SyscallError(e))
            if current == PinnedRuns::Unreadable
                && e.io_error.raw_os_error() == Some(libc::ENOLINK) =>
        {
            stale()
        }
        Err(e) => Err(DatapathError::program(prog_name, e)),
    }
}

/// What a pinned TCX link runs, as far as kg can tell.
#[derive(Debug, PartialEq, Eq)]
enum PinnedRuns {
    /// `prog` (the same code on the same maps) on the device.
    Ours,
    /// Another program on the device.
    Other,
    /// Nothing on the device: the link is stale.
    Detached,
    /// Unknown: by-id lookups take CAP_SYS_ADMIN.
    Unreadable,
}

/// What the TCX link pinned at `pin` runs at `ifindex`.
fn runs_ours(
    prog: &SchedClassifier,
    ifname: &str,
    ifindex: u32,
    attach_type: TcAttachType,
    pin: &Path,
) -> Result<PinnedRuns, DatapathError> {
    let link = FdLink::from(PinnedLink::from_pin(pin).map_err(link_err(ifname))?);
    let prog_id = link.info().map_err(link_err(ifname))?.program_id();
    let attached = match SchedClassifier::query_tcx(ifindex, attach_type) {
        Err(ProgramError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EPERM) => {
            return Ok(PinnedRuns::Unreadable);
        }
        r => r.map_err(link_err(ifname))?.1,
    };
    let ours = prog.info().map_err(link_err(ifname))?;
    Ok(match attached.iter().find(|p| p.id() == prog_id) {
        None => PinnedRuns::Detached,
        Some(running)
            if running.tag() == ours.tag() && pinned_maps(running) == pinned_maps(&ours) =>
        {
            PinnedRuns::Ours
        }
        Some(_) => PinnedRuns::Other,
    })
}

/// A `map_err` for a file system call on `path`.
fn io(path: &Path) -> impl FnOnce(io::Error) -> DatapathError + '_ {
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

fn program_mut<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, DatapathError> {
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| DatapathError::Config(format!("object has no program {name}")))?;
    prog.try_into().map_err(|e| DatapathError::program(name, e))
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

/// Removes the pins under `maps` not named in `keep` (with an empty `keep`, every one: the maps
/// are replaced; with [`PINNED_MAPS`], those of maps an upgrade renamed or dropped, which a
/// program still attached keeps until `attach` moves its link to ours). Returns how many.
fn remove_pins(maps: &Path, keep: &[&str]) -> Result<u64, DatapathError> {
    let mut removed = 0;
    for pin in list_dir(maps)? {
        if !keep.contains(&pin.as_str()) {
            tracing::debug!(pin = %pin, "datapath: removing a map pin");
            let path = maps.join(pin);
            fs::remove_file(&path).map_err(io(&path))?;
            removed += 1;
        }
    }
    Ok(removed)
}

fn list_dir(dir: &Path) -> Result<Vec<String>, DatapathError> {
    match fs::read_dir(dir) {
        Ok(rd) => Ok(rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(io(dir)(e)),
    }
}

/// The IDs of a program's named maps (those pinned; not the per-load `.rodata`/`.bss`).
fn pinned_maps(prog: &aya::programs::ProgramInfo) -> Option<Vec<u32>> {
    let ids = prog.map_ids().ok().flatten()?;
    let named = ids.into_iter().filter(|id| {
        aya::maps::MapInfo::from_id(*id)
            .map(|m| !m.name_as_str().unwrap_or(".").starts_with('.'))
            .unwrap_or(false)
    });
    Some(named.collect())
}

/// Detaches the pinned TCX link or the marked netlink filter of `attachment` (see [`Hook`]).
fn detach_pinned(dir: &Path, attachment: &str) -> Result<Writes, DatapathError> {
    let mut writes = Writes::default();
    let (ifname, hook) = Hook::parse(attachment);
    let pin = dir.join("links").join(attachment);
    if pin.exists() {
        let link = PinnedLink::from_pin(&pin).map_err(link_err(ifname))?;
        // Unpinned and dropped: the last reference goes and the link detaches.
        drop(link.unpin().map_err(io(&pin))?);
        writes.add("link_detach", 1);
    }
    let marker = dir.join("netlink").join(attachment);
    if !marker.exists() {
        return Ok(writes);
    }
    // The interface may be gone already (and its filter with it).
    let index = ifindex(ifname).ok();
    let link = index.map(|i| {
        SchedClassifierLink::attached(
            i,
            hook.attach_type().into(),
            hook.priority(),
            NL_HANDLE,
            None,
        )
    });
    if link.is_some_and(|l| l.is_ok_and(|l| aya::programs::Link::detach(l).is_ok())) {
        writes.add("link_detach", 1);
    }
    // A clsact qdisc we added goes with our filter, unless someone else filters through it.
    let owned = marker.join(QDISC_MARK);
    if owned.exists() {
        if let Some(index) = index
            && rtnl::filters(index).map_err(link_err(ifname))? == 0
        {
            rtnl::delete_clsact(index).map_err(link_err(ifname))?;
            writes.add("qdisc_delete", 1);
        }
        fs::remove_dir(&owned).map_err(io(&owned))?;
    }
    fs::remove_dir(&marker).map_err(io(&marker))?;
    Ok(writes)
}

/// The index of `ifname` in the calling thread's network namespace.
pub fn ifindex(ifname: &str) -> Result<u32, DatapathError> {
    nix::net::if_::if_nametoindex(ifname).map_err(|e| DatapathError::Interface {
        name: ifname.to_owned(),
        reason: format!("not found: {e}"),
    })
}

/// Ethernet or raw IP, from the device's link-layer type (in the calling thread's namespace).
pub fn framing(ifname: &str) -> Result<Framing, DatapathError> {
    use netlink_packet_route::link::LinkLayerType as T;
    let err = |reason: String| DatapathError::Interface {
        name: ifname.to_owned(),
        reason,
    };
    let link_type =
        rtnl::link_type(ifindex(ifname)?).map_err(|e| err(format!("RTM_GETLINK: {e}")))?;
    match link_type {
        T::Ether | T::Loopback => Ok(Framing::L2),
        T::None | T::Tunnel | T::Tunnel6 | T::Ipgre | T::Sit | T::Rawip => Ok(Framing::L3),
        other => Err(err(format!("unsupported link type {other}"))),
    }
}

/// Makes sure `dir` can hold pins: mounts bpffs on `/sys/fs/bpf` when `dir` is under it and
/// nothing is mounted there yet; otherwise `dir` must already be on a bpffs.
fn ensure_bpffs(dir: &Path) -> Result<(), DatapathError> {
    let root = Path::new("/sys/fs/bpf");
    if dir.starts_with(root) && !is_bpffs(root) {
        nix::mount::mount(
            Some("bpf"),
            root,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(|e| io(root)(e.into()))?;
        tracing::info!("datapath: mounted bpffs on /sys/fs/bpf");
    }
    // The nearest existing ancestor must be on bpffs.
    let mut probe = dir;
    while !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new("/"));
    }
    if !is_bpffs(probe) {
        return Err(DatapathError::Config(format!(
            "pin directory {} is not on a bpf filesystem",
            dir.display()
        )));
    }
    Ok(())
}

/// Whether `path` is on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|st| st.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}
