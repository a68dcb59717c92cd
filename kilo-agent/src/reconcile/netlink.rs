//! The real kernel reconciler over rtnetlink: the WireGuard link (create, up, MTU), its
//! addresses, our routes and our rules; plus the multicast watcher that turns kernel changes to
//! our objects into reconcile triggers (foreign churn triggers nothing; it only makes the next
//! pass read the kernel again).
//!
//! Ownership: every route and rule we add carries the protocol marker [`RTPROT_KILO`]; only
//! routes and rules with that marker are ever observed, replaced or deleted.
//!
//! Reads: with a watcher ([`NetlinkKernel::follow`]), an observe dumps links, addresses, routes
//! and rules only when something may have changed since the last dump: at start, after any
//! notification the watcher saw (ours or not, relevant or not), after a write through this
//! connection (failed or not), while the watcher is not subscribed, and at least every
//! [`READ_BACK_EVERY`] observes. Otherwise it returns what the last dump read.
use std::{
    collections::BTreeSet,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use futures::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkExtentMask, LinkFlags, LinkMessage},
    route::{
        RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteMetric,
        RouteProtocol, RouteRealm, RouteScope, RouteType,
    },
    rule::{RuleAction, RuleAttribute, RuleMessage},
};
use rtnetlink::{Handle, IpVersion, LinkUnspec, LinkWireguard, MulticastGroup};

use super::{
    Kernel, KernelError, RTPROT_KILO,
    state::{KRoute, KRule, KernelDiff, KernelState, LinkState},
};
use crate::{
    plan::Devices,
    writes::{READ_BACK_EVERY, Writes},
};

/// The kernel notifications a [`watch`] has seen, plus one each time it subscribes or loses its
/// subscription; `None` while it is not subscribed (nothing counts the changes then).
#[derive(Debug, Clone, Default)]
pub struct Changes(Arc<Seen>);

#[derive(Debug, Default)]
struct Seen {
    count: AtomicU64,
    subscribed: AtomicBool,
}

impl Changes {
    pub fn get(&self) -> Option<u64> {
        let seen = &self.0;
        let count = seen.count.load(Ordering::Acquire);
        seen.subscribed.load(Ordering::Acquire).then_some(count)
    }

    fn bump(&self) {
        self.0.count.fetch_add(1, Ordering::AcqRel);
    }

    fn subscribed(&self, on: bool) {
        self.0.subscribed.store(on, Ordering::Release);
        self.bump();
    }
}

/// What the last dump read, and when.
#[derive(Debug)]
struct LastRead {
    /// [`Changes::get`] just before the dump started.
    seen: u64,
    devices: Devices,
    state: KernelState,
    /// Observes served from it since.
    served: u32,
}

/// The kernel, through one rtnetlink connection.
pub struct NetlinkKernel {
    handle: Handle,
    port: u32,
    changes: Option<Changes>,
    last: Option<LastRead>,
    dumps: u64,
}

impl NetlinkKernel {
    /// Opens a connection in the calling thread's network namespace; must run inside a tokio
    /// runtime (the connection is spawned on it).
    pub fn connect() -> Result<Self, KernelError> {
        // Strict checking lets the kernel filter dumps (routes by our protocol, addresses by
        // link), so a host with a large routing table costs us only our own routes.
        use netlink_sys::AsyncSocket;
        let (mut conn, handle, _) = rtnetlink::new_connection_with_strict_check()
            .map_err(|e| KernelError::Socket(e.to_string()))?;
        let port = conn
            .socket_mut()
            .socket_mut()
            .bind_auto()
            .map_err(|e| KernelError::Socket(e.to_string()))?
            .port_number();
        tokio::spawn(conn);
        Ok(NetlinkKernel {
            handle,
            port,
            changes: None,
            last: None,
            dumps: 0,
        })
    }

    /// Observes from now on dump only when `changes` (fed by a [`watch`] in this namespace)
    /// says something may have changed: see the module doc.
    pub fn follow(&mut self, changes: Changes) {
        self.changes = Some(changes);
    }

    /// How many times an observe has dumped links, addresses, routes and rules.
    pub fn dumps(&self) -> u64 {
        self.dumps
    }

    /// The last dump, if nothing may have changed since.
    fn unchanged(&mut self, devices: &Devices) -> Option<KernelState> {
        let now = self.changes.as_ref()?.get()?;
        let last = self.last.as_mut()?;
        let fresh =
            last.seen == now && last.devices == *devices && last.served + 1 < READ_BACK_EVERY;
        fresh.then(|| {
            last.served += 1;
            last.state.clone()
        })
    }

    async fn dump(&self, devices: &Devices) -> Result<KernelState, KernelError> {
        let names: BTreeSet<&str> = devices.names().collect();
        let all = self.links().await?;
        let name_of: std::collections::BTreeMap<u32, String> =
            all.iter().map(|(n, l)| (l.index, n.clone())).collect();
        let indexes = all.iter().map(|(n, l)| (n.clone(), l.index)).collect();
        let links = all
            .into_iter()
            .filter(|(n, _)| names.contains(n.as_str()))
            .collect::<std::collections::BTreeMap<_, _>>();
        let wireguard = links.get(&devices.wireguard).map(|l| l.index);
        // All of them, so that one of ours on another link is seen (a conflict).
        let (mut addresses, mut elsewhere) = (BTreeSet::new(), std::collections::BTreeMap::new());
        for (index, a) in self.addresses().await? {
            if Some(index) == wireguard {
                addresses.insert(a);
            } else if let Some(name) = name_of.get(&index) {
                elsewhere.insert(a.addr(), name.clone());
            }
        }
        Ok(KernelState {
            links,
            addresses,
            routes: self.routes().await?,
            rules: self.rules().await?.into_iter().collect(),
            elsewhere,
            indexes,
        })
    }

    /// The port of this connection's socket. The kernel's notifications of the changes made
    /// through it carry this port: see [`EventFilter::own_port`].
    pub fn port(&self) -> u32 {
        self.port
    }

    async fn links(&self) -> Result<Vec<(String, LinkState)>, KernelError> {
        let msgs: Vec<LinkMessage> = self
            .handle
            .link()
            .get()
            // Without their counters: a node with many pods has many links.
            .set_filter_mask(AddressFamily::Unspec, vec![LinkExtentMask::SkipStats])
            .execute()
            .try_collect()
            .await
            .map_err(err("dump links"))?;
        Ok(msgs.iter().filter_map(parse_link).collect())
    }

    /// Every address but IPv6 link-local ones, with its link's index.
    async fn addresses(&self) -> Result<Vec<(u32, IpNet)>, KernelError> {
        let msgs: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(err("dump addresses"))?;
        Ok(msgs
            .iter()
            .filter_map(|m| Some((m.header.index, parse_address(m)?)))
            .collect())
    }

    /// Ours (protocol kilo), both families in one dump.
    async fn routes(&self) -> Result<BTreeSet<KRoute>, KernelError> {
        let mut msg = RouteMessage::default();
        msg.header.address_family = AddressFamily::Unspec;
        msg.header.protocol = RouteProtocol::from(RTPROT_KILO);
        let mut out = BTreeSet::new();
        let mut stream = self.handle.route().get(msg).execute();
        while let Some(m) = stream.try_next().await.map_err(err("dump routes"))? {
            out.extend(parse_route(&m));
        }
        Ok(out)
    }

    /// Ours, every family in one dump.
    async fn rules(&self) -> Result<Vec<(KRule, Option<u32>)>, KernelError> {
        let mut get = self.handle.rule().get(IpVersion::V4);
        get.message_mut().header.family = AddressFamily::Unspec;
        let msgs: Vec<RuleMessage> = get
            .execute()
            .try_collect()
            .await
            .map_err(err("dump rules"))?;
        Ok(msgs.iter().filter_map(parse_rule).collect())
    }
}

fn err(op: &'static str) -> impl Fn(rtnetlink::Error) -> KernelError {
    move |e| KernelError::Netlink {
        op: op.to_string(),
        message: e.to_string(),
    }
}

fn parse_link(m: &LinkMessage) -> Option<(String, LinkState)> {
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

fn parse_address(m: &AddressMessage) -> Option<IpNet> {
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

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

/// IPv4 or IPv6 (a dump of every family also holds multicast and MPLS ones).
fn inet(family: AddressFamily) -> bool {
    matches!(family, AddressFamily::Inet | AddressFamily::Inet6)
}

fn parse_route(m: &RouteMessage) -> Option<KRoute> {
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

fn parse_rule(m: &RuleMessage) -> Option<(KRule, Option<u32>)> {
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

fn route_message(r: &KRoute) -> RouteMessage {
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

fn rule_message(r: &KRule, priority: Option<u32>) -> RuleMessage {
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

fn address_message(index: u32, a: &IpNet) -> AddressMessage {
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

/// Adds or deletes one address: the kind of write, or the operation and its error.
async fn set_address(
    h: &Handle,
    index: u32,
    add: bool,
    a: &IpNet,
) -> Result<&'static str, (String, std::io::Error)> {
    use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
    let m = address_message(index, a);
    let (msg, flags, kind, op) = if add {
        let flags = NLM_F_CREATE | NLM_F_EXCL;
        (
            RouteNetlinkMessage::NewAddress(m),
            flags,
            "address_add",
            "add",
        )
    } else {
        (
            RouteNetlinkMessage::DelAddress(m),
            0,
            "address_del",
            "delete",
        )
    };
    request(h, msg, flags)
        .await
        .map(|()| kind)
        .map_err(|e| (format!("{op} address {a}"), e))
}

/// Sends a raw request and waits for its acknowledgement.
async fn request(
    handle: &Handle,
    msg: RouteNetlinkMessage,
    flags: u16,
) -> Result<(), std::io::Error> {
    use netlink_packet_core::{NLM_F_ACK, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
    let mut req = NetlinkMessage::from(msg);
    req.header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
    let mut handle = handle.clone();
    let mut resp = handle.request(req).map_err(std::io::Error::other)?;
    while let Some(m) = resp.next().await {
        if let NetlinkPayload::Error(e) = m.payload
            && e.code.is_some()
        {
            return Err(e.to_io());
        }
    }
    Ok(())
}

impl Kernel for NetlinkKernel {
    fn echo_port(&self) -> Option<u32> {
        Some(self.port)
    }

    async fn observe(&mut self, devices: &Devices) -> Result<KernelState, KernelError> {
        if let Some(state) = self.unchanged(devices) {
            return Ok(state);
        }
        let seen = self.changes.as_ref().and_then(Changes::get);
        self.last = None;
        let state = self.dump(devices).await?;
        self.dumps += 1;
        if let Some(seen) = seen {
            self.last = Some(LastRead {
                seen,
                devices: devices.clone(),
                state: state.clone(),
                served: 0,
            });
        }
        Ok(state)
    }

    async fn create_wireguard(&mut self, name: &str) -> Result<Writes, KernelError> {
        self.last = None;
        self.handle
            .link()
            .add(LinkWireguard::new(name).build())
            .execute()
            .await
            .map_err(err("create WireGuard link"))?;
        let mut w = Writes::default();
        w.add("link_add", 1);
        Ok(w)
    }

    async fn underlay(
        &mut self,
        targets: &BTreeSet<IpAddr>,
        private: u32,
    ) -> Result<std::collections::BTreeMap<IpAddr, IpAddr>, KernelError> {
        use netlink_packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
        let mut out = std::collections::BTreeMap::new();
        for target in targets {
            let mut m = RouteMessage::default();
            m.header.address_family = match target {
                IpAddr::V4(_) => AddressFamily::Inet,
                IpAddr::V6(_) => AddressFamily::Inet6,
            };
            m.header.destination_prefix_length = if target.is_ipv4() { 32 } else { 128 };
            m.attributes
                .push(RouteAttribute::Destination((*target).into()));
            let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetRoute(m));
            req.header.flags = NLM_F_REQUEST;
            let mut handle = self.handle.clone();
            let mut resp = handle.request(req).map_err(|e| KernelError::Netlink {
                op: format!("route to {target}"),
                message: e.to_string(),
            })?;
            while let Some(msg) = resp.next().await {
                match msg.payload {
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(r)) => {
                        let (mut gateway, mut oif) = (None, 0);
                        for a in &r.attributes {
                            match a {
                                RouteAttribute::Gateway(g) => gateway = route_ip(g),
                                RouteAttribute::Oif(i) => oif = *i,
                                _ => {}
                            }
                        }
                        if let Some(g) = gateway.filter(|_| oif == private) {
                            out.insert(*target, g);
                        }
                        break;
                    }
                    NetlinkPayload::Error(e) if e.code.is_some() => break,
                    _ => {}
                }
            }
        }
        Ok(out)
    }

    async fn delete_link(&mut self, index: u32) -> Result<Writes, KernelError> {
        self.last = None;
        self.handle
            .link()
            .del(index)
            .execute()
            .await
            .map_err(err("delete link"))?;
        let mut w = Writes::default();
        w.add("link_del", 1);
        Ok(w)
    }

    async fn apply(&mut self, d: &KernelDiff) -> (Writes, Vec<KernelError>) {
        self.last = None;
        use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
        let mut w = Writes::default();
        let mut errors = Vec::new();
        let h = &self.handle;
        let mut fail = |op: String, e: std::io::Error| {
            errors.push(KernelError::Netlink {
                op,
                message: e.to_string(),
            });
        };
        if let Some((up, mtu)) = d.link_set {
            let mut b = LinkUnspec::new_with_index(d.link_index);
            if up {
                b = b.up();
            }
            if let Some(m) = mtu {
                b = b.mtu(m);
            }
            match h.link().set(b.build()).execute().await {
                Ok(()) => w.add("link_set", 1),
                Err(e) => fail("set link up/mtu".into(), std::io::Error::other(e)),
            }
        }
        // The device keeps an IPv4 address throughout: one left without any loses every route
        // through it, and deleting an address also deletes the new ones of its subnet (its
        // secondaries). So a new address that replaces one of its subnet is held as a /32
        // while the old one goes, before routes are added (a gateway that was our own address
        // would be refused as local). Other addresses go last, after the routes through them.
        let same_subnet = |a: &IpNet, b: &IpNet| {
            a.addr().is_ipv4()
                && b.addr().is_ipv4()
                && a.prefix_len() == b.prefix_len()
                && a.network() == b.network()
        };
        let replacing =
            |a: &&IpNet| a.prefix_len() < 32 && d.address_del.iter().any(|o| same_subnet(a, o));
        let replaced = |o: &&IpNet| {
            d.address_add
                .iter()
                .any(|a| replacing(&a) && same_subnet(a, o))
        };
        let held: Vec<IpNet> = d
            .address_add
            .iter()
            .filter(replacing)
            .map(|a| a.addr().into())
            .collect();
        // (add?, address), in order.
        let steps = (d
            .address_add
            .iter()
            .filter(|a| !replacing(a))
            .chain(&held)
            .map(|a| (true, a)))
        .chain(d.address_del.iter().filter(replaced).map(|a| (false, a)))
        .chain(d.address_add.iter().filter(replacing).map(|a| (true, a)))
        .chain(held.iter().map(|a| (false, a)));
        for (add, a) in steps {
            match set_address(h, d.link_index, add, a).await {
                Ok(kind) => w.add(kind, 1),
                Err((op, e)) => fail(op, e),
            }
        }
        for (r, replace) in &d.route_add {
            let msg = RouteNetlinkMessage::NewRoute(route_message(r));
            let flags = NLM_F_CREATE | if *replace { NLM_F_REPLACE } else { NLM_F_EXCL };
            match request(h, msg, flags).await {
                Ok(()) => w.add(
                    if *replace {
                        "route_replace"
                    } else {
                        "route_add"
                    },
                    1,
                ),
                // Only our routes are observed: what is in the way is somebody else's, and
                // stays (retried with backoff until it is gone).
                Err(e) if !*replace && e.raw_os_error() == Some(libc::EEXIST) => fail(
                    format!("add route {r}"),
                    std::io::Error::other(format!(
                        "{e}: a route to {} in table {} that is not ours is in the way; left alone",
                        r.dst, r.table
                    )),
                ),
                Err(e) => fail(format!("add route {r}"), e),
            }
        }
        for r in &d.rule_add {
            let msg = RouteNetlinkMessage::NewRule(rule_message(r, None));
            match request(h, msg, NLM_F_CREATE | NLM_F_EXCL).await {
                Ok(()) => w.add("rule_add", 1),
                Err(e) => fail(format!("add rule {r}"), e),
            }
        }
        for (r, prio) in &d.rule_del {
            let msg = RouteNetlinkMessage::DelRule(rule_message(r, *prio));
            match request(h, msg, 0).await {
                Ok(()) => w.add("rule_del", 1),
                Err(e) => fail(format!("delete rule {r}"), e),
            }
        }
        for r in &d.route_del {
            let msg = RouteNetlinkMessage::DelRoute(route_message(r));
            match request(h, msg, 0).await {
                Ok(()) => w.add("route_del", 1),
                Err(e) => fail(format!("delete route {r}"), e),
            }
        }
        for a in d.address_del.iter().filter(|o| !replaced(o)) {
            match set_address(h, d.link_index, false, a).await {
                Ok(kind) => w.add(kind, 1),
                Err((op, e)) => fail(op, e),
            }
        }
        (w, errors)
    }
}

/// What kernel notifications concern us. The [`super::Reconciler`] owns the one a [`watch`]
/// applies, and keeps it on the indexes it observed last.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    /// Link names we depend on (the WireGuard interface, the private and tunnel devices).
    pub names: BTreeSet<String>,
    /// Their current indexes.
    pub indexes: BTreeSet<u32>,
    /// The WireGuard interface's index (addresses are only ours there).
    pub wireguard_index: Option<u32>,
    /// The port of the agent's own rtnetlink socket ([`NetlinkKernel::port`]): notifications
    /// carrying it echo the agent's own writes, which need no reconcile of their own.
    pub own_port: Option<u32>,
}

impl EventFilter {
    /// The filter of `devices` before their indexes are known.
    pub fn new(devices: &Devices, own_port: Option<u32>) -> Self {
        EventFilter {
            names: devices.names().map(str::to_owned).collect(),
            own_port,
            ..EventFilter::default()
        }
    }

    /// Follows the devices' current indexes (`wireguard` names the WireGuard interface).
    pub fn follow(
        &mut self,
        links: &std::collections::BTreeMap<String, LinkState>,
        wireguard: &str,
    ) {
        self.indexes = links.values().map(|l| l.index).collect();
        self.wireguard_index = links.get(wireguard).map(|l| l.index);
    }
}

/// Whether a notification is about one of our objects: a route or rule with our protocol marker,
/// an address on the WireGuard interface, or a change to a link we use. Pure.
pub fn is_relevant(msg: &RouteNetlinkMessage, f: &EventFilter) -> bool {
    match msg {
        RouteNetlinkMessage::NewRoute(m) | RouteNetlinkMessage::DelRoute(m) => {
            u8::from(m.header.protocol) == RTPROT_KILO
        }
        RouteNetlinkMessage::NewRule(m) | RouteNetlinkMessage::DelRule(m) => m
            .attributes
            .iter()
            .any(|a| matches!(a, RuleAttribute::Protocol(p) if u8::from(*p) == RTPROT_KILO)),
        RouteNetlinkMessage::NewAddress(m) | RouteNetlinkMessage::DelAddress(m) => {
            f.wireguard_index == Some(m.header.index)
        }
        RouteNetlinkMessage::NewLink(m) | RouteNetlinkMessage::DelLink(m) => {
            f.indexes.contains(&m.header.index)
                || m.attributes
                    .iter()
                    .any(|a| matches!(a, LinkAttribute::IfName(n) if f.names.contains(n)))
        }
        _ => false,
    }
}

type Subscription = (
    tokio::task::JoinHandle<()>,
    futures::channel::mpsc::UnboundedReceiver<(
        netlink_packet_core::NetlinkMessage<RouteNetlinkMessage>,
        netlink_sys::SocketAddr,
    )>,
);

fn subscribe() -> Result<Subscription, KernelError> {
    let (conn, _handle, messages) = rtnetlink::new_multicast_connection(&[
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv6Ifaddr,
        MulticastGroup::Ipv4Route,
        MulticastGroup::Ipv6Route,
        MulticastGroup::Ipv4Rule,
        MulticastGroup::Ipv6Rule,
    ])
    .map_err(|e| KernelError::Socket(e.to_string()))?;
    Ok((tokio::spawn(conn), messages))
}

/// Subscribes to link, address, route and rule notifications (in the calling thread's namespace)
/// and sends `()` on `tx` for each relevant one. Full channel = a trigger is already pending, so
/// bursts coalesce. If the subscription ends (e.g. the socket overran under churn and
/// notifications were lost) it triggers a reconcile and subscribes again. Runs until `tx` is
/// closed. Counts every notification, relevant or not, in `changes` (see [`Changes`]).
pub fn watch(
    filter: Arc<Mutex<EventFilter>>,
    tx: tokio::sync::mpsc::Sender<()>,
    changes: Changes,
) -> Result<tokio::task::JoinHandle<()>, KernelError> {
    let first = subscribe()?;
    Ok(tokio::spawn(async move {
        let mut next = Some(first);
        loop {
            let (conn, mut messages) = match next.take() {
                Some(s) => s,
                None => match subscribe() {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "kernel notifications unavailable; retrying");
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        continue;
                    }
                },
            };
            // What changed before the subscription was seen by nobody.
            changes.subscribed(true);
            while let Some((msg, _)) = messages.next().await {
                changes.bump();
                let netlink_packet_core::NetlinkPayload::InnerMessage(inner) = &msg.payload else {
                    continue;
                };
                let f = filter.lock().expect("filter lock");
                let echo = f.own_port.is_some_and(|p| p == msg.header.port_number);
                let relevant = !echo && is_relevant(inner, &f);
                drop(f);
                if relevant {
                    tracing::debug!(?inner, "kernel change to one of our objects");
                    if tx.is_closed() {
                        break;
                    }
                    let _ = tx.try_send(());
                }
            }
            conn.abort();
            changes.subscribed(false);
            if tx.is_closed() {
                return;
            }
            tracing::warn!("kernel notifications interrupted; reconciling and subscribing again");
            let _ = tx.try_send(());
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }))
}

#[cfg(test)]
mod tests;
