//! Kilo's `--iptables-forward-rules`: ACCEPT rules for the plan's
//! [`ForwardAccept`]s at the top of iptables' own FORWARD chain, written as netfilter netlink
//! messages (no `iptables` process), and removed on clean-up.
//!
//! Why there: a host whose FORWARD policy is DROP (Docker sets it) drops in iptables' base
//! chain whatever another nftables table accepts, so the accepts must be in that very chain.
//! With iptables-nft (Debian 11+, Ubuntu 22.04+, RHEL 8+) that is the chain `FORWARD` of the
//! nftables tables `ip filter` and `ip6 filter`, and each rule is made of the expressions
//! `iptables-nft -I FORWARD -s CIDR -m comment --comment C -j ACCEPT` writes (payload, bitwise
//! for a prefix, cmp, counter, accept; the comment in the rule's user data), so `iptables -S`
//! lists them as its own:
//!
//! ```text
//! -A FORWARD -s 10.2.1.0/24 -m comment --comment "kilo-rs: forward packets from the pod subnet" -j ACCEPT
//! ```
//!
//! kg's rules are those whose comment starts with [`COMMENT_PREFIX`]; nothing else in the chain
//! is read for more than that, changed or removed. Like Kilo (which checks each rule with
//! `iptables -C` and inserts the missing ones), a rule present anywhere in the chain counts;
//! missing ones are inserted at the top. Where the chain does not exist nothing can drop, and
//! nothing is written (the rules follow when iptables creates it: [`ForwardKeeper`] watches
//! the chain). A host on iptables-legacy (x_tables, not nftables) cannot be written without
//! the `iptables` binary: the keeper says so once, with the rules to add by hand.
use std::{collections::BTreeSet, fmt, io, net::IpAddr};

use ipnet::IpNet;
use netlink_sys::Socket;

use super::netfilter::{
    AF_UNSPEC, Conn, Msg, NF_ACCEPT, NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END,
    NFNL_SUBSYS_NFTABLES, NFT_CMP_EQ, NFT_MSG_GETCHAIN, NFT_MSG_GETRULE, NFT_MSG_NEWRULE,
    NFT_REG_1, NFTA_BITWISE_DREG, NFTA_BITWISE_LEN, NFTA_BITWISE_MASK, NFTA_BITWISE_SREG,
    NFTA_BITWISE_XOR, NFTA_CHAIN_NAME, NFTA_CHAIN_TABLE, NFTA_CMP_DATA, NFTA_CMP_OP, NFTA_CMP_SREG,
    NFTA_DATA_VALUE, NFTA_EXPR_DATA, NFTA_EXPR_NAME, NFTA_LIST_ELEM, NFTA_RULE_CHAIN,
    NFTA_RULE_EXPRESSIONS, NFTA_RULE_TABLE, NFTA_RULE_USERDATA, NFTA_TABLE_NAME,
    NFTNL_UDATA_RULE_COMMENT, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REQUEST, NftError, attrs,
    be32, cstr, expr, get, not_found, subscribe, udata_comment,
};
use crate::{
    plan::ForwardAccept,
    sys::netlink::messages,
    writes::{ReadBack, Write, Writes},
};

/// The start of the comment of every rule kg owns in the FORWARD chain.
pub const COMMENT_PREFIX: &str = "kilo-rs: forward packets ";
/// iptables' table and chain.
pub const TABLE: &str = "filter";
pub const CHAIN: &str = "FORWARD";

const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_DELRULE: u16 = 8;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFTA_COUNTER_BYTES: u16 = 1;
const NFTA_COUNTER_PACKETS: u16 = 2;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFT_REG_VERDICT: u32 = 0;

/// Which address a rule matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    /// `-s`: traffic from the network.
    From,
    /// `-d`: traffic to it.
    To,
}

impl Direction {
    /// Offset of the address in the IPv4 or IPv6 header.
    fn offset(self, v6: bool) -> u32 {
        match (self, v6) {
            (Direction::From, false) => 12,
            (Direction::To, false) => 16,
            (Direction::From, true) => 8,
            (Direction::To, true) => 24,
        }
    }

    fn of_offset(offset: u32, v6: bool) -> Option<Self> {
        [Direction::From, Direction::To]
            .into_iter()
            .find(|d| d.offset(v6) == offset)
    }
}

/// One ACCEPT rule of the FORWARD chain, as kg writes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ForwardRule {
    pub direction: Direction,
    /// Truncated; its family picks the table (`ip` or `ip6`).
    pub net: IpNet,
    pub comment: String,
}

impl ForwardRule {
    fn v6(&self) -> bool {
        self.net.addr().is_ipv6()
    }

    fn family(&self) -> u8 {
        if self.v6() {
            NFPROTO_IPV6
        } else {
            NFPROTO_IPV4
        }
    }
}

/// As `iptables -S` prints it.
impl fmt::Display for ForwardRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let flag = match self.direction {
            Direction::From => "-s",
            Direction::To => "-d",
        };
        let tool = if self.v6() { "ip6tables" } else { "iptables" };
        write!(
            f,
            "{tool} -I {CHAIN} {flag} {} -m comment --comment \"{}\" -j ACCEPT",
            self.net, self.comment
        )
    }
}

/// The rules for `accepts`, in Kilo's order (from, then to, for each), without duplicates.
pub fn rules(accepts: &[ForwardAccept]) -> Vec<ForwardRule> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for a in accepts {
        for (direction, word) in [(Direction::From, "from"), (Direction::To, "to")] {
            let r = ForwardRule {
                direction,
                net: a.net.trunc(),
                comment: format!("{COMMENT_PREFIX}{word} {}", a.what.describe()),
            };
            if seen.insert(r.clone()) {
                out.push(r);
            }
        }
    }
    out
}

/// One rule of ours found in the chain: its handle, and what it is when it has exactly the
/// shape kg writes (anything else of ours is removed and written again).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Found {
    handle: u64,
    family: u8,
    rule: Option<ForwardRule>,
}

/// What one family's FORWARD chain holds of ours: (family, `None` when the chain does not
/// exist).
type Chain = (u8, Option<Vec<Found>>);

/// One expression of a rule: its name and its attributes.
type Expression<'a> = (String, Vec<(u16, &'a [u8])>);

/// What one family's FORWARD chain holds of ours; `None` when the chain does not exist.
fn observe(c: &mut Conn, family: u8) -> Result<Option<Vec<Found>>, NftError> {
    let seq = c.next_seq();
    let mut m = Msg::nft_family(NFT_MSG_GETCHAIN, NLM_F_REQUEST | NLM_F_ACK, seq, family);
    m.str(NFTA_CHAIN_TABLE, TABLE).str(NFTA_CHAIN_NAME, CHAIN);
    match c.exchange(&m.finish(), 1, false, "get the FORWARD chain") {
        Ok(_) => {}
        Err(e) if not_found(&e) => return Ok(None),
        Err(e) => return Err(e),
    }
    let seq = c.next_seq();
    let mut m = Msg::nft_family(NFT_MSG_GETRULE, NLM_F_REQUEST | NLM_F_DUMP, seq, family);
    m.str(NFTA_RULE_TABLE, TABLE).str(NFTA_RULE_CHAIN, CHAIN);
    let mut out = Vec::new();
    for reply in c.exchange(&m.finish(), 0, true, "list the FORWARD chain")? {
        let a = attrs(&reply);
        if get(&a, NFTA_RULE_TABLE).map(cstr).as_deref() != Some(TABLE)
            || get(&a, NFTA_RULE_CHAIN).map(cstr).as_deref() != Some(CHAIN)
        {
            continue;
        }
        let Some(comment) = get(&a, NFTA_RULE_USERDATA).and_then(comment) else {
            continue;
        };
        if !comment.starts_with(COMMENT_PREFIX) {
            continue;
        }
        let Some(handle) = get(&a, NFTA_RULE_HANDLE)
            .and_then(|p| Some(u64::from_be_bytes(p.get(..8)?.try_into().ok()?)))
        else {
            continue;
        };
        let rule = parse(get(&a, NFTA_RULE_EXPRESSIONS).unwrap_or_default(), family).map(
            |(direction, net)| ForwardRule {
                direction,
                net,
                comment,
            },
        );
        out.push(Found {
            handle,
            family,
            rule,
        });
    }
    Ok(Some(out))
}

/// The comment in a rule's user data (libnftnl's TLVs), if it has one.
fn comment(mut udata: &[u8]) -> Option<String> {
    while udata.len() >= 2 {
        let (ty, len) = (udata[0], udata[1] as usize);
        let value = udata.get(2..2 + len)?;
        if ty == NFTNL_UDATA_RULE_COMMENT {
            return Some(cstr(value));
        }
        udata = &udata[2 + len..];
    }
    None
}

/// The address match of a rule made exactly as [`rule_msg`] makes them: payload (network
/// header, an address), an optional bitwise mask, cmp eq, counter, accept.
fn parse(expressions: &[u8], family: u8) -> Option<(Direction, IpNet)> {
    let v6 = family == NFPROTO_IPV6;
    let width = if v6 { 16 } else { 4 };
    let exprs: Vec<Expression> = attrs(expressions)
        .into_iter()
        .filter(|(t, _)| *t == NFTA_LIST_ELEM)
        .map(|(_, e)| {
            let e = attrs(e);
            let name = get(&e, NFTA_EXPR_NAME).map(cstr).unwrap_or_default();
            (name, attrs(get(&e, NFTA_EXPR_DATA).unwrap_or_default()))
        })
        .collect();
    let names: Vec<&str> = exprs.iter().map(|(n, _)| n.as_str()).collect();
    let (payload, mask, cmp, verdict) = match names[..] {
        ["payload", "bitwise", "cmp", "counter", "immediate"] => {
            (&exprs[0].1, Some(&exprs[1].1), &exprs[2].1, &exprs[4].1)
        }
        ["payload", "cmp", "counter", "immediate"] => (&exprs[0].1, None, &exprs[1].1, &exprs[3].1),
        _ => return None,
    };
    if be32(get(payload, NFTA_PAYLOAD_BASE))? != NFT_PAYLOAD_NETWORK_HEADER
        || be32(get(payload, NFTA_PAYLOAD_LEN))? != width as u32
        || be32(get(cmp, NFTA_CMP_OP))? != NFT_CMP_EQ
    {
        return None;
    }
    let direction = Direction::of_offset(be32(get(payload, NFTA_PAYLOAD_OFFSET))?, v6)?;
    let value =
        |a: &[(u16, &[u8])], ty| get(&attrs(get(a, ty)?), NFTA_DATA_VALUE).map(<[u8]>::to_vec);
    let address = value(cmp, NFTA_CMP_DATA)?;
    let prefix = match mask {
        Some(m) => {
            let mask = value(m, NFTA_BITWISE_MASK)?;
            let xor = value(m, NFTA_BITWISE_XOR)?;
            if mask.len() != width || xor.iter().any(|b| *b != 0) {
                return None;
            }
            prefix_len(&mask)?
        }
        None => 8 * width as u8,
    };
    let code = get(
        &attrs(get(verdict, NFTA_IMMEDIATE_DATA)?),
        NFTA_DATA_VERDICT,
    )
    .and_then(|v| be32(get(&attrs(v), NFTA_VERDICT_CODE)))?;
    if code != NF_ACCEPT {
        return None;
    }
    let addr: IpAddr = match address.len() {
        4 if !v6 => <[u8; 4]>::try_from(&address[..]).ok()?.into(),
        16 if v6 => <[u8; 16]>::try_from(&address[..]).ok()?.into(),
        _ => return None,
    };
    let net = IpNet::new(addr, prefix).ok()?;
    (net.trunc() == net).then_some((direction, net))
}

/// The prefix length of a contiguous mask.
fn prefix_len(mask: &[u8]) -> Option<u8> {
    let bits: Vec<bool> = mask
        .iter()
        .flat_map(|b| (0..8).rev().map(move |i| (b >> i) & 1 == 1))
        .collect();
    let ones = bits.iter().take_while(|b| **b).count();
    bits[ones..].iter().all(|b| !b).then_some(ones as u8)
}

fn mask(net: &IpNet) -> Vec<u8> {
    match net {
        IpNet::V4(n) => n.netmask().octets().to_vec(),
        IpNet::V6(n) => n.netmask().octets().to_vec(),
    }
}

fn address(net: &IpNet) -> Vec<u8> {
    match net.addr() {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn data(m: &mut Msg, ty: u16, bytes: &[u8]) {
    m.nested(ty, |m| {
        m.attr(NFTA_DATA_VALUE, bytes);
    });
}

/// `iptables-nft -I FORWARD {-s|-d} NET -m comment --comment C -j ACCEPT`, as iptables-nft
/// writes it: inserted at the top of the chain (no `NLM_F_APPEND`).
fn rule_msg(rule: &ForwardRule, seq: u32) -> Vec<u8> {
    let width = if rule.v6() { 16u32 } else { 4 };
    let mut m = Msg::nft_family(
        NFT_MSG_NEWRULE,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE,
        seq,
        rule.family(),
    );
    m.str(NFTA_RULE_TABLE, TABLE)
        .str(NFTA_RULE_CHAIN, CHAIN)
        .nested(NFTA_RULE_EXPRESSIONS, |m| {
            expr(m, "payload", |m| {
                m.be32(NFTA_PAYLOAD_DREG, NFT_REG_1)
                    .be32(NFTA_PAYLOAD_BASE, NFT_PAYLOAD_NETWORK_HEADER)
                    .be32(NFTA_PAYLOAD_OFFSET, rule.direction.offset(rule.v6()))
                    .be32(NFTA_PAYLOAD_LEN, width);
            });
            // A whole address is compared as it is (iptables-nft writes no mask then).
            if u32::from(rule.net.prefix_len()) != 8 * width {
                expr(m, "bitwise", |m| {
                    m.be32(NFTA_BITWISE_SREG, NFT_REG_1)
                        .be32(NFTA_BITWISE_DREG, NFT_REG_1)
                        .be32(NFTA_BITWISE_LEN, width);
                    data(m, NFTA_BITWISE_MASK, &mask(&rule.net));
                    data(m, NFTA_BITWISE_XOR, &vec![0; width as usize]);
                });
            }
            expr(m, "cmp", |m| {
                m.be32(NFTA_CMP_SREG, NFT_REG_1)
                    .be32(NFTA_CMP_OP, NFT_CMP_EQ);
                data(m, NFTA_CMP_DATA, &address(&rule.net));
            });
            expr(m, "counter", |m| {
                m.attr(NFTA_COUNTER_BYTES, &0u64.to_be_bytes())
                    .attr(NFTA_COUNTER_PACKETS, &0u64.to_be_bytes());
            });
            expr(m, "immediate", |m| {
                m.be32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT)
                    .nested(NFTA_IMMEDIATE_DATA, |m| {
                        m.nested(NFTA_DATA_VERDICT, |m| {
                            m.be32(NFTA_VERDICT_CODE, NF_ACCEPT);
                        });
                    });
            });
        })
        .attr(NFTA_RULE_USERDATA, &udata_comment(&rule.comment));
    m.finish()
}

fn delete_msg(found: &Found, seq: u32) -> Vec<u8> {
    let mut m = Msg::nft_family(
        NFT_MSG_DELRULE,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        found.family,
    );
    m.str(NFTA_RULE_TABLE, TABLE)
        .str(NFTA_RULE_CHAIN, CHAIN)
        .attr(NFTA_RULE_HANDLE, &found.handle.to_be_bytes());
    m.finish()
}

/// What to change in the chains: ours to delete, rules to insert.
#[derive(Debug, Default)]
struct Change {
    delete: Vec<Found>,
    insert: Vec<ForwardRule>,
}

/// The difference between `want` and what the chains hold of ours (`found`, per family; a
/// family whose chain is missing gets nothing inserted).
fn diff(want: &[ForwardRule], found: &[Chain]) -> Change {
    let mut change = Change::default();
    let mut kept = BTreeSet::new();
    for (_, rules) in found {
        for f in rules.iter().flatten() {
            match &f.rule {
                Some(r) if want.contains(r) && kept.insert(r.clone()) => {}
                _ => change.delete.push(f.clone()),
            }
        }
    }
    let chain = |family| found.iter().any(|(f, r)| *f == family && r.is_some());
    change.insert = want
        .iter()
        .filter(|r| !kept.contains(*r) && chain(r.family()))
        .cloned()
        .collect();
    change
}

/// Applies `change` in one atomic batch: deletions, then the insertions in reverse, so the
/// chain lists them from the top in the plan's order.
fn apply(c: &mut Conn, change: &Change) -> Result<Writes, NftError> {
    let mut writes = Writes::default();
    if change.delete.is_empty() && change.insert.is_empty() {
        return Ok(writes);
    }
    let mut out = Vec::new();
    let begin = c.next_seq();
    out.extend(batch_mark(NFNL_MSG_BATCH_BEGIN, begin));
    for f in &change.delete {
        let seq = c.next_seq();
        out.extend(delete_msg(f, seq));
    }
    for r in change.insert.iter().rev() {
        let seq = c.next_seq();
        out.extend(rule_msg(r, seq));
    }
    let end = c.next_seq();
    out.extend(batch_mark(NFNL_MSG_BATCH_END, end));
    c.exchange(
        &out,
        change.delete.len() + change.insert.len(),
        false,
        "FORWARD rules batch",
    )?;
    writes.add(Write::ForwardRuleDel, change.delete.len() as u64);
    writes.add(Write::ForwardRuleAdd, change.insert.len() as u64);
    Ok(writes)
}

fn batch_mark(ty: u16, seq: u32) -> Vec<u8> {
    Msg::new(ty, NLM_F_REQUEST, seq, AF_UNSPEC, NFNL_SUBSYS_NFTABLES).finish()
}

/// Both families' chains.
fn observe_all(c: &mut Conn) -> Result<Vec<Chain>, NftError> {
    Ok(vec![
        (NFPROTO_IPV4, observe(c, NFPROTO_IPV4)?),
        (NFPROTO_IPV6, observe(c, NFPROTO_IPV6)?),
    ])
}

/// Which iptables the host uses, as far as the rules go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostIptables {
    /// iptables-nft's `filter` table exists (in one family at least).
    Nft,
    /// No nftables `filter` table, but x_tables' (iptables-legacy's) is in use.
    Legacy,
    /// Neither: no iptables FORWARD chain can drop anything.
    None,
}

/// Whether iptables-legacy's `filter` table is in use in this thread's network namespace (the
/// kernel lists the x_tables tables in use per namespace).
pub fn legacy_filter() -> bool {
    ["ip_tables_names", "ip6_tables_names"].iter().any(|f| {
        std::fs::read_to_string(format!("/proc/thread-self/net/{f}"))
            .is_ok_and(|names| names.lines().any(|l| l.trim() == TABLE))
    })
}

/// The effect the reconciler drives (a fake in memory for its tests: [`FakeForward`]).
pub trait ForwardRules {
    /// Makes kg's rules in the FORWARD chains exactly those of `want` (none for an empty
    /// `want`, removing those of an earlier run); writes only the difference.
    fn ensure(&mut self, want: &[ForwardAccept]) -> Result<Writes, NftError>;
    /// Lines describing what `ensure` would change (for `--dry-run`).
    fn describe(&mut self, want: &[ForwardAccept]) -> Result<Vec<String>, NftError>;
    /// Removes kg's rules, and only them.
    fn clean_up(&mut self) -> Result<Writes, NftError>;
}

/// Keeps kg's FORWARD rules over many calls, reading the chains only when due: at the first
/// call, when the accepts changed, after nftables announced a change to a `filter` table's
/// FORWARD chain made by someone else (iptables creating the table, `iptables -D`, Docker
/// starting), after an error, and at least every `every` calls. Other chains' churn (kube-proxy
/// rewriting its own chains in the same table) costs no read.
pub struct ForwardKeeper {
    conn: Option<Conn>,
    changes: Option<Socket>,
    read_back: ReadBack,
    /// The rules made sure of at the last check.
    last: Option<Vec<ForwardRule>>,
    checks: u64,
    /// What was last said about the host's iptables (said again only when it changes).
    said: Option<(HostIptables, Vec<ForwardRule>)>,
}

impl ForwardKeeper {
    pub fn new(every: u32) -> Self {
        ForwardKeeper {
            conn: None,
            changes: None,
            read_back: ReadBack::every(every),
            last: None,
            checks: 0,
            said: None,
        }
    }

    /// Times the chains were read.
    pub fn checks(&self) -> u64 {
        self.checks
    }

    fn conn(&mut self) -> Result<&mut Conn, NftError> {
        if self.conn.is_none() {
            self.conn = Some(Conn::open()?);
        }
        Ok(self.conn.as_mut().expect("just opened"))
    }

    fn check(&mut self, want: &[ForwardRule]) -> Result<Writes, NftError> {
        self.checks += 1;
        let c = self.conn()?;
        let found = observe_all(c)?;
        let change = diff(want, &found);
        let writes = apply(c, &change)?;
        if !writes.is_empty() {
            tracing::info!(
                added = change.insert.len(),
                removed = change.delete.len(),
                "FORWARD ACCEPT rules (--iptables-forward-rules) updated"
            );
        }
        let legacy = !want.is_empty() && legacy_filter();
        let iptables = if found.iter().any(|(_, r)| r.is_some()) {
            HostIptables::Nft
        } else if legacy {
            HostIptables::Legacy
        } else {
            HostIptables::None
        };
        self.say(iptables, want, legacy);
        Ok(writes)
    }

    /// Logs once what the host's iptables means for the rules (again only when it changes).
    fn say(&mut self, iptables: HostIptables, want: &[ForwardRule], legacy: bool) {
        let now = (iptables, want.to_vec());
        if want.is_empty() || self.said.as_ref() == Some(&now) {
            return;
        }
        let by_hand: Vec<String> = want.iter().map(ToString::to_string).collect();
        match iptables {
            HostIptables::Legacy => tracing::warn!(
                rules = %by_hand.join("; "),
                "--iptables-forward-rules: this host uses iptables-legacy, which kg cannot write \
                 without starting a process; add these rules yourself, or switch the host to \
                 iptables-nft (update-alternatives --set iptables /usr/sbin/iptables-nft); \
                 --fast-path gets the mesh's traffic (only) past a DROP policy"
            ),
            HostIptables::Nft if legacy => tracing::warn!(
                rules = %by_hand.join("; "),
                "--iptables-forward-rules: the rules are in iptables-nft's FORWARD chain, but \
                 iptables-legacy's filter table is in use too, and its FORWARD chain may still \
                 drop: add these rules there yourself"
            ),
            HostIptables::Nft => {}
            HostIptables::None => tracing::info!(
                "--iptables-forward-rules: no iptables FORWARD chain (ip filter) on this host, \
                 so nothing to accept against; the rules follow if iptables-nft creates it"
            ),
        }
        self.said = Some(now);
    }
}

impl ForwardRules for ForwardKeeper {
    fn ensure(&mut self, want: &[ForwardAccept]) -> Result<Writes, NftError> {
        let want = rules(want);
        // Subscribed before a check, so that no change after it goes unseen.
        let own = self.conn.as_ref().and_then(|c| c.port);
        let announced = match &mut self.changes {
            Some(sock) => drain(sock, own),
            None => {
                self.changes = subscribe().ok();
                true
            }
        };
        let trusted = self.conn.is_some() && !announced && self.last.as_ref() == Some(&want);
        if !self.read_back.due(trusted) {
            return Ok(Writes::default());
        }
        let checked = self.check(&want);
        match &checked {
            Ok(_) => self.last = Some(want),
            Err(_) => {
                self.conn = None;
                self.last = None;
            }
        }
        checked
    }

    fn describe(&mut self, want: &[ForwardAccept]) -> Result<Vec<String>, NftError> {
        let want = rules(want);
        let found = observe_all(self.conn()?)?;
        let change = diff(&want, &found);
        let mut lines: Vec<String> = change.insert.iter().map(|r| format!("+ {r}")).collect();
        lines.extend(change.delete.iter().map(|f| match &f.rule {
            Some(r) => format!("- {r}"),
            None => format!("- FORWARD rule handle {} (kg's, malformed)", f.handle),
        }));
        Ok(lines)
    }

    fn clean_up(&mut self) -> Result<Writes, NftError> {
        self.last = None;
        let c = self.conn()?;
        let found = observe_all(c)?;
        apply(c, &diff(&[], &found))
    }
}

/// Reads every queued nftables notification; whether any may concern a `filter` table's
/// FORWARD chain (family ip or ip6) and came from another socket than `own`: a table or that
/// chain created or deleted, a rule of that chain added or removed, or a lost or truncated
/// message.
fn drain(sock: &mut Socket, own: Option<u32>) -> bool {
    let mut buf = [0u8; 8192];
    let mut any = false;
    loop {
        match sock.recv(&mut &mut buf[..], libc::MSG_TRUNC) {
            Ok(n) if n > buf.len() => any = true,
            Ok(n) => any |= concerns(&buf[..n], own),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return any,
            Err(_) => return true,
        }
    }
}

/// Whether one datagram of nftables notifications may concern the FORWARD chains (see
/// [`drain`]).
fn concerns(datagram: &[u8], own: Option<u32>) -> bool {
    messages(datagram).any(|m| {
        let Some(m) = m else {
            return true;
        };
        if own == Some(m.port) || m.ty >> 8 != NFNL_SUBSYS_NFTABLES || m.body.len() < 4 {
            return false;
        }
        if m.body[0] != NFPROTO_IPV4 && m.body[0] != NFPROTO_IPV6 {
            return false;
        }
        let a = attrs(&m.body[4..]);
        let is = |ty, want: &str| get(&a, ty).is_some_and(|v| cstr(v) == want);
        // The table's name is attribute 1 in table, chain and rule messages.
        is(NFTA_TABLE_NAME, TABLE)
            && match m.ty & 0xff {
                NFT_MSG_NEWTABLE | NFT_MSG_DELTABLE => true,
                NFT_MSG_NEWCHAIN | NFT_MSG_DELCHAIN => is(NFTA_CHAIN_NAME, CHAIN),
                NFT_MSG_NEWRULE | NFT_MSG_DELRULE => is(NFTA_RULE_CHAIN, CHAIN),
                _ => false,
            }
    })
}

/// [`ForwardRules`] in memory: the rules it holds.
#[derive(Debug, Default)]
pub struct FakeForward {
    pub rules: BTreeSet<ForwardRule>,
}

impl ForwardRules for FakeForward {
    fn ensure(&mut self, want: &[ForwardAccept]) -> Result<Writes, NftError> {
        let want: BTreeSet<ForwardRule> = rules(want).into_iter().collect();
        let mut writes = Writes::default();
        writes.add(
            Write::ForwardRuleDel,
            self.rules.difference(&want).count() as u64,
        );
        writes.add(
            Write::ForwardRuleAdd,
            want.difference(&self.rules).count() as u64,
        );
        self.rules = want;
        Ok(writes)
    }

    fn describe(&mut self, want: &[ForwardAccept]) -> Result<Vec<String>, NftError> {
        let want: BTreeSet<ForwardRule> = rules(want).into_iter().collect();
        Ok(want
            .difference(&self.rules)
            .map(|r| format!("+ {r}"))
            .collect())
    }

    fn clean_up(&mut self) -> Result<Writes, NftError> {
        let mut writes = Writes::default();
        writes.add(Write::ForwardRuleDel, self.rules.len() as u64);
        self.rules.clear();
        Ok(writes)
    }
}

#[cfg(test)]
mod tests;
