//! A Peer custom resource's mesh view, validated exactly like Kilo's `Peer.Validate()` (nothing
//! trimmed) and translated like its `translatePeer`.
use std::net::IpAddr;

use ipnet::IpNet;

use super::{
    Endpoint, Host, Key, ObjectError, ObjectKind, Peer, PeerEndpoint, PeerSpec,
    endpoint::is_dns1123_subdomain, parse_cidr,
};

/// An external WireGuard peer of the mesh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshPeer {
    pub name: String,
    /// As written (host bits kept, as Kilo does); never empty.
    pub allowed_ips: Vec<IpNet>,
    pub public_key: Key,
    pub endpoint: Option<Endpoint>,
    /// Seconds; non-zero marks the peer as behind NAT (its endpoint may roam).
    pub persistent_keepalive: u16,
    pub preshared_key: Option<Key>,
}

impl MeshPeer {
    /// Kilo's `Peer.Ready`: allowed IPs and a non-zero public key.
    pub fn ready(&self) -> bool {
        !self.allowed_ips.is_empty() && self.public_key != Key([0; 32])
    }

    /// Parses a Peer. A Peer that fails Kilo's `Validate` is `Err` with every bad field;
    /// otherwise the peer and the fields that were ignored (as Kilo ignores them).
    pub fn from_crd(p: &Peer) -> Result<(MeshPeer, Vec<ObjectError>), Vec<ObjectError>> {
        let name = p.metadata.name.clone().unwrap_or_default();
        let mut errs = Vec::new();
        let mut err = |field: String, problem: String| {
            errs.push(ObjectError::new(
                ObjectKind::Peer,
                name.clone(),
                field,
                problem,
            ))
        };
        let s = &p.spec;
        let mut allowed_ips = Vec::new();
        for (i, a) in s.allowed_ips.iter().enumerate() {
            match parse_cidr(a) {
                Ok(n) => allowed_ips.push(n),
                Err(e) => err(format!("spec.allowedIPs[{i}]"), e),
            }
        }
        if s.allowed_ips.is_empty() {
            err(
                "spec.allowedIPs".into(),
                "at least one CIDR is required".into(),
            );
        }
        let public_key = match s.public_key.parse::<Key>() {
            Ok(k) if k != Key([0; 32]) => Some(k),
            Ok(_) => {
                err(
                    "spec.publicKey".into(),
                    "the zero key is not a public key".into(),
                );
                None
            }
            Err(e) => {
                err(
                    "spec.publicKey".into(),
                    format!("invalid WireGuard key: {e}"),
                );
                None
            }
        };
        let endpoint = s.endpoint.as_ref().and_then(|e| match parse_endpoint(e) {
            Ok(e) => Some(e),
            Err((field, problem)) => {
                err(field, problem);
                None
            }
        });
        if s.persistent_keepalive.is_some_and(|k| k < 0) {
            err(
                "spec.persistentKeepalive".into(),
                "must be zero or more seconds".into(),
            );
        }
        // Not part of Kilo's validation: the peer is kept, the value dropped.
        let mut warnings = Vec::new();
        let mut warn = |field: &str, problem: String| {
            warnings.push(ObjectError::new(
                ObjectKind::Peer,
                name.clone(),
                field,
                problem,
            ))
        };
        let persistent_keepalive = match s.persistent_keepalive {
            Some(k) if k > 0 => u16::try_from(k).unwrap_or_else(|_| {
                warn(
                    "spec.persistentKeepalive",
                    format!(
                        "{k} is more than the 65535 seconds WireGuard can carry; counted as none"
                    ),
                );
                0
            }),
            _ => 0,
        };
        let preshared_key = match s.preshared_key.as_deref() {
            None | Some("") => None,
            Some(v) => v
                .parse::<Key>()
                .map_err(|e| {
                    warn(
                        "spec.presharedKey",
                        format!("invalid WireGuard key ({e}); ignored"),
                    )
                })
                .ok(),
        };
        match public_key {
            Some(public_key) if errs.is_empty() => Ok((
                MeshPeer {
                    name,
                    allowed_ips,
                    public_key,
                    endpoint,
                    persistent_keepalive,
                    preshared_key,
                },
                warnings,
            )),
            _ => Err(errs.into_iter().chain(warnings).collect()),
        }
    }

    /// This peer as a Peer object (what `kgctl showconf --as-peer -o yaml` prints).
    pub fn to_crd(&self) -> Peer {
        let endpoint = self.endpoint.as_ref().map(|e| PeerEndpoint {
            dns_or_ip: match &e.host {
                Host::Ip(ip) => super::DnsOrIp {
                    dns: None,
                    ip: Some(ip.to_string()),
                },
                Host::Dns(d) => super::DnsOrIp {
                    dns: Some(d.clone()),
                    ip: None,
                },
            },
            port: e.port.into(),
        });
        let mut p = Peer::new(
            &self.name,
            PeerSpec {
                allowed_ips: self.allowed_ips.iter().map(ToString::to_string).collect(),
                public_key: self.public_key.to_string(),
                endpoint,
                persistent_keepalive: (self.persistent_keepalive > 0)
                    .then_some(self.persistent_keepalive.into()),
                preshared_key: self.preshared_key.map(|k| k.to_string()),
            },
        );
        p.metadata.name = Some(self.name.clone());
        p
    }
}

/// A field's value, if not empty.
fn given(v: &Option<String>) -> Option<&str> {
    v.as_deref().filter(|s| !s.is_empty())
}

/// `spec.endpoint`, validated as Kilo does; the IP wins over the DNS name when both are given
/// (as the CRD documents), and a DNS name alone is read as Kilo's `ParseEndpoint` reads it (an
/// IPv4 address is a valid DNS-1123 name, and stays an address).
fn parse_endpoint(e: &PeerEndpoint) -> Result<Endpoint, (String, String)> {
    let port = u16::try_from(e.port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| {
            (
                "spec.endpoint.port".to_string(),
                format!("{} is not a UDP port", e.port),
            )
        })?;
    let (ip, dns) = (given(&e.dns_or_ip.ip), given(&e.dns_or_ip.dns));
    if let Some(d) = dns.filter(|d| !is_dns1123_subdomain(d)) {
        let why = super::space(d).unwrap_or("not a DNS-1123 subdomain");
        return Err((
            "spec.endpoint.dnsOrIP.dns".to_string(),
            format!("invalid DNS name {d:?} ({why})"),
        ));
    }
    let host = match (ip, dns) {
        (Some(ip), _) => match ip.parse::<IpAddr>() {
            Ok(ip) => Host::Ip(ip.to_canonical()),
            Err(_) => {
                let why = super::space(ip).unwrap_or("not an IP address");
                return Err((
                    "spec.endpoint.dnsOrIP.ip".to_string(),
                    format!("invalid IP address {ip:?} ({why})"),
                ));
            }
        },
        (None, Some(d)) => match d.parse::<IpAddr>() {
            Ok(ip) => Host::Ip(ip),
            Err(_) => Host::Dns(d.to_string()),
        },
        (None, None) => {
            return Err((
                "spec.endpoint.dnsOrIP".to_string(),
                "either an IP address or a DNS name is required".to_string(),
            ));
        }
    };
    Ok(Endpoint { host, port })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::DnsOrIp;

    const KEY: &str = "a2V5NQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

    fn crd(spec: PeerSpec) -> Peer {
        Peer::new("p", spec)
    }

    fn spec() -> PeerSpec {
        PeerSpec {
            allowed_ips: vec!["10.5.0.1/24".into()],
            public_key: KEY.into(),
            ..Default::default()
        }
    }

    fn ep(ip: Option<&str>, dns: Option<&str>, port: u32) -> Option<PeerEndpoint> {
        Some(PeerEndpoint {
            dns_or_ip: DnsOrIp {
                ip: ip.map(Into::into),
                dns: dns.map(Into::into),
            },
            port,
        })
    }

    #[test]
    fn valid_peer_keeps_host_bits() {
        let p = MeshPeer::from_crd(&crd(spec())).unwrap().0;
        assert_eq!(p.allowed_ips[0].to_string(), "10.5.0.1/24");
        assert!(p.ready());
        assert_eq!(p.endpoint, None);
    }

    /// The endpoint a spec with `endpoint` parses to.
    fn endpoint_of(endpoint: Option<PeerEndpoint>) -> String {
        let s = PeerSpec { endpoint, ..spec() };
        let p = MeshPeer::from_crd(&crd(s)).unwrap().0;
        p.endpoint.unwrap().to_string()
    }

    #[test]
    fn endpoints() {
        for (ip, dns, want) in [
            (Some("192.168.0.1"), None, "192.168.0.1:51820"),
            (Some("fd00::1"), None, "[fd00::1]:51820"),
            (None, Some("peer.example.com"), "peer.example.com:51820"),
        ] {
            assert_eq!(endpoint_of(ep(ip, dns, 51820)), want);
        }
    }

    /// Deliberate difference: Kilo's translatePeer lets the DNS name win; the CRD says the IP wins.
    #[test]
    fn ip_wins_over_dns() {
        let both = ep(Some("1.2.3.4"), Some("peer.example.com"), 51820);
        assert_eq!(endpoint_of(both), "1.2.3.4:51820");
    }

    #[test]
    fn every_bad_value_names_object_and_field() {
        type Edit = fn(&mut PeerSpec);
        let cases: [(Edit, &str); 10] = [
            (|s| s.allowed_ips = vec![], "spec.allowedIPs"),
            (
                |s| s.allowed_ips = vec!["10.0.0.0/8".into(), "x".into()],
                "spec.allowedIPs[1]",
            ),
            (|s| s.public_key = "".into(), "spec.publicKey"),
            (
                |s| s.public_key = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".into(),
                "spec.publicKey",
            ),
            (
                |s| s.persistent_keepalive = Some(-1),
                "spec.persistentKeepalive",
            ),
            (
                |s| s.endpoint = ep(Some("1.2.3"), None, 1),
                "spec.endpoint.dnsOrIP.ip",
            ),
            (
                |s| s.endpoint = ep(None, Some("Bad_Name"), 1),
                "spec.endpoint.dnsOrIP.dns",
            ),
            (|s| s.endpoint = ep(None, None, 1), "spec.endpoint.dnsOrIP"),
            (
                |s| s.endpoint = ep(Some("1.2.3.4"), None, 0),
                "spec.endpoint.port",
            ),
            (
                |s| s.endpoint = ep(Some("1.2.3.4"), None, 70000),
                "spec.endpoint.port",
            ),
        ];
        for (edit, field) in cases {
            let mut s = spec();
            edit(&mut s);
            let errs = MeshPeer::from_crd(&crd(s.clone())).unwrap_err();
            assert_eq!(errs.len(), 1, "{s:?}: {errs:?}");
            assert!(
                errs[0]
                    .to_string()
                    .starts_with(&format!("peer \"p\": {field}: ")),
                "{}",
                errs[0]
            );
        }
    }

    /// As Kilo's `Validate`: nothing trimmed, a space spoils the whole Peer.
    #[test]
    fn a_space_makes_the_peer_invalid() {
        type Edit = fn(&mut PeerSpec);
        let cases: [(Edit, &str); 4] = [
            (
                |s| s.allowed_ips = vec![" 10.0.0.0/8".into()],
                r#"spec.allowedIPs[0]: invalid CIDR " 10.0.0.0/8" (leading space)"#,
            ),
            (
                |s| s.public_key = format!("{KEY} "),
                "spec.publicKey: invalid WireGuard key: not valid base64: trailing space",
            ),
            (
                |s| s.endpoint = ep(Some("1.2.3.4 "), None, 1),
                r#"spec.endpoint.dnsOrIP.ip: invalid IP address "1.2.3.4 " (trailing space)"#,
            ),
            (
                |s| s.endpoint = ep(None, Some(" peer.example.com"), 1),
                r#"spec.endpoint.dnsOrIP.dns: invalid DNS name " peer.example.com" (leading space)"#,
            ),
        ];
        for (edit, want) in cases {
            let mut s = spec();
            edit(&mut s);
            let errs = MeshPeer::from_crd(&crd(s)).unwrap_err();
            assert_eq!(errs.len(), 1, "{errs:?}");
            assert_eq!(errs[0].to_string(), format!("peer \"p\": {want}"));
        }
    }

    /// What Kilo accepts, kg accepts: an IPv4 address is a valid DNS-1123 name (and Kilo's
    /// `ParseEndpoint` then reads it as an address), a label may be longer than 63 characters,
    /// and line breaks in a key are skipped.
    #[test]
    fn accepts_what_kilo_accepts() {
        assert_eq!(
            endpoint_of(ep(None, Some("1.2.3.4"), 51820)),
            "1.2.3.4:51820"
        );
        let long = format!("{}.example.com", "a".repeat(64));
        assert_eq!(endpoint_of(ep(None, Some(&long), 1)), format!("{long}:1"));
        assert_eq!(
            endpoint_of(ep(Some("::ffff:1.2.3.4"), None, 1)),
            "1.2.3.4:1"
        );
        let s = PeerSpec {
            public_key: format!("{KEY}\n"),
            ..spec()
        };
        assert_eq!(
            MeshPeer::from_crd(&crd(s)).unwrap().0,
            MeshPeer::from_crd(&crd(spec())).unwrap().0
        );
    }

    /// Kilo keeps a Peer whose keepalive WireGuard cannot carry; so does kg, without it.
    #[test]
    fn keepalive_above_what_wireguard_carries_counts_as_none() {
        let s = PeerSpec {
            persistent_keepalive: Some(70000),
            ..spec()
        };
        let (p, warnings) = MeshPeer::from_crd(&crd(s)).unwrap();
        assert_eq!(p.persistent_keepalive, 0);
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0]
                .to_string()
                .starts_with("peer \"p\": spec.persistentKeepalive: 70000"),
            "{}",
            warnings[0]
        );
    }

    /// Kilo drops a preshared key that does not parse and keeps the peer.
    #[test]
    fn bad_preshared_key_is_ignored() {
        let s = PeerSpec {
            preshared_key: Some("zz".into()),
            ..spec()
        };
        let (p, warnings) = MeshPeer::from_crd(&crd(s)).unwrap();
        assert_eq!(p, MeshPeer::from_crd(&crd(spec())).unwrap().0);
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0]
                .to_string()
                .starts_with("peer \"p\": spec.presharedKey: "),
            "{}",
            warnings[0]
        );
    }

    #[test]
    fn crd_round_trip() {
        let mut s = spec();
        s.endpoint = ep(Some("1.2.3.4"), None, 51820);
        s.persistent_keepalive = Some(10);
        s.preshared_key = Some(KEY.into());
        let p = MeshPeer::from_crd(&crd(s.clone())).unwrap().0;
        let back = p.to_crd();
        assert_eq!(back.spec, s);
        assert_eq!(MeshPeer::from_crd(&back).unwrap(), (p, vec![]));
    }
}
