//! Builds the `kilo-ebpf` object with the pinned nightly and bpf-linker that
//! `cargo xtask setup` installs, so that `include_bytes_aligned!` can embed it.
use std::{env, path::PathBuf};

use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    let pins = include_str!("../xtask/src/pins.rs");
    let pin = |name: &str| -> anyhow::Result<String> {
        let line = pins
            .lines()
            .find(|l| l.contains(&format!("const {name}:")))
            .with_context(|| format!("{name} missing from xtask/src/pins.rs"))?;
        Ok(line.split('"').nth(1).unwrap_or_default().to_owned())
    };
    let nightly = pin("NIGHTLY")?;
    let linker = pin("BPF_LINKER")?;
    // bpf-linker lives in a cache outside git (see xtask setup); put it on PATH.
    let cache = env::var_os("KILO_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env::var_os("HOME").unwrap_or_default()).join(".cache/kilo-rs")
        });
    let bin = cache.join(format!("bpf-linker-{linker}-{nightly}/bin"));
    if !bin.join("bpf-linker").exists() && env::var_os("AYA_BUILD_SKIP").is_none() {
        anyhow::bail!(
            "bpf-linker not found at {}: run `cargo xtask setup` first",
            bin.display()
        );
    }
    let path = env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin];
    paths.extend(env::split_paths(&path));
    // SAFETY: build scripts are single-threaded.
    unsafe {
        env::set_var("PATH", env::join_paths(paths)?);
        // aya-build forwards every line of the nested build as a cargo warning: keep it to the
        // compiler's own messages, without the progress lines.
        env::set_var("CARGO_TERM_QUIET", "true");
    }
    println!("cargo::rerun-if-changed=../xtask/src/pins.rs");
    println!("cargo::rerun-if-changed=../kilo-common/src");
    println!("cargo::rerun-if-env-changed=KILO_CACHE_DIR");
    let ebpf = aya_build::Package {
        name: "kilo-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../kilo-ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], aya_build::Toolchain::Custom(&nightly))?;
    // kilo-testkit embeds the benchmarks' object (`kilo-ebpf-bench`) from here (`links`).
    println!("cargo::metadata=out_dir={}", env::var("OUT_DIR")?);
    Ok(())
}
