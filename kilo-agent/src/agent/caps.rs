//! The Linux capabilities kg needs: checked once at start, so that a DaemonSet missing one says
//! which instead of failing later with a bare `EPERM`, and dropped once start-up is done, on
//! every thread, down to what the steady state uses.
//!
//! Measured on kernel 6.18 by starting `kg` under `setpriv` with reduced sets
//! (`tests/agent_capabilities_privileged.rs`): NET_ADMIN for links, addresses, routes, WireGuard,
//! the nftables rule and attaching programs; BPF and PERFMON for loading the programs (the verifier refuses
//! ours without PERFMON; SYS_ADMIN stands in for both, and for them all before kernel 5.8);
//! SYS_ADMIN only to mount bpffs when `/sys/fs/bpf` is not one (and,
//! while held, to compare a pinned attachment's program with ours on adoption, which saves one
//! atomic link update per attachment at a restart). After start-up kg keeps NET_ADMIN, and
//! BPF on kernels before 6.5 (where every bpf(2) call needs it); it drops the rest from the
//! effective, permitted, inheritable and ambient sets, and from the bounding set when it holds
//! SETPCAP (otherwise the bounding set stays, harmless: nothing can be exec'd to regain them).
//!
//! Capabilities are per thread: the threads already running (the file watcher, the blocking
//! pool) drop theirs too ([`crate::sys::caps`]), and the result is read back from
//! `/proc/self/task/*/status`. The names table is linux/capability.h's.
use crate::sys::caps as sys;
pub use crate::sys::caps::{SIGNAL, signal};

pub const NET_ADMIN: u32 = 12;
pub const SYS_ADMIN: u32 = 21;
pub const PERFMON: u32 = 38;
pub const BPF: u32 = 39;
const SETPCAP: u32 = 8;

/// A capability kg uses, with its bit number (linux/capability.h) and what it is for.
pub const NEEDED: [(&str, u32, &str); 4] = [
    (
        "CAP_NET_ADMIN",
        NET_ADMIN,
        "WireGuard, addresses, routes, the nftables rule and attaching the datapath",
    ),
    ("CAP_SYS_ADMIN", SYS_ADMIN, "mounting bpffs on /sys/fs/bpf"),
    ("CAP_PERFMON", PERFMON, "loading the datapath"),
    ("CAP_BPF", BPF, "loading the datapath"),
];

/// What start-up will do, to tell which capabilities it needs.
#[derive(Debug, Clone, Copy)]
pub struct Needs {
    pub datapath: bool,
    /// `/sys/fs/bpf` must be mounted first.
    pub mount_bpffs: bool,
}

/// A capability set from the text of `/proc/<pid>/status` (`field` is `CapEff`, `CapPrm`,
/// `CapBnd`...). Pure.
pub fn set(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
}

/// The effective capability set from the text of `/proc/self/status`. Pure.
pub fn effective(status: &str) -> Option<u64> {
    set(status, "CapEff")
}

/// The needed capabilities missing from `effective`, with what each is for. Pure.
pub fn missing(effective: u64, needs: Needs) -> Vec<(&'static str, &'static str)> {
    let has = |bit: u32| effective & (1 << bit) != 0;
    NEEDED
        .iter()
        .filter(|(_, bit, _)| match *bit {
            SYS_ADMIN => needs.datapath && needs.mount_bpffs,
            // SYS_ADMIN also allows what BPF and PERFMON do.
            BPF | PERFMON => needs.datapath && !has(SYS_ADMIN),
            _ => true,
        })
        .filter(|(_, bit, _)| !has(*bit))
        .map(|(name, _, what)| (*name, *what))
        .collect()
}

/// Logs a warning per missing capability (reading `/proc/self/status`).
pub fn warn_missing(needs: Needs) {
    let Some(eff) = std::fs::read_to_string("/proc/self/status")
        .ok()
        .as_deref()
        .and_then(effective)
    else {
        return;
    };
    for (name, what) in missing(eff, needs) {
        tracing::warn!(capability = name, needed_for = what, "capability missing");
    }
}

/// The capabilities the steady state uses: NET_ADMIN, and BPF before kernel 6.5 (`release` is
/// `uname -r`'s), where bpf(2) refuses every command, map updates included, without it. Pure.
pub fn steady_state(datapath: bool, release: &str) -> u64 {
    let mut parts = release.split(['.', '-']).map(|p| p.parse::<u32>().ok());
    let version = (
        parts.next().flatten().unwrap_or(0),
        parts.next().flatten().unwrap_or(0),
    );
    let old_bpf = version < (6, 5);
    (1 << NET_ADMIN) | if datapath && old_bpf { 1 << BPF } else { 0 }
}

/// The names of the capabilities in `mask`. Pure.
pub fn names(mask: u64) -> Vec<String> {
    (0..=63)
        .filter(|b| mask & (1 << b) != 0)
        .map(|b| match NAMES.get(b as usize) {
            Some(n) => format!("CAP_{n}"),
            None => format!("CAP_{b}"),
        })
        .collect()
}

const NAMES: [&str; 41] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    #[error("capabilities: {0}")]
    Sys(#[from] sys::CallError),
    #[error("capabilities: thread {tid} still holds {held:?} after the drop")]
    Kept { tid: String, held: Vec<String> },
}

/// What was dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Capabilities no longer effective nor permitted.
    pub dropped: u64,
    /// Whether the bounding set was reduced too (it needs SETPCAP).
    pub bounding: bool,
}

fn status_of(tid: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()
}

/// Keeps only `keep` on every thread of the process (see the module doc) and checks that no
/// thread holds more afterwards. Irreversible.
pub fn drop_all_but(keep: u64) -> Result<Dropped, CapsError> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|source| sys::CallError {
        call: "/proc/self/status",
        source,
    })?;
    let before = set(&status, "CapPrm").unwrap_or(0) | set(&status, "CapEff").unwrap_or(0);
    let bounding = effective(&status).unwrap_or(0) & (1 << SETPCAP) != 0;
    sys::keep_only_on_every_thread(keep, bounding)?;
    // Every thread, including any started meanwhile, must hold nothing beyond `keep`.
    for tid in sys::threads()? {
        let Some(status) = status_of(&tid) else {
            continue; // exited
        };
        let mut held = set(&status, "CapEff").unwrap_or(0) | set(&status, "CapPrm").unwrap_or(0);
        if bounding {
            held |= set(&status, "CapBnd").unwrap_or(0);
        }
        if held & !keep != 0 {
            return Err(CapsError::Kept {
                tid,
                held: names(held & !keep),
            });
        }
    }
    Ok(Dropped {
        dropped: before & !keep,
        bounding,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Needs = Needs {
        datapath: true,
        mount_bpffs: true,
    };

    #[test]
    fn names_what_is_missing() {
        let status = "Name:\tkg\nCapInh:\t0000000000000000\nCapEff:\t000000c000001000\n";
        let eff = effective(status).unwrap();
        assert_eq!(eff, (1 << 12) | (1 << 38) | (1 << 39));
        assert_eq!(
            missing(eff, ALL),
            vec![("CAP_SYS_ADMIN", "mounting bpffs on /sys/fs/bpf")]
        );
        let mounted = Needs {
            mount_bpffs: false,
            ..ALL
        };
        assert!(missing(eff, mounted).is_empty());
        assert!(missing(u64::MAX, ALL).is_empty());
        assert_eq!(missing(0, ALL).len(), 4);
        // SYS_ADMIN stands in for BPF and PERFMON; without the datapath only NET_ADMIN counts.
        assert_eq!(missing((1 << NET_ADMIN) | (1 << SYS_ADMIN), ALL), vec![]);
        let no_datapath = Needs {
            datapath: false,
            mount_bpffs: true,
        };
        assert_eq!(missing(0, no_datapath).len(), 1);
        assert_eq!(effective("Name:\tkg\n"), None);
        assert_eq!(set("CapBnd:\t0000000000001000\n", "CapBnd"), Some(1 << 12));
    }

    #[test]
    fn steady_state_keeps_bpf_only_where_bpf_needs_it() {
        assert_eq!(steady_state(true, "6.18.0-1-amd64"), 1 << NET_ADMIN);
        assert_eq!(steady_state(true, "6.5.0"), 1 << NET_ADMIN);
        assert_eq!(
            steady_state(true, "6.1.0-28-cloud-amd64"),
            (1 << NET_ADMIN) | (1 << BPF)
        );
        assert_eq!(steady_state(true, "5.15.0"), (1 << NET_ADMIN) | (1 << BPF));
        assert_eq!(steady_state(false, "5.15.0"), 1 << NET_ADMIN);
        assert_eq!(
            names((1 << SYS_ADMIN) | (1 << PERFMON)),
            ["CAP_SYS_ADMIN", "CAP_PERFMON"]
        );
    }
}
