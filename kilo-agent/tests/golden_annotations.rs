//! Node annotations against Kilo's own code: a bad value is ignored with Kilo's fallback and
//! reported once, values that cannot be bad are taken as Kilo takes them, and every line of
//! Kilo's `translateNode` table (`tests/data/kilo/annotations.txt`) is read alike.
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use kilo_agent::{
    kgctl,
    mesh::{self, Granularity, Key},
    plan::{self, Encapsulation, KeepaliveSource, Settings},
};
use kilo_testkit::golden::*;

/// A bad node annotation is ignored (the node stays); a Peer failing Kilo's validation is skipped.
#[test]
fn bad_objects_are_reported_and_skipped() {
    let mut snap = fixture();
    set_annotation(&mut snap, "b", mesh::annotations::INTERNAL_IP, Some("x"));
    snap.peers.get_mut("b").unwrap().spec.public_key = "nope".into();
    let p = plan::plan_for(&snap, &settings(Granularity::Location, "a"));
    let errs: Vec<String> = p.errors.iter().map(ToString::to_string).collect();
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert!(errs.contains(
        &r#"node "b": annotation kilo.squat.ai/internal-ip: invalid CIDR "x"; the node has no internal IP"#
            .to_string()
    ));
    assert!(
        errs.iter()
            .any(|e| e.starts_with(r#"peer "b": spec.publicKey: "#))
    );
    let t = p.topology.unwrap();
    assert_eq!(t.node_count(), 4);
    assert_eq!(t.peers.len(), 1);
}

/// Kilo's `translateNode` ignores a bad optional annotation with a fallback. For each one, the
/// fixture with the bad value plans exactly as the fixture with the fallback (the topology,
/// the WireGuard configuration and every route, seen from every node at both granularities),
/// and the bad value is reported once, naming the node, the annotation and the value.
#[test]
fn bad_optional_annotations_fall_back_like_kilo() {
    use mesh::annotations as ann;
    // Node, annotation, bad value, the value Kilo reads instead (`None`: as if absent).
    let cases: &[(&str, &str, &str, Option<&str>)] = &[
        ("a", ann::PERSISTENT_KEEPALIVE, "25s", None),
        ("a", ann::PERSISTENT_KEEPALIVE, "-3", None),
        ("b", ann::FORCE_ENDPOINT, "10.1.0.9", None),
        ("b", ann::FORCE_INTERNAL_IP, "192.168.0.300/32", None),
        ("d", ann::FORCE_INTERNAL_IP, "not-an-ip", None),
        (
            "a",
            ann::DISCOVERED_ENDPOINTS,
            r#"{"a2V5MgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=":{"IP":"10.9.9","Port":1}}"#,
            None,
        ),
        (
            "b",
            ann::ALLOWED_LOCATION_IPS,
            "192.168.178.3/32,192.168.178.300/32",
            Some("192.168.178.3/32"),
        ),
        ("c", ann::ALLOWED_LOCATION_IPS, "bad", None),
        ("c", ann::GRANULARITY, "mesh", None),
        ("b", ann::INTERNAL_IP, "192.168.0.1", None),
        ("b", ann::WIREGUARD_IP, "10.4.0.300/16", None),
        ("c", ann::CNI_COMPATIBILITY_IP, "1.2.3", None),
    ];
    for &(node, key, bad, fallback) in cases {
        let mut with_bad = fixture();
        set_annotation(&mut with_bad, node, key, Some(bad));
        let mut with_fallback = fixture();
        set_annotation(&mut with_fallback, node, key, fallback);
        let what = format!("{node} {key}={bad:?}");
        for g in GRANULARITIES {
            for h in HOSTS {
                for local in [false, true] {
                    let s = Settings {
                        local,
                        persistent_keepalive: KeepaliveSource::LocalNode,
                        encapsulate: Encapsulation::CrossSubnet,
                        ..settings(g, h)
                    };
                    let got = plan::plan_for(&with_bad, &s);
                    let want = plan::plan_for(&with_fallback, &s);
                    assert!(want.errors.is_empty(), "{what}: {:?}", want.errors);
                    let errs: Vec<String> = got.errors.iter().map(ToString::to_string).collect();
                    assert_eq!(errs.len(), 1, "{what}: {errs:?}");
                    let prefix = format!("node \"{node}\": annotation {key}: ");
                    assert!(errs[0].starts_with(&prefix), "{what}: {}", errs[0]);
                    // allowed-location-ips names the bad item.
                    let value = match key {
                        ann::ALLOWED_LOCATION_IPS => bad.split(',').next_back().unwrap(),
                        _ => bad,
                    };
                    assert!(
                        errs[0].contains(&format!("{value:?}")),
                        "{what}: {}",
                        errs[0]
                    );
                    let (t, w) = (got.topology.unwrap(), want.topology.unwrap());
                    assert_eq!(t.node_count(), 4, "{what}: the node stays");
                    assert_eq!(t.dump(), w.dump(), "{what}: topology from {h} ({g})");
                    assert_eq!(
                        kgctl::render_wireguard(None, &t.conf()),
                        kgctl::render_wireguard(None, &w.conf()),
                        "{what}: WireGuard from {h} ({g})"
                    );
                    let (p, q) = (got.plan.unwrap(), want.plan.unwrap());
                    assert_eq!(p.routes, q.routes, "{what}: routes from {h} ({g})");
                    assert_eq!(p.rules, q.rules, "{what}: rules from {h} ({g})");
                    assert_eq!(p, q, "{what}: plan from {h} ({g}, local={local})");
                }
            }
        }
    }
}

/// Annotations that cannot be bad: `leader` counts by presence (any value), `location` by any
/// string, as in Kilo.
#[test]
fn presence_and_free_text_annotations_take_any_value() {
    use mesh::annotations as ann;
    for (key, a, b) in [(ann::LEADER, "", "no"), (ann::LOCATION, "2", "2")] {
        let mut x = fixture();
        set_annotation(&mut x, "c", key, Some(a));
        let mut y = fixture();
        set_annotation(&mut y, "c", key, Some(b));
        let s = settings(Granularity::Location, "c");
        let (p, q) = (plan::plan_for(&x, &s), plan::plan_for(&y, &s));
        assert!(p.errors.is_empty() && q.errors.is_empty());
        assert_eq!(p.plan, q.plan, "{key}");
    }
    let mut x = fixture();
    set_annotation(&mut x, "c", ann::LEADER, Some("false"));
    let t = plan::plan_for(&x, &settings(Granularity::Location, "c"))
        .topology
        .unwrap();
    assert!(
        t.leader,
        "a leader annotation with any value makes c its location's leader"
    );
}

fn go_net(n: Option<IpNet>) -> String {
    n.map_or("<nil>".into(), |n| go_quote(&n.to_string()))
}

/// `name=nil` when there are no items, else `name=` and the items between `[open, sep, close]`.
fn go_map_or_list(
    name: &str,
    items: impl Iterator<Item = String>,
    [open, sep, close]: [&str; 3],
) -> String {
    let items: Vec<String> = items.collect();
    if items.is_empty() {
        return format!("{name}=nil");
    }
    format!("{name}={open}{}{close}", items.join(sep))
}

/// The fields of Kilo's `mesh.Node` a table line shows for annotation `key`, as Kilo prints them.
fn kilo_node_fields(n: &mesh::Node, key: &str, now: i64) -> String {
    let field = key.trim_start_matches("kilo.squat.ai/");
    let fields = match field {
        "allowed-location-ips" => go_map_or_list(
            "AllowedLocationIPs",
            n.allowed_location_ips
                .iter()
                .map(|i| go_quote(&i.to_string())),
            ["[", " ", "]"],
        ),
        "internal-ip" | "force-internal-ip" => format!(
            "InternalIP={} NoInternalIP={}",
            go_net(n.internal_ip()),
            n.no_internal_ip
        ),
        "endpoint" | "force-endpoint" => match &n.endpoint {
            Some(e) => format!("Endpoint={}(ready=true)", go_quote(&e.to_string())),
            None => "Endpoint=<nil>".into(),
        },
        "persistent-keepalive" => {
            let k = n.persistent_keepalive;
            format!("PersistentKeepalive={} ({k} s)", go_duration(k.into()))
        }
        "last-seen" => format!("LastSeen={}", n.last_seen.unwrap_or(0)),
        "key" => {
            let k = n.key.unwrap_or(Key([0; 32]));
            format!(
                "Key={} zero={}",
                go_quote(&k.to_string()),
                k == Key([0; 32])
            )
        }
        "location" => format!("Location={}", go_quote(&n.location)),
        "leader" => format!("Leader={}", n.leader),
        "granularity" => format!(
            "Granularity={}",
            go_quote(n.granularity.map_or("", |g| g.as_str()))
        ),
        "wireguard-ip" => format!("WireGuardIP={}", go_net(n.wireguard_ip)),
        "cni-compatibility-ip" => format!("CNICompatibilityIP={}", go_net(n.cni_compatibility_ip)),
        "discovered-endpoints" => go_map_or_list(
            "DiscoveredEndpoints",
            n.discovered_endpoints
                .iter()
                .map(|(k, a)| format!("{}:{}", go_quote(&k.to_string()), go_quote(&a.to_string()))),
            ["{", ",", "}"],
        ),
        "spec.podCIDR" => format!("Subnet={}", go_net(n.pod_cidrs.first().copied())),
        other => panic!("no field for {other}"),
    };
    format!("{fields} ready={}", n.ready(Some(now)))
}

/// kg reads every node annotation as Kilo's `translateNode` does (annotations.txt, produced by
/// Kilo's code): what Kilo skips or ignores, kg skips or ignores (and reports), what Kilo
/// accepts, kg accepts. The lines where kg deliberately differs are listed with kg's value.
#[test]
fn node_annotations_parse_as_kilo_golden() {
    const KEY1: &str = "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    // Kilo ran at its own time; any instant well after the table's last-seen case will do.
    let now = 1_800_000_000_i64;
    // (line start, kg's fields): kg's dual-stack internal-ip, its `cross` granularity, and a
    // keepalive WireGuard cannot carry counting as none.
    let dual = "InternalIP=\"10.0.0.1/24\" NoInternalIP=false ready=true";
    let deliberate = [
        (
            r#"node kilo.squat.ai/internal-ip "10.0.0.1/24,fd00::1/64""#,
            dual,
        ),
        (
            r#"node kilo.squat.ai/force-internal-ip "10.0.0.1/24,fd00::1/64" =>"#,
            dual,
        ),
        (
            r#"node kilo.squat.ai/force-internal-ip "10.0.0.1/24,fd00::1/64" with"#,
            dual,
        ),
        (
            r#"node kilo.squat.ai/granularity "cross""#,
            "Granularity=\"cross\" ready=true",
        ),
        (
            r#"node kilo.squat.ai/persistent-keepalive "-1""#,
            "PersistentKeepalive=0s (0 s) ready=true",
        ),
        (
            r#"node kilo.squat.ai/persistent-keepalive "99999999999""#,
            "PersistentKeepalive=0s (0 s) ready=true",
        ),
    ];
    let text = data("annotations.txt");
    let (mut seen, mut checked) = (BTreeSet::new(), 0);
    for line in text.lines().filter(|l| l.starts_with("node ")) {
        let (case, kilo) = line.split_once(" => ").unwrap();
        let (key, rest) = case["node ".len()..].split_once(' ').unwrap();
        let (value, mut rest) = go_unquote(rest);
        let mut annotations: BTreeMap<String, String> = [
            ("kilo.squat.ai/endpoint", "10.1.0.1:51820".to_string()),
            ("kilo.squat.ai/key", KEY1.into()),
            ("kilo.squat.ai/last-seen", now.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let mut labels = BTreeMap::new();
        let mut pod_cidr = "10.2.1.0/24".to_string();
        while let Some(with) = rest.trim_start().strip_prefix("with ") {
            let (k, v) = with.split_once('=').unwrap();
            let (v, r) = go_unquote(v);
            match k.strip_prefix("label:") {
                Some(l) => labels.insert(l.to_string(), v),
                None => annotations.insert(k.to_string(), v),
            };
            rest = r;
        }
        match key {
            "spec.podCIDR" => pod_cidr = value,
            _ => {
                annotations.insert(key.to_string(), value);
            }
        }
        let kn: mesh::KubeNode = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n", "annotations": annotations, "labels": labels},
            "spec": {"podCIDR": pod_cidr},
        }))
        .unwrap();
        let (n, _) = mesh::Node::from_kube(&kn, mesh::DEFAULT_TOPOLOGY_LABEL);
        let ours = kilo_node_fields(&n, key, now);
        match deliberate.iter().find(|(start, _)| line.starts_with(start)) {
            Some((start, kg)) => {
                assert!(seen.insert(*start), "{start} matched twice");
                assert_ne!(kilo, *kg, "{line}: no longer a difference");
                assert_eq!(ours, *kg, "{line}");
            }
            None => assert_eq!(ours, kilo, "{line}"),
        }
        checked += 1;
    }
    assert_eq!(
        seen.len(),
        deliberate.len(),
        "every deliberate line is in the table"
    );
    assert!(checked > 90, "{checked} lines");
}
