//! The single values operators type: WireGuard keys, endpoints, CIDRs and comma-separated CIDR
//! lists (flags and annotations). Parsing never panics and what parses prints back to itself.
#![no_main]

use kilo_agent::mesh::{Endpoint, Key, parse_cidr};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(k) = s.parse::<Key>() {
        assert_eq!(k.to_string().parse::<Key>().ok(), Some(k));
    }
    if let Ok(e) = s.parse::<Endpoint>() {
        assert_eq!(e.to_string().parse::<Endpoint>().ok(), Some(e));
    }
    for item in s.split(',') {
        if let Ok(c) = parse_cidr(item) {
            assert_eq!(parse_cidr(&c.to_string()), Ok(c));
        }
    }
});
