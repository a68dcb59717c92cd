//! Attaching the programs to interfaces: TCX links on kernels >= 6.6 (pinned under
//! `links/<attachment>`, so the program stays attached while the agent is down), a clsact qdisc
//! and a netlink filter below (marked by an empty `netlink/<attachment>` directory, since the
//! filter outlives the process by itself), adopting what an earlier run left, and detaching.
//! An attachment is named `<ifname>` for the NAT program at ingress, `<ifname>:encap` and
//! `<ifname>:decap` for the IPIP programs ([`Hook`]; interface names never hold a colon).
use std::{collections::BTreeMap, fs, path::Path};

use aya::{
    Ebpf,
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttach, TcHandle},
    },
    util::KernelVersion,
};
use kilo_common::{PROG_DECAP, PROG_ENCAP, PROG_L2, PROG_L3};

use super::{
    Datapath, DatapathError, io_err, link_err,
    pins::{ensure_bpffs, list_dir},
    rtnl,
};
use crate::writes::{Write, Writes};

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
    pub(super) const fn program(self) -> &'static str {
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
    pub(super) fn parse(attachment: &str) -> (&str, Hook) {
        match attachment.split_once(':') {
            Some((ifname, "encap")) => (ifname, Hook::Encap),
            Some((ifname, "decap")) => (ifname, Hook::Decap),
            _ => (attachment, Hook::Nat),
        }
    }

    pub(super) fn attach_type(self) -> TcAttachType {
        match self {
            Hook::Encap => TcAttachType::Egress,
            Hook::Nat | Hook::Decap => TcAttachType::Ingress,
        }
    }

    /// The netlink filter's priority (lower runs first).
    pub(super) fn priority(self) -> u16 {
        match self {
            Hook::Decap => NL_PRIORITY - 1,
            Hook::Nat | Hook::Encap => NL_PRIORITY,
        }
    }

    pub(super) fn program(self, framing: Framing) -> Result<&'static str, String> {
        match (self, framing) {
            (Hook::Nat, f) => Ok(f.program()),
            (Hook::Encap, Framing::L2) => Ok(PROG_ENCAP),
            (Hook::Decap, Framing::L2) => Ok(PROG_DECAP),
            (_, Framing::L3) => Err("IPIP needs an Ethernet private interface".into()),
        }
    }
}

impl Datapath {
    /// The pinned TCX links that run our programs on our maps now (see `verified`).
    pub(super) fn verify_pinned_links(&mut self) -> BTreeMap<String, u32> {
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

    pub(super) fn mode(&self) -> AttachMode {
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
                writes.add(Write::LinkUpdate, 1);
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
                writes.add(Write::LinkAttach, 1);
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
                fs::create_dir_all(dir).map_err(io_err(dir))?;
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
                fs::create_dir_all(&marker).map_err(io_err(&marker))?;
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

    pub(super) fn detach_attachment(&mut self, attachment: &str) -> Result<Writes, DatapathError> {
        let mut writes = Writes::default();
        if self.held.remove(attachment).is_some() {
            writes.add(Write::LinkDetach, 1);
        }
        if let Some(dir) = self.config.pin_dir.clone() {
            writes += detach_pinned(&dir, attachment)?;
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
        fs::remove_file(pin).map_err(io_err(pin))?;
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
            writes.add(Write::LinkUpdate, 1);
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
pub(super) fn detach_pinned(dir: &Path, attachment: &str) -> Result<Writes, DatapathError> {
    let mut writes = Writes::default();
    let (ifname, hook) = Hook::parse(attachment);
    let pin = dir.join("links").join(attachment);
    if pin.exists() {
        let link = PinnedLink::from_pin(&pin).map_err(link_err(ifname))?;
        // Unpinned and dropped: the last reference goes and the link detaches.
        drop(link.unpin().map_err(io_err(&pin))?);
        writes.add(Write::LinkDetach, 1);
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
        writes.add(Write::LinkDetach, 1);
    }
    // A clsact qdisc we added goes with our filter, unless someone else filters through it.
    let owned = marker.join(QDISC_MARK);
    if owned.exists() {
        if let Some(index) = index
            && rtnl::filters(index).map_err(link_err(ifname))? == 0
        {
            rtnl::delete_clsact(index).map_err(link_err(ifname))?;
            writes.add(Write::QdiscDelete, 1);
        }
        fs::remove_dir(&owned).map_err(io_err(&owned))?;
    }
    fs::remove_dir(&marker).map_err(io_err(&marker))?;
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

pub(super) fn program_mut<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, DatapathError> {
    let prog = ebpf
        .program_mut(name)
        .ok_or_else(|| DatapathError::Config(format!("object has no program {name}")))?;
    prog.try_into().map_err(|e| DatapathError::program(name, e))
}
