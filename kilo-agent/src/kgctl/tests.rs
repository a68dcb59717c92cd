use super::*;
use crate::mesh::objects;

const NOW: i64 = 1_700_000_000;

fn snapshot() -> Snapshot {
    let text = include_str!("../../tests/data/kilo/fixture.yaml")
        .replace("\"NOW\"", &format!("\"{NOW}\""));
    objects::parse_stream(&text, "fixture.yaml").unwrap()
}

fn opts(g: Granularity) -> GlobalOptions {
    GlobalOptions {
        granularity: GranularityArg::Fixed(g),
        now: Some(NOW),
        ..GlobalOptions::default()
    }
}

fn fixture(g: Granularity) -> Cluster {
    cluster(&snapshot(), &opts(g)).unwrap()
}

/// Sets the annotation `key` of node `node` in `snap` to `value`.
fn annotate(snap: &mut Snapshot, node: &str, key: &str, value: &str) {
    let n = snap.nodes.get_mut(node).unwrap();
    let annotations = n.metadata.annotations.as_mut().unwrap();
    annotations.insert(key.into(), value.into());
}

#[test]
fn non_leader_is_reported_on_stderr() {
    let c = fixture(Granularity::Location);
    let shown = showconf_node(&c, "c", &ShowOptions::default()).unwrap();
    assert_eq!(shown.stdout, "");
    assert_eq!(shown.stderr, "Node \"c\" is not a leader node\n");
    assert_eq!(
        showconf_node(&c, "zz", &ShowOptions::default()).unwrap_err(),
        KgctlError::NodeNotFound("zz".into())
    );
}

/// Deliberate difference: Kilo decides leadership by finding the node's key among all
/// WireGuard peers, so a Peer sharing a non-leader's key made kgctl print its config.
#[test]
fn peer_sharing_a_non_leaders_key_does_not_make_it_a_leader() {
    let mut snap = snapshot();
    snap.peers.get_mut("a").unwrap().spec.public_key =
        "a2V5MwAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".into(); // node c's key
    let c = cluster(&snap, &opts(Granularity::Location)).unwrap();
    let shown = showconf_node(&c, "c", &ShowOptions::default()).unwrap();
    assert!(shown.stdout.is_empty() && !shown.stderr.is_empty());
}

#[test]
fn showconf_node_uses_the_nodes_own_keepalive_and_no_private_key() {
    let c = fixture(Granularity::Location);
    let out = showconf_node(&c, "a", &ShowOptions::default())
        .unwrap()
        .stdout;
    assert!(
        out.starts_with("[Interface]\nListenPort = 51820\n\n[Peer]\n"),
        "{out}"
    );
    assert!(!out.contains("PrivateKey"));
    assert_eq!(out.matches("PersistentKeepalive = 25").count(), 4, "{out}");
}

#[test]
fn as_peer_wireguard_adds_allowed_ips_once() {
    let c = fixture(Granularity::Location);
    let o = ShowOptions {
        as_peer: true,
        allowed_ips: vec![
            "10.96.0.0/12".parse().unwrap(),
            "10.2.2.0/24".parse().unwrap(),
        ],
        ..Default::default()
    };
    let out = showconf_node(&c, "b", &o).unwrap().stdout;
    assert_eq!(
        out,
        "[Peer]\nAllowedIPs = 10.2.2.0/24, 192.168.0.1/32, 10.2.3.0/24, 192.168.0.2/32, 10.4.0.2/32, 10.96.0.0/12\n\
         Endpoint = 10.1.0.2:51820\nPersistentKeepalive = 0\nPublicKey = a2V5MgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n"
    );
}

#[test]
fn as_peer_yaml_and_json_emit_a_peer_object() {
    let c = fixture(Granularity::Location);
    for output in [OutputFormat::Yaml, OutputFormat::Json] {
        let o = ShowOptions {
            as_peer: true,
            output,
            ..Default::default()
        };
        let out = showconf_node(&c, "b", &o).unwrap().stdout;
        let obj = match objects::parse_object(out.as_bytes(), "out").unwrap() {
            objects::Object::Peer(p) => p,
            other => panic!("{other:?}"),
        };
        assert_eq!(obj.metadata.name.as_deref(), Some("b"));
        assert_eq!(
            obj.spec.public_key,
            "a2V5MgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
        );
        assert_eq!(obj.spec.endpoint.as_ref().unwrap().port, 51820);
        assert_eq!(
            obj.spec.endpoint.as_ref().unwrap().dns_or_ip.ip.as_deref(),
            Some("10.1.0.2")
        );
        assert_eq!(obj.spec.allowed_ips.len(), 5);
        assert!(out.contains("apiVersion") && out.contains("kilo.squat.ai/v1alpha1"));
    }
}

/// Deliberate difference: Kilo's translatePeer writes the keepalive in nanoseconds and an
/// endpoint `ip: "<nil>"` for a peer without one.
#[test]
fn as_peer_peer_keepalive_in_seconds() {
    let mut snap = snapshot();
    snap.peers.get_mut("a").unwrap().spec.persistent_keepalive = Some(10);
    let c = cluster(&snap, &opts(Granularity::Location)).unwrap();
    let o = ShowOptions {
        as_peer: true,
        output: OutputFormat::Json,
        ..Default::default()
    };
    let out = showconf_peer(&c, "a", &o).unwrap().stdout;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["spec"]["persistentKeepalive"], 10);
    assert!(v["spec"].get("endpoint").is_none(), "{out}");
    let out = showconf_peer(&c, "a", &ShowOptions::default())
        .unwrap()
        .stdout;
    assert_eq!(
        out.matches("PersistentKeepalive = 10").count(),
        4,
        "the peer's own keepalive: {out}"
    );
}

#[test]
fn granularity_auto_and_subnet_detection() {
    let mut snap = snapshot();
    let auto = GlobalOptions {
        now: Some(NOW),
        ..GlobalOptions::default()
    };
    assert_eq!(
        cluster(&snap, &auto).unwrap_err(),
        KgctlError::UnsupportedGranularity("auto".into()),
        "no annotation on the first node"
    );
    for (value, g) in [
        ("full", Granularity::Full),
        ("cross", Granularity::Cross),
        ("location", Granularity::Location),
    ] {
        annotate(&mut snap, "a", mesh::annotations::GRANULARITY, value);
        assert_eq!(cluster(&snap, &auto).unwrap().granularity, g);
    }
    annotate(
        &mut snap,
        "d",
        mesh::annotations::WIREGUARD_IP,
        "10.6.0.1/16",
    );
    let c = cluster(&snap, &auto).unwrap();
    assert_eq!(c.subnet.to_string(), "10.6.0.0/16");
    assert!(graph(&c).unwrap().contains("label=\"10.6.0.0/16\";"));
    let c = cluster(
        &snap,
        &GlobalOptions {
            subnet: Some("10.9.0.0/16".parse().unwrap()),
            ..auto
        },
    )
    .unwrap();
    assert_eq!(c.subnet.to_string(), "10.9.0.0/16");
}

#[test]
fn no_ready_nodes() {
    let o = GlobalOptions {
        now: Some(NOW + 3600),
        ..opts(Granularity::Location)
    };
    assert_eq!(cluster(&snapshot(), &o).unwrap_err(), KgctlError::NoNodes);
}

#[test]
fn cross_graph() {
    let c = fixture(Granularity::Cross);
    let dot = graph(&c).unwrap();
    // a and d are in location 1 but d has no internal IP: its own group.
    for group in ["location:1", "location:2", "node:d"] {
        let subgraph = format!("subgraph \"cluster_location_{group}\"");
        assert!(dot.contains(&subgraph), "{subgraph} in {dot}");
    }
    assert!(
        !dot.contains("\"b\"->\"c\"[ dir=both ]"),
        "b and c share a location: no tunnel"
    );
    for e in [
        "\"a\"->\"b\"[ dir=both ]",
        "\"a\"->\"c\"[ dir=both ]",
        "\"a\"->\"d\"[ dir=both ]",
        "\"c\"->\"d\"[ dir=both ]",
    ] {
        assert!(dot.contains(e), "{e} in {dot}");
    }
}

#[test]
fn dot_escapes_quotes() {
    let mut snap = snapshot();
    annotate(&mut snap, "a", mesh::annotations::LOCATION, "x\"y");
    let dot = graph(&cluster(&snap, &opts(Granularity::Location)).unwrap()).unwrap();
    assert!(dot.contains("label=\"location:x\\\"y\";"), "{dot}");
}

/// kgctl leaves out and reports the same losers as the agents, so `showconf` matches the mesh.
#[test]
fn cluster_resolves_conflicts_like_the_agent() {
    let opts = GlobalOptions {
        granularity: GranularityArg::Fixed(Granularity::Full),
        ..GlobalOptions::default()
    };
    let c = cluster(&crate::mesh::cloned_snapshot(), &opts).unwrap();
    assert_eq!(c.nodes.keys().collect::<Vec<_>>(), ["a"]);
    let lost: Vec<_> = c
        .errors
        .iter()
        .map(|e| (e.name.as_str(), e.field.as_str()))
        .collect();
    assert_eq!(
        lost,
        [("b", "spec.podCIDR"), ("c", "annotation kilo.squat.ai/key")]
    );
}
