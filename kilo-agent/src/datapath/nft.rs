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

use netlink_sys::Socket;

pub use super::netfilter::NftError;
use super::netfilter::{
    AF_UNSPEC, Conn, Msg, NF_ACCEPT, NF_INET_POST_ROUTING, NF_IP_PRI_NAT_SRC, NFNL_MSG_BATCH_BEGIN,
    NFNL_MSG_BATCH_END, NFNL_SUBSYS_NFTABLES, NFPROTO_INET, NFT_CMP_EQ, NFT_META_MARK,
    NFT_MSG_DELTABLE, NFT_MSG_GETCHAIN, NFT_MSG_GETRULE, NFT_MSG_GETTABLE, NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWRULE, NFT_MSG_NEWTABLE, NFT_REG_1, NFTA_BITWISE_DREG, NFTA_BITWISE_LEN,
    NFTA_BITWISE_MASK, NFTA_BITWISE_SREG, NFTA_BITWISE_XOR, NFTA_CHAIN_HOOK, NFTA_CHAIN_NAME,
    NFTA_CHAIN_POLICY, NFTA_CHAIN_TABLE, NFTA_CHAIN_TYPE, NFTA_CMP_DATA, NFTA_CMP_OP,
    NFTA_CMP_SREG, NFTA_DATA_VALUE, NFTA_EXPR_NAME, NFTA_HOOK_HOOKNUM, NFTA_HOOK_PRIORITY,
    NFTA_LIST_ELEM, NFTA_META_DREG, NFTA_META_KEY, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS,
    NFTA_RULE_TABLE, NFTA_RULE_USERDATA, NFTA_TABLE_FLAGS, NFTA_TABLE_NAME,
    NFTNL_UDATA_RULE_COMMENT, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REQUEST,
    attrs, be32, cstr, expr, get, not_found, subscribe, udata_comment,
};
use crate::{
    sys::netlink::messages,
    writes::{ReadBack, Write, Writes},
};

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

/// What the kernel holds of our table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observed {
    pub table: bool,
    /// (type, hook number, priority) of our chain, if it exists.
    pub chain: Option<(String, u32, i32)>,
    /// Every rule of our chain: (expression names, comment).
    pub rules: Vec<(Vec<String>, Option<String>)>,
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
