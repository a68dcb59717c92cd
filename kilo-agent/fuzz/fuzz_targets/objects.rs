//! The file backend's files (a YAML stream of Nodes and Peers) through everything kgctl does
//! with them: parse, resolve the cluster, compute every node's topology, render the graph and
//! each node's WireGuard configuration. Nothing panics; errors name an object and a field.
#![no_main]

use kilo_agent::{kgctl, mesh::objects};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let snapshot = match objects::parse_stream(text, "fuzz.yaml") {
        Ok(s) => s,
        Err(e) => {
            assert!(!e.field.is_empty(), "{e}");
            return;
        }
    };
    let Ok(cluster) = kgctl::cluster(&snapshot, &kgctl::GlobalOptions::default()) else {
        return;
    };
    let _ = kgctl::graph(&cluster);
    let names: Vec<String> = cluster.nodes.keys().cloned().collect();
    for name in names {
        let _ = kgctl::showconf_node(&cluster, &name, &Default::default());
    }
});
