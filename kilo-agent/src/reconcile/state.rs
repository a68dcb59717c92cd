//! Kernel state in kernel terms (ifindexes, tables, protocol marker) and the pure diff
//! between what the plan wants and what the kernel has.
//!
//! Both the real netlink reconciler and the in-memory fake observe into [`KernelState`]
//! and apply a [`KernelDiff`]; the diff itself never does I/O, so it is tested without root.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use ipnet::IpNet;

use crate::plan::{Device, Devices, Plan};

/// The state of one link, as far as the agent cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkState {
    pub index: u32,
    pub up: bool,
    pub mtu: u32,
}

/// A route in kernel terms. Only routes carrying our protocol marker are ever observed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KRoute {
    pub table: u32,
    pub dst: IpNet,
    pub gateway: Option<IpAddr>,
    pub src: Option<IpAddr>,
    pub oif: u32,
    /// Only meaningful with a gateway (the kernel reports it only then).
    pub onlink: bool,
    /// The route's MTU metric (routes the datapath encapsulates leave room for the outer header).
    pub mtu: Option<u32>,
    /// The route's "to" realm (RTA_FLOW's low 16 bits; `None` for 0 or none): the datapath's
    /// encapsulation looks only at packets routed with [`kilo_common::KILO_REALM`].
    pub realm: Option<u16>,
}

/// An ip rule in kernel terms (`from SRC to DST iif IF lookup TABLE`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KRule {
    pub src: Option<IpNet>,
    pub dst: Option<IpNet>,
    pub iif: Option<String>,
    pub table: u32,
}

impl KRule {
    pub fn is_ipv6(&self) -> bool {
        matches!(self.src.or(self.dst), Some(IpNet::V6(_)))
    }
}

/// What the kernel has (observed) or should have (desired) for the agent's objects.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelState {
    /// Links by name: the WireGuard interface and the devices routes refer to.
    pub links: BTreeMap<String, LinkState>,
    /// Addresses on the WireGuard interface (link-local ones are never managed).
    pub addresses: BTreeSet<IpNet>,
    /// Our routes (protocol marker [`super::RTPROT_KILO`]).
    pub routes: BTreeSet<KRoute>,
    /// Our rules, with the priority the kernel gave each (needed to delete it).
    pub rules: BTreeMap<KRule, Option<u32>>,
    /// Addresses on the other links, with the link's name: one of ours there is a conflict.
    pub elsewhere: BTreeMap<IpAddr, String>,
    /// Every link's index by name (the datapath attaches by name without asking again).
    pub indexes: BTreeMap<String, u32>,
}

/// What the WireGuard link itself should look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkWant {
    pub up: bool,
    /// `None` leaves the MTU alone.
    pub mtu: Option<u32>,
}

/// The desired routes, rules and addresses, resolved against the observed links.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    pub addresses: BTreeSet<IpNet>,
    pub routes: BTreeSet<KRoute>,
    pub rules: BTreeSet<KRule>,
    /// Plan entries that could not be resolved (a device that does not exist), by description.
    pub problems: Vec<String>,
}

/// The outer IPv4 header the datapath adds to what it encapsulates (Kilo gives `tunl0` the
/// private interface's MTU minus this).
pub const IPIP_OVERHEAD: u32 = 20;

/// The next hops of the routes the datapath encapsulates: their gateways (IPIP's outer
/// destinations, from the plan) when a device has to carry them, i.e. without a tunnel device.
pub fn ipip_gateways(plan: &Plan, devices: &Devices) -> BTreeSet<IpAddr> {
    if devices.tunnel.is_some() {
        return BTreeSet::new();
    }
    plan.routes
        .iter()
        .filter(|r| r.device == Device::Tunnel)
        .filter_map(|r| r.gateway)
        .collect()
}

/// Translates the plan into kernel terms. A route through a device that does not exist is
/// reported and skipped; everything else is still applied. Without a tunnel device, the routes
/// through `Device::Tunnel` go out of the private interface, where the datapath encapsulates
/// them, with its MTU minus [`IPIP_OVERHEAD`] and the realm `realm` (`None` once the kernel
/// is known to drop realms), and through `underlay[gateway]` when the gateway is not on that
/// link (the outer packet goes to the gateway through that router, as Kilo's `tunl0` routes it).
pub fn desired(
    plan: &Plan,
    devices: &Devices,
    links: &BTreeMap<String, LinkState>,
    underlay: &BTreeMap<IpAddr, IpAddr>,
    realm: Option<u16>,
) -> Desired {
    let mut out = Desired {
        addresses: plan.addresses.iter().copied().collect(),
        ..Desired::default()
    };
    for route in &plan.routes {
        let datapath_ipip = route.device == Device::Tunnel && devices.tunnel.is_none();
        let device = if datapath_ipip {
            Device::Private
        } else {
            route.device
        };
        let link = devices.name(device).and_then(|name| links.get(name));
        let index = link.map(|l| l.index);
        let Some(oif) = index else {
            out.problems.push(format!(
                "route {} (table {}): device {:?} ({}) not found",
                route.dst,
                route.table,
                route.device,
                devices.name(route.device).unwrap_or("unconfigured")
            ));
            continue;
        };
        out.routes.insert(KRoute {
            table: route.table,
            dst: route.dst.trunc(),
            gateway: route.gateway.map(|g| match underlay.get(&g) {
                Some(hop) if datapath_ipip => *hop,
                _ => g,
            }),
            src: route.src,
            oif,
            onlink: route.onlink && route.gateway.is_some(),
            mtu: link
                .filter(|_| datapath_ipip)
                .map(|l| l.mtu.saturating_sub(IPIP_OVERHEAD)),
            realm: realm.filter(|_| datapath_ipip),
        });
    }
    for rule in &plan.rules {
        let iif = match rule.iif {
            None => None,
            Some(device) => match devices.name(device) {
                Some(name) => Some(name.to_owned()),
                None => {
                    out.problems.push(format!(
                        "rule to table {}: input device {device:?} not configured",
                        rule.table
                    ));
                    continue;
                }
            },
        };
        out.rules.insert(KRule {
            src: rule.src.map(|n| n.trunc()),
            dst: rule.dst.map(|n| n.trunc()),
            iif,
            table: rule.table,
        });
    }
    out
}

/// The difference between desired and observed kernel state, in the order it is applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelDiff {
    /// Set the WireGuard link up and/or its MTU: (up, mtu).
    pub link_set: Option<(bool, Option<u32>)>,
    pub link_index: u32,
    pub address_add: Vec<IpNet>,
    pub address_del: Vec<IpNet>,
    /// Routes to add; `true` = replace one of ours with the same table and destination.
    pub route_add: Vec<(KRoute, bool)>,
    pub route_del: Vec<KRoute>,
    pub rule_add: Vec<KRule>,
    pub rule_del: Vec<(KRule, Option<u32>)>,
}

impl KernelDiff {
    pub fn is_empty(&self) -> bool {
        self.link_set.is_none()
            && self.address_add.is_empty()
            && self.address_del.is_empty()
            && self.route_add.is_empty()
            && self.route_del.is_empty()
            && self.rule_add.is_empty()
            && self.rule_del.is_empty()
    }
}

/// Computes what to change on the WireGuard link (`link`, already observed to exist) and for
/// our addresses, routes and rules. Pure.
pub fn diff(
    link: &LinkState,
    want: LinkWant,
    desired: &Desired,
    observed: &KernelState,
) -> KernelDiff {
    let mut d = KernelDiff {
        link_index: link.index,
        ..KernelDiff::default()
    };
    let mtu = want.mtu.filter(|m| *m != link.mtu);
    if (want.up && !link.up) || mtu.is_some() {
        d.link_set = Some((want.up, mtu));
    }
    d.address_add = desired
        .addresses
        .difference(&observed.addresses)
        .copied()
        .collect();
    d.address_del = observed
        .addresses
        .difference(&desired.addresses)
        .copied()
        .collect();
    let stale: Vec<&KRoute> = observed.routes.difference(&desired.routes).collect();
    let mut replaced = BTreeSet::new();
    for r in desired.routes.difference(&observed.routes) {
        let same_key = stale
            .iter()
            .find(|s| s.table == r.table && s.dst == r.dst && !replaced.contains(*s));
        if let Some(s) = same_key {
            replaced.insert(*s);
            d.route_add.push((r.clone(), true));
        } else {
            d.route_add.push((r.clone(), false));
        }
    }
    d.route_del = stale
        .into_iter()
        .filter(|s| !replaced.contains(s))
        .cloned()
        .collect();
    d.rule_add = desired
        .rules
        .iter()
        .filter(|r| !observed.rules.contains_key(*r))
        .cloned()
        .collect();
    d.rule_del = observed
        .rules
        .iter()
        .filter(|(r, _)| !desired.rules.contains(*r))
        .map(|(r, p)| (r.clone(), *p))
        .collect();
    d
}

impl fmt::Display for KRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.dst)?;
        if let Some(gw) = self.gateway {
            write!(f, " via {gw}")?;
        }
        write!(f, " dev #{}", self.oif)?;
        if self.onlink {
            f.write_str(" onlink")?;
        }
        if let Some(src) = self.src {
            write!(f, " src {src}")?;
        }
        // In `ip route`'s order.
        if let Some(realm) = self.realm {
            write!(f, " realm {realm}")?;
        }
        if let Some(mtu) = self.mtu {
            write!(f, " mtu {mtu}")?;
        }
        write!(f, " table {}", self.table)
    }
}

impl fmt::Display for KRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.src {
            Some(src) => write!(f, "from {src}")?,
            None => f.write_str("from all")?,
        }
        if let Some(dst) = self.dst {
            write!(f, " to {dst}")?;
        }
        if let Some(iif) = &self.iif {
            write!(f, " iif {iif}")?;
        }
        write!(f, " lookup {}", self.table)
    }
}

impl fmt::Display for KernelDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((up, mtu)) = self.link_set {
            write!(f, "~ link #{}", self.link_index)?;
            if up {
                f.write_str(" up")?;
            }
            if let Some(mtu) = mtu {
                write!(f, " mtu {mtu}")?;
            }
            writeln!(f)?;
        }
        for a in &self.address_del {
            writeln!(f, "- address {a} dev #{}", self.link_index)?;
        }
        for a in &self.address_add {
            writeln!(f, "+ address {a} dev #{}", self.link_index)?;
        }
        for r in &self.route_del {
            writeln!(f, "- route {r}")?;
        }
        for (r, replace) in &self.route_add {
            writeln!(f, "{} route {r}", if *replace { "~" } else { "+" })?;
        }
        for (r, _) in &self.rule_del {
            writeln!(f, "- rule {r}")?;
        }
        for r in &self.rule_add {
            writeln!(f, "+ rule {r}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{KILO_TABLE, MAIN_TABLE, Route, Rule};

    fn devices() -> Devices {
        Devices {
            wireguard: "kilo0".into(),
            private: Some("eth0".into()),
            tunnel: None,
        }
    }

    fn links() -> BTreeMap<String, LinkState> {
        BTreeMap::from([
            (
                "kilo0".into(),
                LinkState {
                    index: 5,
                    up: true,
                    mtu: 1420,
                },
            ),
            (
                "eth0".into(),
                LinkState {
                    index: 2,
                    up: true,
                    mtu: 1500,
                },
            ),
        ])
    }

    fn plan() -> Plan {
        Plan {
            addresses: vec!["10.4.0.1/16".parse().unwrap()],
            routes: vec![
                Route {
                    dst: "10.2.1.0/24".parse().unwrap(),
                    gateway: Some("10.4.0.2".parse().unwrap()),
                    src: None,
                    device: Device::WireGuard,
                    onlink: true,
                    table: MAIN_TABLE,
                },
                Route {
                    dst: "10.0.0.9/32".parse().unwrap(),
                    gateway: None,
                    src: None,
                    device: Device::Tunnel,
                    onlink: false,
                    table: KILO_TABLE,
                },
            ],
            rules: vec![Rule {
                src: Some("10.2.0.0/24".parse().unwrap()),
                dst: Some("10.0.0.2/32".parse().unwrap()),
                iif: None,
                table: KILO_TABLE,
            }],
            ..Plan::default()
        }
    }

    #[test]
    fn unresolvable_device_is_reported_and_the_rest_kept() {
        let devices = Devices {
            tunnel: Some("tunl0".into()),
            ..devices()
        };
        let d = desired(&plan(), &devices, &links(), &BTreeMap::new(), Some(1107));
        assert_eq!(d.routes.len(), 1);
        assert_eq!(d.rules.len(), 1);
        assert_eq!(d.problems.len(), 1);
        assert!(d.problems[0].contains("10.0.0.9/32"), "{:?}", d.problems);
    }

    #[test]
    fn without_a_tunnel_device_tunnel_routes_leave_by_the_private_interface() {
        let d = desired(&plan(), &devices(), &links(), &BTreeMap::new(), Some(1107));
        assert!(d.problems.is_empty(), "{:?}", d.problems);
        let r = d.routes.iter().find(|r| r.table == KILO_TABLE).unwrap();
        assert_eq!((r.oif, r.mtu, r.realm), (2, Some(1480), Some(1107)), "{r}");
        // Other routes keep the device's own MTU and carry no realm.
        assert!(
            d.routes
                .iter()
                .filter(|r| r.table != KILO_TABLE)
                .all(|r| r.mtu.is_none() && r.realm.is_none())
        );
        // Realms known not to hold: none asked for.
        let d = desired(&plan(), &devices(), &links(), &BTreeMap::new(), None);
        assert!(d.routes.iter().all(|r| r.realm.is_none()));
        // A gateway off the link: through the underlay's router toward it.
        let router: IpAddr = "192.168.0.254".parse().unwrap();
        let mut plan = plan();
        plan.routes[1].gateway = Some("192.168.9.9".parse().unwrap());
        assert_eq!(
            ipip_gateways(&plan, &devices()),
            BTreeSet::from(["192.168.9.9".parse().unwrap()])
        );
        let underlay = BTreeMap::from([("192.168.9.9".parse().unwrap(), router)]);
        let d = desired(&plan, &devices(), &links(), &underlay, Some(1107));
        let r = d.routes.iter().find(|r| r.table == KILO_TABLE).unwrap();
        assert_eq!(r.gateway, Some(router), "{r}");
    }

    #[test]
    fn matching_kernel_gives_an_empty_diff() {
        let l = links();
        let d = desired(&plan(), &devices(), &l, &BTreeMap::new(), Some(1107));
        let observed = KernelState {
            links: l.clone(),
            addresses: d.addresses.clone(),
            routes: d.routes.clone(),
            rules: d.rules.iter().map(|r| (r.clone(), Some(32765))).collect(),
            elsewhere: BTreeMap::new(),
            indexes: BTreeMap::new(),
        };
        let want = LinkWant {
            up: true,
            mtu: Some(1420),
        };
        let diff = diff(&l["kilo0"], want, &d, &observed);
        assert!(diff.is_empty(), "{diff}");
    }

    #[test]
    fn changed_gateway_replaces_and_stale_entries_are_deleted() {
        let l = links();
        let devices = Devices {
            tunnel: Some("tunl0".into()),
            ..devices()
        };
        let d = desired(&plan(), &devices, &l, &BTreeMap::new(), Some(1107));
        let mut old = d.routes.iter().next().unwrap().clone();
        old.gateway = Some("10.4.0.3".parse().unwrap());
        let stale = KRoute {
            table: MAIN_TABLE,
            dst: "10.9.0.0/24".parse().unwrap(),
            gateway: None,
            src: None,
            oif: 5,
            onlink: false,
            mtu: None,
            realm: None,
        };
        let observed = KernelState {
            links: l.clone(),
            addresses: ["10.4.0.9/16".parse().unwrap()].into(),
            routes: [old, stale.clone()].into(),
            rules: BTreeMap::new(),
            elsewhere: BTreeMap::new(),
            indexes: BTreeMap::new(),
        };
        let want = LinkWant {
            up: true,
            mtu: Some(1380),
        };
        let diff = diff(&l["kilo0"], want, &d, &observed);
        assert_eq!(diff.link_set, Some((true, Some(1380))));
        assert_eq!(diff.route_add.len(), 1);
        assert!(diff.route_add[0].1, "same table+dst must be a replace");
        assert_eq!(diff.route_del, vec![stale]);
        assert_eq!(
            diff.address_add,
            vec!["10.4.0.1/16".parse::<IpNet>().unwrap()]
        );
        assert_eq!(
            diff.address_del,
            vec!["10.4.0.9/16".parse::<IpNet>().unwrap()]
        );
        assert_eq!(diff.rule_add.len(), 1);
    }
}
