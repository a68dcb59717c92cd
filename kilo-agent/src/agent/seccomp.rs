//! After start-up the agent installs a seccomp filter, on every thread (TSYNC), that makes
//! the system calls it no longer needs fail with `EPERM`: starting a program (`execve`,
//! `execveat`), loading BPF programs or creating maps (`bpf` with `BPF_PROG_LOAD` or
//! `BPF_MAP_CREATE`: everything is loaded at start), reading or writing other processes
//! (`ptrace`, `process_vm_readv`/`writev`), mounting (`mount`, the new mount API, `umount2`,
//! `pivot_root`, `chroot`) and the kernel-wide calls (modules, `kexec`, `reboot`, swap).
//! Everything else is allowed. `--seccomp=false` turns it off for debugging.
use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp: {0}")]
    Filter(String),
}

/// `kexec_file_load`, which libc names for musl on x86_64 only.
#[cfg(target_arch = "x86_64")]
const SYS_KEXEC_FILE_LOAD: libc::c_long = libc::SYS_kexec_file_load;
/// asm-generic/unistd.h's number.
#[cfg(target_arch = "aarch64")]
const SYS_KEXEC_FILE_LOAD: libc::c_long = 294;
/// arch/arm/tools/syscall.tbl's number.
#[cfg(target_arch = "arm")]
const SYS_KEXEC_FILE_LOAD: libc::c_long = 401;

/// The system calls refused outright.
const REFUSED: [libc::c_long; 21] = [
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_fsopen,
    libc::SYS_fsmount,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    SYS_KEXEC_FILE_LOAD,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
];

/// `bpf(2)` commands refused (linux/bpf.h).
const BPF_MAP_CREATE: u64 = 0;
const BPF_PROG_LOAD: u64 = 5;

/// Installs the filter on all threads of the process (irreversible) and returns true. On an
/// architecture seccompiler has no filter for (32-bit ARM), warns and returns false: Kilo has
/// no filter at all, and the agent must still run there.
pub fn install() -> Result<bool, SeccompError> {
    let Ok(arch) = std::env::consts::ARCH.try_into() else {
        tracing::warn!(
            arch = std::env::consts::ARCH,
            "no seccomp filter for this architecture: exec is not forbidden"
        );
        return Ok(false);
    };
    let err = |e: seccompiler::BackendError| SeccompError::Filter(e.to_string());
    let bpf_cmd = |cmd| {
        SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, cmd)
            .and_then(|c| SeccompRule::new(vec![c]))
            .map_err(err)
    };
    // libc's syscall numbers are `c_long`: i64 on 64-bit targets, i32 on 32-bit ARM.
    #[allow(clippy::useless_conversion)]
    let nr = |n: libc::c_long| i64::from(n);
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        REFUSED.iter().map(|n| (nr(*n), vec![])).collect();
    rules.insert(
        nr(libc::SYS_bpf),
        vec![bpf_cmd(BPF_MAP_CREATE)?, bpf_cmd(BPF_PROG_LOAD)?],
    );
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(err)?;
    let program: BpfProgram = filter.try_into().map_err(err)?;
    seccompiler::apply_filter_all_threads(&program)
        .map_err(|e| SeccompError::Filter(e.to_string()))?;
    Ok(true)
}
