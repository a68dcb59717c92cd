//! `cargo xtask kernels [LABEL ...]`: the datapath, namespace and mesh tiers again inside the
//! distribution kernels operators run ([`pins::KERNELS`]). Each kernel boots in a VM
//! (virtme-ng over qemu: KVM where it works, TCG where it does not) whose root filesystem is
//! this machine's, read-only, so the test binaries built here run there unchanged; the kernel's
//! own modules (WireGuard, IPIP) are unpacked from its Debian package into the cache.
//!
//! Every check runs on every kernel, even after one failed; the run writes
//! `target/kernels/matrix.md` (kernel by check, with each check's time) and each check's log
//! beside it, and fails if any check did.
use std::{
    fmt::Write as _,
    fs,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{cache_dir, cargo, install_debian_packages, output, pins, root_dir, run};

/// One check: a test target of kilo-agent, run whole, with the environment it needs.
struct Check {
    name: &'static str,
    test: &'static str,
    /// The test binary's arguments beyond `--test-threads` (a filter).
    args: &'static str,
    /// Only on these kernels (empty: on every one).
    only: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
}

/// Kernel WireGuard: the tests' meshes let kg create and configure the device itself
/// (`--create-interface=true`, Kilo's default) instead of starting wireguard-go.
const KERNEL_WG: (&str, &str) = ("KRS_WIREGUARD", "kernel");

/// The userspace WireGuard path (wireguard-go) is what every mesh test runs on the host; here
/// the meshes use the kernel's, as Kilo's manifests do. The demo mesh has IPIP inside a location
/// with Kilo's defaults; the IPIP mesh tests' other cases stay on the host's kernel.
const CHECKS: &[Check] = &[
    Check {
        name: "TC program (BPF_PROG_TEST_RUN)",
        test: "datapath_prog_privileged",
        args: "",
        only: &[],
        env: &[],
    },
    Check {
        name: "IPIP programs (BPF_PROG_TEST_RUN)",
        test: "datapath_ipip_privileged",
        args: "",
        only: &[],
        env: &[],
    },
    Check {
        name: "namespaces: masquerade, fast path, adoption, clean-up",
        test: "datapath_netns_privileged",
        args: "",
        only: &[],
        env: &[],
    },
    Check {
        name: "demo mesh, kernel WireGuard",
        test: "mesh_demo_privileged",
        args: "--nocapture",
        only: &[],
        env: &[KERNEL_WG],
    },
    Check {
        name: "kernel IPIP (tunl0) interop",
        test: "mesh_ipip_privileged",
        args: "tunl0",
        // One kernel with the module shows both directions; Debian 12's is the most used.
        only: &["6.1"],
        env: &[KERNEL_WG],
    },
    Check {
        name: "Kubernetes backend (API server), kubeadm overlay's CNI, kernel WireGuard",
        test: "kube_apiserver_privileged",
        args: "kg_mesh_on_the_api_server",
        // The kubeadm overlay's part that depends on the kernel (the cluster itself does not
        // fit a VM under TCG: TESTING.md, "kernels"). One kernel, for CI time.
        only: &["6.1"],
        env: &[KERNEL_WG],
    },
];

impl Check {
    /// Whether the check runs on the kernel `label`: on its own kernels by default; when checks
    /// are asked for by `filter` (a part of their test target or name), those that match, on
    /// every kernel asked for.
    fn runs_on(&self, label: &str, filter: Option<&str>) -> bool {
        match filter {
            Some(f) => self.test.contains(f) || self.name.contains(f),
            None => self.only.is_empty() || self.only.contains(&label),
        }
    }
}

/// A booted kernel's files: its image and the release its modules are under.
struct Kernel {
    label: &'static str,
    /// The Debian package version that was booted.
    version: String,
    image: PathBuf,
    release: String,
}

pub fn kernels(only: &[String], filter: Option<&str>) -> Result<()> {
    if let Some(bad) = only
        .iter()
        .find(|l| !pins::KERNELS.iter().any(|k| k.0 == l.as_str()))
    {
        bail!("no pinned kernel {bad:?}; have {:?}", labels());
    }
    let vm = install_vm()?;
    let kernels: Vec<Kernel> = pins::KERNELS
        .iter()
        .filter(|k| only.is_empty() || only.iter().any(|l| l == k.0))
        .map(|k| install_kernel(k.0, k.1))
        .collect::<Result<_>>()?;
    let tests = build_tests()?;
    let out = root_dir().join("target/kernels");
    let _ = fs::remove_dir_all(&out);
    let mut results = Vec::new();
    for kernel in &kernels {
        let dir = out.join(kernel.label);
        fs::create_dir_all(&dir)?;
        let start = Instant::now();
        boot(
            &vm,
            kernel,
            &guest_script(kernel.label, filter, &tests, &dir)?,
            &dir,
        )?;
        eprintln!(
            "xtask kernels: {} ({}) done in {:.0} s",
            kernel.label,
            kernel.version,
            start.elapsed().as_secs_f64()
        );
        results.push(read_results(&dir, kernel.label, filter)?);
    }
    let table = matrix(&kernels, &results);
    fs::write(out.join("matrix.md"), &table)?;
    eprintln!("{table}");
    let failed: Vec<String> = kernels
        .iter()
        .zip(&results)
        .flat_map(|(k, r)| {
            r.iter().filter(|o| o.rc != 0).map(move |o| {
                format!(
                    "{} on {} (log: target/kernels/{}/{}.log)",
                    o.name, k.label, k.label, o.slug
                )
            })
        })
        .collect();
    if !failed.is_empty() {
        bail!("kernel checks failed:\n  {}", failed.join("\n  "));
    }
    Ok(())
}

fn labels() -> Vec<&'static str> {
    pins::KERNELS.iter().map(|k| k.0).collect()
}

/// What boots a kernel: `vng` in a virtualenv, the static busybox for its initramfs, and
/// whether KVM works here.
struct Vm {
    vng: PathBuf,
    busybox: PathBuf,
}

fn install_vm() -> Result<Vm> {
    install_debian_packages(pins::KERNEL_VM_PACKAGES)?;
    let venv = cache_dir().join(format!("virtme-ng-{}", pins::VIRTME_NG));
    // A virtualenv's scripts name its interpreter by path: it is built where it lives, and
    // counts as installed once the marker is written.
    let done = venv.join(".installed");
    if !done.exists() {
        let _ = fs::remove_dir_all(&venv);
        run(Command::new("/usr/bin/python3")
            .args(["-m", "venv"])
            .arg(&venv))?;
        run(Command::new(venv.join("bin/pip"))
            .args(["install", "-q"])
            .arg(format!("virtme-ng=={}", pins::VIRTME_NG)))?;
        fs::write(&done, "")?;
    }
    let busybox_root = cache_dir().join(pins::BUSYBOX_STATIC);
    let busybox = busybox_root.join("usr/bin/busybox");
    if !busybox.exists() {
        let deb = download(pins::BUSYBOX_STATIC)?;
        unpack(&deb, &busybox_root)?;
    }
    Ok(Vm {
        vng: venv.join("bin/vng"),
        busybox,
    })
}

/// The private apt configuration (sources, lists, cache) that reaches every pinned suite,
/// leaving the machine's own sources as they are.
fn apt_dir() -> PathBuf {
    cache_dir().join("kernels/apt")
}

/// `tool` (`apt-get`, `apt-cache`) on the private configuration.
fn apt(tool: &str, args: &[&str]) -> Command {
    let dir = apt_dir();
    let mut cmd = Command::new(tool);
    cmd.arg("-qq")
        .arg("-o=APT::Sandbox::User=root")
        .arg(format!(
            "-o=Dir::Etc::SourceList={}",
            dir.join("sources.list").display()
        ))
        .arg("-o=Dir::Etc::SourceParts=/dev/null")
        .arg(format!(
            "-o=Dir::State::Lists={}",
            dir.join("lists").display()
        ))
        .arg(format!("-o=Dir::Cache={}", dir.join("cache").display()))
        .args(args);
    cmd
}

fn apt_update() -> Result<()> {
    let dir = apt_dir();
    fs::create_dir_all(dir.join("lists/partial"))?;
    fs::create_dir_all(dir.join("cache/archives/partial"))?;
    let key = "[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]";
    let mut sources = String::new();
    // Each pinned kernel's suite, and bookworm for the static busybox.
    let mut suites: Vec<&str> = pins::KERNELS.iter().map(|k| k.2).collect();
    suites.push("bookworm");
    suites.sort_unstable();
    suites.dedup();
    for suite in suites {
        let archive = if suite.ends_with("-security") {
            "debian-security"
        } else {
            "debian"
        };
        writeln!(
            sources,
            "deb {key} http://deb.debian.org/{archive} {suite} main"
        )?;
    }
    fs::write(dir.join("sources.list"), sources)?;
    run(&mut apt("apt-get", &["update"]))
}

/// Downloads `package` (its newest version in the private sources) into the cache once; a
/// cached `.deb` is used as it is.
fn download(package: &str) -> Result<PathBuf> {
    let debs = cache_dir().join("kernels/debs");
    fs::create_dir_all(&debs)?;
    if let Some(deb) = cached_deb(&debs, package)? {
        return Ok(deb);
    }
    apt_update()?;
    run(apt("apt-get", &["download", package]).current_dir(&debs))?;
    cached_deb(&debs, package)?.with_context(|| format!("{package} not downloaded"))
}

/// Unpacks (not installs) `package` at `version`, from any pinned suite of the private sources,
/// into `root`, once: a machine may have another of the package's files installed.
pub(crate) fn unpack_pinned(package: &str, version: &str, root: &Path) -> Result<()> {
    if root.exists() {
        return Ok(());
    }
    let debs = cache_dir().join("kernels/debs");
    fs::create_dir_all(&debs)?;
    let name = format!("{package}_{version}");
    let deb = match cached_deb(&debs, &name)? {
        Some(deb) => deb,
        None => {
            apt_update()?;
            run(apt("apt-get", &["download", &format!("{package}={version}")]).current_dir(&debs))?;
            cached_deb(&debs, &name)?.with_context(|| format!("{name} not downloaded"))?
        }
    };
    unpack(&deb, root)
}

fn cached_deb(dir: &Path, package: &str) -> Result<Option<PathBuf>> {
    let prefix = format!("{package}_");
    Ok(fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
        }))
}

fn unpack(deb: &Path, root: &Path) -> Result<()> {
    let partial = PathBuf::from(format!("{}.partial", root.display()));
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial)?;
    run(Command::new("dpkg").arg("-x").arg(deb).arg(&partial))?;
    let _ = fs::remove_dir_all(root);
    fs::rename(&partial, root)?;
    Ok(())
}

/// The pinned package of a series, or the newest of its series once Debian has replaced it.
fn resolve(package: &str) -> Result<String> {
    let debs = cache_dir().join("kernels/debs");
    fs::create_dir_all(&debs)?;
    if cached_deb(&debs, package)?.is_some() {
        return Ok(package.to_owned());
    }
    apt_update()?;
    let names = output(&mut apt("apt-cache", &["pkgnames", "linux-image-"]))?;
    if names.lines().any(|n| n == package) {
        return Ok(package.to_owned());
    }
    // linux-image-6.1.0-57-amd64-unsigned: the series is what comes before the ABI number.
    let series = package
        .strip_suffix("-amd64-unsigned")
        .and_then(|head| head.rsplit_once('-'))
        .map(|(series, _)| series)
        .with_context(|| format!("{package}: not a kernel package name"))?;
    let abi = |n: &str| -> Option<u32> {
        n.strip_prefix(series)?
            .strip_prefix('-')?
            .strip_suffix("-amd64-unsigned")?
            .parse()
            .ok()
    };
    names
        .lines()
        .filter_map(|n| abi(n).map(|a| (a, n.to_owned())))
        .max()
        .map(|(_, n)| {
            eprintln!("xtask kernels: {package} is gone from Debian's registry; using {n}");
            n
        })
        .with_context(|| format!("no package of {package}'s series in Debian's registry"))
}

/// The kernel image and its modules, unpacked into the cache, `depmod`ed, and reachable from
/// the VM at `/lib/modules/RELEASE` (the guest reads the host's `/lib/modules`).
fn install_kernel(label: &'static str, package: &str) -> Result<Kernel> {
    let package = resolve(package)?;
    let deb = download(&package)?;
    let version = deb
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.split('_').nth(1))
        .unwrap_or("?")
        .replace("%3a", ":");
    let root = cache_dir().join("kernels").join(&package);
    if !root.join("boot").exists() {
        unpack(&deb, &root)?;
    }
    // 6.12's package keeps its modules under usr/lib; depmod -b reads ROOT/lib/modules.
    if !root.join("lib").exists() {
        std::os::unix::fs::symlink("usr/lib", root.join("lib"))?;
    }
    let release = fs::read_dir(root.join("lib/modules"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .with_context(|| format!("{package}: no modules"))?;
    let image = root.join(format!("boot/vmlinuz-{release}"));
    let modules = root.join("lib/modules").join(&release);
    if !modules.join("modules.dep.bin").exists() {
        run(Command::new("depmod").arg("-b").arg(&root).arg(&release))?;
    }
    let link = Path::new("/lib/modules").join(&release);
    if fs::read_link(&link).ok().as_deref() != Some(modules.as_path()) {
        fs::create_dir_all("/lib/modules")?;
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&modules, &link)
            .with_context(|| format!("link {}", link.display()))?;
    }
    Ok(Kernel {
        label,
        version,
        image,
        release,
    })
}

/// Builds the checks' test binaries (and kg and kgctl, which they run); their paths by target.
fn build_tests() -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "--no-run",
        "--package",
        "kilo-agent",
        "--message-format=json-render-diagnostics",
    ]);
    let mut targets: Vec<&str> = CHECKS.iter().map(|c| c.test).collect();
    targets.sort_unstable();
    targets.dedup();
    for t in &targets {
        cmd.args(["--test", t]);
    }
    let json = output(&mut cmd)?;
    let mut found = Vec::new();
    for line in json.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(name), Some(exe)) = (
            msg.pointer("/target/name").and_then(|v| v.as_str()),
            msg.get("executable").and_then(|v| v.as_str()),
        ) else {
            continue;
        };
        if targets.contains(&name) {
            found.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    if let Some(missing) = targets.iter().find(|t| !found.iter().any(|f| f.0 == **t)) {
        bail!("cargo test --no-run built no {missing}");
    }
    Ok(found)
}

/// A file-name-safe form of a check's name.
fn slug(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    s.split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

/// The script the VM runs: bpffs, the modules the userspace and kernel paths need, then every
/// check with its own log and a line `SLUG RC SECONDS` in `results`.
fn guest_script(
    label: &str,
    filter: Option<&str>,
    tests: &[(String, PathBuf)],
    out: &Path,
) -> Result<PathBuf> {
    let agent = root_dir().join("kilo-agent");
    let mut s = String::from("#!/bin/sh\n");
    writeln!(s, "OUT={}", out.display())?;
    s.push_str(
        "exec >\"$OUT/guest.log\" 2>&1\n\
         export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root\n\
         export TMPDIR=/dev/shm RUST_BACKTRACE=1 KILO_REQUIRE_ALL=1 KILO_KERNEL_MATRIX=1\n\
         uname -r >\"$OUT/release\"\n\
         mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf\n\
         modprobe tun; modprobe wireguard\n\
         : >\"$OUT/results\"\n",
    );
    writeln!(s, "cd {}", agent.display())?;
    for check in CHECKS.iter().filter(|c| c.runs_on(label, filter)) {
        let exe = &tests.iter().find(|t| t.0 == check.test).expect("built").1;
        let env: String = check.env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
        let slug = slug(check.name);
        writeln!(
            s,
            "start=$(date +%s); env {env}timeout 600 {} --test-threads=2 {} >\"$OUT/{slug}.log\" 2>&1; \
             rc=$?; echo \"{slug} $rc $(( $(date +%s) - start ))\" >>\"$OUT/results\"",
            exe.display(),
            check.args
        )?;
    }
    s.push_str("sync\n");
    let path = out.join("guest.sh");
    fs::write(&path, s)?;
    run(Command::new("chmod").arg("+x").arg(&path))?;
    Ok(path)
}

/// Set once KVM failed here: the later kernels boot with TCG at once.
static KVM_FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How long a KVM guest may take to print its kernel's banner; a working one takes seconds.
const KVM_BOOT: Duration = Duration::from_secs(60);

/// Boots `kernel` and runs `script`: with KVM first, then TCG when KVM fails, at once (as it
/// does under nested virtualisation that cannot set the host CPU's MSRs) or by hanging before
/// the kernel starts (as other nested hosts do).
fn boot(vm: &Vm, kernel: &Kernel, script: &Path, out: &Path) -> Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let console = out.join("console.log");
    for kvm in [true, false] {
        if kvm && KVM_FAILED.load(Relaxed) {
            continue;
        }
        let mut cmd = Command::new(&vm.vng);
        let path = std::env::join_paths(
            std::iter::once(vm.vng.parent().unwrap().to_path_buf()).chain(std::env::split_paths(
                &std::env::var_os("PATH").unwrap_or_default(),
            )),
        )?;
        cmd.env("PATH", path)
            .arg("--run")
            .arg(&kernel.image)
            .arg("--busybox")
            .arg(&vm.busybox)
            .args([
                "--memory",
                "3G",
                "--cpus",
                "2",
                "--force-initramfs",
                "--verbose",
            ])
            .arg("--rwdir")
            .arg(out)
            .arg("--exec")
            .arg(script)
            .stdin(std::process::Stdio::null())
            .stdout(fs::File::create(&console)?)
            .stderr(fs::File::options().append(true).open(&console)?);
        if !kvm {
            cmd.arg("--disable-kvm");
        }
        let _ = fs::remove_file(out.join("results"));
        eprintln!(
            "xtask kernels: booting {} ({}, {}) with {}",
            kernel.label,
            kernel.release,
            kernel.version,
            if kvm { "KVM" } else { "TCG" }
        );
        let started = Instant::now();
        // Its own process group, so that a hung guest's qemu goes with vng.
        let mut child = cmd.process_group(0).spawn().context("start vng")?;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            let banner = fs::read_to_string(&console).is_ok_and(|c| c.contains("Linux version"));
            if kvm && !banner && started.elapsed() > KVM_BOOT {
                let group = format!("-{}", child.id());
                let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_secs(1));
        };
        if out.join("results").exists() {
            return Ok(());
        }
        if kvm && (status.is_none() || started.elapsed() < KVM_BOOT) {
            eprintln!("xtask kernels: KVM did not boot ({status:?}); trying TCG");
            KVM_FAILED.store(true, Relaxed);
            continue;
        }
        break;
    }
    bail!(
        "{} did not run its checks (console: {})",
        kernel.label,
        console.display()
    )
}

/// One check's outcome on one kernel.
struct Outcome {
    name: &'static str,
    slug: String,
    rc: i32,
    seconds: u64,
}

fn read_results(dir: &Path, label: &str, filter: Option<&str>) -> Result<Vec<Outcome>> {
    let text = fs::read_to_string(dir.join("results"))?;
    CHECKS
        .iter()
        .filter(|c| c.runs_on(label, filter))
        .map(|c| {
            let slug = slug(c.name);
            let line = text
                .lines()
                .find(|l| l.split(' ').next() == Some(slug.as_str()));
            let (rc, seconds) = match line.map(|l| l.split(' ').collect::<Vec<_>>()) {
                Some(f) if f.len() == 3 => (f[1].parse().unwrap_or(-1), f[2].parse().unwrap_or(0)),
                _ => (-1, 0),
            };
            // A test that skipped did not run: only one the kernel cannot run may (a TCX test
            // below 6.6, whose netlink variant runs).
            let log = fs::read_to_string(dir.join(format!("{slug}.log"))).unwrap_or_default();
            let skipped = log
                .lines()
                .any(|l| l.starts_with("SKIP ") && !l.contains(": kernel: "));
            let rc = if rc == 0 && skipped {
                eprintln!("xtask kernels: {} skipped on {label}", c.name);
                -2
            } else {
                rc
            };
            Ok(Outcome {
                name: c.name,
                slug,
                rc,
                seconds,
            })
        })
        .collect()
}

/// The Markdown table of checks by kernel.
fn matrix(kernels: &[Kernel], results: &[Vec<Outcome>]) -> String {
    let mut t = String::from("| check |");
    for k in kernels {
        let _ = write!(t, " {} ({}) |", k.label, k.version);
    }
    t.push_str("\n|---|");
    t.push_str(&"---|".repeat(kernels.len()));
    t.push('\n');
    for c in CHECKS {
        let _ = write!(t, "| {} |", c.name);
        for r in results {
            let Some(o) = r.iter().find(|o| o.name == c.name) else {
                t.push_str(" not run |");
                continue;
            };
            let verdict = match o.rc {
                0 => "pass",
                -2 => "SKIPPED",
                124 => "TIMEOUT",
                _ => "FAIL",
            };
            let _ = write!(t, " {verdict} ({} s) |", o.seconds);
        }
        t.push('\n');
    }
    t
}
