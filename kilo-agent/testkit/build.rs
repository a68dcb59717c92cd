//! Points the kit at kilo-agent's eBPF objects: kilo-agent's build script builds them into its
//! OUT_DIR and names that directory to its dependents (`links` metadata), so that the kit can
//! embed the benchmarks' object (`kilo-ebpf-bench`) without building it again.
fn main() {
    let dir = std::env::var("DEP_KILO_EBPF_OUT_DIR")
        .expect("kilo-agent's build script names its OUT_DIR (DEP_KILO_EBPF_OUT_DIR)");
    println!("cargo::rustc-env=KILO_EBPF_OUT_DIR={dir}");
    println!("cargo::rerun-if-env-changed=DEP_KILO_EBPF_OUT_DIR");
}
