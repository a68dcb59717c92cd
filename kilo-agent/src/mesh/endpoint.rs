//! WireGuard endpoints as Kilo writes them: `ip:port`, `[ipv6]:port` or `dns-name:port`.
use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Host {
    Ip(IpAddr),
    /// A DNS-1123 name, resolved by the WireGuard reconciler (I/O), never by pure code.
    Dns(String),
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    pub host: Host,
    pub port: u16,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointError {
    #[error("expected host:port, got {0:?}")]
    Format(String),
    #[error("invalid port in {0:?}")]
    Port(String),
    #[error("{0:?} is neither an IP address nor a DNS name")]
    Host(String),
}

impl Endpoint {
    pub fn ip(&self) -> Option<IpAddr> {
        match self.host {
            Host::Ip(ip) => Some(ip),
            Host::Dns(_) => None,
        }
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(a: SocketAddr) -> Self {
        Endpoint {
            host: Host::Ip(a.ip()),
            port: a.port(),
        }
    }
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    /// Exactly Kilo's `wireguard.ParseEndpoint`: Go's `net.SplitHostPort` (an IPv6 address in
    /// brackets), a decimal port in 1..=65535 (leading zeros allowed, no sign), then an IP
    /// address (an IPv4-mapped one is IPv4) or else a DNS-1123 subdomain. Nothing is trimmed.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let format = || EndpointError::Format(s.into());
        let (host, port) = split_host_port(s).ok_or_else(format)?;
        let port = Some(port)
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|p| p.parse::<u32>().ok())
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p > 0)
            .ok_or_else(|| EndpointError::Port(s.into()))?;
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(SocketAddr::new(ip.to_canonical(), port).into());
        }
        if !is_dns1123_subdomain(host) {
            return Err(EndpointError::Host(host.into()));
        }
        Ok(Endpoint {
            host: Host::Dns(host.into()),
            port,
        })
    }
}

/// Go's `net.SplitHostPort`: `host:port` with no other colon, or `[host]:port`.
fn split_host_port(s: &str) -> Option<(&str, &str)> {
    let (host, port) = s.rsplit_once(':')?;
    let host = match host.strip_prefix('[') {
        Some(inner) => inner.strip_suffix(']')?,
        None => host,
    };
    (!host.contains([':', '[', ']']) || (s.starts_with('[') && !host.contains(['[', ']'])))
        .then_some((host, port))
}

/// Kubernetes' `IsDNS1123Subdomain`: at most 253 characters, dot-separated labels of lowercase
/// letters, digits and inner hyphens (no limit per label).
pub(crate) fn is_dns1123_subdomain(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(ip) => write!(f, "{}", SocketAddr::new(*ip, self.port)),
            Host::Dns(name) => write!(f, "{name}:{}", self.port),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kilo_forms() {
        for s in [
            "10.1.0.1:51820",
            "[fd00::1]:51820",
            "node-a.example.com:51820",
        ] {
            assert_eq!(s.parse::<Endpoint>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn rejects_malformed() {
        for s in [
            "10.1.0.1",
            "fd00::1:51820",
            "Host_Name:1",
            ":51820",
            "a:0",
            "a:65536",
            " 10.1.0.1:51820",
            "10.1.0.1:51820 ",
            "10.1.0.1:+51820",
            "[fe80::1%1]:51820",
            "[a]b:1",
            "a]:1",
            "[a:1",
        ] {
            assert!(s.parse::<Endpoint>().is_err(), "{s}");
        }
    }

    /// What Go's `SplitHostPort`, `ParseIP` and `IsDNS1123Subdomain` accept beyond the usual forms.
    #[test]
    fn accepts_what_kilo_accepts() {
        for (s, want) in [
            ("[10.1.0.1]:51820", "10.1.0.1:51820"),
            ("[::ffff:10.1.0.1]:051820", "10.1.0.1:51820"),
            ("1.2.3:51820", "1.2.3:51820"),
            ("[node-a]:1", "node-a:1"),
            (
                &format!("{}.b:1", "a".repeat(64)),
                &format!("{}.b:1", "a".repeat(64)),
            ),
        ] {
            assert_eq!(s.parse::<Endpoint>().unwrap().to_string(), want, "{s}");
        }
    }
}
