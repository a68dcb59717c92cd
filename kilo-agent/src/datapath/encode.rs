//! Conversions between plan entries and map keys/values (pure).
use std::net::IpAddr;

use aya::maps::lpm_trie::Key;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use kilo_common::{
    ENTRY_IPIP, ENTRY_NEIGH, ENTRY_REDIRECT, ENTRY_SERVICE, EntryValue, FAMILY_BITS, FAMILY_V4,
    FAMILY_V6, LpmData,
};

use crate::plan::{DatapathEntry, Device, EntryKind, NextHop};

/// Maps a plan's devices to interface indices (for the fast path's egress).
pub trait Resolver {
    fn ifindex(&self, device: Device) -> Option<u32>;
}

impl<F: Fn(Device) -> Option<u32>> Resolver for F {
    fn ifindex(&self, device: Device) -> Option<u32> {
        self(device)
    }
}

/// Resolves nothing: no entry gets a fast-path egress.
pub struct NoResolver;

impl Resolver for NoResolver {
    fn ifindex(&self, _: Device) -> Option<u32> {
        None
    }
}

/// The trie key of a CIDR (host bits cleared).
pub fn entry_key(net: &IpNet) -> Key<LpmData> {
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
    Key::new(
        FAMILY_BITS + u32::from(net.prefix_len()),
        LpmData { family, addr },
    )
}

/// The CIDR of a key read back from a map, if it is one this module writes.
pub fn net_from_key(key: &Key<LpmData>) -> Option<IpNet> {
    let bits = u8::try_from(key.prefix_len().checked_sub(FAMILY_BITS)?).ok()?;
    let LpmData { family, addr } = key.data();
    let net = match family {
        FAMILY_V4 => {
            if addr[4..].iter().any(|b| *b != 0) {
                return None;
            }
            let a: [u8; 4] = addr[..4].try_into().ok()?;
            IpNet::V4(Ipv4Net::new(a.into(), bits).ok()?)
        }
        FAMILY_V6 => IpNet::V6(Ipv6Net::new(addr.into(), bits).ok()?),
        _ => return None,
    };
    // Host bits set: not a key we write (and one the program would never find).
    (net.trunc() == net).then_some(net)
}

/// Entry kinds: their `EntryValue::kind` code is the index + 1 (a metrics label, not read by
/// the program), and their metrics label.
const KINDS: [(EntryKind, &str); 6] = [
    (EntryKind::Node, "node"),
    (EntryKind::WireGuardIp, "wireguard_ip"),
    (EntryKind::Peer, "peer"),
    (EntryKind::Service, "service"),
    (EntryKind::LocalPods, "local_pods"),
    (EntryKind::AllowedLocation, "allowed_location"),
];

pub fn kind_code(kind: EntryKind) -> u32 {
    KINDS
        .iter()
        .position(|(k, _)| *k == kind)
        .map_or(0, |i| i as u32 + 1)
}

pub fn kind_from_code(code: u32) -> Option<EntryKind> {
    Some(KINDS.get(code.checked_sub(1)? as usize)?.0)
}

/// The metrics label of an entry kind ("unknown" for an entry of no known kind).
pub fn kind_label(kind: Option<EntryKind>) -> &'static str {
    KINDS
        .iter()
        .find(|(k, _)| Some(*k) == kind)
        .map_or("unknown", |(_, label)| label)
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
        Some(NextHop::Ipip { local, remote }) => {
            value.flags |= ENTRY_IPIP;
            value.nh_family = FAMILY_V4;
            value.nh_addr[..4].copy_from_slice(&remote.octets());
            value.nh_addr[4..8].copy_from_slice(&local.octets());
        }
        None => {}
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::NoResolver;

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
        assert_eq!(v4.prefix_len(), FAMILY_BITS);
        assert_ne!(v4.data(), v6.data());
        // Host bits are cleared.
        let k = entry_key(&"10.1.2.3/16".parse().unwrap());
        assert_eq!(net_from_key(&k), Some("10.1.0.0/16".parse().unwrap()));
    }

    #[test]
    fn bad_keys_are_rejected() {
        let key = |family, len, addr| Key::new(FAMILY_BITS + len, LpmData { family, addr });
        assert_eq!(net_from_key(&key(FAMILY_V4, 33, [0; 16])), None);
        assert_eq!(net_from_key(&key(FAMILY_V6, 129, [0; 16])), None);
        assert_eq!(net_from_key(&key(7, 0, [0; 16])), None);
        assert_eq!(
            net_from_key(&Key::new(
                8,
                LpmData {
                    family: FAMILY_V4,
                    addr: [0; 16]
                }
            )),
            None
        );
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
        // IPIP needs no device: the outer destination, then the outer source.
        e.kind = EntryKind::Node;
        e.next_hop = Some(NextHop::Ipip {
            local: "192.168.0.1".parse().unwrap(),
            remote: "192.168.0.2".parse().unwrap(),
        });
        let v = entry_value(&e, 5, &NoResolver);
        assert_eq!((v.flags, v.nh_family), (ENTRY_IPIP, FAMILY_V4));
        assert_eq!(&v.nh_addr[..8], &[192, 168, 0, 2, 192, 168, 0, 1]);
    }
}
