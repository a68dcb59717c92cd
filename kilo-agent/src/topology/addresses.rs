//! Address helpers: private and public ranges, one-address CIDRs, the WireGuard IP allocator
//! and Kilo's leader choice by endpoint.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use crate::mesh::{Endpoint, Node};

/// The private ranges, the agent's one definition (leader choice and IP detection): RFC 1918
/// and all of RFC 4193's `fc00::/7`, where Kilo's `isPublic` checks only `fd00::/16`. An
/// IPv4-mapped address is IPv4, as in Go.
pub fn is_private(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.is_private(),
        IpAddr::V6(v6) => v6.segments()[0] & 0xfe00 == 0xfc00,
    }
}

/// Kilo's `isPublic`, with [`is_private`]'s ranges; no address is not public.
pub fn is_public(ip: Option<IpAddr>) -> bool {
    ip.is_some_and(|ip| !is_private(ip))
}

/// Kilo's `findLeader` over nodes sorted by name.
pub fn find_leader(nodes: &[&Node]) -> usize {
    let mut leaders = Vec::new();
    let mut public = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let ip = n.endpoint.as_ref().and_then(Endpoint::ip);
        if n.leader {
            if is_public(ip) {
                return i;
            }
            leaders.push(i);
        }
        if ip.is_some() && is_public(ip) {
            public.push(i);
        }
    }
    leaders.first().or(public.first()).copied().unwrap_or(0)
}

/// One-address CIDR (/32 or /128).
pub fn host_net(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

/// The `n`th address of a subnet (Kilo's allocator: segment i gets address i + 1), if inside it.
pub fn nth_address(subnet: IpNet, n: u128) -> Option<IpAddr> {
    let ip = match subnet.network() {
        IpAddr::V4(a) => IpAddr::V4(Ipv4Addr::from(
            u32::from(a).checked_add(u32::try_from(n).ok()?)?,
        )),
        IpAddr::V6(a) => IpAddr::V6(Ipv6Addr::from(u128::from(a).checked_add(n)?)),
    };
    subnet.contains(&ip).then_some(ip)
}
