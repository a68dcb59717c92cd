//! A Peer custom resource's mesh view, validated like Kilo's `Peer.Validate()`.
use std::net::IpAddr;

use ipnet::IpNet;

use super::{
    Endpoint, Host, Key, ObjectError, ObjectKind, Peer, PeerEndpoint, PeerSpec, parse_cidr,
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
        let persistent_keepalive = match s.persistent_keepalive {
            None => 0,
            Some(k) => u16::try_from(k).unwrap_or_else(|_| {
                err(
                    "spec.persistentKeepalive".into(),
                    format!("{k} is not in 0..=65535 seconds"),
                );
                0
            }),
        };
        // Not part of Kilo's validation: a bad preshared key is dropped, the peer kept.
        let mut warnings = Vec::new();
        let preshared_key = match s.preshared_key.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(v) => v
                .parse::<Key>()
                .map_err(|e| {
                    warnings.push(ObjectError::new(
                        ObjectKind::Peer,
                        name.clone(),
                        "spec.presharedKey",
                        format!("invalid WireGuard key ({e}); ignored"),
                    ))
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

/// A field's value, trimmed, if not empty.
fn given(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

/// `spec.endpoint`: the IP wins over the DNS name when both are given (as the CRD documents).
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
    if let Some(ip) = ip {
        let ip: IpAddr = ip.parse().map_err(|_| {
            (
                "spec.endpoint.dnsOrIP.ip".to_string(),
                format!("invalid IP address {ip:?}"),
            )
        })?;
        if let Some(d) = dns {
            // Still validate the name, so a typo is reported even when the IP wins.
            format!("{d}:{port}").parse::<Endpoint>().map_err(|e| {
                (
                    "spec.endpoint.dnsOrIP.dns".to_string(),
                    format!("invalid DNS name {d:?}: {e}"),
                )
            })?;
        }
        return Ok(Endpoint {
            host: Host::Ip(ip),
            port,
        });
    }
    if let Some(d) = dns {
        return match format!("{d}:{port}").parse::<Endpoint>() {
            Ok(
                ep @ Endpoint {
                    host: Host::Dns(_), ..
                },
            ) => Ok(ep),
            _ => Err((
                "spec.endpoint.dnsOrIP.dns".to_string(),
                format!("invalid DNS name {d:?}"),
            )),
        };
    }
    Err((
        "spec.endpoint.dnsOrIP".to_string(),
        "either an IP address or a DNS name is required".to_string(),
    ))
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
