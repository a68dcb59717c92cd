use super::*;
use crate::plan::ForwardWhat;

fn accept(net: &str, what: ForwardWhat) -> ForwardAccept {
    ForwardAccept {
        net: net.parse().unwrap(),
        what,
    }
}

/// Two rules per accept (from, to) with Kilo's comment under kg's prefix, truncated, and no
/// rule twice.
#[test]
fn rules_follow_kilo_from_then_to() {
    let r = rules(&[
        accept("10.2.1.7/24", ForwardWhat::PodSubnet),
        accept("192.168.0.1/32", ForwardWhat::PrivateIps),
        accept("10.2.1.0/24", ForwardWhat::PodSubnet),
    ]);
    let shown: Vec<String> = r.iter().map(ToString::to_string).collect();
    assert_eq!(
        shown,
        [
            r#"iptables -I FORWARD -s 10.2.1.0/24 -m comment --comment "kilo-rs: forward packets from the pod subnet" -j ACCEPT"#,
            r#"iptables -I FORWARD -d 10.2.1.0/24 -m comment --comment "kilo-rs: forward packets to the pod subnet" -j ACCEPT"#,
            r#"iptables -I FORWARD -s 192.168.0.1/32 -m comment --comment "kilo-rs: forward packets from private IPs" -j ACCEPT"#,
            r#"iptables -I FORWARD -d 192.168.0.1/32 -m comment --comment "kilo-rs: forward packets to private IPs" -j ACCEPT"#,
        ]
    );
}

/// What `rule_msg` writes parses back to the same rule (IPv4 and IPv6, a prefix and a
/// whole address); other shapes do not.
#[test]
fn written_expressions_parse_back() {
    for (net, what) in [
        ("10.2.1.0/24", ForwardWhat::PodSubnet),
        ("192.168.0.1/32", ForwardWhat::PrivateIps),
        ("fd00:2::/64", ForwardWhat::NodePodSubnet),
        ("fd00::1/128", ForwardWhat::PrivateIps),
    ] {
        for rule in rules(&[accept(net, what)]) {
            let msg = rule_msg(&rule, 1);
            // header (16), nfgenmsg (4), then the attributes.
            let a = attrs(&msg[20..]);
            let family = msg[16];
            assert_eq!(family, rule.family());
            let parsed = parse(get(&a, NFTA_RULE_EXPRESSIONS).unwrap(), family);
            assert_eq!(parsed, Some((rule.direction, rule.net)), "{rule}");
            let c = get(&a, NFTA_RULE_USERDATA).and_then(comment);
            assert_eq!(c.as_deref(), Some(rule.comment.as_str()));
            // In the other family's table the same bytes mean nothing of ours.
            let other = if family == NFPROTO_IPV4 {
                NFPROTO_IPV6
            } else {
                NFPROTO_IPV4
            };
            assert_eq!(parse(get(&a, NFTA_RULE_EXPRESSIONS).unwrap(), other), None);
        }
    }
}

#[test]
fn prefix_lengths_of_masks() {
    assert_eq!(prefix_len(&[255, 255, 255, 0]), Some(24));
    assert_eq!(prefix_len(&[255, 255, 128, 0]), Some(17));
    assert_eq!(prefix_len(&[0; 4]), Some(0));
    assert_eq!(prefix_len(&[255, 0, 255, 0]), None);
}

fn found(handle: u64, rule: Option<ForwardRule>) -> Found {
    Found {
        handle,
        family: NFPROTO_IPV4,
        rule,
    }
}

/// The diff keeps ours that are wanted (once), deletes the rest of ours, and inserts only
/// into a family whose chain exists.
#[test]
fn diff_writes_only_the_difference() {
    let want = rules(&[
        accept("10.2.1.0/24", ForwardWhat::PodSubnet),
        accept("fd00:2::/64", ForwardWhat::PodSubnet),
    ]);
    let (from, to) = (want[0].clone(), want[1].clone());
    let stale = rules(&[accept("10.2.9.0/24", ForwardWhat::PodSubnet)])[0].clone();
    // All there (the IPv6 chain missing): nothing to do.
    let all = vec![
        (
            NFPROTO_IPV4,
            Some(vec![
                found(1, Some(from.clone())),
                found(2, Some(to.clone())),
            ]),
        ),
        (NFPROTO_IPV6, None),
    ];
    let c = diff(&want, &all);
    assert!(c.delete.is_empty() && c.insert.is_empty(), "{c:?}");
    // A duplicate, a stale rule and a malformed one go; the missing one comes.
    let messy = vec![
        (
            NFPROTO_IPV4,
            Some(vec![
                found(1, Some(from.clone())),
                found(2, Some(from.clone())),
                found(3, Some(stale)),
                found(4, None),
            ]),
        ),
        (NFPROTO_IPV6, Some(vec![])),
    ];
    let c = diff(&want, &messy);
    let handles: Vec<u64> = c.delete.iter().map(|f| f.handle).collect();
    assert_eq!(handles, [2, 3, 4]);
    assert_eq!(c.insert, [to, want[2].clone(), want[3].clone()]);
    // Nothing wanted: every rule of ours goes.
    assert_eq!(diff(&[], &messy).delete.len(), 4);
}

/// Notifications about the FORWARD chain of a `filter` table count; those about other
/// chains or tables, and the echoes of our own writes, do not.
#[test]
fn only_forward_chain_notifications_concern_the_keeper() {
    let rule_msg_in = |family: u8, table: &str, chain: &str, port: u32| {
        let mut m = Msg::nft_family(NFT_MSG_NEWRULE, 0, 0, family);
        m.str(NFTA_RULE_TABLE, table).str(NFTA_RULE_CHAIN, chain);
        let mut b = m.finish();
        b[12..16].copy_from_slice(&port.to_ne_bytes());
        b
    };
    assert!(concerns(
        &rule_msg_in(NFPROTO_IPV4, "filter", "FORWARD", 9),
        Some(1)
    ));
    assert!(concerns(
        &rule_msg_in(NFPROTO_IPV6, "filter", "FORWARD", 9),
        None
    ));
    assert!(!concerns(
        &rule_msg_in(NFPROTO_IPV4, "filter", "FORWARD", 1),
        Some(1)
    ));
    assert!(!concerns(
        &rule_msg_in(NFPROTO_IPV4, "filter", "KUBE-FORWARD", 9),
        Some(1)
    ));
    assert!(!concerns(
        &rule_msg_in(NFPROTO_IPV4, "nat", "FORWARD", 9),
        Some(1)
    ));
    assert!(!concerns(&rule_msg_in(1, "filter", "FORWARD", 9), Some(1)));
    let mut policy = Msg::nft_family(NFT_MSG_NEWCHAIN, 0, 0, NFPROTO_IPV4);
    policy
        .str(NFTA_CHAIN_TABLE, "filter")
        .str(NFTA_CHAIN_NAME, "FORWARD");
    assert!(concerns(&policy.finish(), None));
}
