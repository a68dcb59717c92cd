//! Synchronous rtnetlink requests (no process, no runtime) for attachment: a device's link type,
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

/// Sends one request and collects the answer (a dump's messages, or nothing for an ack).
fn request(message: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
    let socket = crate::effects::netlink_socket(NETLINK_ROUTE)?;
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = 1;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let mut out = Vec::new();
    let mut buf = vec![0; 1 << 16];
    loop {
        let n = socket.recv(&mut &mut buf[..], 0)?;
        let mut at = 0;
        while at < n {
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[at..n])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(out),
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                        None => Ok(out),
                    };
                }
                NetlinkPayload::InnerMessage(m) => out.push(m),
                _ => {}
            }
            if len == 0 {
                break;
            }
            at += len;
        }
    }
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
