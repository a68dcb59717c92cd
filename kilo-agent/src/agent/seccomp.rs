//! The agent cannot start processes: after start-up it installs a seccomp filter, on every
//! thread (TSYNC), that makes `execve` and `execveat` fail with `EPERM`. Everything else is
//! allowed. `--seccomp=false` turns it off for debugging.
use std::collections::BTreeMap;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp: unsupported architecture {0}")]
    Arch(String),
    #[error("seccomp: {0}")]
    Filter(String),
}

/// Installs the no-exec filter on all threads of the process. Irreversible.
pub fn forbid_exec() -> Result<(), SeccompError> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|_| SeccompError::Arch(std::env::consts::ARCH.into()))?;
    let rules = BTreeMap::from([(libc::SYS_execve, vec![]), (libc::SYS_execveat, vec![])]);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| SeccompError::Filter(e.to_string()))?;
    let program: BpfProgram = filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError::Filter(e.to_string()))?;
    seccompiler::apply_filter_all_threads(&program).map_err(|e| SeccompError::Filter(e.to_string()))
}
