//! What every reconciler reports: the writes it made to the kernel ([`Writes`]), and how often
//! the reconcilers read the kernel back instead of trusting their record ([`READ_BACK_EVERY`]).
use std::{collections::BTreeMap, fmt, ops::AddAssign};

/// Passes between full reads of what the agent keeps in the kernel (the datapath's maps, its
/// nftables table, links, addresses, routes and rules), which in between trust their record of
/// what they wrote: every 10 minutes at the default 30 s resync. A read-back of the maps costs
/// about a microsecond of kernel time per entry, so at 10,000 entries this keeps an idle
/// resync's average under a millisecond.
pub const READ_BACK_EVERY: u32 = 20;

/// Declares [`Write`], each kind with its name.
macro_rules! kinds {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal,)*) => {
        /// One kind of write to the kernel (or a file), as [`Writes`] counts it and as the
        /// `kilo_writes_total` metric labels it (`kind`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Write {
            $($(#[doc = $doc])* $variant,)*
        }

        impl Write {
            /// Every kind, in the order of their names.
            pub const ALL: &[Write] = &[$(Write::$variant,)*];

            /// The kind's name: its metric label and its word in logs.
            pub fn name(self) -> &'static str {
                match self {
                    $(Write::$variant => $name,)*
                }
            }
        }
    };
}

kinds! {
    /// an address added to a link.
    AddressAdd => "address_add",
    /// an address removed from a link.
    AddressDel => "address_del",
    /// the CNI configuration file written.
    CniConfig => "cni_config",
    /// a per-entry counter slot zeroed before reuse.
    CounterReset => "counter_reset",
    /// an ACCEPT added to a FORWARD chain (`--iptables-forward-rules`).
    ForwardRuleAdd => "forward_rule_add",
    /// an ACCEPT removed from a FORWARD chain.
    ForwardRuleDel => "forward_rule_del",
    /// a link created (the WireGuard device).
    LinkAdd => "link_add",
    /// a program attached to an interface.
    LinkAttach => "link_attach",
    /// a link deleted.
    LinkDel => "link_del",
    /// a program detached from an interface.
    LinkDetach => "link_detach",
    /// a link's state or MTU set.
    LinkSet => "link_set",
    /// a program's attachment replaced by a newer program.
    LinkUpdate => "link_update",
    /// the program's config map written.
    MapConfig => "map_config",
    /// a trie entry deleted.
    MapDelete => "map_delete",
    /// a trie entry inserted.
    MapInsert => "map_insert",
    /// a trie entry's value replaced.
    MapUpdate => "map_update",
    /// the masquerade chain created.
    NftChain => "nft_chain",
    /// the masquerade rule added.
    NftRule => "nft_rule",
    /// the masquerade table created.
    NftTable => "nft_table",
    /// the masquerade table deleted.
    NftTableDelete => "nft_table_delete",
    /// a bpffs pin removed.
    PinRemove => "pin_remove",
    /// a clsact qdisc deleted.
    QdiscDelete => "qdisc_delete",
    /// a route added or replaced.
    RouteAdd => "route_add",
    /// a route deleted.
    RouteDel => "route_del",
    /// a route replaced (one of ours whose attributes changed).
    RouteReplace => "route_replace",
    /// an ip rule added.
    RuleAdd => "rule_add",
    /// an ip rule deleted.
    RuleDel => "rule_del",
    /// the WireGuard device's key or port set.
    WireguardDeviceSet => "wireguard_device_set",
    /// a WireGuard peer added.
    WireguardPeerAdd => "wireguard_peer_add",
    /// a WireGuard peer removed.
    WireguardPeerRemove => "wireguard_peer_remove",
    /// a WireGuard peer's configuration changed.
    WireguardPeerUpdate => "wireguard_peer_update",
}

impl fmt::Display for Write {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Writes made to the kernel (or a file), counted by [`Write`] kind. A reconcile with nothing to
/// do returns an empty `Writes`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Writes(BTreeMap<Write, u64>);

impl Writes {
    pub fn add(&mut self, kind: Write, n: u64) {
        if n > 0 {
            *self.0.entry(kind).or_default() += n;
        }
    }

    pub fn get(&self, kind: Write) -> u64 {
        self.0.get(&kind).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (Write, u64)> + '_ {
        self.0.iter().map(|(k, v)| (*k, *v))
    }
}

impl AddAssign for Writes {
    fn add_assign(&mut self, rhs: Self) {
        for (k, v) in rhs.0 {
            self.add(k, v);
        }
    }
}

impl fmt::Display for Writes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no writes");
        }
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&parts.join(" "))
    }
}

/// Counts a reconciler's passes between full reads of the kernel: a pass reads it when the
/// reconciler's record cannot be trusted (none yet, a failed write, a change someone else
/// made) or when `every` passes went by since the last read; in between it trusts the record.
#[derive(Debug, Clone)]
pub struct ReadBack {
    every: u32,
    since: u32,
}

impl Default for ReadBack {
    fn default() -> Self {
        ReadBack::every(READ_BACK_EVERY)
    }
}

impl ReadBack {
    pub fn every(every: u32) -> Self {
        ReadBack { every, since: 0 }
    }

    /// Counts this pass; whether it must read the kernel (counting restarts then). `trusted`:
    /// whether the record may be trusted if no periodic read is due.
    pub fn due(&mut self, trusted: bool) -> bool {
        self.since += 1;
        if trusted && self.since < self.every {
            return false;
        }
        self.since = 0;
        true
    }
}
