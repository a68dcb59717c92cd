//! Synchronous netlink requests: one socket call to send, reads until the kernel has answered.
//! For the datapath's few rtnetlink queries and the nftables rule, both made from synchronous
//! code under the datapath's lock (rtnetlink's and wireguard-control's sockets serve the rest);
//! the nftables messages are built by hand (`crate::datapath::nft` says why).
use std::{io, time::Duration};

use netlink_sys::Socket;

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_MULTI: u16 = 0x2;

/// A netlink socket of `protocol`, bound, whose reads give up after 5 s (a reply never comes
/// only on a kernel bug; the agent must not hang on it).
pub fn socket(protocol: isize) -> io::Result<Socket> {
    let mut sock = Socket::new(protocol)?;
    sock.bind_auto()?;
    socket2::SockRef::from(&sock).set_read_timeout(Some(Duration::from_secs(5)))?;
    Ok(sock)
}

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket: {0}")]
    Io(#[from] io::Error),
    #[error("refused by the kernel: {0}")]
    Kernel(io::Error),
    #[error("malformed netlink reply")]
    Malformed,
}

/// One netlink message: its type, flags, sender's port and what follows the header.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    pub ty: u16,
    pub flags: u16,
    pub port: u32,
    /// The whole message, header included.
    pub bytes: &'a [u8],
    /// What follows the 16-byte header.
    pub body: &'a [u8],
}

/// The messages of one datagram in order; `None` for a malformed length, and nothing after it.
pub fn messages(mut b: &[u8]) -> impl Iterator<Item = Option<Message<'_>>> {
    std::iter::from_fn(move || {
        if b.len() < 16 {
            return None;
        }
        let len = u32::from_ne_bytes(b[..4].try_into().expect("4 bytes")) as usize;
        if len < 16 || len > b.len() {
            b = &[];
            return Some(None);
        }
        let m = Message {
            ty: u16::from_ne_bytes([b[4], b[5]]),
            flags: u16::from_ne_bytes([b[6], b[7]]),
            port: u32::from_ne_bytes(b[12..16].try_into().expect("4 bytes")),
            bytes: &b[..len],
            body: &b[16..len],
        };
        b = &b[((len + 3) & !3).min(b.len())..];
        Some(Some(m))
    })
}

/// Sends `request` (one or more messages) on `sock` and reads replies until `acks`
/// acknowledgements (or one error) and, for a `dump`, its end. Returns the data messages
/// (headers included), in order; the first error the kernel sent, if any.
pub fn exchange(
    sock: &Socket,
    request: &[u8],
    acks: usize,
    dump: bool,
) -> Result<Vec<Vec<u8>>, NetlinkError> {
    sock.send(request, 0)?;
    let mut buf = Vec::with_capacity(1 << 16);
    let mut data = Vec::new();
    let mut seen = 0;
    let mut done = !dump;
    let mut error = None;
    while seen < acks || !done {
        buf.clear();
        match sock.recv(&mut buf, 0) {
            Ok(_) => {}
            // A failed batch may leave some acks out: report the error we have.
            Err(e)
                if error.is_some()
                    && matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
            {
                break;
            }
            Err(e) => return Err(e.into()),
        };
        for m in messages(&buf) {
            let m = m.ok_or(NetlinkError::Malformed)?;
            match m.ty {
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(
                        m.body
                            .get(..4)
                            .ok_or(NetlinkError::Malformed)?
                            .try_into()
                            .expect("4 bytes"),
                    );
                    if code != 0 && error.is_none() {
                        error = Some(io::Error::from_raw_os_error(-code));
                    }
                    seen += 1;
                    if dump {
                        done = true;
                    }
                }
                NLMSG_DONE => done = true,
                _ => {
                    data.push(m.bytes.to_vec());
                    if dump && m.flags & NLM_F_MULTI == 0 {
                        done = true;
                    }
                }
            }
        }
    }
    match error {
        Some(e) => Err(NetlinkError::Kernel(e)),
        None => Ok(data),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(ty: u16, flags: u16, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend(((16 + body.len()) as u32).to_ne_bytes());
        m.extend(ty.to_ne_bytes());
        m.extend(flags.to_ne_bytes());
        m.extend(7u32.to_ne_bytes());
        m.extend(42u32.to_ne_bytes());
        m.extend(body);
        while m.len() % 4 != 0 {
            m.push(0);
        }
        m
    }

    #[test]
    fn messages_split_a_datagram_and_stop_at_a_bad_length() {
        let mut d = message(16, NLM_F_MULTI, &[1, 2, 3]);
        d.extend(message(NLMSG_DONE, 0, &[0; 4]));
        let got: Vec<_> = messages(&d)
            .map(|m| m.map(|m| (m.ty, m.port, m.body.len())))
            .collect();
        assert_eq!(got, [Some((16, 42, 3)), Some((NLMSG_DONE, 42, 4))]);
        let mut bad = message(16, 0, &[1]);
        bad[0] = 200;
        let got: Vec<_> = messages(&bad).map(|m| m.is_some()).collect();
        assert_eq!(got, [false]);
    }
}
