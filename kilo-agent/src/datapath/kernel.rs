//! What the datapath needs of the running kernel: every BPF program type, map type and helper
//! the programs use, with the Linux release that brought it, probed once at start so that a
//! kernel without one is refused in one line naming the kernel and what it lacks (rather than
//! a verifier log, or programs that load and then drop traffic). TCX (6.6) is not required:
//! below it, programs attach through clsact and netlink.
use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};

/// One thing the programs use, and the release that introduced it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Requirement {
    pub what: &'static str,
    /// The first Linux release that has it.
    pub since: &'static str,
    pub probe: Probe,
}

/// How to ask the kernel for a [`Requirement`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Probe {
    Program(ProgramType),
    Map(MapType),
    /// A helper callable from a TC classifier.
    Helper(BpfHelper),
}

/// The oldest kernel that has everything below (and that the kernel matrix runs).
pub const MINIMUM: &str = "5.10";

/// Everything the programs use that some kernel in use lacks. The mapped counters array
/// (`BPF_F_MMAPABLE`, 5.5) and the decapsulation's `BPF_ADJ_ROOM_MAC` (5.2) come before the ring
/// buffer, and are not probed apart.
pub const REQUIREMENTS: &[Requirement] = &[
    Requirement {
        what: "TC classifier programs",
        since: "4.1",
        probe: Probe::Program(ProgramType::SchedClassifier),
    },
    Requirement {
        what: "LPM-trie maps (the mesh destinations and NAT sources)",
        since: "4.11",
        probe: Probe::Map(MapType::LpmTrie),
    },
    Requirement {
        what: "BPF ring buffers (the programs' logs)",
        since: "5.8",
        probe: Probe::Map(MapType::RingBuf),
    },
    Requirement {
        what: "bpf_get_route_realm (which routes IPIP takes)",
        since: "4.4",
        probe: Probe::Helper(BpfHelper::BPF_FUNC_get_route_realm),
    },
    Requirement {
        what: "bpf_skb_adjust_room (IPIP)",
        since: "4.13",
        probe: Probe::Helper(BpfHelper::BPF_FUNC_skb_adjust_room),
    },
    Requirement {
        what: "bpf_redirect_neigh (the fast path)",
        since: "5.10",
        probe: Probe::Helper(BpfHelper::BPF_FUNC_redirect_neigh),
    },
];

/// The kernel lacks something the programs use.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error(
    "kernel {release} lacks {}; kg needs Linux {MINIMUM} or newer",
    missing.iter().map(|r| format!("{} (Linux {})", r.what, r.since)).collect::<Vec<_>>().join(", ")
)]
pub struct Unsupported {
    pub release: String,
    pub missing: Vec<Requirement>,
}

/// The requirements `probe` says are missing. A probe that cannot tell (an error other than
/// "unsupported", such as a missing capability) counts as present: loading will say more.
pub fn missing(probe: impl Fn(Probe) -> Option<bool>) -> Vec<Requirement> {
    REQUIREMENTS
        .iter()
        .filter(|r| probe(r.probe) == Some(false))
        .copied()
        .collect()
}

/// Asks the running kernel (bpf(2), no process started).
pub fn probe(p: Probe) -> Option<bool> {
    match p {
        Probe::Program(t) => is_program_supported(t).ok(),
        Probe::Map(t) => is_map_supported(t).ok(),
        Probe::Helper(h) => is_helper_supported(ProgramType::SchedClassifier, h).ok(),
    }
}

/// Checks the running kernel: `Err` names it and everything it lacks.
pub fn check() -> Result<(), Unsupported> {
    check_with(&release(), probe)
}

/// [`check`] with another kernel's answers.
pub fn check_with(release: &str, probe: impl Fn(Probe) -> Option<bool>) -> Result<(), Unsupported> {
    let missing = missing(probe);
    match missing.is_empty() {
        true => Ok(()),
        false => Err(Unsupported {
            release: release.to_owned(),
            missing,
        }),
    }
}

/// The running kernel's release (`uname -r`).
pub fn release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "(unknown release)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel of 5.4's era: no ring buffer, no bpf_redirect_neigh.
    fn linux_5_4(p: Probe) -> Option<bool> {
        Some(!matches!(
            p,
            Probe::Map(MapType::RingBuf) | Probe::Helper(BpfHelper::BPF_FUNC_redirect_neigh)
        ))
    }

    #[test]
    fn an_older_kernel_is_refused_in_one_line_naming_it_and_what_it_lacks() {
        let err = check_with("5.4.0-1-amd64", linux_5_4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "kernel 5.4.0-1-amd64 lacks BPF ring buffers (the programs' logs) (Linux 5.8), \
             bpf_redirect_neigh (the fast path) (Linux 5.10); kg needs Linux 5.10 or newer"
        );
        assert!(!err.to_string().contains('\n'));
    }

    #[test]
    fn a_probe_that_cannot_tell_refuses_nothing() {
        assert_eq!(check_with("x", |_| None), Ok(()));
        assert_eq!(check_with("x", |_| Some(true)), Ok(()));
    }

    #[test]
    fn no_requirement_is_newer_than_the_minimum() {
        let version = |v: &str| -> (u32, u32) {
            let (a, b) = v.split_once('.').unwrap();
            (a.parse().unwrap(), b.parse().unwrap())
        };
        for r in REQUIREMENTS {
            assert!(version(r.since) <= version(MINIMUM), "{r:?}");
        }
    }

    /// The real probes on the running kernel (every kernel the tests run on has everything).
    #[test]
    fn the_running_kernel_has_everything_when_it_can_be_asked() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        assert_eq!(check(), Ok(()), "{}", release());
    }
}
