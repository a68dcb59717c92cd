use super::*;
use crate::mesh::DEFAULT_TOPOLOGY_LABEL;
use k8s_openapi::api::core::v1::NodeSpec;
use kube::api::ObjectMeta;

const KEY1: &str = "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

pub(crate) fn kube_node(name: &str, ann: &[(&str, &str)], pod_cidr: Option<&str>) -> KubeNode {
    KubeNode {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: Some(
                ann.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: pod_cidr.map(Into::into),
            ..Default::default()
        }),
        status: None,
    }
}

/// Parses the node [`kube_node`] builds, with the default topology label.
fn parse(
    name: &str,
    ann: &[(&str, &str)],
    pod_cidr: Option<&str>,
) -> Result<Node, Vec<ObjectError>> {
    clean(Node::from_kube(
        &kube_node(name, ann, pod_cidr),
        DEFAULT_TOPOLOGY_LABEL,
    ))
}

/// The node when nothing was invalid, else the errors.
fn clean((n, errs): (Node, Vec<ObjectError>)) -> Result<Node, Vec<ObjectError>> {
    if errs.is_empty() { Ok(n) } else { Err(errs) }
}

fn ready_node() -> Node {
    let ann = [
        (annotations::ENDPOINT, "2.2.2.2:51820"),
        (annotations::INTERNAL_IP, "1.1.1.1/32"),
        (annotations::KEY, KEY1),
        (annotations::LAST_SEEN, "1000"),
    ];
    parse("n", &ann, Some("10.2.0.0/16")).unwrap()
}

/// Kilo's TestReady cases.
#[test]
fn ready_like_kilo() {
    let now = Some(1010);
    assert!(ready_node().ready(now), "valid");
    let empty = parse("e", &[], None).unwrap();
    assert!(!empty.ready(now), "empty fields");
    type Edit = fn(&mut Node);
    let cases: [(Edit, bool, &str); 5] = [
        (|n| n.endpoint = None, false, "empty endpoint"),
        (|n| n.key = None, false, "empty key"),
        (|n| n.key = Some(Key([0; 32])), false, "zero key"),
        (
            |n| n.internal_ips.clear(),
            true,
            "empty internal IP is still ready, as in Kilo",
        ),
        (|n| n.pod_cidrs.clear(), false, "empty subnet"),
    ];
    for (edit, ready, why) in cases {
        let mut n = ready_node();
        edit(&mut n);
        assert_eq!(n.ready(now), ready, "{why}");
    }
    assert!(!ready_node().ready(Some(1000 + 60)), "stale last-seen");
    assert!(ready_node().ready(Some(1000 + 59)));
    let mut n = ready_node();
    n.last_seen = None;
    assert!(!n.ready(now), "no last-seen");
    assert!(n.ready(None), "no clock: freshness not checked");
}

#[test]
fn parses_every_annotation() {
    let kn = kube_node(
        "a",
        &[
            (annotations::ENDPOINT, "10.1.0.1:51820"),
            (annotations::FORCE_ENDPOINT, "[2001:db8::1]:51821"),
            (annotations::INTERNAL_IP, "192.168.0.1/24"),
            (annotations::KEY, KEY1),
            (annotations::LAST_SEEN, "1700000000"),
            (annotations::LEADER, ""),
            (annotations::PERSISTENT_KEEPALIVE, "25"),
            (annotations::WIREGUARD_IP, "10.4.0.1/16"),
            (
                annotations::DISCOVERED_ENDPOINTS,
                r#"{"a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=":{"IP":"5.6.7.8","Port":4242,"Zone":""}}"#,
            ),
            (
                annotations::ALLOWED_LOCATION_IPS,
                "192.168.178.3/32,10.9.0.0/16",
            ),
            (annotations::GRANULARITY, "full"),
        ],
        Some("10.2.1.7/24"),
    );
    let n = clean(Node::from_kube(&kn, DEFAULT_TOPOLOGY_LABEL)).unwrap();
    assert_eq!(n.endpoint.unwrap().to_string(), "[2001:db8::1]:51821");
    assert_eq!(
        n.internal_ips,
        vec!["192.168.0.1/24".parse::<IpNet>().unwrap()]
    );
    assert_eq!(n.key.unwrap().to_string(), KEY1);
    assert_eq!(n.last_seen, Some(1700000000));
    assert!(n.leader);
    assert_eq!(n.persistent_keepalive, 25);
    assert_eq!(n.pod_cidrs, vec!["10.2.1.0/24".parse::<IpNet>().unwrap()]);
    assert_eq!(n.wireguard_ip.unwrap().to_string(), "10.4.0.1/16");
    assert_eq!(
        n.discovered_endpoints.values().next().unwrap().to_string(),
        "5.6.7.8:4242"
    );
    assert_eq!(n.allowed_location_ips.len(), 2);
    assert_eq!(n.granularity, Some(Granularity::Full));
}

#[test]
fn location_annotation_overrides_label() {
    let mut kn = kube_node("a", &[], None);
    kn.metadata.labels = Some(
        [(DEFAULT_TOPOLOGY_LABEL.to_string(), "eu".to_string())]
            .into_iter()
            .collect(),
    );
    assert_eq!(
        clean(Node::from_kube(&kn, DEFAULT_TOPOLOGY_LABEL))
            .unwrap()
            .location,
        "eu"
    );
    assert_eq!(
        clean(Node::from_kube(&kn, "other/label")).unwrap().location,
        ""
    );
    kn.metadata
        .annotations
        .get_or_insert_default()
        .insert(annotations::LOCATION.into(), "us".into());
    assert_eq!(
        clean(Node::from_kube(&kn, DEFAULT_TOPOLOGY_LABEL))
            .unwrap()
            .location,
        "us"
    );
}

#[test]
fn force_internal_ip() {
    let forced = |v| {
        let ann = [
            (annotations::INTERNAL_IP, "1.1.1.1/32"),
            (annotations::FORCE_INTERNAL_IP, v),
        ];
        parse("a", &ann, None).unwrap()
    };
    for v in ["", "-"] {
        let n = forced(v);
        assert!(n.internal_ips.is_empty() && n.no_internal_ip, "{v:?}");
    }
    let n = forced("fd00::1/64,2.2.2.2/24");
    assert_eq!(
        n.internal_ips,
        vec![
            "2.2.2.2/24".parse::<IpNet>().unwrap(),
            "fd00::1/64".parse().unwrap()
        ]
    );
}

#[test]
fn dual_stack_pod_cidrs() {
    let mut kn = kube_node("a", &[], Some("10.2.1.0/24"));
    kn.spec.as_mut().unwrap().pod_cidrs = Some(vec!["10.2.1.0/24".into(), "fd00:2:1::/64".into()]);
    let n = clean(Node::from_kube(&kn, DEFAULT_TOPOLOGY_LABEL)).unwrap();
    assert_eq!(n.pod_cidrs.len(), 2);
    assert!(matches!(n.pod_cidrs[1], IpNet::V6(_)));
}

#[test]
fn every_bad_value_names_object_and_field() {
    let cases: &[(&str, &str)] = &[
        (annotations::ENDPOINT, "nope"),
        (annotations::FORCE_ENDPOINT, "1.2.3.4"),
        (annotations::INTERNAL_IP, "x"),
        (annotations::FORCE_INTERNAL_IP, "1.2.3.4"),
        (annotations::KEY, "short"),
        (annotations::LAST_SEEN, "NOW"),
        (annotations::PERSISTENT_KEEPALIVE, "-1"),
        (annotations::WIREGUARD_IP, "10.4.0.1"),
        (annotations::DISCOVERED_ENDPOINTS, "{"),
        (annotations::ALLOWED_LOCATION_IPS, "10.0.0.0/8,bad"),
        (annotations::GRANULARITY, "mesh"),
        (annotations::CNI_COMPATIBILITY_IP, "1.2.3"),
    ];
    for (k, v) in cases {
        let errs = parse("b", &[(k, v)], None).unwrap_err();
        assert_eq!(errs.len(), 1, "{k}={v}: {errs:?}");
        let msg = errs[0].to_string();
        assert!(
            msg.starts_with(&format!("node \"b\": annotation {k}: ")),
            "{msg}"
        );
    }
    let errs = parse("b", &[], Some("10.2.0.0/33")).unwrap_err();
    assert_eq!(
        errs[0].to_string(),
        r#"node "b": spec.podCIDR: invalid CIDR "10.2.0.0/33"; the node is not ready"#
    );
    let errs = parse("b", &[(annotations::INTERNAL_IP, "x")], None).unwrap_err();
    assert_eq!(
        errs[0].to_string(),
        r#"node "b": annotation kilo.squat.ai/internal-ip: invalid CIDR "x"; the node has no internal IP"#
    );
}

/// A value above Kubernetes' annotation limit is refused by name, unparsed; the rest applies.
#[test]
fn oversized_annotation_is_refused_by_name() {
    let huge = "10.0.0.0/8,".repeat(MAX_ANNOTATION_BYTES / 10);
    let (n, errs) = Node::from_kube(
        &kube_node(
            "big",
            &[
                (annotations::ALLOWED_LOCATION_IPS, huge.as_str()),
                (annotations::LOCATION, "east"),
            ],
            Some("10.2.1.0/24"),
        ),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(errs.len(), 1, "{errs:?}");
    let msg = errs[0].to_string();
    assert!(
        msg.starts_with(&format!(
            "node \"big\": annotation {}: {} bytes, more than the 262144",
            annotations::ALLOWED_LOCATION_IPS,
            huge.len()
        )),
        "{msg}"
    );
    assert!(n.allowed_location_ips.is_empty());
    assert_eq!(n.location, "east");
}

/// Kilo's fallbacks: the node is kept, each bad field reported once.
#[test]
fn bad_values_fall_back_like_kilo() {
    let (n, errs) = Node::from_kube(
        &kube_node(
            "f",
            &[
                (annotations::FORCE_ENDPOINT, "nope:x"),
                (annotations::ENDPOINT, "2.2.2.2:51820"),
                (annotations::FORCE_INTERNAL_IP, "1.2.3"),
                (annotations::INTERNAL_IP, "1.1.1.1/24"),
                (
                    annotations::ALLOWED_LOCATION_IPS,
                    "10.9.0.0/16,bad,10.8.0.0/16",
                ),
                (annotations::PERSISTENT_KEEPALIVE, "soon"),
                (
                    annotations::DISCOVERED_ENDPOINTS,
                    r#"{"notakey":{"IP":"5.6.7.8","Port":1},"a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=":{"IP":"5.6.7.9","Port":2}}"#,
                ),
                (annotations::KEY, KEY1),
            ],
            Some("10.2.0.0/16"),
        ),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.endpoint.unwrap().to_string(), "2.2.2.2:51820");
    assert_eq!(n.internal_ips, vec!["1.1.1.1/24".parse::<IpNet>().unwrap()]);
    assert_eq!(
        n.allowed_location_ips,
        vec![
            "10.9.0.0/16".parse::<IpNet>().unwrap(),
            "10.8.0.0/16".parse().unwrap()
        ]
    );
    assert_eq!(n.persistent_keepalive, 0);
    assert_eq!(
        n.discovered_endpoints.len(),
        1,
        "the bad key alone is dropped"
    );
    let msgs: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(msgs.len(), 4, "{msgs:#?}");
    assert!(
        msgs[0].contains(r#"force-endpoint: invalid endpoint "nope:x""#),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.contains(r#""soon""#) && m.contains("persistent-keepalive"))
    );
    // A bad IP in discovered-endpoints drops the whole map, as Go's JSON decoding does.
    let (n, errs) = Node::from_kube(
        &kube_node(
            "f",
            &[(
                annotations::DISCOVERED_ENDPOINTS,
                r#"{"a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=":{"IP":"5.6.7","Port":2}}"#,
            )],
            None,
        ),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert!(n.discovered_endpoints.is_empty());
    assert_eq!(errs.len(), 1);
}

/// Go's JSON decoding: field names ignoring case, unknown fields ignored; an entry no
/// peer could use is dropped alone, a value Go refuses drops the map.
#[test]
fn discovered_endpoints_as_go_decodes_them() {
    let parse = |v: &str| {
        let kn = kube_node("n", &[(annotations::DISCOVERED_ENDPOINTS, v)], None);
        let (n, errs) = Node::from_kube(&kn, DEFAULT_TOPOLOGY_LABEL);
        let eps: Vec<String> = n
            .discovered_endpoints
            .values()
            .map(ToString::to_string)
            .collect();
        (eps, errs.len())
    };
    let key2 = "a2V5MgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let v = format!(
        r#" {{"{KEY1}":{{"ip":"5.6.7.8","pOrT":7,"Zone":"","x":1}},"{key2}":{{"IP":"","Port":1}}}} "#
    );
    assert_eq!(parse(&v), (vec!["5.6.7.8:7".to_string()], 0));
    let v = format!(r#"{{"{KEY1}":{{"IP":"5.6.7.8","Port":70000}}}}"#);
    assert_eq!(parse(&v), (vec![], 0));
    for bad in [
        r#"{"k":{"IP":"5.6.7.8","Port":"1"}}"#,
        r#"{"k":{"IP":5}}"#,
        r#"{"k":1}"#,
    ] {
        assert_eq!(parse(bad), (vec![], 1), "{bad}");
    }
}

/// Kilo splits on commas and keeps only the items that are exactly CIDRs; each skipped
/// item is reported by name, with the reason.
#[test]
fn list_items_are_read_as_kilo_reads_them() {
    let (n, errs) = Node::from_kube(
        &kube_node(
            "n",
            &[(
                annotations::ALLOWED_LOCATION_IPS,
                "10.9.0.0/24, 10.9.1.0/24,10.9.2.7/24,,10.9.3.0/24 ,x,",
            )],
            None,
        ),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(
        n.allowed_location_ips,
        vec![
            "10.9.0.0/24".parse::<IpNet>().unwrap(),
            "10.9.2.7/24".parse().unwrap()
        ]
    );
    let msgs: Vec<String> = errs.iter().map(ToString::to_string).collect();
    let field = r#"node "n": annotation kilo.squat.ai/allowed-location-ips"#;
    assert_eq!(
        msgs,
        [
            format!(r#"{field}: item " 10.9.1.0/24": leading space, Kilo ignores this item"#),
            format!(r#"{field}: item "": empty, Kilo ignores this item"#),
            format!(r#"{field}: item "10.9.3.0/24 ": trailing space, Kilo ignores this item"#),
            format!(r#"{field}: item "x": not a CIDR, Kilo ignores this item"#),
            format!(r#"{field}: item "": empty, Kilo ignores this item"#),
        ]
    );
}

/// Nothing is trimmed: a value Kilo refuses because of a space is refused, with Kilo's
/// fallback, and Go's number syntax (a sign, leading zeros) is accepted.
#[test]
fn values_are_read_as_kilo_reads_them() {
    let key = format!("{KEY1} ");
    let (n, errs) = Node::from_kube(
        &kube_node(
            "n",
            &[
                (annotations::FORCE_ENDPOINT, " 1.1.1.1:51820"),
                (annotations::ENDPOINT, "[2.2.2.2]:051820"),
                (annotations::FORCE_INTERNAL_IP, " -"),
                (annotations::INTERNAL_IP, "10.0.0.1/024"),
                (annotations::KEY, key.as_str()),
                (annotations::LAST_SEEN, "+1000"),
                (annotations::PERSISTENT_KEEPALIVE, "+25"),
                (annotations::GRANULARITY, "full "),
                (annotations::LOCATION, " eu"),
                (annotations::WIREGUARD_IP, "10.4.0.1/16\n"),
            ],
            Some(" 10.2.0.0/16"),
        ),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.endpoint.unwrap().to_string(), "2.2.2.2:51820");
    assert!(!n.no_internal_ip);
    assert_eq!(
        n.internal_ips,
        vec!["10.0.0.1/24".parse::<IpNet>().unwrap()]
    );
    assert_eq!((n.key, n.last_seen), (None, Some(1000)));
    assert_eq!(n.persistent_keepalive, 25);
    assert_eq!(n.granularity, None);
    assert_eq!(n.location, " eu");
    assert_eq!(n.wireguard_ip, None);
    assert!(n.pod_cidrs.is_empty());
    let msgs: Vec<String> = errs.iter().map(ToString::to_string).collect();
    let want = [
        (
            "force-endpoint",
            r#"invalid endpoint " 1.1.1.1:51820" (leading space)"#,
        ),
        ("force-internal-ip", r#"invalid CIDR " -" (leading space)"#),
        ("key", "(trailing space); the node is not ready"),
        ("wireguard-ip", "(trailing space); ignored"),
        ("granularity", r#"unknown granularity "full ""#),
    ];
    for (field, problem) in want {
        assert!(
            msgs.iter()
                .any(|m| m.contains(&format!("kilo.squat.ai/{field}: ")) && m.contains(problem)),
            "{field}: {problem} not in {msgs:#?}"
        );
    }
    assert!(
        msgs.iter()
            .any(|m| m.contains(r#"spec.podCIDR: invalid CIDR " 10.2.0.0/16" (leading space)"#)),
        "{msgs:#?}"
    );
    assert_eq!(msgs.len(), want.len() + 1, "{msgs:#?}");
}

/// kg's dual-stack `internal-ip` is exactly one CIDR per family; anything else with a
/// comma is refused, as Kilo refuses it.
#[test]
fn dual_stack_internal_ip_is_exact() {
    for v in [
        "1.1.1.1/24,",
        ",1.1.1.1/24",
        "1.1.1.1/24, fd00::1/64",
        "1.1.1.1/24,2.2.2.2/24",
    ] {
        let (n, errs) = Node::from_kube(
            &kube_node("n", &[(annotations::INTERNAL_IP, v)], None),
            DEFAULT_TOPOLOGY_LABEL,
        );
        assert!(n.internal_ips.is_empty(), "{v:?}");
        assert_eq!(errs.len(), 1, "{v:?}");
    }
}

#[test]
fn keepalive_outside_what_wireguard_carries_counts_as_none() {
    for v in ["-1", "65536"] {
        let (n, errs) = Node::from_kube(
            &kube_node("n", &[(annotations::PERSISTENT_KEEPALIVE, v)], None),
            DEFAULT_TOPOLOGY_LABEL,
        );
        assert_eq!(n.persistent_keepalive, 0);
        assert!(errs[0].problem.contains("outside 0..=65535"), "{errs:?}");
    }
}

#[test]
fn empty_written_annotations_mean_absent() {
    // Kilo writes "" for the internal and WireGuard IPs of nodes that have none.
    let ann = [
        (annotations::INTERNAL_IP, ""),
        (annotations::WIREGUARD_IP, ""),
    ];
    let n = parse("c", &ann, None).unwrap();
    assert!(n.internal_ips.is_empty() && n.wireguard_ip.is_none() && !n.no_internal_ip);
}
