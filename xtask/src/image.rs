//! `cargo xtask image`: static `kg` and `kgctl` for every architecture the image is published
//! for, one OCI image index over them, docker-archives, plain `kgctl` release files, and the
//! checks that each architecture's binaries run (under qemu-user where the host cannot).
//!
//! Cross builds use zig (PyPI's `ziglang`) through cargo-zigbuild: zig brings a C compiler for
//! ring and a musl to link against for every target. rustup's server here has no `rust-std` for
//! the 32-bit ARM targets, so armv7's standard library is built from `rust-src`
//! (`-Z build-std`, allowed on the pinned stable by `RUSTC_BOOTSTRAP`). The eBPF object is
//! built on the host by kilo-agent's build script and embedded unchanged in every architecture.
use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{cache_dir, cargo, install_debian_packages, is_root, output, pins, root_dir, run};

/// One platform of the image index.
struct Arch {
    /// The name in file names: `kgctl-linux-<name>`, `kilo-rs-<name>.tar`, tag `<version>-<name>`.
    name: &'static str,
    /// OCI `architecture` and `variant`.
    architecture: &'static str,
    variant: Option<&'static str>,
    target: &'static str,
    /// The qemu-user emulator that runs its binaries here; `None`: the host runs them.
    qemu: Option<&'static str>,
    /// No `rust-std` to download: build the standard library from `rust-src`.
    build_std: bool,
}

const ARCHES: &[Arch] = &[
    Arch {
        name: "amd64",
        architecture: "amd64",
        variant: None,
        target: pins::IMAGE_TARGET,
        qemu: None,
        build_std: false,
    },
    Arch {
        name: "arm64",
        architecture: "arm64",
        variant: None,
        target: "aarch64-unknown-linux-musl",
        qemu: Some("qemu-aarch64-static"),
        build_std: false,
    },
    Arch {
        name: "armv7",
        architecture: "arm",
        variant: Some("v7"),
        target: "armv7-unknown-linux-musleabihf",
        qemu: Some("qemu-arm-static"),
        build_std: true,
    },
];

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The image's name and tag.
fn image_ref() -> String {
    format!("kilo-rs:{VERSION}")
}

/// Builds, assembles and checks the image; with `arm64_tests`, also runs the pure test tier
/// for arm64 under qemu-user.
pub fn image(arm64_tests: bool) -> Result<()> {
    build_image(ARCHES, arm64_tests)
}

/// The image for this machine's architecture alone (amd64), as `cargo xtask e2e` loads it.
pub fn host_image() -> Result<()> {
    build_image(&ARCHES[..1], false)
}

fn build_image(arches: &[Arch], arm64_tests: bool) -> Result<()> {
    if !is_root() {
        bail!("building the image installs Debian packages and unpacks layers as root");
    }
    install_debian_packages(pins::IMAGE_PACKAGES)?;
    let path = install_cross_tools()?;
    for arch in arches {
        let started = std::time::Instant::now();
        run(cross_cargo(&path, arch, "zigbuild").args([
            "--release",
            "--package",
            "kilo-agent",
            "--bins",
        ]))?;
        eprintln!("xtask: {} built in {:.0?}", arch.target, started.elapsed());
    }
    let out = root_dir().join("target/image");
    let layout = out.join("oci");
    if layout.exists() {
        std::fs::remove_dir_all(&layout)?;
    }
    std::fs::create_dir_all(&out)?;
    run(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(&layout))?;
    let mut manifests = Vec::new();
    for arch in arches {
        manifests.push(assemble(&out, &layout, arch)?);
    }
    write_index(&layout, manifests)?;
    let fixture = fixture_dir(&out)?;
    let mut showconf: Option<String> = None;
    let mut sums = String::new();
    for arch in arches {
        let archive = archive(&out, arch);
        let _ = std::fs::remove_file(&archive);
        // Through the index: what a pull on that platform would get.
        run(Command::new("skopeo")
            .args(["copy", "--override-os", "linux"])
            .args(["--override-arch", arch.architecture])
            .args(
                arch.variant
                    .map(|v| ["--override-variant", v])
                    .iter()
                    .flatten(),
            )
            .arg(format!("oci:{}:{VERSION}", layout.display()))
            .arg(format!(
                "docker-archive:{}:{}",
                archive.display(),
                image_ref()
            )))?;
        let conf = check_arch(&out, &archive, &fixture, arch)?;
        match &showconf {
            None => showconf = Some(conf),
            Some(first) if *first != conf => bail!(
                "kgctl showconf on {} printed\n{conf}\nbut on {} it printed\n{first}",
                arch.name,
                ARCHES[0].name
            ),
            Some(_) => {}
        }
        let release = out.join(format!("kgctl-linux-{}", arch.name));
        std::fs::copy(bin_dir(arch).join("kgctl"), &release)?;
        sums.push_str(&output(
            Command::new("sha256sum")
                .current_dir(&out)
                .arg(release.file_name().expect("a file name")),
        )?);
    }
    std::fs::write(out.join("SHA256SUMS"), sums)?;
    eprintln!(
        "image {}: OCI layout {} (tag {VERSION}: an index of {}; tags {VERSION}-<arch>: each \
         alone), docker-archives {} and kilo-rs-<arch>.tar (`docker load -i`, `podman load -i`, \
         `ctr images import`), kgctl release files {}/kgctl-linux-<arch> with SHA256SUMS",
        image_ref(),
        layout.display(),
        arches.iter().map(|a| a.name).collect::<Vec<_>>().join(", "),
        archive(&out, &ARCHES[0]).display(),
        out.display()
    );
    if arm64_tests {
        arm64_test_tier(&path)?;
    }
    Ok(())
}

/// PATH with the pinned zig and cargo-zigbuild first, both installed into the cache once;
/// the rustup targets and `rust-src` the builds need.
fn install_cross_tools() -> Result<std::ffi::OsString> {
    let zig = cache_dir().join(format!("ziglang-{}", pins::ZIGLANG));
    if !zig.join("ziglang/zig").exists() {
        let staging = zig.with_extension("partial");
        let _ = std::fs::remove_dir_all(&staging);
        run(Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(&staging)
            .arg(format!("ziglang=={}", pins::ZIGLANG)))?;
        std::fs::rename(&staging, &zig)?;
    }
    let zigbuild = cache_dir().join(format!("cargo-zigbuild-{}", pins::CARGO_ZIGBUILD));
    if !zigbuild.join("bin/cargo-zigbuild").exists() {
        let staging = zigbuild.with_extension("partial");
        run(cargo()
            .args(["install", "cargo-zigbuild", "--locked", "--version"])
            .arg(pins::CARGO_ZIGBUILD)
            .arg("--root")
            .arg(&staging))?;
        std::fs::rename(&staging, &zigbuild)?;
    }
    let installed = output(Command::new("rustup").args([
        "target",
        "list",
        "--installed",
        "--toolchain",
        pins::STABLE,
    ]))?;
    for arch in ARCHES.iter().filter(|a| !a.build_std) {
        if !installed.lines().any(|l| l == arch.target) {
            run(Command::new("rustup").args([
                "target",
                "add",
                arch.target,
                "--toolchain",
                pins::STABLE,
            ]))?;
        }
    }
    run(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        pins::STABLE,
    ]))?;
    Ok(env::join_paths(
        [zig.join("ziglang"), zigbuild.join("bin")]
            .into_iter()
            .chain(env::split_paths(&env::var_os("PATH").unwrap_or_default())),
    )?)
}

/// `cargo-zigbuild <subcommand> --target <arch's>` with the pinned stable toolchain.
fn cross_cargo(path: &std::ffi::OsStr, arch: &Arch, subcommand: &str) -> Command {
    let mut cmd = Command::new("cargo-zigbuild");
    cmd.current_dir(root_dir())
        .env("PATH", path)
        .env("RUSTUP_TOOLCHAIN", pins::STABLE)
        .env("KILO_CACHE_DIR", cache_dir())
        .args([subcommand, "--target", arch.target]);
    if arch.build_std {
        // No self-contained crt objects come without rust-std: zig's musl brings its own.
        cmd.env("RUSTC_BOOTSTRAP", "1")
            .env(target_env(arch, "RUSTFLAGS"), "-Clink-self-contained=no")
            .arg("-Zbuild-std=std,panic_abort");
    }
    cmd
}

/// Cargo's `CARGO_TARGET_<TRIPLE>_<KEY>` variable for the arch's target.
fn target_env(arch: &Arch, key: &str) -> String {
    format!(
        "CARGO_TARGET_{}_{key}",
        arch.target.to_uppercase().replace('-', "_")
    )
}

fn bin_dir(arch: &Arch) -> PathBuf {
    root_dir().join(format!("target/{}/release", arch.target))
}

fn archive(out: &Path, arch: &Arch) -> PathBuf {
    if arch.qemu.is_none() {
        out.join("kilo-rs.tar")
    } else {
        out.join(format!("kilo-rs-{}.tar", arch.name))
    }
}

fn bundle(out: &Path, arch: &Arch) -> PathBuf {
    out.join(format!("bundle-{}", arch.name))
}

/// One architecture's image in the layout, tagged `<version>-<name>`; returns its manifest's
/// descriptor with the platform added.
fn assemble(out: &Path, layout: &Path, arch: &Arch) -> Result<serde_json::Value> {
    let bundle = bundle(out, arch);
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)?;
    }
    let tag = format!("{VERSION}-{}", arch.name);
    let image = format!("{}:{tag}", layout.display());
    run(Command::new("umoci").args(["new", "--image", &image]))?;
    run(Command::new("umoci")
        .args(["unpack", "--image", &image])
        .arg(&bundle))?;
    let usr_bin = bundle.join("rootfs/usr/bin");
    std::fs::create_dir_all(&usr_bin)?;
    for name in ["kg", "kgctl"] {
        std::fs::copy(bin_dir(arch).join(name), usr_bin.join(name))?;
    }
    run(Command::new("umoci")
        .args(["repack", "--image", &image])
        .arg(&bundle))?;
    run(Command::new("umoci").args([
        "config",
        "--image",
        &image,
        "--os",
        "linux",
        "--architecture",
        arch.architecture,
        "--config.entrypoint",
        "/usr/bin/kg",
        "--config.label",
        "org.opencontainers.image.title=kilo-rs",
        "--config.label",
        &format!("org.opencontainers.image.version={VERSION}"),
    ]))?;
    let index = read_json(&layout.join("index.json"))?;
    let mut descriptor = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag.as_str())
        .cloned()
        .with_context(|| format!("umoci wrote no tag {tag} in {}", layout.display()))?;
    let mut platform = serde_json::json!({"os": "linux", "architecture": arch.architecture});
    if let Some(v) = arch.variant {
        platform["variant"] = v.into();
    }
    descriptor["platform"] = platform;
    descriptor
        .as_object_mut()
        .expect("a descriptor is an object")
        .remove("annotations");
    Ok(descriptor)
}

/// Writes the image index over `manifests` as a blob and tags it `<version>` in the layout's
/// own index.
fn write_index(layout: &Path, manifests: Vec<serde_json::Value>) -> Result<()> {
    let blob = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": manifests,
    }))?;
    let staging = layout.join("index.blob");
    std::fs::write(&staging, &blob)?;
    let digest = output(Command::new("sha256sum").arg(&staging))?;
    let digest = digest
        .split_whitespace()
        .next()
        .context("sha256sum printed nothing")?
        .to_owned();
    std::fs::rename(&staging, layout.join("blobs/sha256").join(&digest))?;
    let path = layout.join("index.json");
    let mut index = read_json(&path)?;
    index["manifests"]
        .as_array_mut()
        .context("index.json has no manifests")?
        .push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": format!("sha256:{digest}"),
            "size": blob.len(),
            "annotations": {"org.opencontainers.image.ref.name": VERSION},
        }));
    std::fs::write(&path, serde_json::to_vec(&index)?)?;
    Ok(())
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}", path.display()))
}

/// Kilo's fixture for the golden files (kilo-agent/tests/data/kilo), one object per file,
/// every node seen now, as kgctl's file backend reads it.
fn fixture_dir(out: &Path) -> Result<PathBuf> {
    let dir = out.join("fixture");
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let text = std::fs::read_to_string(root_dir().join("kilo-agent/tests/data/kilo/fixture.yaml"))?
        .replace("\"NOW\"", &format!("\"{now}\""));
    for (i, doc) in text.split("\n---\n").skip(1).enumerate() {
        std::fs::write(dir.join(format!("{i:02}.yaml")), doc)?;
    }
    Ok(dir)
}

/// Checks one architecture as pulled through the index: its configuration (entrypoint, OS,
/// architecture), its root holding only the two binaries, both running (the host's in a chroot of
/// the image's root, where there is no libc; the others under qemu-user, where no musl loader
/// exists either), and returns `kgctl showconf node b` on the fixture.
fn check_arch(out: &Path, archive: &Path, fixture: &Path, arch: &Arch) -> Result<String> {
    let config = output(
        Command::new("skopeo")
            .args(["inspect", "--config"])
            .arg(format!("docker-archive:{}", archive.display())),
    )?;
    let config: serde_json::Value =
        serde_json::from_str(&config).context("skopeo inspect --config")?;
    if config["config"]["Entrypoint"] != serde_json::json!(["/usr/bin/kg"])
        || config["os"] != "linux"
        || config["architecture"] != arch.architecture
    {
        bail!(
            "the {} image's configuration is not what was built: {config:#}",
            arch.name
        );
    }
    let rootfs = bundle(out, arch).join("rootfs");
    let entries: Vec<String> = std::fs::read_dir(&rootfs)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if entries != ["usr"] {
        bail!(
            "the {} image holds more than /usr/bin/{{kg,kgctl}}: {entries:?}",
            arch.name
        );
    }
    let binary = |name: &str| {
        let mut cmd = match arch.qemu {
            None => {
                let mut c = Command::new("chroot");
                c.arg(&rootfs).arg(format!("/usr/bin/{name}"));
                c
            }
            Some(qemu) => {
                let mut c = Command::new(qemu);
                c.arg(rootfs.join("usr/bin").join(name));
                c
            }
        };
        cmd.env_remove("KUBECONFIG");
        cmd
    };
    for name in ["kg", "kgctl"] {
        let version = output(binary(name).arg("--version"))?;
        if !version.starts_with(&format!("{name} {VERSION}")) {
            bail!(
                "{name} --version in the {} image printed {version:?}",
                arch.name
            );
        }
    }
    // Outside the chroot, where the fixture is: the image's own kgctl, emulated where needed.
    let kgctl = rootfs.join("usr/bin/kgctl");
    let mut showconf = match arch.qemu {
        None => Command::new(&kgctl),
        Some(qemu) => {
            let mut c = Command::new(qemu);
            c.arg(&kgctl);
            c
        }
    };
    let conf = showconf
        .env_remove("KUBECONFIG")
        .args(["--backend", "file", "--backend-dir"])
        .arg(fixture)
        .args(["--mesh-granularity", "location", "showconf", "node", "b"])
        .output()?;
    let text = String::from_utf8_lossy(&conf.stdout).into_owned();
    if !conf.status.success() || !text.contains("[Peer]") {
        bail!(
            "kgctl showconf in the {} image: {}\n{text}{}",
            arch.name,
            conf.status,
            String::from_utf8_lossy(&conf.stderr)
        );
    }
    eprintln!(
        "image checked: linux/{}{}: entrypoint /usr/bin/kg, static kg and kgctl run{}, \
         kgctl showconf node b on Kilo's fixture",
        arch.architecture,
        arch.variant.map(|v| format!("/{v}")).unwrap_or_default(),
        arch.qemu.map(|q| format!(" under {q}")).unwrap_or_default()
    );
    Ok(text)
}

/// The pure tier (kilo-agent's unit tests and the golden tests) built for arm64 and run under
/// qemu-user. `tests/golden_kgctl.rs` is left out: it runs the kgctl binary itself, which needs
/// the kernel to know arm64 binaries (binfmt_misc); the image's check runs that kgctl instead.
fn arm64_test_tier(path: &std::ffi::OsStr) -> Result<()> {
    let arch = &ARCHES[1];
    let qemu = arch.qemu.expect("arm64 is emulated");
    let started = std::time::Instant::now();
    run(cross_cargo(path, arch, "test")
        .env(target_env(arch, "RUNNER"), qemu)
        .args(["--package", "kilo-agent", "--lib"])
        .args(["--test", "golden", "--test", "golden_annotations"])
        .args(["--test", "golden_validation"]))?;
    eprintln!(
        "xtask: the pure tier passed for {} under {qemu} in {:.0?}",
        arch.target,
        started.elapsed()
    );
    Ok(())
}
