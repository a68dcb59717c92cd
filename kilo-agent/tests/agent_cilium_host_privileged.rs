//! `--compatibility=cilium`: the agent reads `cilium_host`'s IPv4 address over netlink at every
//! pass, as Kilo does, here in a throwaway namespace where a veth pair plays Cilium's (cilium_host, cilium_net).
use kilo_testkit as support;

use ipnet::IpNet;
use kilo_agent::agent::detect::CiliumHost;
use support::netns::NetNs;

#[test]
fn cilium_host_address_is_read_again_on_one_connection() {
    if !support::require_root("cilium_host_address_is_read_again_on_one_connection") {
        return;
    }
    let ns = NetNs::new("cil");
    let seen = ns.run(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let cilium = CiliumHost::connect().unwrap();
                let mut seen: Vec<Option<IpNet>> = Vec::new();
                for step in [
                    "true",
                    "ip link add cilium_host type veth peer name cilium_net",
                    "ip addr add fd00::12/128 dev cilium_host",
                    "ip addr add 10.0.1.77/32 dev cilium_host",
                    "ip addr del 10.0.1.77/32 dev cilium_host; ip addr add 10.0.1.78/32 dev cilium_host",
                    "ip link del cilium_host",
                ] {
                    ns.sh(step);
                    seen.push(cilium.address().await.unwrap());
                }
                seen
            })
    });
    let ip = |s: &str| Some(s.parse::<IpNet>().unwrap());
    assert_eq!(
        seen,
        [
            None,
            None,
            None,
            ip("10.0.1.77/32"),
            ip("10.0.1.78/32"),
            None
        ]
    );
}
