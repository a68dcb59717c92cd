//! The multicast watcher: kernel notifications about our objects become reconcile triggers
//! ([`EventFilter`] says which concern us); every notification counts in [`Changes`], so the next
//! observe knows it must read the kernel again.
use std::{
    collections::BTreeSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use futures::StreamExt;
use netlink_packet_route::{RouteNetlinkMessage, link::LinkAttribute, rule::RuleAttribute};
use rtnetlink::MulticastGroup;

use super::super::{KernelError, RTPROT_KILO, state::LinkState};
use crate::plan::Devices;

/// The kernel notifications a [`watch`] has seen, plus one each time it subscribes or loses its
/// subscription; `None` while it is not subscribed (nothing counts the changes then).
#[derive(Debug, Clone, Default)]
pub struct Changes(Arc<Seen>);

#[derive(Debug, Default)]
pub(super) struct Seen {
    count: AtomicU64,
    subscribed: AtomicBool,
}

impl Changes {
    pub fn get(&self) -> Option<u64> {
        let seen = &self.0;
        let count = seen.count.load(Ordering::Acquire);
        seen.subscribed.load(Ordering::Acquire).then_some(count)
    }

    pub(super) fn bump(&self) {
        self.0.count.fetch_add(1, Ordering::AcqRel);
    }

    pub(super) fn subscribed(&self, on: bool) {
        self.0.subscribed.store(on, Ordering::Release);
        self.bump();
    }
}

/// What kernel notifications concern us. The [`crate::reconcile::Reconciler`] owns the one a [`watch`]
/// applies, and keeps it on the indexes it observed last.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    /// Link names we depend on (the WireGuard interface, the private and tunnel devices).
    pub names: BTreeSet<String>,
    /// Their current indexes.
    pub indexes: BTreeSet<u32>,
    /// The WireGuard interface's index (addresses are only ours there).
    pub wireguard_index: Option<u32>,
    /// The port of the agent's own rtnetlink socket ([`super::NetlinkKernel::port`]): notifications
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

pub(super) fn subscribe() -> Result<Subscription, KernelError> {
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
