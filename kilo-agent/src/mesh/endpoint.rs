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

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(addr) = s.parse::<SocketAddr>() {
            return Ok(addr.into());
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| EndpointError::Format(s.into()))?;
        let port: u16 = port.parse().map_err(|_| EndpointError::Port(s.into()))?;
        if port == 0 {
            return Err(EndpointError::Port(s.into()));
        }
        if host.parse::<IpAddr>().is_ok() || host.starts_with('[') {
            // A bare IPv6 address needs brackets; anything else that looks like an IP is malformed.
            return Err(EndpointError::Format(s.into()));
        }
        let dns1123 = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !dns1123 {
            return Err(EndpointError::Host(host.into()));
        }
        Ok(Endpoint {
            host: Host::Dns(host.into()),
            port,
        })
    }
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
        ] {
            assert!(s.parse::<Endpoint>().is_err(), "{s}");
        }
    }
}
