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
use std::{collections::BTreeSet, net::IpAddr};

use futures::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::AddressMessage,
    link::{LinkExtentMask, LinkMessage},
    route::{RouteAttribute, RouteMessage, RouteProtocol},
    rule::RuleMessage,
};
use rtnetlink::{Handle, IpVersion, LinkUnspec, LinkWireguard};

use super::{
    Kernel, KernelError, RTPROT_KILO,
    state::{KRoute, KRule, KernelDiff, KernelState, LinkState},
};
use crate::{
    plan::Devices,
    writes::{READ_BACK_EVERY, Write, Writes},
};
mod messages;
mod watch;

use messages::*;
pub use watch::{Changes, EventFilter, is_relevant, watch};

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
/// Adds or deletes one address: the kind of write, or the operation and its error.
async fn set_address(
    h: &Handle,
    index: u32,
    add: bool,
    a: &IpNet,
) -> Result<Write, (String, std::io::Error)> {
    use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
    let m = address_message(index, a);
    let (msg, flags, kind, op) = if add {
        let flags = NLM_F_CREATE | NLM_F_EXCL;
        (
            RouteNetlinkMessage::NewAddress(m),
            flags,
            Write::AddressAdd,
            "add",
        )
    } else {
        (
            RouteNetlinkMessage::DelAddress(m),
            0,
            Write::AddressDel,
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
        w.add(Write::LinkAdd, 1);
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
        w.add(Write::LinkDel, 1);
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
                Ok(()) => w.add(Write::LinkSet, 1),
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
                        Write::RouteReplace
                    } else {
                        Write::RouteAdd
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
                Ok(()) => w.add(Write::RuleAdd, 1),
                Err(e) => fail(format!("add rule {r}"), e),
            }
        }
        for (r, prio) in &d.rule_del {
            let msg = RouteNetlinkMessage::DelRule(rule_message(r, *prio));
            match request(h, msg, 0).await {
                Ok(()) => w.add(Write::RuleDel, 1),
                Err(e) => fail(format!("delete rule {r}"), e),
            }
        }
        for r in &d.route_del {
            let msg = RouteNetlinkMessage::DelRoute(route_message(r));
            match request(h, msg, 0).await {
                Ok(()) => w.add(Write::RouteDel, 1),
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
#[cfg(test)]
mod tests;
