//! kilo-testkit: the kit of kilo-agent's integration tests (`tests/*.rs`, as `support`) and
//! benchmarks (`examples/bench_*.rs`). Here, beside the modules: root and kernel checks that
//! skip or fail a test ([`require_root`], [`REQUIRE_ALL`], [`KERNEL_MATRIX`]), waiting
//! ([`eventually`]), CPU affinity, the benchmarks' flags ([`arg`]) and their baseline
//! classifiers ([`noop`], [`lookups`]). The modules:
//! - [`agent`]: the agent's test setup (a stand-in planner, reconciler settings, the local node);
//! - [`apiserver`]: a real etcd and kube-apiserver on loopback, TLS and a token;
//! - [`apistub`]: a stand-in API server front door that records requests (HTTP or TLS);
//! - [`bpffs`]: a private bpffs, and UDP probes that tell which source a receiver sees;
//! - [`golden`]: Kilo's fixture and golden outputs, as the golden tests read them;
//! - [`kg`]: the one way to start `kg`, `kgctl` or a tool beside them ([`kg::Launch`]);
//! - [`median`]: the benchmarks' median and its confidence interval (kilo-common's, which
//!   `cargo xtask bench` shares);
//! - [`mesh`]: the demo's three-node mesh (`xtask/scripts/mesh.sh`);
//! - [`metrics`]: the one reader of kg's Prometheus text;
//! - [`netns`]: throwaway network namespaces and wireguard-go devices in them;
//! - [`packets`]: crafted packets and a BPF_PROG_TEST_RUN wrapper;
//! - [`reliability`]: the reliability table's records (`KILO_RELIABILITY_OUT`);
//! - [`report`]: the benchmarks' JSON results (`KILO_BENCH_JSON`);
//! - [`traffic`]: a ping and a TCP stream that run through a fault and say what they lost.

pub mod agent;
pub mod apiserver;
pub mod apistub;
pub mod bpffs;
pub mod golden;
pub mod kg;
pub mod mesh;
pub mod metrics;
pub mod netns;
pub mod packets;
pub mod reliability;
pub mod report;
pub mod stats;
pub mod traffic;

pub use kilo_common::median;

/// The benchmarks' baseline object (kilo-ebpf's `kilo-ebpf-bench`: `kilo_noop`, an empty
/// classifier, and `kilo_lookups`, the datapath's lookups alone), embedded only by the tests and
/// benchmarks (from kilo-agent's build, see `build.rs`).
pub static BENCH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("KILO_EBPF_OUT_DIR"), "/kilo-ebpf-bench"));

/// The empty classifier, loaded (keep the `Ebpf` alive while using it).
pub fn noop() -> aya::Ebpf {
    let mut ebpf = aya::Ebpf::load(BENCH_OBJECT).expect("load the bench object");
    load_baseline(&mut ebpf, kilo_common::PROG_NOOP);
    ebpf
}

/// The lookups alone (`kilo_lookups`), loaded, with `dp`'s destination and NAT-source entries
/// copied into its tries: the floor of what `dp`'s program costs with those entries.
pub fn lookups(dp: &mut kilo_agent::datapath::Datapath) -> aya::Ebpf {
    use aya::maps::LpmTrie;
    use kilo_agent::datapath::{DatapathMaps as _, Trie, entry_key};
    use kilo_common::{EntryValue, LpmData, MAP_BENCH_DST, MAP_BENCH_NAT_SRC};
    let max = dp.config().max_entries;
    let mut ebpf = aya::EbpfLoader::new()
        .map_max_entries(MAP_BENCH_DST, max)
        .map_max_entries(MAP_BENCH_NAT_SRC, max)
        .load(BENCH_OBJECT)
        .expect("load the bench object");
    for (trie, name) in [
        (Trie::Destination, MAP_BENCH_DST),
        (Trie::NatSource, MAP_BENCH_NAT_SRC),
    ] {
        let mut copy: LpmTrie<_, LpmData, EntryValue> =
            LpmTrie::try_from(ebpf.map_mut(name).expect(name)).expect(name);
        for (net, value) in dp.maps().entries(trie).expect("read the datapath's trie") {
            copy.insert(&entry_key(&net), &value, 0).expect(name);
        }
    }
    load_baseline(&mut ebpf, kilo_common::PROG_LOOKUPS);
    ebpf
}

fn load_baseline(ebpf: &mut aya::Ebpf, name: &str) {
    let prog: &mut aya::programs::SchedClassifier = ebpf
        .program_mut(name)
        .unwrap_or_else(|| panic!("{name} in the bench object"))
        .try_into()
        .expect("a classifier");
    prog.load().unwrap_or_else(|e| panic!("load {name}: {e}"));
}

/// A loaded classifier of `noop()` or `lookups()`, by name.
pub fn baseline<'a>(ebpf: &'a aya::Ebpf, name: &str) -> &'a aya::programs::SchedClassifier {
    ebpf.program(name)
        .and_then(|p| p.try_into().ok())
        .unwrap_or_else(|| panic!("{name} loaded"))
}

/// The loaded empty classifier of `noop()`.
pub fn noop_program(ebpf: &aya::Ebpf) -> &aya::programs::SchedClassifier {
    baseline(ebpf, kilo_common::PROG_NOOP)
}

/// Set by `cargo xtask test`: a test that would skip for want of root or of the API server
/// fails instead, so that no tier passes without running.
pub const REQUIRE_ALL: &str = "KILO_REQUIRE_ALL";

/// Skips (says why, returns false) when `missing` is Some, or fails under [`REQUIRE_ALL`].
pub fn skip_unless(test: &str, missing: Option<String>) -> bool {
    let Some(why) = missing else {
        return true;
    };
    assert!(
        std::env::var_os(REQUIRE_ALL).is_none(),
        "{test} cannot run: {why} ({REQUIRE_ALL} is set)"
    );
    eprintln!("SKIP {test}: {why}");
    false
}

/// True when the test may create namespaces and load BPF programs. Elsewhere root-only tests
/// print why they skip and pass (fail under [`REQUIRE_ALL`]).
pub fn require_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    skip_unless(
        test,
        (!root).then(|| "needs root (network namespaces, BPF)".to_string()),
    )
}

/// Set by `cargo xtask kernels` inside each distribution kernel: there a test that needs a
/// kernel feature the host's kernel may lack (a module, TCX) must find it.
pub const KERNEL_MATRIX: &str = "KILO_KERNEL_MATRIX";

/// Skips when the running kernel lacks `feature` (`missing` is Some), even under
/// [`REQUIRE_ALL`]: the kernel matrix runs the test where the kernel has it, and fails there if
/// it is missing (under [`KERNEL_MATRIX`]).
pub fn skip_unless_kernel(test: &str, missing: Option<String>) -> bool {
    let Some(why) = missing else {
        return true;
    };
    assert!(
        std::env::var_os(KERNEL_MATRIX).is_none(),
        "{test} cannot run: {why} ({KERNEL_MATRIX} is set)"
    );
    eprintln!("SKIP {test}: kernel: {why}");
    false
}

/// Whether the running kernel attaches TC programs with TCX (Linux 6.6), as kg's `Auto` does.
pub fn kernel_has_tcx() -> bool {
    aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0))
}

/// The attach mode kg chooses on this kernel (TCX, else netlink and clsact), for tests that
/// check adoption and clean-up on whatever the kernel has.
pub fn kernel_attach_mode() -> kilo_agent::datapath::AttachMode {
    match kernel_has_tcx() {
        true => kilo_agent::datapath::AttachMode::Tcx,
        false => kilo_agent::datapath::AttachMode::Netlink,
    }
}

/// True when TCX is there; otherwise skips, in the kernel matrix too (the test's netlink variant
/// covers the kernel).
pub fn require_tcx(test: &str) -> bool {
    if kernel_has_tcx() {
        return true;
    }
    eprintln!("SKIP {test}: kernel: no TCX before Linux 6.6 (the netlink variant runs)");
    false
}

/// Whether the tests' meshes use kernel WireGuard (`KRS_WIREGUARD=kernel`, as the kernel matrix
/// runs them): kg then creates and configures the device itself (`--create-interface=true`,
/// Kilo's default) and no wireguard-go runs. Otherwise wireguard-go provides the device (a
/// kernel without the module, like the host's here, has no other).
pub fn kernel_wireguard() -> bool {
    std::env::var("KRS_WIREGUARD").as_deref() == Ok("kernel")
}

/// kg's `--create-interface` for the tests' meshes (see [`kernel_wireguard`]).
pub fn create_interface_flag() -> &'static str {
    match kernel_wireguard() {
        true => "--create-interface=true",
        false => "--create-interface=false",
    }
}

/// Waits (bounded at 60 s; for liveness only, never a speed check) until `f` holds.
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "timed out waiting until {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
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

/// The CPUs this process may run on.
pub fn online_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the kernel fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(
        ok,
        0,
        "sched_getaffinity: {}",
        std::io::Error::last_os_error()
    );
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Keeps the calling thread on `cpu`.
pub fn pin_to_cpu(cpu: usize) {
    // SAFETY: as above; the set names one CPU.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu, &mut set) };
    let ok = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    assert_eq!(
        ok,
        0,
        "sched_setaffinity: {}",
        std::io::Error::last_os_error()
    );
}
