//! A Peer object as JSON or YAML (the API server's and the file backend's forms): decoding and
//! Kilo's validation never panic, and every rejection names its field.
#![no_main]

use kilo_agent::mesh::{MeshPeer, Peer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let json = serde_json::from_slice::<Peer>(data).ok();
    let yaml = serde_yaml::from_slice::<Peer>(data).ok();
    for peer in json.iter().chain(yaml.iter()) {
        match MeshPeer::from_crd(peer) {
            Ok((p, warnings)) => {
                for w in warnings {
                    assert!(!w.field.is_empty(), "a warning that names no field: {w}");
                }
                // What was accepted survives the way back to a CRD and a second parse.
                let (again, _) = MeshPeer::from_crd(&p.to_crd()).expect("a parsed peer re-parses");
                assert_eq!(again.allowed_ips, p.allowed_ips);
            }
            Err(errors) => {
                assert!(!errors.is_empty());
                for e in errors {
                    assert!(e.field.starts_with("spec") || e.field.starts_with("metadata"), "{e}");
                }
            }
        }
    }
});
