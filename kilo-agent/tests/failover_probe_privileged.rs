//! The failover probe's ICMP echo on real sockets, between two namespaces: the successor `a`
//! routes the location's WireGuard IP to the leader `b` over their private link, as kg's plan
//! does. `b`'s kernel answers while it holds the address, and stops when it is gone (its
//! `kilo0` deleted) or the link is down, within the timeout; through a raw socket (the
//! namespace's default `ping_group_range` allows no datagram one) and through a datagram one.
use std::time::Duration;

use kilo_agent::agent::probe::{Icmp, Prober as _};
use kilo_testkit as support;
use support::netns::{NetNs, veth};

/// Opens the probe's sockets in `a` and echoes the WireGuard IP once.
fn echo(a: &NetNs) -> bool {
    a.run(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let icmp = Icmp::open().expect("the probe's socket");
            icmp.echo("10.4.0.1".parse().unwrap(), 1, Duration::from_millis(500))
                .await
        })
    })
}

#[test]
fn the_leaders_kernel_answers_while_it_holds_the_wireguard_ip() {
    if !support::require_root("the_leaders_kernel_answers_while_it_holds_the_wireguard_ip") {
        return;
    }
    let a = NetNs::new("succ");
    let b = NetNs::new("lead");
    veth(&a, "eth0", &b, "eth0");
    a.sh("ip addr add 172.20.0.2/24 dev eth0");
    b.sh("ip addr add 172.20.0.1/24 dev eth0");
    a.sh("ip route add 10.4.0.1/32 via 172.20.0.1 dev eth0");
    b.sh("ip addr add 10.4.0.1/32 dev lo");
    for range in ["1 0", "0 2147483647"] {
        a.sh(&format!("sysctl -qw net.ipv4.ping_group_range=\"{range}\""));
        assert!(echo(&a), "ping_group_range {range}: answered");
    }
    // The device (its address) gone: no answer.
    b.sh("ip addr del 10.4.0.1/32 dev lo");
    assert!(!echo(&a), "no answer without the address");
    b.sh("ip addr add 10.4.0.1/32 dev lo");
    assert!(echo(&a), "answered again");
    // The link cut: no answer.
    b.sh("ip link set eth0 down");
    assert!(!echo(&a), "no answer over a cut link");
}
