//! Conversions between plan entries and map keys/values (pure).
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use kilo_common::{
    Config, ENTRY_NEIGH, ENTRY_REDIRECT, ENTRY_SERVICE, EntryKey, EntryValue, FAMILY_V4, FAMILY_V6,
    NAT4_INDEXED, NAT4_LIST, NAT6_INDEXED, NAT6_LIST, Nat4, Nat6,
};

use super::sync::Resolver;
use crate::plan::{DatapathEntry, Device, EntryKind, NextHop};

/// The map key of a CIDR (host bits cleared).
pub fn entry_key(net: &IpNet) -> EntryKey {
    let net = net.trunc();
    let mut addr = [0u8; 16];
    let family = match net {
        IpNet::V4(n) => {
            addr[..4].copy_from_slice(&n.addr().octets());
            FAMILY_V4
        }
        IpNet::V6(n) => {
            addr.copy_from_slice(&n.addr().octets());
            FAMILY_V6
        }
    };
    EntryKey {
        family,
        prefix_len: u32::from(net.prefix_len()),
        addr,
    }
}

/// The CIDR of a key read back from a map, if it is one this module writes.
pub fn net_from_key(key: &EntryKey) -> Option<IpNet> {
    let bits = u8::try_from(key.prefix_len).ok()?;
    let net = match key.family {
        FAMILY_V4 => {
            if key.addr[4..].iter().any(|b| *b != 0) {
                return None;
            }
            let a: [u8; 4] = key.addr[..4].try_into().ok()?;
            IpNet::V4(Ipv4Net::new(a.into(), bits).ok()?)
        }
        FAMILY_V6 => IpNet::V6(Ipv6Net::new(key.addr.into(), bits).ok()?),
        _ => return None,
    };
    // Host bits set: not a key we write (and one the program would never find).
    (net.trunc() == net).then_some(net)
}

/// `EntryValue::kind` codes (a metrics label, not read by the program).
pub const fn kind_code(kind: EntryKind) -> u32 {
    match kind {
        EntryKind::Node => 1,
        EntryKind::WireGuardIp => 2,
        EntryKind::Peer => 3,
        EntryKind::Service => 4,
        EntryKind::LocalPods => 5,
        EntryKind::AllowedLocation => 6,
    }
}

pub const fn kind_from_code(code: u32) -> Option<EntryKind> {
    Some(match code {
        1 => EntryKind::Node,
        2 => EntryKind::WireGuardIp,
        3 => EntryKind::Peer,
        4 => EntryKind::Service,
        5 => EntryKind::LocalPods,
        6 => EntryKind::AllowedLocation,
        _ => return None,
    })
}

/// The map value of a plan entry with counter slot `counter`. A next hop whose device the
/// resolver does not know gives an entry without a fast-path egress.
pub fn entry_value(entry: &DatapathEntry, counter: u32, resolver: &dyn Resolver) -> EntryValue {
    let mut value = EntryValue {
        counter,
        flags: 0,
        kind: kind_code(entry.kind),
        ifindex: 0,
        nh_family: 0,
        nh_addr: [0; 16],
    };
    if entry.kind == EntryKind::Service {
        value.flags |= ENTRY_SERVICE;
    }
    match entry.next_hop {
        Some(NextHop::WireGuard) => {
            if let Some(ifindex) = resolver.ifindex(Device::WireGuard) {
                value.flags |= ENTRY_REDIRECT;
                value.ifindex = ifindex;
            }
        }
        Some(NextHop::Gateway { address, device }) => {
            if let Some(ifindex) = resolver.ifindex(device) {
                value.flags |= ENTRY_REDIRECT | ENTRY_NEIGH;
                value.ifindex = ifindex;
                match address {
                    IpAddr::V4(a) => {
                        value.nh_family = FAMILY_V4;
                        value.nh_addr[..4].copy_from_slice(&a.octets());
                    }
                    IpAddr::V6(a) => {
                        value.nh_family = FAMILY_V6;
                        value.nh_addr = a.octets();
                    }
                }
            }
        }
        None => {}
    }
    value
}

/// `config` with its NAT source lists ([`Config::nat4`], [`Config::nat6`]) made from
/// `nat_sources` (each NAT source and its counter slot): per family longest prefix first, or
/// [`NAT4_INDEXED`] / [`NAT6_INDEXED`] when there are more than fit.
pub fn with_nat_sources<'a>(
    config: Config,
    nat_sources: impl IntoIterator<Item = (&'a IpNet, u32)>,
) -> Config {
    let mut list: Vec<(IpNet, u32)> = nat_sources
        .into_iter()
        .map(|(n, c)| (n.trunc(), c))
        .collect();
    list.sort_by_key(|(n, _)| std::cmp::Reverse(n.prefix_len()));
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    for (net, counter) in list {
        match net {
            IpNet::V4(n) => v4.push(Nat4 {
                net: u32::from(n.addr()),
                mask: u32::from(n.netmask()),
                counter,
            }),
            IpNet::V6(n) => v6.push(Nat6 {
                hi: (u128::from(n.addr()) >> 64) as u64,
                lo: u128::from(n.addr()) as u64,
                prefix_len: u32::from(n.prefix_len()),
                counter,
            }),
        }
    }
    let mut out = Config {
        nat4_len: NAT4_INDEXED,
        nat4: [Nat4::default(); NAT4_LIST],
        nat6_len: NAT6_INDEXED,
        nat6: [Nat6::default(); NAT6_LIST],
        ..config
    };
    if v4.len() <= NAT4_LIST {
        out.nat4_len = v4.len() as u32;
        out.nat4[..v4.len()].copy_from_slice(&v4);
    }
    if v6.len() <= NAT6_LIST {
        out.nat6_len = v6.len() as u32;
        out.nat6[..v6.len()].copy_from_slice(&v6);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_carry_the_family() {
        for s in [
            "10.0.0.0/8",
            "0.0.0.0/0",
            "192.168.1.7/32",
            "fd00::/8",
            "::/0",
            "2001:db8::1/128",
        ] {
            let net: IpNet = s.parse().unwrap();
            let key = entry_key(&net);
            assert_eq!(net_from_key(&key), Some(net), "{s}");
        }
        let v4 = entry_key(&"0.0.0.0/0".parse().unwrap());
        let v6 = entry_key(&"::/0".parse().unwrap());
        assert_eq!(v4.prefix_len, 0);
        assert_ne!(v4, v6);
        // Host bits are cleared.
        let k = entry_key(&"10.1.2.3/16".parse().unwrap());
        assert_eq!(net_from_key(&k), Some("10.1.0.0/16".parse().unwrap()));
    }

    #[test]
    fn bad_keys_are_rejected() {
        let key = |family, prefix_len, addr| EntryKey {
            family,
            prefix_len,
            addr,
        };
        assert_eq!(net_from_key(&key(FAMILY_V4, 33, [0; 16])), None);
        assert_eq!(net_from_key(&key(FAMILY_V6, 129, [0; 16])), None);
        assert_eq!(net_from_key(&key(7, 0, [0; 16])), None);
        let mut host_bits = [0u8; 16];
        host_bits[3] = 1;
        assert_eq!(net_from_key(&key(FAMILY_V4, 24, host_bits)), None);
        host_bits[3] = 0;
        host_bits[9] = 1;
        assert_eq!(net_from_key(&key(FAMILY_V4, 0, host_bits)), None);
    }

    #[test]
    fn next_hops_resolve_to_egress() {
        let resolver = |d: Device| match d {
            Device::WireGuard => Some(7),
            Device::Private => Some(3),
            Device::Tunnel => None,
        };
        let mut e = DatapathEntry {
            kind: EntryKind::Node,
            owner: "a".into(),
            next_hop: Some(NextHop::WireGuard),
        };
        let v = entry_value(&e, 5, &resolver);
        assert_eq!((v.counter, v.flags, v.ifindex), (5, ENTRY_REDIRECT, 7));
        e.next_hop = Some(NextHop::Gateway {
            address: "10.0.0.1".parse().unwrap(),
            device: Device::Private,
        });
        let v = entry_value(&e, 5, &resolver);
        assert_eq!(v.flags, ENTRY_REDIRECT | ENTRY_NEIGH);
        assert_eq!(
            (v.ifindex, v.nh_family, &v.nh_addr[..4]),
            (3, FAMILY_V4, &[10, 0, 0, 1][..])
        );
        e.next_hop = Some(NextHop::Gateway {
            address: "10.0.0.1".parse().unwrap(),
            device: Device::Tunnel,
        });
        assert_eq!(entry_value(&e, 5, &resolver).flags, 0);
        e.kind = EntryKind::Service;
        e.next_hop = None;
        assert_eq!(entry_value(&e, 5, &resolver).flags, ENTRY_SERVICE);
    }

    #[test]
    fn nat_lists_are_longest_first_per_family_until_they_overflow() {
        let nets: Vec<IpNet> = [
            "10.244.0.0/16",
            "10.4.0.1/32",
            "fd00:244::/48",
            "10.244.1.0/24",
            "fd00:4::1/128",
            "10.9.0.0/8",
            "fd00:9::/32",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let base = Config {
            mark: 0x1000,
            ..Config::DEFAULT
        };
        let c = with_nat_sources(base, nets[..5].iter().zip([1, 2, 3, 4, 5]));
        assert_eq!(c.mark, 0x1000, "the settings are kept");
        assert_eq!((c.nat4_len, c.nat6_len), (3, 2));
        let got: Vec<(u32, u32, u32)> = c.nat4.iter().map(|n| (n.net, n.mask, n.counter)).collect();
        assert_eq!(
            got,
            [
                (0x0a04_0001, 0xffff_ffff, 2),
                (0x0af4_0100, 0xffff_ff00, 4),
                (0x0af4_0000, 0xffff_0000, 1),
            ]
        );
        assert_eq!(
            c.nat6,
            [
                Nat6 {
                    hi: 0xfd00_0004_0000_0000,
                    lo: 1,
                    prefix_len: 128,
                    counter: 5
                },
                Nat6 {
                    hi: 0xfd00_0244_0000_0000,
                    lo: 0,
                    prefix_len: 48,
                    counter: 3
                },
            ]
        );
        // Host bits are cleared.
        let host: IpNet = "10.9.8.7/8".parse().unwrap();
        assert_eq!(
            with_nat_sources(base, [(&host, 9)]).nat4[0].net,
            0x0a00_0000
        );
        let empty = with_nat_sources(base, []);
        assert_eq!((empty.nat4_len, empty.nat6_len), (0, 0));
        let over = with_nat_sources(base, nets.iter().zip(0..));
        assert_eq!((over.nat4_len, over.nat6_len), (NAT4_INDEXED, NAT6_INDEXED));
        assert_eq!(over.nat4, [Nat4::default(); NAT4_LIST]);
        assert_eq!(over.nat6, [Nat6::default(); NAT6_LIST]);
    }
}
