//! Golden tests: our topology, WireGuard configs, routes, datapath maps and DOT against Kilo's
//! own output on its fixture (tests/data/kilo/, copied from Kilo's pkg/mesh run). Byte for byte
//! where Kilo is right; each deliberate difference has its own test below. Annotations and Peer
//! validation against Kilo's own code: `golden_annotations.rs`, `golden_validation.rs`.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use ipnet::IpNet;
use kilo_agent::{
    graph,
    kgctl::{self, Interface},
    mesh::{self, Granularity, Key, objects},
    plan::{self, Device, Encapsulation, EntryKind, NextHop, Settings},
    topology::Topology,
};
use kilo_testkit::golden::*;

#[test]
fn topology_matches_golden() {
    for (g, h, text, t) in each_case() {
        assert_eq!(t.dump(), section(&text, "## topology"), "{g} from {h}");
    }
}

#[test]
fn conf_matches_golden() {
    let key: Key = PRIV.parse().unwrap();
    for (g, h, text, t) in each_case() {
        let ours = kgctl::render_wireguard(
            Some(Interface {
                private_key: Some(&key),
                listen_port: 51820,
            }),
            &t.conf(),
        );
        assert_eq!(
            ours,
            section(&text, "## wireguard: Topology.Conf()"),
            "{g} from {h}"
        );
    }
}

#[test]
fn as_peer_matches_golden() {
    for (g, h, text, t) in each_case() {
        let p = t.as_peer().unwrap();
        let ips: Vec<String> = p.allowed_ips.iter().map(ToString::to_string).collect();
        let ours = format!(
            "## Topology.AsPeer(): key={} endpoint={} allowedIPs=[{}]",
            p.public_key,
            p.endpoint.map(|e| e.to_string()).unwrap_or_default(),
            ips.join(" ")
        );
        assert_eq!(
            ours,
            header_line(&text, "## Topology.AsPeer()"),
            "{g} from {h}"
        );
    }
}

#[test]
fn peer_conf_matches_golden() {
    for (g, h, text, t) in each_case() {
        for peer in ["a", "b"] {
            let ours = kgctl::render_wireguard(None, &t.peer_conf(peer));
            let header = format!("## wireguard: Topology.PeerConf(\"{peer}\")");
            assert_eq!(ours, section(&text, &header), "{g} from {h}, peer {peer}");
        }
    }
}

#[test]
fn dot_matches_golden() {
    for (g, h, text, t) in each_case() {
        assert_eq!(
            graph::render_dot(&t),
            section(&text, "## graph: Topology.Dot()"),
            "{g} from {h}"
        );
    }
}

const ENCAPS: [(Encapsulation, &str); 3] = [
    (Encapsulation::Never, "never"),
    (Encapsulation::CrossSubnet, "crosssubnet"),
    (Encapsulation::Always, "always"),
];

/// Kilo's route lines with our two deliberate changes applied: destinations truncated and one
/// route per (table, destination), the first in Kilo's order. `proto 4` (Kilo's marker) is
/// stripped: the reconciler uses its own protocol.
fn kilo_routes_normalized(section: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut seen = BTreeSet::new();
    let mut routes = BTreeSet::new();
    let mut rules = BTreeSet::new();
    for l in section.lines() {
        if l.starts_with("ip rule") {
            rules.insert(l.to_string());
            continue;
        }
        let Some(rest) = l.strip_prefix("route ") else {
            continue;
        };
        let rest = rest
            .strip_suffix(" proto 4")
            .expect("Kilo's routes are proto 4");
        let (dst, tail) = rest.split_once(' ').unwrap();
        let dst = dst.parse::<IpNet>().unwrap().trunc();
        let table = tail
            .split_once("table ")
            .map_or("254", |(_, t)| t.split(' ').next().unwrap())
            .to_string();
        if seen.insert((table, dst)) {
            routes.insert(format!("route {dst} {tail}"));
        }
    }
    (routes, rules)
}

#[test]
fn routes_and_rules_match_golden_for_every_local_and_encapsulation() {
    let snap = fixture();
    for (g, h, text) in each_golden() {
        for local in [false, true] {
            for (enc, enc_name) in ENCAPS {
                let s = Settings {
                    local,
                    encapsulate: enc,
                    ..settings(g, h)
                };
                let plan = plan_of(&snap, &s);
                let header = format!(
                    "## routes: Topology.Routes(local={local}, encapsulate={enc_name}, IPIP)"
                );
                let (want_routes, want_rules) = kilo_routes_normalized(&section(&text, &header));
                let routes: BTreeSet<String> =
                    plan.routes.iter().map(ToString::to_string).collect();
                let rules: BTreeSet<String> = plan.rules.iter().map(ToString::to_string).collect();
                assert_eq!(routes, want_routes, "{g} from {h} {header}");
                assert_eq!(rules, want_rules, "{g} from {h} {header}");
                assert_eq!(routes.len(), plan.routes.len(), "no duplicate routes");
            }
        }
    }
}

/// Deliberate difference: Kilo routes `10.5.0.1/24`, `10.5.0.2/24` and `10.5.0.3/24` (one
/// network, claimed by peers a and b); the kernel rejects host bits, so the plan routes
/// `10.5.0.0/24` once. And where two nodes share 192.168.0.1 (a and b), Kilo emits two routes
/// for 192.168.0.1/32; the plan keeps the first.
#[test]
fn deliberate_route_differences() {
    let snap = fixture();
    let text = data("full-from-c.txt");
    let sec = section(
        &text,
        "## routes: Topology.Routes(local=true, encapsulate=never, IPIP)",
    );
    let kilo_peer_routes = sec
        .lines()
        .filter(|l| l.starts_with("route 10.5.0."))
        .count();
    let kilo_shared = sec
        .lines()
        .filter(|l| l.starts_with("route 192.168.0.1/32 "))
        .count();
    assert_eq!((kilo_peer_routes, kilo_shared), (3, 2));
    let s = Settings {
        local: true,
        encapsulate: Encapsulation::Never,
        ..settings(Granularity::Full, "c")
    };
    let plan = plan_of(&snap, &s);
    let peer: Vec<_> = plan
        .routes
        .iter()
        .filter(|r| r.dst.to_string().starts_with("10.5.0."))
        .collect();
    assert_eq!(peer.len(), 1);
    assert_eq!(peer[0].dst.to_string(), "10.5.0.0/24");
    let shared: Vec<_> = plan
        .routes
        .iter()
        .filter(|r| r.dst.to_string() == "192.168.0.1/32")
        .collect();
    assert_eq!(shared.len(), 1);
    assert_eq!(
        shared[0].gateway.unwrap().to_string(),
        "10.4.0.1",
        "segment node:a comes first"
    );
}

/// Deliberate difference: the WireGuard plan gives each CIDR to one peer and one entry per key.
/// Kilo's config for `location` from a lists key4 twice (segment node:d and Peer a share it)
/// and 10.5.0.0/24 three times on two peers; the device ends up with whatever was set last.
#[test]
fn wireguard_plan_normalizes_kilo_conf() {
    let snap = fixture();
    let planned = plan::plan_for(&snap, &settings(Granularity::Location, "a"));
    let t = planned.topology.unwrap();
    let kilo = t.conf();
    assert_eq!(kilo.len(), 4);
    let wg = planned.plan.unwrap().wireguard;
    assert_eq!(wg.listen_port, 51820);
    let render = |p: &plan::WireGuardPeer| {
        let ips: Vec<String> = p.allowed_ips.iter().map(ToString::to_string).collect();
        format!("{} {}", p.public_key, ips.join(","))
    };
    let got: Vec<String> = wg.peers.iter().map(render).collect();
    assert_eq!(
        got,
        vec![
            "a2V5MgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= 10.2.2.0/24,192.168.0.1/32,10.2.3.0/24,192.168.0.2/32,10.4.0.2/32,192.168.178.3/32",
            "a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= 10.2.4.0/24,10.4.0.3/32,10.5.0.0/24",
            "a2V5NQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= ",
        ]
    );
    // The merged key4 entry keeps node d's endpoint.
    assert_eq!(
        wg.peers[1].endpoint.as_ref().unwrap().to_string(),
        "10.1.0.4:51820"
    );
    assert_eq!(
        wg.peers[2].endpoint.as_ref().unwrap().to_string(),
        "192.168.0.1:51820"
    );
}

/// Kilo's iptables rules → DatapathPlan. Parses `KILO-NAT -d X -j RETURN` (mesh destinations),
/// `POSTROUTING -s X -j KILO-NAT` (NAT sources) and `POSTROUTING -d X -j KILO-NAT`
/// (masquerade destinations) from the golden file and compares the sets (keys truncated).
fn iptables_sets(section: &str) -> [BTreeSet<IpNet>; 3] {
    let mut out: [BTreeSet<IpNet>; 3] = Default::default();
    for l in section.lines() {
        let words: Vec<&str> = l.split_whitespace().collect();
        let arg = |flag: &str| {
            words
                .iter()
                .position(|w| *w == flag)
                .map(|i| words[i + 1].parse::<IpNet>().unwrap().trunc())
        };
        let (Some(chain), Some(target)) = (
            words.iter().position(|w| *w == "-A").map(|i| words[i + 1]),
            words.last(),
        ) else {
            continue;
        };
        match (chain, *target) {
            ("KILO-NAT", "RETURN") => out[0].extend(arg("-d")),
            ("POSTROUTING", "KILO-NAT") => {
                out[1].extend(arg("-s"));
                out[2].extend(arg("-d"));
            }
            _ => {}
        }
    }
    out
}

#[test]
fn datapath_matches_kilo_iptables_rules() {
    let snap = fixture();
    for (g, h, text) in each_golden() {
        for cni in [true, false] {
            let d = plan_of(
                &snap,
                &Settings {
                    cni,
                    ..settings(g, h)
                },
            )
            .datapath;
            let header =
                format!("## iptables: Topology.Rules(cni={cni}, iptablesForwardRule=false)");
            let [mesh, nat, masq] = iptables_sets(&section(&text, &header));
            let what = format!("{g} from {h} cni={cni}");
            assert_eq!(keys(&d.mesh_destinations), mesh, "{what}");
            assert_eq!(keys(&d.nat_sources), nat, "{what}");
            assert_eq!(keys(&d.masquerade_destinations), masq, "{what}");
            for (k, _) in d
                .mesh_destinations
                .iter()
                .chain(&d.nat_sources)
                .chain(&d.masquerade_destinations)
            {
                assert_eq!(*k, k.trunc(), "LPM keys have no host bits");
            }
        }
    }
}

#[test]
fn datapath_entries_have_kind_owner_and_next_hop() {
    let snap = fixture();
    let svc: IpNet = "10.96.0.0/12".parse().unwrap();
    let n = |s: &str| s.parse::<IpNet>().unwrap();
    // Leader a (location:1): remote segments and peers go straight into WireGuard.
    let d = plan_of(&snap, &settings(Granularity::Location, "a")).datapath;
    let e = &d.mesh_destinations;
    assert_eq!(
        (
            e[&n("10.2.2.0/24")].kind,
            e[&n("10.2.2.0/24")].owner.as_str()
        ),
        (EntryKind::Node, "b")
    );
    assert_eq!(e[&n("10.2.2.0/24")].next_hop, Some(NextHop::WireGuard));
    assert_eq!(e[&n("10.4.0.2/32")].kind, EntryKind::WireGuardIp);
    assert_eq!(e[&n("10.4.0.2/32")].owner, "location:2");
    assert_eq!(
        e[&n("10.2.1.0/24")].next_hop,
        None,
        "local location: never redirected"
    );
    assert_eq!(e[&n("10.5.0.0/24")].kind, EntryKind::Peer);
    assert_eq!(
        e[&n("10.5.0.0/24")].owner,
        "a",
        "first peer claiming the network"
    );
    assert_eq!(e[&n("10.5.0.0/24")].next_hop, Some(NextHop::WireGuard));
    assert_eq!((e[&svc].kind, e[&svc].next_hop), (EntryKind::Service, None));
    assert_eq!(d.nat_sources[&n("10.2.1.0/24")].kind, EntryKind::LocalPods);
    assert_eq!(d.nat_sources[&n("10.5.0.0/24")].kind, EntryKind::Peer);
    assert!(d.masquerade_destinations.is_empty());
    // Non-leader c (location:2, leader b at 192.168.0.1): remote via the leader's private IP,
    // through tunl0 (encapsulated, so never redirected bare out of the private interface).
    let p = plan_of(&snap, &settings(Granularity::Location, "c"));
    let d = p.datapath;
    let gw = Some(NextHop::Gateway {
        address: "192.168.0.1".parse().unwrap(),
        device: Device::Tunnel,
    });
    assert_eq!(d.mesh_destinations[&n("10.2.1.0/24")].next_hop, gw);
    assert_eq!(d.mesh_destinations[&n("10.5.0.0/24")].next_hop, gw);
    assert!(p.ipip.encapsulate.contains_key(&n("10.2.1.0/24")));
    assert_eq!(d.mesh_destinations[&n("10.2.2.0/24")].next_hop, None);
    assert_eq!(d.mesh_destinations[&svc].next_hop, None);
    let m = &d.masquerade_destinations[&n("192.168.178.3/32")];
    assert_eq!(
        (m.kind, m.owner.as_str()),
        (EntryKind::AllowedLocation, "location:2")
    );
}

#[test]
fn plan_interface_addresses_and_leadership() {
    let snap = fixture();
    let leaders: BTreeMap<&str, Vec<String>> = HOSTS
        .iter()
        .map(|h| {
            let p = plan_of(&snap, &settings(Granularity::Location, h));
            assert_eq!(p.wireguard.peers.is_empty(), p.addresses.is_empty());
            (*h, p.addresses.iter().map(ToString::to_string).collect())
        })
        .collect();
    assert_eq!(leaders["a"], vec!["10.4.0.1/16"]);
    assert_eq!(leaders["b"], vec!["10.4.0.2/16"]);
    assert!(leaders["c"].is_empty(), "c is not a leader");
    assert_eq!(leaders["d"], vec!["10.4.0.3/16"]);
}

#[test]
fn plan_is_none_when_local_node_missing_or_not_ready() {
    let snap = fixture();
    let p = plan::plan_for(&snap, &settings(Granularity::Location, "zz"));
    assert!(p.plan.is_none() && p.topology.is_none());
    assert_eq!(p.ready_nodes, 4);
    let p = plan::plan_for(
        &snap,
        &Settings {
            now: Some(NOW + 3600),
            ..settings(Granularity::Location, "a")
        },
    );
    assert!(p.plan.is_none(), "every node is stale an hour later");
    assert_eq!(p.ready_nodes, 0);
}

/// Kilo's IPIP encapsulator rules: `KILO-IPIP -s <ip>/32 -j ACCEPT` for the private IPs of the
/// local logical location (the golden section is Kilo's, for `--encapsulate != never, --local`).
#[test]
fn ipip_sources_match_golden() {
    let snap = fixture();
    for (g, h, text) in each_golden() {
        let sec = section(&text, "## iptables: IPIP encapsulator Rules");
        let want: Vec<IpNet> = sec
            .lines()
            .filter(|l| l.contains("-A KILO-IPIP"))
            .map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                w[w.iter().position(|x| *x == "-s").unwrap() + 1]
                    .parse()
                    .unwrap()
            })
            .collect();
        let s = settings(g, h);
        let t = plan::plan_for(&snap, &s).topology.unwrap();
        // Kilo renders the rules from the logical location even in full mode; they are
        // only installed in location mode (full mode has no location to encapsulate in).
        let ours = plan::ipip_sources(&t, &s);
        if g == Granularity::Location {
            assert_eq!(ours, want, "{g} from {h}");
        } else {
            assert!(ours.is_empty());
        }
        let never = Settings {
            encapsulate: Encapsulation::Never,
            ..s.clone()
        };
        assert!(plan::ipip_sources(&t, &never).is_empty());
    }
}

/// `kgctl connect`'s plan for a new Peer "laptop": Kilo's `PeerConf` as its WireGuard peers and
/// Kilo's `PeerRoutes` (every segment's pod CIDRs, private IPs and allowed location IPs via
/// the segment's WireGuard IP, the WireGuard IPs, the other peers' allowed IPs, and
/// `--allowed-ips` via the first segment) through the WireGuard interface.
#[test]
fn connect_plan_is_kilo_peer_conf_and_peer_routes() {
    let mut snap = fixture();
    let c = kgctl::Connect {
        name: "laptop".into(),
        allowed_ip: "10.5.9.9/32".parse().unwrap(),
        allowed_ips: vec!["10.96.0.0/12".parse().unwrap()],
        persistent_keepalive: 10,
        port: 51820,
    };
    let key: Key = "bGFwdG9wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
        .parse()
        .unwrap();
    snap.peers.insert("laptop".into(), c.peer(key));
    let opts = kgctl::GlobalOptions {
        granularity: kgctl::GranularityArg::Fixed(Granularity::Location),
        now: Some(NOW),
        ..kgctl::GlobalOptions::default()
    };
    let cluster = kgctl::cluster(&snap, &opts).unwrap();
    let p = c.plan(&cluster).unwrap();
    assert_eq!(p.addresses, vec![c.allowed_ip]);
    assert_eq!(p.wireguard.listen_port, 51820);
    let t = cluster.topology("d", 10).unwrap();
    let mut with_extra = cluster.clone();
    with_extra
        .nodes
        .get_mut("a")
        .unwrap()
        .allowed_location_ips
        .push("10.96.0.0/12".parse().unwrap());
    let t_extra = with_extra.topology("d", 10).unwrap();
    assert_eq!(
        p.wireguard.peers,
        plan::normalize_wireguard(t_extra.peer_conf("laptop"))
    );
    assert!(
        p.wireguard
            .peers
            .iter()
            .all(|w| w.persistent_keepalive == 10)
    );
    let routes: Vec<String> = p.routes.iter().map(ToString::to_string).collect();
    let mut want: Vec<String> = [
        ("10.2.1.0/24", Some("10.4.0.1")),
        ("10.2.2.0/24", Some("10.4.0.2")),
        ("10.2.3.0/24", Some("10.4.0.2")),
        ("10.2.4.0/24", Some("10.4.0.3")),
        ("192.168.0.1/32", Some("10.4.0.1")),
        ("192.168.0.2/32", Some("10.4.0.2")),
        ("192.168.178.3/32", Some("10.4.0.2")),
        ("10.4.0.1/32", None),
        ("10.4.0.2/32", None),
        ("10.4.0.3/32", None),
        ("10.5.0.0/24", None),
        ("10.96.0.0/12", Some("10.4.0.1")),
    ]
    .iter()
    .map(|(dst, gw)| {
        plan::Route {
            dst: dst.parse().unwrap(),
            gateway: gw.map(|g| g.parse().unwrap()),
            src: None,
            device: plan::Device::WireGuard,
            onlink: gw.is_some(),
            table: plan::MAIN_TABLE,
        }
        .to_string()
    })
    .collect();
    want.sort();
    let mut got = routes.clone();
    got.sort();
    assert_eq!(got, want, "{}", t.dump());
    assert!(
        !routes.iter().any(|r| r.contains("10.5.9.9")),
        "no route to itself"
    );
    let missing = kgctl::Connect {
        name: "nobody".into(),
        ..c
    };
    assert_eq!(
        missing.plan(&cluster).unwrap_err(),
        kgctl::KgctlError::PeerNotFound("nobody".into())
    );
}

/// The fixture with `cni-compatibility-ip` on b and c (a and d have none), the input of the
/// `compat-*` goldens.
fn compat_fixture() -> mesh::Snapshot {
    let mut snap = fixture();
    for (node, ip) in [("b", "10.0.2.9/32"), ("c", "10.0.3.9/32")] {
        set_annotation(
            &mut snap,
            node,
            mesh::annotations::CNI_COMPATIBILITY_IP,
            Some(ip),
        );
    }
    snap
}

/// Kilo's cilium and flannel encapsulators (`--compatibility`), from every host, `--local` on
/// and off, every `--encapsulate`: the routes and rules of Kilo 0.7.0 (the `compat-*` goldens,
/// normalized as for IPIP; Kilo's `flannel.1` is our `Device::Tunnel`, printed `tunl0`).
#[test]
fn compatibility_routes_and_rules_match_golden() {
    use plan::Compatibility;
    let snap = compat_fixture();
    let mut failed = Vec::new();
    for (compatibility, name) in [
        (Compatibility::Cilium, "cilium"),
        (Compatibility::Flannel, "flannel"),
    ] {
        for g in GRANULARITIES {
            for h in HOSTS {
                let text = data(&format!("compat-{name}-{g}-from-{h}.txt"));
                for local in [false, true] {
                    for (enc, enc_name) in ENCAPS {
                        let s = Settings {
                            local,
                            encapsulate: enc,
                            compatibility,
                            ..settings(g, h)
                        };
                        let plan = plan_of(&snap, &s);
                        let header = format!(
                            "## routes: Topology.Routes(local={local}, encapsulate={enc_name}, {name})"
                        );
                        let sec = section(&text, &header).replace(" dev flannel.1 ", " dev tunl0 ");
                        let (want_routes, want_rules) = kilo_routes_normalized(&sec);
                        let routes: BTreeSet<String> =
                            plan.routes.iter().map(ToString::to_string).collect();
                        let rules: BTreeSet<String> =
                            plan.rules.iter().map(ToString::to_string).collect();
                        if (&routes, &rules) != (&want_routes, &want_rules) {
                            let diff = |a: &BTreeSet<String>, b: &BTreeSet<String>| {
                                a.difference(b).cloned().collect::<Vec<_>>()
                            };
                            failed.push(format!(
                                "{g} from {h} {header}: kg only {:?}, Kilo only {:?}",
                                diff(&routes, &want_routes)
                                    .into_iter()
                                    .chain(diff(&rules, &want_rules))
                                    .collect::<Vec<_>>(),
                                diff(&want_routes, &routes)
                                    .into_iter()
                                    .chain(diff(&want_rules, &rules))
                                    .collect::<Vec<_>>(),
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Deliberate difference: with `--local` and encapsulation, Kilo's cilium encapsulator adds
/// `KILO-IPIP` (accept IPIP from the location's private IPs, drop the rest) as its IPIP
/// encapsulator does. With `--compatibility` the CNI's device (or the kernel's `tunl0`) carries
/// IPIP: kg's datapath neither wraps nor filters it (its IPIP plan is empty), and nothing drops
/// IPIP from elsewhere.
#[test]
fn cilium_ipip_is_not_filtered_by_the_datapath() {
    use plan::{Compatibility, IpipPlan};
    let text = data("compat-cilium-location-from-b.txt");
    let sec = section(&text, "## iptables: cilium encapsulator Rules");
    let accepts: Vec<&str> = sec
        .lines()
        .filter(|l| l.contains("-A KILO-IPIP") && l.ends_with("-j ACCEPT"))
        .collect();
    assert_eq!(accepts.len(), 2, "{sec}");
    assert!(sec.contains("\"Kilo: reject other IPIP traffic\" -j DROP"));
    let snap = compat_fixture();
    let s = settings(Granularity::Location, "b");
    let cilium = plan_of(
        &snap,
        &Settings {
            compatibility: Compatibility::Cilium,
            ..s.clone()
        },
    );
    assert!(cilium.routes.iter().any(|r| r.device == Device::Tunnel));
    assert_eq!(cilium.ipip, IpipPlan::default());
    let own = plan_of(&snap, &s).ipip;
    assert_eq!(
        own.sources
            .keys()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["192.168.0.2/32"],
        "kg's own IPIP accepts only the location's other node"
    );
}

// ---------------------------------------------------------------------------------------------
// Parsing and Peer claims against Kilo's own code: `annotations.txt` (Kilo's `translateNode`,
// `Peer.Validate` and `translatePeer` on a table of values), and Kilo's topology on the fixture
// plus the Peers of `nested-peers.yaml` and `peer-overlaps.yaml`. One block; keep it together.
// ---------------------------------------------------------------------------------------------

/// The fixture plus the objects of `extra` (a YAML stream in tests/data/kilo/).
fn fixture_with(extra: &str) -> mesh::Snapshot {
    let text = format!("{}\n{}", data("fixture.yaml"), data(extra));
    objects::parse_stream(&text.replace("\"NOW\"", &format!("\"{NOW}\"")), extra).unwrap()
}

/// The goldens `{prefix}-{granularity}-from-{host}.txt` Kilo wrote (one per leader).
fn extra_goldens(prefix: &str) -> Vec<(Granularity, &'static str, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/kilo");
    GRANULARITIES
        .into_iter()
        .flat_map(|g| HOSTS.into_iter().map(move |h| (g, h)))
        .filter_map(|(g, h)| {
            let name = format!("{prefix}-{}", golden_name(g, h));
            dir.join(&name).exists().then(|| (g, h, data(&name)))
        })
        .collect()
}

fn leader_conf(t: &Topology) -> String {
    let key: Key = PRIV.parse().unwrap();
    let interface = Interface {
        private_key: Some(&key),
        listen_port: 51820,
    };
    kgctl::render_wireguard(Some(interface), &t.conf())
}

/// Nested Peer prefixes: gateway-office claims 172.20.0.0/16, vpn-backup 172.20.0.0/16 and
/// 172.20.5.0/24. Kilo drops only the exact duplicate, so vpn-backup keeps its /24 (longest
/// prefix wins). Every leader's topology and WireGuard configuration, both Peers'
/// configurations, the routes and the NAT rules are Kilo's.
#[test]
fn nested_peer_prefixes_match_golden() {
    let snap = fixture_with("nested-peers.yaml");
    let goldens = extra_goldens("nested-peers");
    assert_eq!(goldens.len(), 7, "location: leaders a, b, d; full: a to d");
    for (g, h, text) in goldens {
        let what = format!("{g} from {h}");
        let planned = plan::plan_for(&snap, &settings(g, h));
        assert!(planned.errors.is_empty(), "{what}: {:?}", planned.errors);
        let t = planned.topology.unwrap();
        assert_eq!(t.dump(), section(&text, "## topology"), "{what}");
        assert_eq!(
            leader_conf(&t),
            section(&text, "## wireguard: Topology.Conf()"),
            "{what}"
        );
        for peer in ["gateway-office", "vpn-backup"] {
            let header = format!("## wireguard: Topology.PeerConf(\"{peer}\")");
            let ours = kgctl::render_wireguard(None, &t.peer_conf(peer));
            assert_eq!(ours, section(&text, &header), "{what}, {peer}");
        }
        // Every `--local` and `--encapsulate`: Kilo's routes, and ours.
        let (kilo, ours): (BTreeMap<_, _>, BTreeMap<_, _>) = [false, true]
            .into_iter()
            .flat_map(|local| ENCAPS.map(|enc| (local, enc)))
            .map(|(local, (encapsulate, name))| {
                let header =
                    format!("## routes: Topology.Routes(local={local}, encapsulate={name}, IPIP)");
                let s = Settings {
                    local,
                    encapsulate,
                    ..settings(g, h)
                };
                let ours: BTreeSet<String> = plan_of(&snap, &s)
                    .routes
                    .iter()
                    .map(ToString::to_string)
                    .collect();
                let kilo = kilo_routes_normalized(&section(&text, &header)).0;
                ((header.clone(), kilo), (header, ours))
            })
            .unzip();
        assert_eq!(ours, kilo, "{what}");
        let d = plan_of(&snap, &settings(g, h)).datapath;
        let header = "## iptables: Topology.Rules(cni=true, iptablesForwardRule=false)";
        let [mesh, nat, _] = iptables_sets(&section(&text, header));
        assert_eq!(keys(&d.mesh_destinations), mesh, "{what}");
        assert_eq!(keys(&d.nat_sources), nat, "{what}");
    }
}

/// Deliberate difference: a Peer's allowed IP inside a node's pod CIDR, equal to a node's
/// internal IP or WireGuard IP, or inside a service CIDR is dropped from the Peer and reported.
/// Kilo keeps it, and WireGuard gives it to the Peer, listed after the segments: the Peer takes
/// the node's traffic. Every leader's configuration is Kilo's without exactly these claims.
#[test]
fn peer_claims_on_node_ranges_are_dropped_where_kilo_keeps_them() {
    let snap = fixture_with("peer-overlaps.yaml");
    // In name order, as reported.
    let dropped = [
        (
            "inside-pod-cidr",
            "10.2.1.128/25",
            "pod CIDR 10.2.1.0/24 of node \"a\"",
        ),
        (
            "inside-service-cidr",
            "10.96.0.10/32",
            "service CIDR 10.96.0.0/12",
        ),
        (
            "inside-wg-subnet",
            "10.4.0.1/32",
            "WireGuard IP 10.4.0.1/32",
        ),
        (
            "internal-ip",
            "192.168.0.1/32",
            "internal IP 192.168.0.1/32 of node \"a\"",
        ),
    ];
    let goldens = extra_goldens("peer-overlaps");
    assert_eq!(goldens.len(), 7);
    for (g, h, text) in goldens {
        let what = format!("{g} from {h}");
        let planned = plan::plan_for(&snap, &settings(g, h));
        let lost: Vec<String> = planned.errors.iter().map(ToString::to_string).collect();
        assert_eq!(lost.len(), dropped.len(), "{what}: {lost:#?}");
        for (msg, (peer, ip, owner)) in lost.iter().zip(dropped) {
            let want = format!("{peer:?}: spec.allowedIPs[0]: {ip} lies within {owner}");
            assert!(msg.contains(&want), "{what}: {msg} (want {want})");
        }
        let kilo = section(&text, "## wireguard: Topology.Conf()");
        let mut want = kilo.clone();
        for (_, ip, _) in dropped {
            let line = format!("AllowedIPs = {ip}\n");
            assert_eq!(kilo.matches(&line).count(), 1, "{what}: Kilo keeps {ip}");
            want = want.replace(&line, "");
        }
        assert_eq!(leader_conf(&planned.topology.unwrap()), want, "{what}");
    }
    // kgctl knows no service CIDRs: it keeps that claim, as Kilo does.
    let opts = kgctl::GlobalOptions {
        granularity: kgctl::GranularityArg::Fixed(Granularity::Location),
        now: Some(NOW),
        ..Default::default()
    };
    let c = kgctl::cluster(&snap, &opts).unwrap();
    let ips = |p: &str| c.peers[p].allowed_ips.clone();
    assert_eq!(
        ips("inside-service-cidr"),
        vec!["10.96.0.10/32".parse::<IpNet>().unwrap()]
    );
    assert!(ips("internal-ip").is_empty());
}

/// `--iptables-forward-rules` (with `--cni`): the FORWARD accepts of Kilo's `Rules(cni=true,
/// iptablesForwardRule=true)`, in Kilo's order and with Kilo's comment after kg's prefix; none
/// without the flag or without `--cni` (Kilo's `cni=false` section has none either).
#[test]
fn forward_rules_match_kilo_iptables_rules() {
    use kilo_agent::datapath::forward::{self, Direction};
    let snap = fixture();
    for (g, h, text) in each_golden() {
        let kilo: Vec<(Direction, IpNet, String)> = section(
            &text,
            "## iptables: Topology.Rules(cni=true, iptablesForwardRule=true)",
        )
        .lines()
        .filter(|l| l.contains(" FORWARD "))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let arg = |flag: &str| words.iter().position(|w| *w == flag).map(|i| words[i + 1]);
            let (direction, net) = match (arg("-s"), arg("-d")) {
                (Some(s), None) => (Direction::From, s),
                (None, Some(d)) => (Direction::To, d),
                _ => panic!("{l}"),
            };
            let comment = l.split('"').nth(1).unwrap();
            let what = comment.strip_prefix("Kilo: forward packets ").unwrap();
            (direction, net.parse().unwrap(), what.to_string())
        })
        .collect();
        assert!(!kilo.is_empty(), "{g} from {h}");
        let planned = |cni, iptables_forward_rules| {
            plan_of(
                &snap,
                &Settings {
                    cni,
                    iptables_forward_rules,
                    ..settings(g, h)
                },
            )
            .forward
        };
        let ours: Vec<(Direction, IpNet, String)> = forward::rules(&planned(true, true))
            .into_iter()
            .map(|r| {
                let what = r.comment.strip_prefix(forward::COMMENT_PREFIX).unwrap();
                (r.direction, r.net, what.to_string())
            })
            .collect();
        assert_eq!(ours, kilo, "{g} from {h}");
        assert!(planned(true, false).is_empty());
        assert!(planned(false, true).is_empty());
        assert!(
            !section(
                &text,
                "## iptables: Topology.Rules(cni=false, iptablesForwardRule=true)"
            )
            .contains(" FORWARD ")
        );
    }
}
