//! Kernel messages and the kernel state in kernel terms, both ways: links, addresses, routes and
//! rules parsed from rtnetlink dumps (ours only: protocol [`RTPROT_KILO`]), and the messages that
//! add, replace or delete ours.
use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_route::{
    AddressFamily,
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkFlags, LinkMessage},
    route::{
        RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteMetric,
        RouteProtocol, RouteRealm, RouteScope, RouteType,
    },
    rule::{RuleAction, RuleAttribute, RuleMessage},
};

use super::super::{
    KernelError, RTPROT_KILO,
    state::{KRoute, KRule, LinkState},
};

pub(super) fn err(op: &'static str) -> impl Fn(rtnetlink::Error) -> KernelError {
    move |e| KernelError::Netlink {
        op: op.to_string(),
        message: e.to_string(),
    }
}

pub(super) fn parse_link(m: &LinkMessage) -> Option<(String, LinkState)> {
    let mut name = None;
    let mut mtu = 0;
    for a in &m.attributes {
        match a {
            LinkAttribute::IfName(n) => name = Some(n.clone()),
            LinkAttribute::Mtu(v) => mtu = *v,
            _ => {}
        }
    }
    Some((
        name?,
        LinkState {
            index: m.header.index,
            up: m.header.flags.contains(LinkFlags::Up),
            mtu,
        },
    ))
}

pub(super) fn parse_address(m: &AddressMessage) -> Option<IpNet> {
    let mut address = None;
    let mut local = None;
    for a in &m.attributes {
        match a {
            AddressAttribute::Address(ip) => address = Some(*ip),
            AddressAttribute::Local(ip) => local = Some(*ip),
            _ => {}
        }
    }
    let ip = local.or(address)?;
    if let IpAddr::V6(v6) = ip
        && (v6.segments()[0] & 0xffc0) == 0xfe80
    {
        return None; // link-local: the kernel's, never ours
    }
    IpNet::new(ip, m.header.prefix_len).ok()
}

pub(super) fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

/// IPv4 or IPv6 (a dump of every family also holds multicast and MPLS ones).
pub(super) fn inet(family: AddressFamily) -> bool {
    matches!(family, AddressFamily::Inet | AddressFamily::Inet6)
}

pub(super) fn parse_route(m: &RouteMessage) -> Option<KRoute> {
    if u8::from(m.header.protocol) != RTPROT_KILO || !inet(m.header.address_family) {
        return None;
    }
    let mut table = u32::from(m.header.table);
    let mut dst = None;
    let mut gateway = None;
    let mut src = None;
    let mut oif = 0;
    let mut mtu = None;
    let mut realm = None;
    for a in &m.attributes {
        match a {
            RouteAttribute::Realm(r) => realm = Some(r.destination).filter(|r| *r != 0),
            RouteAttribute::Metrics(metrics) => {
                mtu = metrics.iter().find_map(|x| match x {
                    RouteMetric::Mtu(v) => Some(*v),
                    _ => None,
                });
            }
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(d) => dst = route_ip(d),
            RouteAttribute::Gateway(g) => gateway = route_ip(g),
            RouteAttribute::PrefSource(s) => src = route_ip(s),
            RouteAttribute::Oif(i) => oif = *i,
            _ => {}
        }
    }
    let dst = match dst {
        Some(ip) => IpNet::new(ip, m.header.destination_prefix_length).ok()?,
        None if m.header.address_family == AddressFamily::Inet6 => "::/0".parse().ok()?,
        None => "0.0.0.0/0".parse().ok()?,
    };
    Some(KRoute {
        table,
        dst,
        gateway,
        src,
        oif,
        onlink: gateway.is_some() && m.header.flags.contains(RouteFlags::Onlink),
        mtu,
        realm,
    })
}

pub(super) fn parse_rule(m: &RuleMessage) -> Option<(KRule, Option<u32>)> {
    if !inet(m.header.family) {
        return None;
    }
    let mut ours = false;
    let mut table = u32::from(m.header.table);
    let (mut src, mut dst, mut iif, mut priority) = (None, None, None, None);
    for a in &m.attributes {
        match a {
            RuleAttribute::Protocol(p) => ours = u8::from(*p) == RTPROT_KILO,
            RuleAttribute::Table(t) => table = *t,
            RuleAttribute::Source(ip) => src = IpNet::new(*ip, m.header.src_len).ok(),
            RuleAttribute::Destination(ip) => dst = IpNet::new(*ip, m.header.dst_len).ok(),
            RuleAttribute::Iifname(n) => iif = Some(n.clone()),
            RuleAttribute::Priority(p) => priority = Some(*p),
            _ => {}
        }
    }
    ours.then_some((
        KRule {
            src,
            dst,
            iif,
            table,
        },
        priority,
    ))
}

pub(super) fn route_message(r: &KRoute) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = match r.dst {
        IpNet::V4(_) => AddressFamily::Inet,
        IpNet::V6(_) => AddressFamily::Inet6,
    };
    m.header.destination_prefix_length = r.dst.prefix_len();
    m.header.protocol = RouteProtocol::from(RTPROT_KILO);
    m.header.kind = RouteType::Unicast;
    m.header.scope = if r.gateway.is_some() {
        RouteScope::Universe
    } else {
        RouteScope::Link
    };
    if r.table > 255 {
        m.header.table = RouteHeader::RT_TABLE_UNSPEC;
    } else {
        m.header.table = r.table as u8;
    }
    m.attributes.push(RouteAttribute::Table(r.table));
    m.attributes
        .push(RouteAttribute::Destination(r.dst.addr().into()));
    if let Some(gw) = r.gateway {
        m.attributes.push(RouteAttribute::Gateway(gw.into()));
    }
    if let Some(src) = r.src {
        m.attributes.push(RouteAttribute::PrefSource(src.into()));
    }
    m.attributes.push(RouteAttribute::Oif(r.oif));
    if let Some(mtu) = r.mtu {
        m.attributes
            .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(mtu)]));
    }
    if let Some(destination) = r.realm {
        m.attributes.push(RouteAttribute::Realm(RouteRealm {
            source: 0,
            destination,
        }));
    }
    if r.onlink {
        m.header.flags |= RouteFlags::Onlink;
    }
    m
}

pub(super) fn rule_message(r: &KRule, priority: Option<u32>) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = if r.is_ipv6() {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    m.header.action = RuleAction::ToTable;
    if r.table > 255 {
        m.header.table = RouteHeader::RT_TABLE_UNSPEC;
    } else {
        m.header.table = r.table as u8;
    }
    m.attributes.push(RuleAttribute::Table(r.table));
    if let Some(src) = r.src {
        m.header.src_len = src.prefix_len();
        m.attributes.push(RuleAttribute::Source(src.addr()));
    }
    if let Some(dst) = r.dst {
        m.header.dst_len = dst.prefix_len();
        m.attributes.push(RuleAttribute::Destination(dst.addr()));
    }
    if let Some(iif) = &r.iif {
        m.attributes.push(RuleAttribute::Iifname(iif.clone()));
    }
    if let Some(p) = priority {
        m.attributes.push(RuleAttribute::Priority(p));
    }
    m.attributes
        .push(RuleAttribute::Protocol(RouteProtocol::from(RTPROT_KILO)));
    m
}

pub(super) fn address_message(index: u32, a: &IpNet) -> AddressMessage {
    let mut m = AddressMessage::default();
    m.header.family = match a {
        IpNet::V4(_) => AddressFamily::Inet,
        IpNet::V6(_) => AddressFamily::Inet6,
    };
    m.header.prefix_len = a.prefix_len();
    m.header.index = index;
    m.attributes.push(AddressAttribute::Local(a.addr()));
    m.attributes.push(AddressAttribute::Address(a.addr()));
    m
}
