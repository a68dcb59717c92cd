//! The CNI configuration file kg rewrites (`--cni-path`): any text either fails with a message
//! or is rewritten into a file that carries the pod CIDRs and needs no second rewrite.
#![no_main]

use ipnet::IpNet;
use kilo_agent::reconcile::cni::with_pod_cidrs;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let cidrs: [IpNet; 2] = ["10.10.1.0/24".parse().unwrap(), "fd10:1::/64".parse().unwrap()];
    match with_pod_cidrs(text, &cidrs) {
        Ok(Some(out)) => assert_eq!(with_pod_cidrs(&out, &cidrs), Ok(None)),
        Ok(None) => {}
        Err(message) => assert!(!message.is_empty()),
    }
});
