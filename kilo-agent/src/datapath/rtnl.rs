//! Synchronous rtnetlink requests ([`crate::sys::netlink`]) for attachment: a device's link type,
//! and the `clsact` qdisc that netlink (pre-TCX) attachment needs (whether anything is still
//! filtered through it, and removing it).
use std::io;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{LinkLayerType, LinkMessage},
    tc::{TcHandle, TcMessage},
};
use netlink_sys::protocols::NETLINK_ROUTE;

use crate::sys::netlink::{self, NetlinkError};

/// Sends one request and collects the answer (a dump's messages, or nothing for an ack).
fn request(message: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
    let socket = netlink::socket(NETLINK_ROUTE)?;
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = 1;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    let acks = usize::from(flags & NLM_F_ACK != 0);
    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
    let replies = netlink::exchange(&socket, &buf, acks, dump).map_err(|e| match e {
        NetlinkError::Io(e) | NetlinkError::Kernel(e) => e,
        NetlinkError::Malformed => invalid(e.to_string()),
    })?;
    replies
        .iter()
        .map(
            |m| match NetlinkMessage::<RouteNetlinkMessage>::deserialize(m) {
                Ok(NetlinkMessage {
                    payload: NetlinkPayload::InnerMessage(m),
                    ..
                }) => Ok(m),
                Ok(_) => Err(invalid("an unexpected reply".into())),
                Err(e) => Err(invalid(e.to_string())),
            },
        )
        .collect()
}

/// The link-layer type (ARPHRD) of the device with index `ifindex`.
pub fn link_type(ifindex: u32) -> io::Result<LinkLayerType> {
    let mut m = LinkMessage::default();
    m.header.index = ifindex;
    let reply = request(RouteNetlinkMessage::GetLink(m), NLM_F_REQUEST | NLM_F_ACK)?;
    match reply.first() {
        Some(RouteNetlinkMessage::NewLink(link)) => Ok(link.header.link_layer_type),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "no link in the reply",
        )),
    }
}

fn tc_message(ifindex: u32, parent: TcHandle, handle: TcHandle) -> TcMessage {
    let mut m = TcMessage::default();
    m.header.index = ifindex as i32;
    m.header.parent = parent;
    m.header.handle = handle;
    m
}

/// Filters on the device's clsact ingress and egress hooks.
pub fn filters(ifindex: u32) -> io::Result<usize> {
    let mut n = 0;
    for minor in [TcHandle::MIN_INGRESS, TcHandle::MIN_EGRESS] {
        let parent = TcHandle {
            major: u16::MAX,
            minor,
        };
        let m = tc_message(ifindex, parent, TcHandle::UNSPEC);
        n += request(
            RouteNetlinkMessage::GetTrafficFilter(m),
            NLM_F_REQUEST | NLM_F_DUMP,
        )?
        .len();
    }
    Ok(n)
}

/// Deletes the device's clsact qdisc.
pub fn delete_clsact(ifindex: u32) -> io::Result<()> {
    let handle = TcHandle {
        major: u16::MAX,
        minor: 0,
    };
    let m = tc_message(ifindex, TcHandle::CLSACT, handle);
    request(
        RouteNetlinkMessage::DelQueueDiscipline(m),
        NLM_F_REQUEST | NLM_F_ACK,
    )?;
    Ok(())
}
