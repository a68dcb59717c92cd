//! Helpers shared by the integration tests: root checks and throwaway network namespaces.
#![allow(dead_code)]

pub mod agent;
pub mod bpffs;
pub mod netns;
pub mod packets;

/// True when the test may create namespaces and load BPF programs. Elsewhere root-only tests
/// print why they skip and pass.
pub fn require_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("SKIP {test}: needs root (network namespaces, BPF)");
    }
    root
}

/// `--name VALUE` from the command line (the benchmarks' flags), or `default`.
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
