//! The netlink reconciler's change counting, route messages and event filter.
use netlink_packet_route::rule::RuleAttribute;

use super::{watch::*, *};

#[test]
fn changes_count_only_while_subscribed() {
    let c = Changes::default();
    assert_eq!(c.get(), None, "no watcher yet");
    c.subscribed(true);
    let first = c.get().unwrap();
    c.bump();
    assert_eq!(c.get(), Some(first + 1));
    c.subscribed(false);
    assert_eq!(c.get(), None, "notifications may be lost: nothing to trust");
    c.subscribed(true);
    assert!(c.get().unwrap() > first + 1);
}

#[test]
fn route_messages_round_trip() {
    let r = KRoute {
        table: 1107,
        dst: "10.0.0.2/32".parse().unwrap(),
        gateway: Some("10.0.0.2".parse().unwrap()),
        src: Some("10.0.0.1".parse().unwrap()),
        oif: 3,
        onlink: true,
        mtu: Some(1480),
        realm: Some(kilo_common::KILO_REALM),
    };
    assert_eq!(parse_route(&route_message(&r)), Some(r));
    let rule = KRule {
        src: Some("10.2.0.0/24".parse().unwrap()),
        dst: Some("10.0.0.2/32".parse().unwrap()),
        iif: Some("kilo0".into()),
        table: 1107,
    };
    assert_eq!(
        parse_rule(&rule_message(&rule, Some(7))),
        Some((rule, Some(7)))
    );
}

#[test]
fn foreign_churn_is_not_relevant() {
    let f = EventFilter {
        names: ["kilo0".to_string()].into(),
        indexes: [5].into(),
        wireguard_index: Some(5),
        own_port: None,
    };
    let mut foreign = route_message(&KRoute {
        table: 254,
        dst: "192.0.2.0/24".parse().unwrap(),
        gateway: None,
        src: None,
        oif: 9,
        onlink: false,
        mtu: None,
        realm: None,
    });
    let ours = foreign.clone();
    foreign.header.protocol = RouteProtocol::Bird;
    assert!(!is_relevant(&RouteNetlinkMessage::NewRoute(foreign), &f));
    assert!(is_relevant(&RouteNetlinkMessage::DelRoute(ours), &f));
    let mut addr = address_message(9, &"192.0.2.1/24".parse().unwrap());
    assert!(!is_relevant(
        &RouteNetlinkMessage::NewAddress(addr.clone()),
        &f
    ));
    addr.header.index = 5;
    assert!(is_relevant(&RouteNetlinkMessage::DelAddress(addr), &f));
    let mut rule = rule_message(
        &KRule {
            src: None,
            dst: None,
            iif: None,
            table: 100,
        },
        None,
    );
    assert!(is_relevant(&RouteNetlinkMessage::NewRule(rule.clone()), &f));
    rule.attributes
        .retain(|a| !matches!(a, RuleAttribute::Protocol(_)));
    assert!(!is_relevant(&RouteNetlinkMessage::NewRule(rule), &f));
}
