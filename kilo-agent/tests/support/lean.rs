//! The lean reference program (kilo-ebpf's `kilo_lean`, the datapath issue's cost model) for
//! the benchmarks and its test: loaded from an instance of the object, its tries filled with a
//! plan's IPv4 mesh destinations and NAT sources.
use aya::{
    Ebpf,
    maps::lpm_trie::{Key, LpmTrie},
    programs::SchedClassifier,
};
use ipnet::IpNet;
use kilo_agent::plan::DatapathPlan;
use kilo_common::{MAP_LEAN_MESH, MAP_LEAN_NAT, PROG_LEAN};

/// Loads the lean reference in `ebpf` and fills its tries from `plan` (IPv4 entries only).
pub fn load(ebpf: &mut Ebpf, plan: &DatapathPlan) {
    let prog: &mut SchedClassifier = ebpf
        .program_mut(PROG_LEAN)
        .expect("the lean reference in the object")
        .try_into()
        .unwrap();
    prog.load().expect("load the lean reference");
    for (map, nets) in [
        (MAP_LEAN_MESH, &plan.mesh_destinations),
        (MAP_LEAN_NAT, &plan.nat_sources),
    ] {
        let mut trie: LpmTrie<_, [u8; 4], u32> =
            LpmTrie::try_from(ebpf.map_mut(map).expect("a lean trie")).unwrap();
        for net in nets.keys() {
            if let IpNet::V4(n) = net {
                let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                trie.insert(&key, &1, 0)
                    .unwrap_or_else(|e| panic!("{map}: insert {n}: {e}"));
            }
        }
    }
}
