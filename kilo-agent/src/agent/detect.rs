//! Local IP auto-detection, as Kilo's `pkg/mesh/discoverips.go` does it, over netlink (no `ip`
//! process).
//!
//! Candidates in order: the addresses the host name resolves to (when assigned locally), the
//! addresses of the default-route interfaces, then every interface's. Loopback and link-local
//! addresses are skipped, as are the WireGuard interface, `tunl0` and `kube-bridge`. Within each
//! group IPv4 comes first, then by string. The private IP is the first private (RFC 1918,
//! `fc00::/7`: [`is_private`], the agent's one definition) candidate inside `--internal-cidr`
//! (when given); the public IP the first public candidate, falling back to the private one.
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::{
    AddressFamily,
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkMessage},
    route::{RouteAttribute, RouteMessage},
};

use crate::topology::is_private;

/// An address on an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfAddr {
    pub interface: String,
    pub address: IpNet,
}

/// What the host looks like, as far as detection cares.
#[derive(Debug, Clone, Default)]
pub struct HostView {
    pub addresses: Vec<IfAddr>,
    /// Interfaces carrying a default route in the main table.
    pub default_interfaces: Vec<String>,
    /// MTUs by interface.
    pub mtus: BTreeMap<String, u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Detected {
    pub private: Option<IfAddr>,
    pub public: Option<IfAddr>,
}

fn usable(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local() && !v4.is_unspecified(),
        IpAddr::V6(v6) => {
            !v6.is_loopback() && (v6.segments()[0] & 0xffc0) != 0xfe80 && !v6.is_unspecified()
        }
    }
}

fn sorted(mut v: Vec<&IfAddr>) -> Vec<&IfAddr> {
    v.sort_by_key(|a| (a.address.addr().is_ipv6(), a.address.addr().to_string()));
    v
}

/// Chooses the private and public IPs. Pure.
pub fn choose(
    host: &HostView,
    hostname_ips: &[IpAddr],
    ignored_interfaces: &[&str],
    internal_cidrs: &[IpNet],
) -> Detected {
    let candidates: Vec<&IfAddr> = host
        .addresses
        .iter()
        .filter(|a| usable(a.address.addr()))
        .filter(|a| !ignored_interfaces.contains(&a.interface.as_str()))
        .collect();
    let groups = [
        sorted(
            candidates
                .iter()
                .copied()
                .filter(|a| hostname_ips.contains(&a.address.addr()))
                .collect(),
        ),
        sorted(
            candidates
                .iter()
                .copied()
                .filter(|a| host.default_interfaces.contains(&a.interface))
                .collect(),
        ),
        sorted(candidates.clone()),
    ];
    let ordered: Vec<&IfAddr> = groups.into_iter().flatten().collect();
    let private = ordered
        .iter()
        .find(|a| {
            is_private(a.address.addr())
                && (internal_cidrs.is_empty()
                    || internal_cidrs.iter().any(|c| c.contains(&a.address.addr())))
        })
        .map(|a| (*a).clone());
    let public = ordered
        .iter()
        .find(|a| !is_private(a.address.addr()))
        .map(|a| (*a).clone())
        .or_else(|| private.clone());
    Detected { private, public }
}

/// The interface whose IPv4 address Kilo's cilium encapsulator publishes as the node's
/// `cni-compatibility-ip`.
pub const CILIUM_HOST: &str = "cilium_host";

/// Reads `cilium_host`'s address over one netlink connection, at every pass (Kilo's
/// `CNICompatibilityIP`, read whenever it handles its own node): Cilium may readdress it.
#[derive(Clone)]
pub struct CiliumHost {
    handle: rtnetlink::Handle,
}

impl CiliumHost {
    /// Opens the netlink connection (its task runs on the current runtime).
    pub fn connect() -> Result<Self, DetectError> {
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|x| DetectError(x.to_string()))?;
        tokio::spawn(conn);
        Ok(CiliumHost { handle })
    }

    /// The first IPv4 address of `cilium_host`; `None` when there is no such interface or no
    /// IPv4 address on it (Cilium not running).
    pub async fn address(&self) -> Result<Option<IpNet>, DetectError> {
        let e = |e: rtnetlink::Error| DetectError(e.to_string());
        let mut links = self.handle.link().get().match_name(CILIUM_HOST).execute();
        let index = match links.try_next().await {
            Ok(Some(l)) => l.header.index,
            Ok(None) => return Ok(None),
            Err(rtnetlink::Error::NetlinkError(m)) if m.raw_code() == -libc::ENODEV => {
                return Ok(None);
            }
            Err(x) => return Err(e(x)),
        };
        let addrs: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(e)?;
        Ok(addrs
            .iter()
            .filter_map(address_of)
            .find(|a| a.addr().is_ipv4()))
    }
}

/// An address message's address (its local address, else its address) with its prefix.
fn address_of(a: &AddressMessage) -> Option<IpNet> {
    let ip = a
        .attributes
        .iter()
        .find_map(|x| match x {
            AddressAttribute::Local(ip) => Some(*ip),
            _ => None,
        })
        .or_else(|| {
            a.attributes.iter().find_map(|x| match x {
                AddressAttribute::Address(ip) => Some(*ip),
                _ => None,
            })
        })?;
    IpNet::new(ip, a.header.prefix_len).ok()
}

/// `--mtu=auto`: the first default-route interface's MTU minus WireGuard's overhead.
pub fn auto_mtu(host: &HostView) -> u32 {
    host.default_interfaces
        .first()
        .and_then(|i| host.mtus.get(i))
        .map(|m| m.saturating_sub(super::config::WIREGUARD_OVERHEAD))
        .unwrap_or(super::config::DEFAULT_MTU)
}

/// The addresses the host name resolves to (getaddrinfo; no process).
pub fn resolve_hostname(name: &str) -> Vec<IpAddr> {
    use std::net::ToSocketAddrs;
    (name, 0)
        .to_socket_addrs()
        .map(|it| it.map(|a: SocketAddr| a.ip()).collect())
        .unwrap_or_default()
}

#[derive(Debug, thiserror::Error)]
#[error("detecting local addresses: {0}")]
pub struct DetectError(String);

/// Reads links, addresses and default routes over netlink (in the calling thread's namespace).
pub async fn observe() -> Result<HostView, DetectError> {
    let e = |e: rtnetlink::Error| DetectError(e.to_string());
    let (conn, handle, _) = rtnetlink::new_connection().map_err(|x| DetectError(x.to_string()))?;
    let conn = tokio::spawn(conn);
    let links: Vec<LinkMessage> = handle
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(e)?;
    let mut names = BTreeMap::new();
    let mut mtus = BTreeMap::new();
    for l in &links {
        let mut name = None;
        let mut mtu = None;
        for a in &l.attributes {
            match a {
                LinkAttribute::IfName(n) => name = Some(n.clone()),
                LinkAttribute::Mtu(m) => mtu = Some(*m),
                _ => {}
            }
        }
        if let Some(n) = name {
            if let Some(m) = mtu {
                mtus.insert(n.clone(), m);
            }
            names.insert(l.header.index, n);
        }
    }
    let mut addresses = Vec::new();
    let addrs: Vec<_> = handle
        .address()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(e)?;
    for a in addrs {
        let Some(interface) = names.get(&a.header.index) else {
            continue;
        };
        if let Some(address) = address_of(&a) {
            addresses.push(IfAddr {
                interface: interface.clone(),
                address,
            });
        }
    }
    let mut default_interfaces = Vec::new();
    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut msg = RouteMessage::default();
        msg.header.address_family = family;
        let routes: Vec<RouteMessage> = handle
            .route()
            .get(msg)
            .execute()
            .try_collect()
            .await
            .map_err(e)?;
        for r in routes {
            let main = r
                .attributes
                .iter()
                .find_map(|a| match a {
                    RouteAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(r.header.table))
                == crate::plan::MAIN_TABLE;
            if !main || r.header.destination_prefix_length != 0 {
                continue;
            }
            for a in &r.attributes {
                if let RouteAttribute::Oif(i) = a
                    && let Some(n) = names.get(i)
                    && !default_interfaces.contains(n)
                {
                    default_interfaces.push(n.clone());
                }
            }
        }
    }
    conn.abort();
    Ok(HostView {
        addresses,
        default_interfaces,
        mtus,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(i: &str, s: &str) -> IfAddr {
        IfAddr {
            interface: i.into(),
            address: s.parse().unwrap(),
        }
    }

    fn host() -> HostView {
        HostView {
            addresses: vec![
                a("lo", "127.0.0.1/8"),
                a("eth1", "192.168.1.5/24"),
                a("eth0", "10.0.0.7/24"),
                a("eth0", "fe80::1/64"),
                a("eth0", "203.0.113.9/24"),
                a("kilo0", "10.4.0.1/16"),
            ],
            default_interfaces: vec!["eth0".into()],
            mtus: BTreeMap::from([("eth0".into(), 1500)]),
        }
    }

    #[test]
    fn default_route_interface_first_then_all() {
        let d = choose(&host(), &[], &["kilo0", "tunl0", "kube-bridge"], &[]);
        assert_eq!(d.private, Some(a("eth0", "10.0.0.7/24")));
        assert_eq!(d.public, Some(a("eth0", "203.0.113.9/24")));
        assert_eq!(auto_mtu(&host()), 1420);
    }

    /// The leader choice's private ranges: all of `fc00::/7` is private, `fe00::/8` is not.
    #[test]
    fn ipv6_private_is_the_whole_ula_range() {
        let h = HostView {
            addresses: vec![a("eth0", "fc00::7/64"), a("eth0", "fe00::9/64")],
            ..HostView::default()
        };
        let d = choose(&h, &[], &[], &[]);
        assert_eq!(d.private, Some(a("eth0", "fc00::7/64")));
        assert_eq!(d.public, Some(a("eth0", "fe00::9/64")));
    }

    #[test]
    fn hostname_addresses_and_internal_cidr_win() {
        let ip: IpAddr = "192.168.1.5".parse().unwrap();
        let d = choose(&host(), &[ip], &["kilo0"], &[]);
        assert_eq!(d.private, Some(a("eth1", "192.168.1.5/24")));
        let d = choose(
            &host(),
            &[],
            &["kilo0"],
            &["192.168.0.0/16".parse().unwrap()],
        );
        assert_eq!(d.private, Some(a("eth1", "192.168.1.5/24")));
    }

    #[test]
    fn public_falls_back_to_private_and_ignored_interfaces_are_skipped() {
        let mut h = host();
        h.addresses
            .retain(|x| x.address.addr().to_string() != "203.0.113.9");
        let d = choose(&h, &[], &["kilo0"], &[]);
        assert_eq!(d.public, d.private);
        let d = choose(&h, &[], &["kilo0", "eth0", "eth1"], &[]);
        assert_eq!(d, Detected::default());
    }
}
