//! nf_tables over netlink, as both netfilter reconcilers write it (the masquerade rule,
//! `nft.rs`; the FORWARD accepts, `forward.rs`): the wire constants, a message builder
//! ([`Msg`]), an attribute parser, the socket ([`Conn`]) and its errors ([`NftError`]).
use std::io;

use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};

use crate::sys::netlink::{self, NetlinkError};

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("netfilter netlink socket: {0}")]
    Io(#[from] io::Error),
    #[error("{what} refused by the kernel: {source}")]
    Kernel {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("malformed netlink reply to {0}")]
    Malformed(&'static str),
}

// netlink / nfnetlink / nf_tables constants (linux/netlink.h, nfnetlink.h, nf_tables.h).
pub(super) const NLM_F_REQUEST: u16 = 0x1;
pub(super) const NLM_F_ACK: u16 = 0x4;
pub(super) const NLM_F_DUMP: u16 = 0x300;
pub(super) const NLM_F_CREATE: u16 = 0x400;
pub(super) const NLM_F_APPEND: u16 = 0x800;
pub(super) const NLA_F_NESTED: u16 = 0x8000;
pub(super) const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub(super) const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub(super) const NFNL_MSG_BATCH_END: u16 = 0x11;
pub(super) const NFT_MSG_NEWTABLE: u16 = 0;
pub(super) const NFT_MSG_GETTABLE: u16 = 1;
pub(super) const NFT_MSG_DELTABLE: u16 = 2;
pub(super) const NFT_MSG_NEWCHAIN: u16 = 3;
pub(super) const NFT_MSG_GETCHAIN: u16 = 4;
pub(super) const NFT_MSG_NEWRULE: u16 = 6;
pub(super) const NFT_MSG_GETRULE: u16 = 7;
pub(super) const NFPROTO_INET: u8 = 1;
pub(super) const AF_UNSPEC: u8 = 0;
pub(super) const NFTA_TABLE_NAME: u16 = 1;
pub(super) const NFTA_TABLE_FLAGS: u16 = 2;
pub(super) const NFTA_CHAIN_TABLE: u16 = 1;
pub(super) const NFTA_CHAIN_NAME: u16 = 3;
pub(super) const NFTA_CHAIN_HOOK: u16 = 4;
pub(super) const NFTA_CHAIN_POLICY: u16 = 5;
pub(super) const NFTA_CHAIN_TYPE: u16 = 7;
pub(super) const NFTA_HOOK_HOOKNUM: u16 = 1;
pub(super) const NFTA_HOOK_PRIORITY: u16 = 2;
pub(super) const NFTA_RULE_TABLE: u16 = 1;
pub(super) const NFTA_RULE_CHAIN: u16 = 2;
pub(super) const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub(super) const NFTA_RULE_USERDATA: u16 = 7;
pub(super) const NFTA_LIST_ELEM: u16 = 1;
pub(super) const NFTA_EXPR_NAME: u16 = 1;
pub(super) const NFTA_EXPR_DATA: u16 = 2;
pub(super) const NFTA_META_DREG: u16 = 1;
pub(super) const NFTA_META_KEY: u16 = 2;
pub(super) const NFT_META_MARK: u32 = 3;
pub(super) const NFTA_BITWISE_SREG: u16 = 1;
pub(super) const NFTA_BITWISE_DREG: u16 = 2;
pub(super) const NFTA_BITWISE_LEN: u16 = 3;
pub(super) const NFTA_BITWISE_MASK: u16 = 4;
pub(super) const NFTA_BITWISE_XOR: u16 = 5;
pub(super) const NFTA_CMP_SREG: u16 = 1;
pub(super) const NFTA_CMP_OP: u16 = 2;
pub(super) const NFTA_CMP_DATA: u16 = 3;
pub(super) const NFT_CMP_EQ: u32 = 0;
pub(super) const NFTA_DATA_VALUE: u16 = 1;
pub(super) const NFT_REG_1: u32 = 1;
pub(super) const NF_INET_POST_ROUTING: u32 = 4;
pub(super) const NF_IP_PRI_NAT_SRC: i32 = 100;
pub(super) const NF_ACCEPT: u32 = 1;
/// libnftnl's rule comment TLV type, so `nft list` prints it as a comment.
pub(super) const NFTNL_UDATA_RULE_COMMENT: u8 = 0;

/// A netlink message under construction.
pub(super) struct Msg(Vec<u8>);

impl Msg {
    pub(super) fn new(ty: u16, flags: u16, seq: u32, family: u8, res_id: u16) -> Self {
        let mut b = Vec::with_capacity(256);
        b.extend_from_slice(&0u32.to_ne_bytes()); // length, patched in finish
        b.extend_from_slice(&ty.to_ne_bytes());
        b.extend_from_slice(&flags.to_ne_bytes());
        b.extend_from_slice(&seq.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.push(family);
        b.push(0); // NFNETLINK_V0
        b.extend_from_slice(&res_id.to_be_bytes());
        Msg(b)
    }

    pub(super) fn nft(op: u16, flags: u16, seq: u32) -> Self {
        Msg::nft_family(op, flags, seq, NFPROTO_INET)
    }

    /// An nf_tables message about an object of `family` (`NFPROTO_*`).
    pub(super) fn nft_family(op: u16, flags: u16, seq: u32, family: u8) -> Self {
        Msg::new((NFNL_SUBSYS_NFTABLES << 8) | op, flags, seq, family, 0)
    }

    pub(super) fn attr(&mut self, ty: u16, payload: &[u8]) -> &mut Self {
        let len = 4 + payload.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&ty.to_ne_bytes());
        self.0.extend_from_slice(payload);
        self.pad();
        self
    }

    pub(super) fn str(&mut self, ty: u16, s: &str) -> &mut Self {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(ty, &v)
    }

    pub(super) fn be32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_be_bytes())
    }

    pub(super) fn nested(&mut self, ty: u16, f: impl FnOnce(&mut Msg)) -> &mut Self {
        let start = self.0.len();
        self.0.extend_from_slice(&[0, 0]);
        self.0.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        f(self);
        let len = (self.0.len() - start) as u16;
        self.0[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    fn pad(&mut self) {
        while !self.0.len().is_multiple_of(4) {
            self.0.push(0);
        }
    }

    pub(super) fn finish(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

pub(super) fn expr(m: &mut Msg, name: &str, data: impl FnOnce(&mut Msg)) {
    m.nested(NFTA_LIST_ELEM, |m| {
        m.str(NFTA_EXPR_NAME, name);
        m.nested(NFTA_EXPR_DATA, data);
    });
}

pub(super) fn udata_comment(comment: &str) -> Vec<u8> {
    let mut v = comment.as_bytes().to_vec();
    v.push(0);
    v.truncate(255);
    let mut out = vec![NFTNL_UDATA_RULE_COMMENT, v.len() as u8];
    out.extend(v);
    out
}

/// Parsed netlink attributes of one level: (type without flags, payload).
pub(super) fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & !NLA_F_NESTED & 0x7fff;
        if len < 4 || len > b.len() {
            break;
        }
        out.push((ty, &b[4..len]));
        let next = (len + 3) & !3;
        b = &b[next.min(b.len())..];
    }
    out
}

pub(super) fn get<'a>(a: &[(u16, &'a [u8])], ty: u16) -> Option<&'a [u8]> {
    a.iter().find(|(t, _)| *t == ty).map(|(_, p)| *p)
}

pub(super) fn cstr(p: &[u8]) -> String {
    String::from_utf8_lossy(p.split(|b| *b == 0).next().unwrap_or_default()).into_owned()
}

pub(super) fn be32(p: Option<&[u8]>) -> Option<u32> {
    Some(u32::from_be_bytes(p?.get(..4)?.try_into().ok()?))
}

/// A netfilter netlink socket (in the network namespace it was opened in), for any number of
/// calls.
pub(super) struct Conn {
    sock: Socket,
    /// The socket's netlink port: notifications of our own writes carry it.
    pub(super) port: Option<u32>,
    pub(super) seq: u32,
}

impl Conn {
    pub(super) fn open() -> Result<Self, NftError> {
        let sock = netlink::socket(NETLINK_NETFILTER)?;
        let mut addr = netlink_sys::SocketAddr::new(0, 0);
        let port = sock
            .get_address(&mut addr)
            .ok()
            .map(|()| addr.port_number());
        Ok(Conn { sock, port, seq: 0 })
    }

    pub(super) fn next_seq(&mut self) -> u32 {
        self.seq += 1;
        self.seq
    }

    /// Sends `buf` and reads replies until `acks` acknowledgements (or one error) and, for a
    /// dump, NLMSG_DONE. Returns the payloads (after nfgenmsg) of data messages.
    pub(super) fn exchange(
        &mut self,
        buf: &[u8],
        acks: usize,
        dump: bool,
        what: &'static str,
    ) -> Result<Vec<Vec<u8>>, NftError> {
        let replies = netlink::exchange(&self.sock, buf, acks, dump).map_err(|e| match e {
            NetlinkError::Io(e) => NftError::Io(e),
            NetlinkError::Kernel(source) => NftError::Kernel { what, source },
            NetlinkError::Malformed => NftError::Malformed(what),
        })?;
        // The header (16 bytes), then nfgenmsg (4).
        Ok(replies
            .into_iter()
            .filter(|m| m.len() >= 20)
            .map(|m| m[20..].to_vec())
            .collect())
    }
}

pub(super) fn not_found(e: &NftError) -> bool {
    matches!(e, NftError::Kernel { source, .. } if source.raw_os_error() == Some(libc::ENOENT))
}

/// A socket in the nftables multicast group, not blocking.
pub(super) fn subscribe() -> io::Result<Socket> {
    const NFNLGRP_NFTABLES: u32 = 7;
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    sock.add_membership(NFNLGRP_NFTABLES)?;
    sock.set_non_blocking(true)?;
    Ok(sock)
}
