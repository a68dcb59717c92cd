//! Peers against Kilo's own code: every line of Kilo's `Peer.Validate` and `translatePeer` table
//! (`tests/data/kilo/peers.txt`) is accepted, refused or translated alike.
use std::collections::BTreeMap;

use kilo_agent::mesh;
use kilo_testkit::golden::*;

/// One value of the peer table's `spec=`: a quoted string, a list of them, `nil`, `{k=v ...}`
/// or a bare word; and the rest of the text.
#[derive(Debug)]
enum GoValue {
    Str(String),
    List(Vec<String>),
    Nil,
    Map(BTreeMap<String, GoValue>),
    Bare(String),
}

fn go_value(s: &str) -> (GoValue, &str) {
    if s.starts_with('"') {
        let (v, rest) = go_unquote(s);
        return (GoValue::Str(v), rest);
    }
    if let Some(mut rest) = s.strip_prefix('[') {
        let mut items = Vec::new();
        loop {
            rest = rest.trim_start();
            if let Some(r) = rest.strip_prefix(']') {
                return (GoValue::List(items), r);
            }
            let (v, r) = go_unquote(rest);
            items.push(v);
            rest = r;
        }
    }
    if let Some(inner) = s.strip_prefix('{') {
        let (map, rest) = go_fields(inner, '}');
        return (GoValue::Map(map), rest);
    }
    let end = s.find([' ', '}']).unwrap_or(s.len());
    match &s[..end] {
        "nil" => (GoValue::Nil, &s[end..]),
        w => (GoValue::Bare(w.to_string()), &s[end..]),
    }
}

/// `k=v k=v ...` up to `close` (or the end).
fn go_fields(mut s: &str, close: char) -> (BTreeMap<String, GoValue>, &str) {
    let mut out = BTreeMap::new();
    loop {
        s = s.trim_start();
        if s.is_empty() {
            return (out, s);
        }
        if let Some(rest) = s.strip_prefix(close) {
            return (out, rest);
        }
        let (k, rest) = s.split_once('=').unwrap();
        let (v, rest) = go_value(rest);
        out.insert(k.to_string(), v);
        s = rest;
    }
}

fn go_str(v: Option<&GoValue>) -> Option<String> {
    match v {
        Some(GoValue::Str(s) | GoValue::Bare(s)) => Some(s.clone()),
        _ => None,
    }
}

/// The peer table's spec as a Peer object.
fn table_peer(spec: &str) -> mesh::Peer {
    let (f, _) = go_fields(spec, '\0');
    let endpoint = match f.get("endpoint") {
        Some(GoValue::Map(e)) => Some(mesh::PeerEndpoint {
            dns_or_ip: mesh::DnsOrIp {
                dns: go_str(e.get("dns")),
                ip: go_str(e.get("ip")),
            },
            port: go_str(e.get("port")).unwrap().parse().unwrap(),
        }),
        _ => None,
    };
    let spec = mesh::PeerSpec {
        allowed_ips: match f.get("allowedIPs") {
            Some(GoValue::List(l)) => l.clone(),
            _ => Vec::new(),
        },
        public_key: go_str(f.get("publicKey")).unwrap(),
        endpoint,
        persistent_keepalive: go_str(f.get("persistentKeepalive")).map(|k| k.parse().unwrap()),
        preshared_key: go_str(f.get("presharedKey")),
    };
    mesh::Peer::new("p", spec)
}

/// Kilo's `Peer.Validate` then `translatePeer` (annotations.txt): a Peer Kilo leaves out (it
/// fails validation or is not ready) kg leaves out, and a Peer Kilo keeps, kg keeps with the
/// same allowed IPs, key, endpoint, keepalive and preshared key. kg reports each left-out or
/// ignored value. One deliberate difference: with both `ip` and `dns`, kg uses the IP, as the
/// CRD documents; Kilo uses the name.
#[test]
fn peers_validate_and_translate_as_kilo_golden() {
    let text = data("annotations.txt");
    let mut checked = 0;
    for line in text.lines().filter(|l| l.starts_with("peer ")) {
        let (case, outcome) = line.split_once(" => ").unwrap();
        let (name, spec) = case.split_once(": spec=").unwrap();
        let (validate, kilo) = outcome.split_once(" | ").unwrap();
        let kept_by_kilo = validate == "validate=ok" && kilo.ends_with(" ready=true");
        let parsed = mesh::MeshPeer::from_crd(&table_peer(spec));
        let ours = parsed.as_ref().ok().filter(|(p, _)| p.ready());
        assert_eq!(ours.is_some(), kept_by_kilo, "{line}: {parsed:?}");
        if let Err(errors) = &parsed {
            assert!(!errors.is_empty() && errors.iter().all(|e| e.field.starts_with("spec.")));
        }
        let Some((p, _)) = ours else {
            checked += 1;
            continue;
        };
        let ips: Vec<String> = p
            .allowed_ips
            .iter()
            .map(|i| go_quote(&i.to_string()))
            .collect();
        let endpoint = p.endpoint.as_ref().map_or("<nil>".into(), |e| {
            format!("{}(ready=true)", go_quote(&e.to_string()))
        });
        let psk = p
            .preshared_key
            .map_or("<nil>".into(), |k| go_quote(&k.to_string()));
        let ours = format!(
            "AllowedIPs=[{}] PublicKey={} Endpoint={endpoint} PersistentKeepalive={} \
             PresharedKey={psk} ready=true",
            ips.join(" "),
            go_quote(&p.public_key.to_string()),
            go_duration(p.persistent_keepalive.into()),
        );
        if name == "peer endpoint dns and ip" {
            assert_eq!(
                ours,
                kilo.replace("peer.example:51820", "1.2.3.4:51820"),
                "{line}"
            );
            assert_ne!(ours, kilo);
        } else {
            assert_eq!(ours, kilo, "{line}");
        }
        checked += 1;
    }
    assert!(checked > 20, "{checked} lines");
}
