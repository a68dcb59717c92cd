//! What `cargo xtask` installs, idempotently and keyed on the versions `pins.rs` holds: the
//! toolchains, bpf-linker, cargo-fuzz, Debian's packages, and the Kubernetes binaries built
//! from Debian's source; all cached outside git (`cache_dir`).
use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result};

use crate::{cargo, output, pins, root_dir, run};

/// Where expensive tools are cached, outside git, keyed on their version.
pub(crate) fn cache_dir() -> PathBuf {
    env::var_os("KILO_CACHE_DIR").map_or_else(
        || PathBuf::from(env::var_os("HOME").unwrap_or_default()).join(".cache/kilo-rs"),
        PathBuf::from,
    )
}

pub(crate) fn bpf_linker_dir() -> PathBuf {
    cache_dir().join(format!("bpf-linker-{}-{}", pins::BPF_LINKER, pins::NIGHTLY))
}

/// Everything: what the tests need, the e2e cluster and cargo-fuzz (`cargo xtask test` runs
/// them all).
pub(crate) fn setup() -> Result<()> {
    setup_mesh()?;
    if is_root() {
        // One Go build gives the e2e cluster's binaries and the tests' kube-apiserver.
        install_kube_cluster()?;
    }
    setup_tests()?;
    install_cargo_fuzz()
}

/// What building kg needs: the toolchains and bpf-linker (the eBPF object is embedded).
pub(crate) fn setup_build() -> Result<()> {
    install_toolchains()?;
    install_bpf_linker()
}

/// What the demo's mesh needs: the build, and the tools its scripts run.
pub(crate) fn setup_mesh() -> Result<()> {
    setup_build()?;
    install_debian_packages(pins::DEMO_PACKAGES)
}

/// What the tests and benchmarks run: the mesh's tools and the rest, and the test API server.
pub(crate) fn setup_tests() -> Result<()> {
    setup_mesh()?;
    install_debian_packages(pins::TEST_PACKAGES)?;
    install_kubectl()?;
    install_kube_apiserver()
}

/// The pinned kubectl (`pins::KUBECTL`), at `kubectl_dir()/usr/bin/kubectl`.
pub(crate) fn kubectl_dir() -> PathBuf {
    cache_dir().join(format!("kubectl-{}", pins::KUBECTL))
}

pub(crate) fn install_kubectl() -> Result<()> {
    crate::kernels::unpack_pinned("kubectl", pins::KUBECTL, &kubectl_dir())
}

pub(crate) fn cargo_fuzz_dir() -> PathBuf {
    cache_dir().join(format!("cargo-fuzz-{}", pins::CARGO_FUZZ))
}

pub(crate) fn install_cargo_fuzz() -> Result<()> {
    let dir = cargo_fuzz_dir();
    if dir.join("bin/cargo-fuzz").exists() {
        return Ok(());
    }
    let staging = dir.with_extension("partial");
    run(cargo()
        .env("PATH", with_bin_on_path(&staging)?)
        .args([
            "install",
            "cargo-fuzz",
            "--locked",
            "--version",
            pins::CARGO_FUZZ,
        ])
        .arg("--root")
        .arg(&staging))?;
    std::fs::rename(&staging, &dir)?;
    Ok(())
}

fn install_toolchains() -> Result<()> {
    let installed = output(Command::new("rustup").args(["toolchain", "list"]))?;
    let has = |name: &str| installed.lines().any(|l| l.starts_with(name));
    if !has(pins::STABLE) {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            pins::STABLE,
            "--profile",
            "minimal",
            "--component",
            "clippy,rustfmt",
        ]))?;
    }
    let nightly_ok = has(pins::NIGHTLY)
        && output(Command::new("rustup").args([
            "component",
            "list",
            "--installed",
            "--toolchain",
            pins::NIGHTLY,
        ]))?
        .lines()
        .any(|l| l.starts_with("rust-src"));
    if !nightly_ok {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            pins::NIGHTLY,
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
    }
    Ok(())
}

/// `PATH` with `root`'s `bin` first, so that `cargo install --root ROOT` has no reason to warn
/// that its binaries are not on the user's `PATH` (xtask runs them by their path).
fn with_bin_on_path(root: &Path) -> Result<std::ffi::OsString> {
    let path = env::var_os("PATH").unwrap_or_default();
    Ok(env::join_paths(
        std::iter::once(root.join("bin")).chain(env::split_paths(&path)),
    )?)
}

/// bpf-linker linked against the pinned nightly's own libLLVM, so no system LLVM is needed.
fn install_bpf_linker() -> Result<()> {
    let dir = bpf_linker_dir();
    if dir.join("bin/bpf-linker").exists() {
        return Ok(());
    }
    let sysroot =
        output(Command::new("rustc").args([&format!("+{}", pins::NIGHTLY), "--print", "sysroot"]))?;
    let libdir = Path::new(sysroot.trim()).join("lib");
    let so = std::fs::read_dir(&libdir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so"))
        .with_context(|| format!("no libLLVM.so in {}", libdir.display()))?;
    let libdir = libdir.display();
    let rustflags =
        format!("-C link-arg=-L{libdir} -C link-arg=-l:{so} -C link-arg=-Wl,-rpath,{libdir}");
    let staging = dir.with_extension("partial");
    run(Command::new("cargo")
        .env("PATH", with_bin_on_path(&staging)?)
        .env("RUSTFLAGS", rustflags)
        .env_remove("RUSTUP_TOOLCHAIN")
        .args([
            &format!("+{}", pins::NIGHTLY),
            "install",
            "bpf-linker",
            "--locked",
            "--version",
            pins::BPF_LINKER,
            "--no-default-features",
            "--features",
            &format!("{},no-llvm-linking", pins::BPF_LINKER_LLVM),
            "--root",
        ])
        .arg(&staging))?;
    std::fs::rename(&staging, &dir)?;
    Ok(())
}

pub(crate) fn install_debian_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .map(|s| !s.contains("install ok installed"))
                .unwrap_or(true)
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        eprintln!(
            "xtask: not root, not installing Debian packages {missing:?}; the root-only test tiers will skip"
        );
        return Ok(());
    }
    run(Command::new("apt-get").arg("update").arg("-qq"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn kube_apiserver_dir() -> PathBuf {
    cache_dir().join(format!("kube-apiserver-{}", pins::KUBE_APISERVER))
}

/// Every binary of the e2e cluster (`pins::KUBE_CLUSTER`) and kubectl, from the same build.
fn kube_cluster_dir() -> PathBuf {
    cache_dir().join(format!("kube-cluster-{}", pins::KUBE_APISERVER))
}

/// kube-apiserver for the tests, built once from Debian's source package and cached outside
/// git (about 4 minutes on 2 cores); `xtask/scripts/kube-apiserver.sh` says how. Taken from the
/// e2e cluster's build when that one is cached.
fn install_kube_apiserver() -> Result<()> {
    let dir = kube_apiserver_dir();
    if dir.join("kube-apiserver").exists() {
        return Ok(());
    }
    let cluster = kube_cluster_dir();
    if cluster.join("kube-apiserver").exists() {
        let staging = dir.with_extension("partial");
        std::fs::create_dir_all(&staging)?;
        for name in ["kube-apiserver", "kubectl"] {
            std::fs::copy(cluster.join(name), staging.join(name))?;
        }
        std::fs::rename(&staging, &dir)?;
        return Ok(());
    }
    if !is_root() {
        eprintln!("xtask: not root, not building kube-apiserver; the API server tests will skip");
        return Ok(());
    }
    build_kube(&["kube-apiserver"], &dir)
}

/// The e2e cluster's Kubernetes binaries, built once (kube-apiserver in the same Go build when
/// it is not cached yet, then kept for the tests too). Returns their directory.
pub(crate) fn install_kube_cluster() -> Result<PathBuf> {
    let dir = kube_cluster_dir();
    if pins::KUBE_CLUSTER
        .iter()
        .chain(&["kubectl"])
        .all(|name| dir.join(name).exists())
    {
        return Ok(dir);
    }
    build_kube(pins::KUBE_CLUSTER, &dir)?;
    install_kube_apiserver()?;
    Ok(dir)
}

/// Builds `cmds` (names under the Kubernetes tree's `cmd/`) from Debian's `kubernetes` source
/// package in one Go build, into `out` with the same release's kubectl.
fn build_kube(cmds: &[&str], out: &Path) -> Result<()> {
    // The machine's own package sources, as source-package sources too.
    let sources = Path::new("/etc/apt/sources.list.d/kilo-rs-src.sources");
    if !sources.exists() {
        let debian = std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources")
            .context("reading the machine's Debian package sources")?;
        std::fs::write(sources, debian.replace("Types: deb\n", "Types: deb-src\n"))?;
        run(Command::new("apt-get").arg("update").arg("-qq"))?;
    }
    install_debian_packages(pins::KUBE_APISERVER_BUILD_DEPS)?;
    eprintln!(
        "xtask: building {} {} (once)",
        cmds.join(", "),
        pins::KUBE_APISERVER
    );
    run(Command::new("bash")
        .arg(root_dir().join("xtask/scripts/kube-apiserver.sh"))
        .arg(pins::KUBE_APISERVER)
        .arg(out)
        .args(cmds))
}

pub(crate) fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_ok_and(|s| s.trim() == "0")
}
