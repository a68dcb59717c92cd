//! What each trie should hold: the plan's entries by role ([`Plans`]), merged per trie in CIDR
//! order ([`Plans::wants`]), with the value each entry gets.
use std::collections::BTreeMap;

use ipnet::IpNet;
use kilo_common::{ENTRY_COVERED, ENTRY_MASQUERADE, EntryValue};

use super::{
    Role, Trie,
    encode::{self, Resolver},
};
use crate::plan::{DatapathEntry, DatapathPlan, IpipPlan};

/// Everything the maps hold: the NAT roles' plan and the IPIP roles'. A [`DatapathPlan`]
/// alone means no IPIP.
#[derive(Debug, Clone, Copy)]
pub struct Plans<'a> {
    pub nat: &'a DatapathPlan,
    pub ipip: &'a IpipPlan,
}

static NONE: BTreeMap<IpNet, DatapathEntry> = BTreeMap::new();
static NO_IPIP: IpipPlan = IpipPlan {
    encapsulate: BTreeMap::new(),
    sources: BTreeMap::new(),
    decapsulate: BTreeMap::new(),
};

impl<'a> From<&'a DatapathPlan> for Plans<'a> {
    fn from(nat: &'a DatapathPlan) -> Self {
        Plans {
            nat,
            ipip: &NO_IPIP,
        }
    }
}

impl<'a> Plans<'a> {
    /// The entries of one role.
    pub fn role(self, role: Role) -> &'a BTreeMap<IpNet, DatapathEntry> {
        match role {
            Role::Mesh => &self.nat.mesh_destinations,
            Role::NatSource => &self.nat.nat_sources,
            Role::MasqueradeDestination => &self.nat.masquerade_destinations,
            Role::Encapsulate => &self.ipip.encapsulate,
            Role::IpipSource => &self.ipip.sources,
            Role::Decapsulate => &self.ipip.decapsulate,
        }
    }

    /// What one trie should hold, in CIDR order: each role's entries; in the destination trie
    /// the mesh destinations and the masquerade destinations (a CIDR in both is a mesh
    /// destination), the latter marked covered when inside a mesh destination.
    pub(crate) fn wants(self, trie: Trie) -> impl Iterator<Item = (IpNet, Want<'a>)> + Clone {
        let (first, second) = roles(trie);
        let nat = self.nat;
        let mut a = self.role(first).iter().peekable();
        let mut b = second.map_or(&NONE, |r| self.role(r)).iter().peekable();
        std::iter::from_fn(move || {
            let take_a = match (a.peek(), b.peek()) {
                (Some((x, _)), Some((y, _))) => x <= y,
                (x, _) => x.is_some(),
            };
            if take_a {
                let (net, entry) = a.next()?;
                if b.peek().is_some_and(|(y, _)| *y == net) {
                    b.next();
                }
                let want = Want {
                    role: first,
                    entry,
                    covered: None,
                };
                return Some((*net, want));
            }
            let (net, entry) = b.next()?;
            let want = Want {
                role: second.expect("entries only with a second role"),
                entry,
                covered: nat.covering_mesh(net),
            };
            Some((*net, want))
        })
    }
}

/// The roles whose entries a trie holds: one, or (the destination trie) two.
const fn roles(trie: Trie) -> (Role, Option<Role>) {
    match trie {
        Trie::Destination => (Role::Mesh, Some(Role::MasqueradeDestination)),
        Trie::NatSource => (Role::NatSource, None),
        Trie::Encapsulate => (Role::Encapsulate, None),
        Trie::IpipSource => (Role::IpipSource, None),
        Trie::Decapsulate => (Role::Decapsulate, None),
    }
}

/// The role of an entry a trie holds (`None` for a covered one: it stands for the mesh
/// destination whose value it holds).
pub(super) fn role_of(trie: Trie, value: &EntryValue) -> Option<Role> {
    if value.flags & ENTRY_COVERED != 0 {
        return None;
    }
    let (first, second) = roles(trie);
    Some(match second {
        Some(r) if value.flags & ENTRY_MASQUERADE != 0 => r,
        _ => first,
    })
}

/// What one trie entry should hold: its role and plan entry and, for a covered masquerade
/// destination, the mesh destination whose value it takes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Want<'a> {
    pub role: Role,
    pub entry: &'a DatapathEntry,
    pub(super) covered: Option<(IpNet, &'a DatapathEntry)>,
}

impl Want<'_> {
    /// The map value with counter slot `counter`.
    pub(super) fn value(&self, counter: u32, resolver: &dyn Resolver) -> EntryValue {
        let (entry, flags) = match self.covered {
            Some((_, mesh)) => (mesh, ENTRY_COVERED),
            None if self.role == Role::MasqueradeDestination => (self.entry, ENTRY_MASQUERADE),
            None => (self.entry, 0),
        };
        let mut value = encode::entry_value(entry, counter, resolver);
        value.flags |= flags;
        value
    }

    /// Whether `v` is this entry's value as it should be, in a trie holding `have`: with a
    /// counter slot of its own, or (covered) the slot of the mesh destination covering it,
    /// which must be as it should be too.
    pub(super) fn held_by(
        &self,
        v: &EntryValue,
        have: &BTreeMap<IpNet, EntryValue>,
        slots: u32,
        resolver: &dyn Resolver,
    ) -> bool {
        let slot_ok = match self.covered {
            None => true,
            Some((outer, mesh)) => have.get(&outer).is_some_and(|o| {
                o.counter == v.counter && encode::entry_value(mesh, o.counter, resolver) == *o
            }),
        };
        slot_ok && v.counter < slots && self.value(v.counter, resolver) == *v
    }
}
