//! The one static masquerade rule, a reconciler beside the datapath (netfilter, not BPF: the two
//! share only the mark, and the datapath's reconciler keeps the rule with its program), written
//! as netfilter netlink messages (no `nft` process; the only crate for them is GPL-3.0):
//!
//! ```text
//! table inet kilo {
//!     chain postrouting {
//!         type nat hook postrouting priority srcnat; policy accept;
//!         meta mark & MASK == MARK masquerade comment "kilo-rs: masquerade mark MARK/MASK"
//!     }
//! }
//! ```
//!
//! One `inet` table covers IPv4 and IPv6. [`ensure_masquerade`] reads the table first and writes
//! nothing when it is already exactly this; otherwise it replaces the whole table in one atomic
//! batch (add, delete, add: the usual idempotent reload). [`Keeper`] does the same over many
//! calls, reading the ruleset only when netfilter announced a change to our table or a check
//! is due.
//! [`remove_masquerade`] deletes it. Everything happens in the calling thread's network
//! namespace.
use std::io;

use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};

use crate::{
    sys::netlink::{self, NetlinkError, messages},
    writes::{ReadBack, Write, Writes},
};

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

/// The rule's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasqueradeRule {
    /// The private table (family inet).
    pub table: String,
    pub mark: u32,
    pub mask: u32,
}

impl MasqueradeRule {
    pub fn new(mark: u32, mask: u32) -> Self {
        MasqueradeRule {
            table: "kilo".into(),
            mark,
            mask,
        }
    }

    fn comment(&self) -> String {
        format!("kilo-rs: masquerade mark {:#x}/{:#x}", self.mark, self.mask)
    }
}

pub const CHAIN: &str = "postrouting";
const EXPRESSIONS: [&str; 4] = ["meta", "bitwise", "cmp", "masq"];

// netlink / nfnetlink / nf_tables constants (linux/netlink.h, nfnetlink.h, nf_tables.h).
pub(super) const NLM_F_REQUEST: u16 = 0x1;
pub(super) const NLM_F_ACK: u16 = 0x4;
pub(super) const NLM_F_DUMP: u16 = 0x300;
pub(super) const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLA_F_NESTED: u16 = 0x8000;
pub(super) const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub(super) const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub(super) const NFNL_MSG_BATCH_END: u16 = 0x11;
pub(super) const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
pub(super) const NFT_MSG_DELTABLE: u16 = 2;
pub(super) const NFT_MSG_NEWCHAIN: u16 = 3;
pub(super) const NFT_MSG_GETCHAIN: u16 = 4;
pub(super) const NFT_MSG_NEWRULE: u16 = 6;
pub(super) const NFT_MSG_GETRULE: u16 = 7;
const NFPROTO_INET: u8 = 1;
pub(super) const AF_UNSPEC: u8 = 0;
pub(super) const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
pub(super) const NFTA_CHAIN_TABLE: u16 = 1;
pub(super) const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
pub(super) const NFTA_RULE_TABLE: u16 = 1;
pub(super) const NFTA_RULE_CHAIN: u16 = 2;
pub(super) const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub(super) const NFTA_RULE_USERDATA: u16 = 7;
pub(super) const NFTA_LIST_ELEM: u16 = 1;
pub(super) const NFTA_EXPR_NAME: u16 = 1;
pub(super) const NFTA_EXPR_DATA: u16 = 2;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFT_META_MARK: u32 = 3;
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
const NF_INET_POST_ROUTING: u32 = 4;
const NF_IP_PRI_NAT_SRC: i32 = 100;
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

    fn nft(op: u16, flags: u16, seq: u32) -> Self {
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

fn data_value(m: &mut Msg, ty: u16, v: u32) {
    // The mark is compared in host byte order (meta loads skb->mark as a host u32).
    m.nested(ty, |m| {
        m.attr(NFTA_DATA_VALUE, &v.to_ne_bytes());
    });
}

/// The batch that (re)creates the table atomically.
fn replace_batch(rule: &MasqueradeRule, seq: &mut u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut next = || {
        *seq += 1;
        *seq
    };
    out.extend(
        Msg::new(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            next(),
            AF_UNSPEC,
            NFNL_SUBSYS_NFTABLES,
        )
        .finish(),
    );
    let table = |op, flags, s| {
        let mut m = Msg::nft(op, NLM_F_REQUEST | NLM_F_ACK | flags, s);
        m.str(NFTA_TABLE_NAME, &rule.table);
        if op == NFT_MSG_NEWTABLE {
            m.be32(NFTA_TABLE_FLAGS, 0);
        }
        m.finish()
    };
    out.extend(table(NFT_MSG_NEWTABLE, NLM_F_CREATE, next()));
    out.extend(table(NFT_MSG_DELTABLE, 0, next()));
    out.extend(table(NFT_MSG_NEWTABLE, NLM_F_CREATE, next()));
    let mut chain = Msg::nft(
        NFT_MSG_NEWCHAIN,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE,
        next(),
    );
    chain
        .str(NFTA_CHAIN_TABLE, &rule.table)
        .str(NFTA_CHAIN_NAME, CHAIN)
        .nested(NFTA_CHAIN_HOOK, |m| {
            m.be32(NFTA_HOOK_HOOKNUM, NF_INET_POST_ROUTING)
                .be32(NFTA_HOOK_PRIORITY, NF_IP_PRI_NAT_SRC as u32);
        })
        .be32(NFTA_CHAIN_POLICY, NF_ACCEPT)
        .str(NFTA_CHAIN_TYPE, "nat");
    out.extend(chain.finish());
    let mut r = Msg::nft(
        NFT_MSG_NEWRULE,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_APPEND,
        next(),
    );
    r.str(NFTA_RULE_TABLE, &rule.table)
        .str(NFTA_RULE_CHAIN, CHAIN)
        .nested(NFTA_RULE_EXPRESSIONS, |m| {
            expr(m, "meta", |m| {
                m.be32(NFTA_META_KEY, NFT_META_MARK)
                    .be32(NFTA_META_DREG, NFT_REG_1);
            });
            expr(m, "bitwise", |m| {
                m.be32(NFTA_BITWISE_SREG, NFT_REG_1)
                    .be32(NFTA_BITWISE_DREG, NFT_REG_1)
                    .be32(NFTA_BITWISE_LEN, 4);
                data_value(m, NFTA_BITWISE_MASK, rule.mask);
                data_value(m, NFTA_BITWISE_XOR, 0);
            });
            expr(m, "cmp", |m| {
                m.be32(NFTA_CMP_SREG, NFT_REG_1)
                    .be32(NFTA_CMP_OP, NFT_CMP_EQ);
                data_value(m, NFTA_CMP_DATA, rule.mark);
            });
            expr(m, "masq", |_| {});
        })
        .attr(NFTA_RULE_USERDATA, &udata_comment(&rule.comment()));
    out.extend(r.finish());
    out.extend(
        Msg::new(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            next(),
            AF_UNSPEC,
            NFNL_SUBSYS_NFTABLES,
        )
        .finish(),
    );
    out
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

/// What the kernel holds of our table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observed {
    pub table: bool,
    /// (type, hook number, priority) of our chain, if it exists.
    pub chain: Option<(String, u32, i32)>,
    /// Every rule of our chain: (expression names, comment).
    pub rules: Vec<(Vec<String>, Option<String>)>,
}

pub(super) fn not_found(e: &NftError) -> bool {
    matches!(e, NftError::Kernel { source, .. } if source.raw_os_error() == Some(libc::ENOENT))
}

/// Reads our table, chain and rules.
fn observe(c: &mut Conn, table: &str) -> Result<Observed, NftError> {
    let mut out = Observed::default();
    let seq = c.next_seq();
    let mut m = Msg::nft(NFT_MSG_GETTABLE, NLM_F_REQUEST | NLM_F_ACK, seq);
    m.str(NFTA_TABLE_NAME, table);
    match c.exchange(&m.finish(), 1, false, "get table") {
        Ok(_) => out.table = true,
        Err(e) if not_found(&e) => return Ok(out),
        Err(e) => return Err(e),
    }
    let seq = c.next_seq();
    let mut m = Msg::nft(NFT_MSG_GETCHAIN, NLM_F_REQUEST | NLM_F_ACK, seq);
    m.str(NFTA_CHAIN_TABLE, table).str(NFTA_CHAIN_NAME, CHAIN);
    match c.exchange(&m.finish(), 1, false, "get chain") {
        Ok(replies) => {
            let reply = replies.first().ok_or(NftError::Malformed("get chain"))?;
            let a = attrs(reply);
            let hook = attrs(get(&a, NFTA_CHAIN_HOOK).unwrap_or_default());
            out.chain = Some((
                get(&a, NFTA_CHAIN_TYPE).map(cstr).unwrap_or_default(),
                be32(get(&hook, NFTA_HOOK_HOOKNUM)).unwrap_or(u32::MAX),
                be32(get(&hook, NFTA_HOOK_PRIORITY)).unwrap_or(0) as i32,
            ));
        }
        Err(e) if not_found(&e) => return Ok(out),
        Err(e) => return Err(e),
    }
    let seq = c.next_seq();
    let mut m = Msg::nft(NFT_MSG_GETRULE, NLM_F_REQUEST | NLM_F_DUMP, seq);
    m.str(NFTA_RULE_TABLE, table).str(NFTA_RULE_CHAIN, CHAIN);
    for reply in c.exchange(&m.finish(), 0, true, "list rules")? {
        let a = attrs(&reply);
        if get(&a, NFTA_RULE_TABLE).map(cstr).as_deref() != Some(table)
            || get(&a, NFTA_RULE_CHAIN).map(cstr).as_deref() != Some(CHAIN)
        {
            continue;
        }
        let names = attrs(get(&a, NFTA_RULE_EXPRESSIONS).unwrap_or_default())
            .into_iter()
            .filter(|(t, _)| *t == NFTA_LIST_ELEM)
            .map(|(_, e)| get(&attrs(e), NFTA_EXPR_NAME).map(cstr).unwrap_or_default())
            .collect();
        let comment = get(&a, NFTA_RULE_USERDATA).and_then(|u| {
            (u.len() >= 2 && u[0] == NFTNL_UDATA_RULE_COMMENT)
                .then(|| cstr(&u[2..(2 + u[1] as usize).min(u.len())]))
        });
        out.rules.push((names, comment));
    }
    Ok(out)
}

/// The state [`ensure_masquerade`] makes.
pub fn desired(rule: &MasqueradeRule) -> Observed {
    Observed {
        table: true,
        chain: Some(("nat".into(), NF_INET_POST_ROUTING, NF_IP_PRI_NAT_SRC)),
        rules: vec![(
            EXPRESSIONS.iter().map(|s| s.to_string()).collect(),
            Some(rule.comment()),
        )],
    }
}

/// Installs the rule unless it is there already (then nothing is written).
pub fn ensure_masquerade(rule: &MasqueradeRule) -> Result<Writes, NftError> {
    ensure_masquerade_with(&mut Conn::open()?, rule)
}

/// [`ensure_masquerade`] over an open socket.
fn ensure_masquerade_with(c: &mut Conn, rule: &MasqueradeRule) -> Result<Writes, NftError> {
    let mut writes = Writes::default();
    if observe(c, &rule.table)? == desired(rule) {
        return Ok(writes);
    }
    let batch = replace_batch(rule, &mut c.seq);
    c.exchange(&batch, 5, false, "masquerade table batch")?;
    writes.add(Write::NftTable, 1);
    writes.add(Write::NftChain, 1);
    writes.add(Write::NftRule, 1);
    Ok(writes)
}

/// Keeps the rule in place over many calls without reading the ruleset at each: it checks (and
/// repairs) at the first call, after netfilter announced a change to our table made by someone
/// else (the nftables multicast group, drained without waiting; other tables' changes, e.g.
/// kube-proxy's, and the echoes of our own writes do not count), after an error, and at least
/// every `every` calls. Without the group (no subscription possible) it checks at every call.
pub struct Keeper {
    rule: MasqueradeRule,
    /// `None` before the first check and after an error: the next call checks.
    conn: Option<Conn>,
    changes: Option<Socket>,
    read_back: ReadBack,
    checks: u64,
}

impl Keeper {
    pub fn new(rule: MasqueradeRule, every: u32) -> Self {
        Keeper {
            rule,
            conn: None,
            changes: None,
            read_back: ReadBack::every(every),
            checks: 0,
        }
    }

    /// [`ensure_masquerade`] when due (see the type's doc).
    pub fn ensure(&mut self) -> Result<Writes, NftError> {
        // Subscribed before a check, so that no change after it goes unseen; until then every
        // call checks.
        let own = self.conn.as_ref().and_then(|c| c.port);
        let announced = match &mut self.changes {
            Some(sock) => drain(sock, own, &self.rule.table),
            None => {
                self.changes = subscribe().ok();
                true
            }
        };
        if !self.read_back.due(self.conn.is_some() && !announced) {
            return Ok(Writes::default());
        }
        self.checks += 1;
        let conn = match &mut self.conn {
            Some(c) => c,
            None => self.conn.insert(Conn::open()?),
        };
        let checked = ensure_masquerade_with(conn, &self.rule);
        if checked.is_err() {
            self.conn = None;
        }
        checked
    }

    /// Times the ruleset was read.
    pub fn checks(&self) -> u64 {
        self.checks
    }
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

/// Reads every queued notification; whether any may concern `table` (family inet) and came
/// from another socket than `own` (the port our writes go through): a change to our table, its
/// chain or rule, a message too long for the buffer, a lost one or an overrun count; another
/// table's changes and the generation messages do not.
fn drain(sock: &mut Socket, own: Option<u32>, table: &str) -> bool {
    let mut buf = [0u8; 8192];
    let mut any = false;
    loop {
        match sock.recv(&mut &mut buf[..], libc::MSG_TRUNC) {
            Ok(n) if n > buf.len() => any = true,
            Ok(n) => any |= concerns(&buf[..n], own, table),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return any,
            Err(_) => return true,
        }
    }
}

/// Whether one datagram of nftables notifications may concern `table` (see [`drain`]).
fn concerns(datagram: &[u8], own: Option<u32>, table: &str) -> bool {
    messages(datagram).any(|m| {
        let Some(m) = m else {
            return true;
        };
        // nfgenmsg (family, version, resource id), then the attributes: the table's name is
        // attribute 1 in every table, chain, rule, set and object message. The generation
        // message that ends each batch has family AF_UNSPEC.
        let other = m.ty >> 8 != NFNL_SUBSYS_NFTABLES
            || m.body.len() >= 4
                && (m.body[0] != NFPROTO_INET
                    || get(&attrs(&m.body[4..]), NFTA_TABLE_NAME)
                        .is_some_and(|n| cstr(n) != table));
        own != Some(m.port) && !other
    })
}

/// Deletes the table (and with it the chain and rule) if it exists.
pub fn remove_masquerade(table: &str) -> Result<Writes, NftError> {
    let mut writes = Writes::default();
    let mut c = Conn::open()?;
    if !observe(&mut c, table)?.table {
        return Ok(writes);
    }
    let mut out = Vec::new();
    let s = c.next_seq();
    out.extend(
        Msg::new(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            s,
            AF_UNSPEC,
            NFNL_SUBSYS_NFTABLES,
        )
        .finish(),
    );
    let s = c.next_seq();
    let mut m = Msg::nft(NFT_MSG_DELTABLE, NLM_F_REQUEST | NLM_F_ACK, s);
    m.str(NFTA_TABLE_NAME, table);
    out.extend(m.finish());
    let s = c.next_seq();
    out.extend(
        Msg::new(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            s,
            AF_UNSPEC,
            NFNL_SUBSYS_NFTABLES,
        )
        .finish(),
    );
    match c.exchange(&out, 1, false, "delete table") {
        Ok(_) => {}
        Err(e) if not_found(&e) => return Ok(writes),
        Err(e) => return Err(e),
    }
    writes.add(Write::NftTableDelete, 1);
    Ok(writes)
}

#[cfg(test)]
mod tests;
