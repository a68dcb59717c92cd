//! The map diff against in-memory maps.
use std::collections::BTreeSet;

use kilo_common::ENTRY_MASQUERADE;

use super::*;
use crate::{
    datapath::{FakeMaps, NoResolver, Role},
    plan::{DatapathEntry, DatapathPlan, EntryKind, NextHop},
    writes::{READ_BACK_EVERY, Write},
};

/// Makes the maps equal to `plan` after reading them all back, as a first apply does.
fn sync_maps<'a>(
    maps: &mut FakeMaps,
    plan: impl Into<Plans<'a>>,
    resolver: &dyn Resolver,
) -> Result<Writes, DatapathError> {
    Tries::default().apply(maps, plan, resolver)
}

fn entry(kind: EntryKind, owner: &str) -> DatapathEntry {
    DatapathEntry {
        kind,
        owner: owner.into(),
        next_hop: None,
    }
}

fn plan(mesh: &[&str], nat: &[&str], masq: &[&str]) -> DatapathPlan {
    let m = |v: &[&str], k| {
        v.iter()
            .map(|s| (s.parse().unwrap(), entry(k, s)))
            .collect()
    };
    DatapathPlan {
        mesh_destinations: m(mesh, EntryKind::Node),
        nat_sources: m(nat, EntryKind::LocalPods),
        masquerade_destinations: m(masq, EntryKind::AllowedLocation),
    }
}

fn slot(maps: &FakeMaps, trie: Trie, net: &str) -> u32 {
    maps.tries[&trie][&net.parse::<IpNet>().unwrap()].counter
}

/// Nested CIDRs, so that masquerade destinations fall inside mesh destinations (and the
/// other way round).
const NESTED: [&str; 10] = [
    "10.0.0.0/8",
    "10.1.0.0/16",
    "10.1.2.0/24",
    "10.2.0.0/16",
    "10.2.0.0/24",
    "192.168.0.0/16",
    "192.168.1.0/24",
    "172.16.0.0/12",
    "172.16.5.0/24",
    "0.0.0.0/0",
];

proptest::proptest! {
    /// Syncs from one record (no read-back in between) keep the tries equal to the plan,
    /// give no two entries one slot of their own and a newly given slot a zeroed counter,
    /// and a covered entry the slot of the mesh destination covering it; an entry is left
    /// without a slot only while all are held (slots freed by an apply's deletes are handed
    /// out from the next apply on).
    #[test]
    fn syncs_from_the_record_keep_slots_distinct_and_zeroed(
        plans in proptest::collection::vec(
            [(); 3].map(|()| proptest::collection::btree_set(0usize..10, 0..6)),
            1..10,
        ),
    ) {
        let mut maps = FakeMaps::new(100, 8);
        let mut tries = Tries::default();
        let mut before = BTreeSet::new();
        for sets in plans {
            let [mesh, nat, masq] = sets.map(|s| s.iter().map(|i| NESTED[*i]).collect::<Vec<_>>());
            let p = plan(&mesh, &nat, &masq);
            let wants: Vec<(Trie, IpNet, bool)> = Trie::ALL
                .iter()
                .flat_map(|t| Plans::from(&p).wants(*t).map(move |(n, w)| (*t, n, w.covered.is_some())))
                .collect();
            let want: BTreeSet<(Trie, IpNet)> = wants.iter().map(|(t, n, _)| (*t, *n)).collect();
            let own = wants.iter().filter(|w| !w.2).count();
            for _ in 0..2 {
                tries.apply(&mut maps, &p, &NoResolver).unwrap();
                let held: BTreeSet<(Trie, IpNet, u32, bool)> = Trie::ALL
                    .iter()
                    .flat_map(|t| maps.tries[t].iter().map(move |(n, v)| {
                        (*t, *n, v.counter, v.flags & ENTRY_COVERED != 0)
                    }))
                    .collect();
                let have: BTreeSet<(Trie, IpNet)> = held.iter().map(|h| (h.0, h.1)).collect();
                proptest::prop_assert_eq!(&have, &want);
                let slots: Vec<u32> = held.iter().filter(|h| !h.3).map(|h| h.2).filter(|c| *c != NO_COUNTER).collect();
                let distinct: BTreeSet<u32> = slots.iter().copied().collect();
                proptest::prop_assert_eq!(distinct.len(), slots.len(), "{:?}", held);
                for (_, net, c, _) in held.iter().filter(|h| h.3) {
                    let (outer, _) = p.covering_mesh(net).unwrap();
                    proptest::prop_assert_eq!(*c, slot(&maps, Trie::Destination, &outer.to_string()));
                }
                for h in held.difference(&before).filter(|h| h.2 != NO_COUNTER && !h.3) {
                    proptest::prop_assert_eq!(maps.counters[h.2 as usize], Counter::default());
                }
                // Traffic on every slot before the next apply.
                maps.counters.fill(Counter { packets: 1, bytes: 1 });
                before = held;
            }
            let counted = before.iter().filter(|h| h.2 != NO_COUNTER && !h.3).count();
            proptest::prop_assert_eq!(counted, own.min(8), "{:?}", before);
        }
    }
}

#[test]
fn first_sync_inserts_second_writes_nothing() {
    let mut maps = FakeMaps::new(100, 100);
    let p = plan(
        &["10.0.0.0/24", "fd00::/64"],
        &["10.0.1.0/24"],
        &["192.168.0.0/16"],
    );
    let w = sync_maps(&mut maps, &p, &NoResolver).unwrap();
    assert_eq!(w.get(Write::MapInsert), 4);
    assert_eq!(w.total(), 4);
    assert!(sync_maps(&mut maps, &p, &NoResolver).unwrap().is_empty());
    // Distinct slots across roles.
    let slots: BTreeSet<u32> = maps
        .tries
        .values()
        .flat_map(|t| t.values().map(|v| v.counter))
        .collect();
    assert_eq!(slots.len(), 4);
}

#[test]
fn one_change_is_one_write_and_slots_are_stable() {
    let mut maps = FakeMaps::new(100, 100);
    let p1 = plan(&["10.0.0.0/24", "10.0.2.0/24"], &[], &[]);
    sync_maps(&mut maps, &p1, &NoResolver).unwrap();
    let keep = slot(&maps, Trie::Destination, "10.0.2.0/24");
    let p2 = plan(&["10.0.2.0/24", "10.0.3.0/24"], &[], &[]);
    let w = sync_maps(&mut maps, &p2, &NoResolver).unwrap();
    assert_eq!(
        (w.get(Write::MapInsert), w.get(Write::MapDelete), w.total()),
        (1, 1, 2)
    );
    assert_eq!(slot(&maps, Trie::Destination, "10.0.2.0/24"), keep);
    // The new entry did not take the slot of the one deleted in the same apply.
    assert_ne!(slot(&maps, Trie::Destination, "10.0.3.0/24"), keep);
}

/// Inserts go destinations first, deletes go destinations last: in between, no packet is
/// marked that neither topology marks.
#[test]
fn destinations_go_in_first_and_out_last() {
    let mut maps = FakeMaps::new(100, 100);
    let full = plan(&["10.1.0.0/16"], &["10.244.0.0/24"], &["192.168.0.0/24"]);
    sync_maps(&mut maps, &full, &NoResolver).unwrap();
    let first: IpNet = "10.1.0.0/16".parse().unwrap();
    assert_eq!(
        maps.log[0],
        (Trie::Destination, first, true),
        "{:?}",
        maps.log
    );
    maps.log.clear();
    sync_maps(&mut maps, &plan(&[], &[], &[]), &NoResolver).unwrap();
    assert_eq!(maps.log.len(), 3);
    assert_eq!(maps.log[0].0, Trie::NatSource, "{:?}", maps.log);
    assert_eq!(maps.log[2].0, Trie::Destination, "{:?}", maps.log);
    assert!(maps.log.iter().all(|(_, _, inserted)| !inserted));
}

/// One trie for both kinds of destination: a masquerade destination is flagged; one inside
/// a mesh destination (not one around it) holds that mesh destination's value and counter
/// slot, and is no counter of its own; a CIDR in both is a mesh destination. Covered and
/// uncovered again as the mesh destination comes and goes, with slots kept distinct.
#[test]
fn masquerade_destinations_inside_mesh_destinations_are_covered() {
    let mut maps = FakeMaps::new(100, 100);
    let mut tries = Tries::default();
    let masq = ["10.1.0.0/16", "192.168.0.0/16", "172.16.0.0/12"];
    let mut p = plan(
        &["10.0.0.0/8", "192.168.1.0/24", "172.16.0.0/12"],
        &[],
        &masq,
    );
    p.mesh_destinations
        .get_mut(&"10.0.0.0/8".parse().unwrap())
        .unwrap()
        .next_hop = Some(NextHop::WireGuard);
    let resolver = |_| Some(7);
    tries.apply(&mut maps, &p, &resolver).unwrap();
    let dst = |maps: &FakeMaps, net: &str| maps.tries[&Trie::Destination][&net.parse().unwrap()];
    assert_eq!(maps.tries[&Trie::Destination].len(), 5);
    let outer = dst(&maps, "10.0.0.0/8");
    let covered = dst(&maps, "10.1.0.0/16");
    assert_eq!(covered.flags, outer.flags | ENTRY_COVERED);
    assert_eq!((covered.counter, covered.ifindex), (outer.counter, 7));
    assert_eq!(dst(&maps, "192.168.0.0/16").flags, ENTRY_MASQUERADE);
    assert_eq!(dst(&maps, "192.168.1.0/24").flags, 0);
    assert_eq!(dst(&maps, "172.16.0.0/12").flags, 0);
    assert!(tries.apply(&mut maps, &p, &resolver).unwrap().is_empty());
    let c = tries.counters(&maps).unwrap();
    let roles: Vec<(Role, String)> = c
        .entries
        .iter()
        .map(|e| (e.role, e.net.to_string()))
        .collect();
    assert_eq!(c.entries.len(), 4, "{roles:?}");
    assert_eq!(c.slots_used, 4);
    assert_eq!(c.fill[&Role::Mesh], 3);
    assert_eq!(c.fill[&Role::MasqueradeDestination], 2);
    assert!(
        c.entry(Role::MasqueradeDestination, &"10.1.0.0/16".parse().unwrap())
            .is_none()
    );
    let distinct = |maps: &FakeMaps| {
        let own: Vec<u32> = maps.tries[&Trie::Destination]
            .values()
            .filter(|v| v.flags & ENTRY_COVERED == 0)
            .map(|v| v.counter)
            .collect();
        own.iter().collect::<BTreeSet<_>>().len() == own.len()
    };
    // The mesh destination goes: the masquerade destination masquerades, on a slot of its
    // own (zeroed), taken before the mesh destination's is freed.
    maps.counters.fill(Counter {
        packets: 1,
        bytes: 1,
    });
    let mut without = p.clone();
    without
        .mesh_destinations
        .remove(&"10.0.0.0/8".parse().unwrap());
    let w = tries.apply(&mut maps, &without, &resolver).unwrap();
    assert_eq!(
        (w.get(Write::MapUpdate), w.get(Write::MapDelete)),
        (1, 1),
        "{w}"
    );
    let now = dst(&maps, "10.1.0.0/16");
    assert_eq!(now.flags, ENTRY_MASQUERADE);
    assert_ne!(now.counter, outer.counter);
    assert_eq!(maps.counters[now.counter as usize], Counter::default());
    assert!(distinct(&maps));
    // And comes back: covered again, its own slot freed for the next entry.
    tries.apply(&mut maps, &p, &resolver).unwrap();
    let again = dst(&maps, "10.1.0.0/16");
    assert_eq!(again.counter, dst(&maps, "10.0.0.0/8").counter);
    assert!(again.flags & ENTRY_COVERED != 0 && distinct(&maps));
    let mut more = p.clone();
    more.nat_sources.insert(
        "10.244.0.0/24".parse().unwrap(),
        entry(EntryKind::LocalPods, "n"),
    );
    tries.apply(&mut maps, &more, &resolver).unwrap();
    assert_eq!(slot(&maps, Trie::NatSource, "10.244.0.0/24"), now.counter);
}

/// The metrics take the entries from the record (a scrape reads no entry back) and their
/// traffic from the counters; without a record they read the maps.
#[test]
fn counters_come_from_the_record_and_the_counter_slots() {
    let mut maps = FakeMaps::new(100, 4);
    let p = plan(&["10.1.0.0/16", "10.2.0.0/16"], &["10.244.0.0/24"], &[]);
    let mut tries = Tries::default();
    let before = tries.counters(&maps).unwrap();
    assert!(before.entries.is_empty() && before.capacity == 100 && before.slots == 4);
    tries.apply(&mut maps, &p, &NoResolver).unwrap();
    let s = slot(&maps, Trie::Destination, "10.2.0.0/16") as usize;
    maps.counters[s] = Counter {
        packets: 3,
        bytes: 300,
    };
    // Gone from the maps behind the agent's back: still in the record.
    maps.tries.get_mut(&Trie::NatSource).unwrap().clear();
    let c = tries.counters(&maps).unwrap();
    assert_eq!(c.entries.len(), 3, "{c:?}");
    assert_eq!((c.slots_used, c.slots, c.capacity), (3, 4, 100));
    let net = "10.2.0.0/16".parse().unwrap();
    assert_eq!(c.entry(Role::Mesh, &net).unwrap().packets, 3);
    assert_eq!(read_counters(&maps).unwrap().entries.len(), 2);
}

/// An idle apply compares the plan with the record; a change behind the agent's back is
/// repaired at the next read-back.
#[test]
fn idle_syncs_trust_the_record_until_the_next_read_back() {
    let mut maps = FakeMaps::new(100, 100);
    let p = plan(&["10.1.0.0/16"], &["10.244.0.0/24"], &[]);
    let mut tries = Tries::default();
    assert_eq!(tries.apply(&mut maps, &p, &NoResolver).unwrap().total(), 2);
    maps.tries.get_mut(&Trie::Destination).unwrap().clear();
    let mut repaired_at = None;
    for i in 1..=READ_BACK_EVERY {
        let w = tries.apply(&mut maps, &p, &NoResolver).unwrap();
        if !w.is_empty() {
            assert_eq!(w.get(Write::MapInsert), 1, "{w}");
            repaired_at = Some(i);
            break;
        }
    }
    assert_eq!(repaired_at, Some(READ_BACK_EVERY));
    assert!(maps.tries[&Trie::Destination].contains_key(&"10.1.0.0/16".parse().unwrap()));
}

#[test]
fn a_failed_write_reads_back_at_the_next_apply() {
    let mut maps = FakeMaps::new(1, 100);
    let mut tries = Tries::default();
    let p = plan(&["10.1.0.0/16", "10.2.0.0/16"], &[], &[]);
    assert!(tries.apply(&mut maps, &p, &NoResolver).is_err());
    maps.capacity = 2;
    maps.tries.get_mut(&Trie::Destination).unwrap().clear();
    let w = tries.apply(&mut maps, &p, &NoResolver).unwrap();
    assert_eq!(w.get(Write::MapInsert), 2, "{w}");
}

#[test]
fn changed_value_is_an_update_and_reused_slots_are_zeroed() {
    let mut maps = FakeMaps::new(100, 2);
    let p1 = plan(&["10.0.0.0/24"], &[], &[]);
    sync_maps(&mut maps, &p1, &NoResolver).unwrap();
    let s = slot(&maps, Trie::Destination, "10.0.0.0/24") as usize;
    maps.counters[s] = Counter {
        packets: 3,
        bytes: 300,
    };
    // Same CIDR, next hop now resolvable: an update, counter kept.
    let mut p2 = p1.clone();
    p2.mesh_destinations.values_mut().next().unwrap().next_hop = Some(NextHop::WireGuard);
    let w = sync_maps(&mut maps, &p2, &|_| Some(9)).unwrap();
    assert_eq!((w.get(Write::MapUpdate), w.total()), (1, 1));
    assert_eq!(maps.counters[s].packets, 3);
    // Remove it, then add two new entries: one reuses the slot, which is zeroed first.
    sync_maps(&mut maps, &plan(&[], &[], &[]), &NoResolver).unwrap();
    let w = sync_maps(
        &mut maps,
        &plan(&["10.9.0.0/16", "10.8.0.0/16"], &[], &[]),
        &NoResolver,
    )
    .unwrap();
    assert_eq!(w.get(Write::CounterReset), 1);
    assert!(maps.counters.iter().all(|c| *c == Counter::default()));
}

#[test]
fn full_map_fails_naming_the_entry_and_keeps_the_old_topology() {
    let mut maps = FakeMaps::new(3, 100);
    let old = plan(&["10.0.0.0/24", "10.0.1.0/24"], &[], &[]);
    sync_maps(&mut maps, &old, &NoResolver).unwrap();
    let new = plan(&["10.1.0.0/24", "10.1.1.0/24", "10.1.2.0/24"], &[], &[]);
    let err = sync_maps(&mut maps, &new, &NoResolver).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("10.1.1.0/24") && msg.contains("mesh_destination"),
        "{msg}"
    );
    assert!(msg.contains("full"), "{msg}");
    for net in old.mesh_destinations.keys() {
        assert!(
            maps.tries[&Trie::Destination].contains_key(net),
            "{net} lost"
        );
    }
}

#[test]
fn exhausted_slots_still_insert_entries_without_counters() {
    let mut maps = FakeMaps::new(100, 1);
    let p = plan(&["10.0.0.0/24", "10.0.1.0/24"], &[], &[]);
    sync_maps(&mut maps, &p, &NoResolver).unwrap();
    let slots: Vec<u32> = maps.tries[&Trie::Destination]
        .values()
        .map(|v| v.counter)
        .collect();
    assert!(
        slots.contains(&NO_COUNTER) && slots.contains(&0),
        "{slots:?}"
    );
    assert!(sync_maps(&mut maps, &p, &NoResolver).unwrap().is_empty());
    let c = read_counters(&maps).unwrap();
    assert_eq!(c.entries.len(), 2);
    let owners: Vec<&str> = c.labelled(&p).map(|(_, o)| o).collect();
    assert_eq!(owners, ["10.0.0.0/24", "10.0.1.0/24"]);
}

#[test]
fn host_bits_in_the_plan_are_cleared() {
    let mut maps = FakeMaps::new(100, 10);
    let p = plan(&["10.0.0.7/24"], &[], &[]);
    sync_maps(&mut maps, &p, &NoResolver).unwrap();
    assert!(maps.tries[&Trie::Destination].contains_key(&"10.0.0.0/24".parse().unwrap()));
    assert!(sync_maps(&mut maps, &p, &NoResolver).unwrap().is_empty());
}
