//! Desired state, diff and display of the WireGuard device.
use std::net::SocketAddr;

use super::*;
use crate::writes::Write;
use crate::{
    mesh::Endpoint,
    plan::{WireGuardPeer, WireGuardPlan},
};

fn peer(n: u8, ip: &str, endpoint: Option<&str>) -> WireGuardPeer {
    WireGuardPeer {
        public_key: Key([n; 32]),
        preshared_key: None,
        endpoint: endpoint.map(|e| e.parse::<Endpoint>().unwrap()),
        allowed_ips: vec![ip.parse().unwrap()],
        persistent_keepalive: 0,
    }
}

fn no_dns(_: &str, _: u16) -> Vec<SocketAddr> {
    vec![]
}

#[test]
fn second_pass_is_empty_and_one_change_touches_one_peer() {
    let mut plan = WireGuardPlan {
        listen_port: 51820,
        peers: vec![
            peer(1, "10.2.1.0/24", Some("192.0.2.1:51820")),
            peer(2, "10.2.2.0/24", Some("192.0.2.2:51820")),
        ],
    };
    let mut fake = FakeWireGuard::default();
    let mut problems = vec![];
    let want = desired(&plan, Key([9; 32]), None, &no_dns, &mut problems);
    let d = diff(&want, &fake.observe().unwrap().unwrap_or_default());
    let w = fake.apply(&d).unwrap();
    assert_eq!(w.get(Write::WireguardPeerAdd), 2);
    let observed = fake.observe().unwrap().unwrap();
    assert!(diff(&want, &observed).is_empty());

    plan.peers[1]
        .allowed_ips
        .push("10.2.3.0/24".parse().unwrap());
    plan.peers.push(peer(3, "10.2.4.0/24", None));
    let want = desired(&plan, Key([9; 32]), Some(&observed), &no_dns, &mut problems);
    let d = diff(&want, &observed);
    assert_eq!(d.add.len(), 1);
    assert_eq!(d.update.len(), 1);
    assert_eq!(d.update[0].0, Key([2; 32]));
    assert!(d.update[0].1.endpoint.is_none() && d.update[0].1.keepalive.is_none());
    assert!(d.remove.is_empty() && d.private_key.is_none() && d.listen_port.is_none());
    assert!(problems.is_empty());
}

#[test]
fn dns_endpoint_keeps_current_address_and_reports_failures() {
    let plan = WireGuardPlan {
        listen_port: 1,
        peers: vec![peer(1, "10.0.0.0/8", Some("node-a.example:51820"))],
    };
    let rr = |_: &str, port: u16| -> Vec<SocketAddr> {
        vec![
            SocketAddr::new("192.0.2.1".parse().unwrap(), port),
            SocketAddr::new("192.0.2.2".parse().unwrap(), port),
        ]
    };
    let mut observed = DeviceState::default();
    observed.peers.insert(
        Key([1; 32]),
        PeerState {
            preshared_key: None,
            endpoint: Some("192.0.2.2:51820".parse().unwrap()),
            allowed_ips: ["10.0.0.0/8".parse().unwrap()].into(),
            keepalive: 0,
        },
    );
    let mut problems = vec![];
    let want = desired(&plan, Key([9; 32]), Some(&observed), &rr, &mut problems);
    assert_eq!(
        want.peers[&Key([1; 32])].endpoint,
        Some("192.0.2.2:51820".parse().unwrap())
    );
    desired(&plan, Key([9; 32]), Some(&observed), &no_dns, &mut problems);
    assert_eq!(problems.len(), 1, "{problems:?}");
}

#[test]
fn display_never_prints_the_private_key() {
    let d = WgDiff {
        private_key: Some(Key([7; 32])),
        ..WgDiff::default()
    };
    assert!(!d.to_string().contains(&Key([7; 32]).to_string()));
    let s = DeviceState {
        private_key: Some(Key([7; 32])),
        ..DeviceState::default()
    };
    assert!(!format!("{s:?}").contains(&Key([7; 32]).to_string()));
}
