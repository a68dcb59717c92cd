//! The namespace helpers themselves: two namespaces joined by a veth can ping each other,
//! and a dropped namespace is gone.
use kilo_testkit as support;

use support::netns::{NetNs, sh, veth};

#[test]
fn veth_pair_pings_and_namespaces_are_removed() {
    if !support::require_root("veth_pair_pings_and_namespaces_are_removed") {
        return;
    }
    let name;
    {
        let a = NetNs::new("a");
        let b = NetNs::new("b");
        name = a.name.clone();
        veth(&a, "eth0", &b, "eth0");
        a.sh("ip addr add 10.200.0.1/30 dev eth0");
        b.sh("ip addr add 10.200.0.2/30 dev eth0");
        a.sh("busybox ping -c1 -W2 10.200.0.2");
    }
    assert!(!sh("ip netns list").contains(&name));
}
