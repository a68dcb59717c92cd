//! Mesh tier: the demo (`xtask/scripts/demo.sh`) as a test. Three nodes in two locations, each a
//! network namespace with a pod behind a bridge, wireguard-go, and the real `kg` and `kgctl`
//! binaries on the file backend, with Kilo's default `--encapsulate=always`. Asserts what the
//! demo shows: pods reach each other across locations through WireGuard (also from a
//! non-leader, whose traffic reaches its leader in IPIP), the internet host sees the node's
//! address (masqueraded) while a pod in another location sees the pod's own, n1's datapath
//! counters saw that traffic (the masquerade decision, the pod CIDR's NAT-source entry), and
//! nothing is left behind (namespaces, processes, pins).
use kilo_testkit as support;

use std::{path::Path, process::Command};

#[test]
fn three_nodes_two_locations_route_encrypt_and_masquerade() {
    if !support::require_root("three_nodes_two_locations_route_encrypt_and_masquerade") {
        return;
    }
    let prefix = format!("krs-mesh{}", std::process::id());
    let kg = support::kg::binary("kg");
    let bin = kg.parent().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/scripts/demo.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg(bin)
        .env("KRS_DEMO_PREFIX", &prefix)
        .env(
            "KRS_DEMO_WG",
            format!("km{}-", std::process::id() % 100_000),
        )
        .output()
        .expect("run demo.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The demo's own output, for `--nocapture` (the kernel matrix keeps it in its logs).
    println!("{stdout}");
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    for want in [
        "3 packets transmitted, 3 packets received",
        "internet host saw the packet from 192.168.50.1",
        "pod3 saw the packet from 10.42.1.2",
        "latest handshake",
        "kilo_leader 1",
        "10.42.3.0/24 via 192.168.50.1 dev eth0 proto 107 src 192.168.50.2 onlink realm 1107 mtu 1480",
        "\"subnet\": \"10.42.1.0/24\"",
        "demo OK",
    ] {
        assert!(stdout.contains(want), "missing {want:?} in:\n{stdout}");
    }
    // n1's metrics (the only ones the demo prints): the eBPF program marked pod1's packet to the
    // internet host for masquerading, and counted it on n1's pod CIDR (its NAT source).
    for series in [
        "kilo_datapath_packets_total{decision=\"masquerade\"}",
        "kilo_datapath_bytes_total{decision=\"masquerade\"}",
        "kilo_datapath_entry_packets_total{role=\"nat_source\",cidr=\"10.42.1.0/24\",kind=\"local_pods\",owner=\"n1\"}",
        "kilo_datapath_entry_bytes_total{role=\"nat_source\",cidr=\"10.42.1.0/24\",kind=\"local_pods\",owner=\"n1\"}",
        // pod2's packets reached n1 in IPIP from n2, and the replies went back that way.
        "kilo_datapath_packets_total{decision=\"decapsulated\"}",
        "kilo_datapath_packets_total{decision=\"encapsulated\"}",
        "kilo_datapath_entry_packets_total{role=\"ipip_source\",cidr=\"192.168.50.2/32\",kind=\"node\",owner=\"n2\"}",
    ] {
        let value = metric(&stdout, series);
        assert!(value > 0, "{series} is {value} in:\n{stdout}");
    }
    assert_eq!(
        metric(&stdout, "kilo_datapath_map_entries{map=\"nat_source\"}"),
        1,
        "{stdout}"
    );
    // kg created a kernel WireGuard device (KRS_WIREGUARD=kernel), or configured wireguard-go's.
    let link = match support::kernel_wireguard() {
        true => "link type: wireguard",
        false => "link type: tun",
    };
    assert!(stdout.contains(link), "missing {link:?} in:\n{stdout}");
    // Two pings across locations, both complete.
    assert_eq!(stdout.matches("0% packet loss").count(), 2, "{stdout}");
    let left = support::netns::sh("ip netns list");
    assert!(!left.contains(&prefix), "namespaces left behind: {left}");
    // `[k]` keeps pgrep from matching the shell that runs it.
    let procs = support::netns::try_sh(&format!("pgrep -af '[k]{}'", &prefix[1..]));
    assert!(
        String::from_utf8_lossy(&procs.stdout).trim().is_empty(),
        "processes left behind: {}",
        String::from_utf8_lossy(&procs.stdout)
    );
    assert!(!Path::new(&format!("/sys/fs/bpf/{prefix}-n1")).exists());
}

/// The value of `series` (name and labels) in the demo's output; panics if absent.
fn metric(exposition: &str, series: &str) -> u64 {
    support::metrics::metric(exposition, series)
        .unwrap_or_else(|| panic!("no {series} in:\n{exposition}"))
}
