//! kgctl end to end: the built binary on a directory holding Kilo's fixture objects, compared
//! with Kilo's golden WireGuard and DOT text.
use std::{
    path::Path,
    process::{Command, Output},
    time::{SystemTime, UNIX_EPOCH},
};

use kilo_testkit::golden::{data, section};

/// The fixture, one object per file, last-seen = now.
fn fixture_dir() -> tempfile::TempDir {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let text = data("fixture.yaml").replace("\"NOW\"", &format!("\"{now}\""));
    let dir = tempfile::tempdir().unwrap();
    for (i, doc) in text.split("\n---\n").skip(1).enumerate() {
        std::fs::write(dir.path().join(format!("{i:02}.yaml")), doc).unwrap();
    }
    dir
}

fn kgctl(dir: &Path, args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_kgctl"))
        .args(["--backend", "file", "--backend-dir"])
        .arg(dir)
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kgctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// kgctl knows no private key: Kilo's kgctl prints `[Interface]` with the port only.
fn without_private_key(conf: &str) -> String {
    conf.lines()
        .filter(|l| !l.starts_with("PrivateKey = "))
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn showconf_node_matches_golden() {
    let dir = fixture_dir();
    // Leaders whose own keepalive is 0 (the goldens were made with keepalive 0).
    for (g, host) in [
        ("location", "b"),
        ("location", "d"),
        ("full", "b"),
        ("full", "c"),
        ("full", "d"),
    ] {
        let out = kgctl(
            dir.path(),
            &["--mesh-granularity", g, "showconf", "node", host],
        );
        let golden = section(
            &data(&format!("{g}-from-{host}.txt")),
            "## wireguard: Topology.Conf()",
        );
        assert_eq!(stdout(&out), without_private_key(&golden), "{g} {host}");
    }
}

#[test]
fn showconf_node_non_leader() {
    let dir = fixture_dir();
    let out = kgctl(
        dir.path(),
        &["--mesh-granularity", "location", "showconf", "node", "c"],
    );
    assert!(out.stdout.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "Node \"c\" is not a leader node\n"
    );
}

/// Kilo's kgctl renders a node's config with the node's own keepalive annotation (25 for a).
#[test]
fn showconf_node_with_keepalive() {
    let dir = fixture_dir();
    let out = kgctl(
        dir.path(),
        &["--mesh-granularity", "location", "showconf", "node", "a"],
    );
    let golden = section(
        &data("location-from-a.txt"),
        "## wireguard: Topology.Conf()",
    );
    let want =
        without_private_key(&golden).replace("PersistentKeepalive = 0", "PersistentKeepalive = 25");
    assert_eq!(stdout(&out), want);
}

#[test]
fn showconf_peer_matches_golden() {
    let dir = fixture_dir();
    for g in ["location", "full"] {
        for peer in ["a", "b"] {
            let out = kgctl(
                dir.path(),
                &["--mesh-granularity", g, "showconf", "peer", peer],
            );
            let golden = section(
                &data(&format!("{g}-from-a.txt")),
                &format!("## wireguard: Topology.PeerConf(\"{peer}\")"),
            );
            assert_eq!(stdout(&out), golden, "{g} {peer}");
        }
    }
}

#[test]
fn graph_matches_golden() {
    let dir = fixture_dir();
    for g in ["location", "full"] {
        let out = kgctl(dir.path(), &["--mesh-granularity", g, "graph"]);
        let golden = section(
            &data(&format!("{g}-from-a.txt")),
            "## graph: Topology.Dot()",
        );
        // Kilo prints the graph with Println.
        assert_eq!(stdout(&out), format!("{golden}\n"), "{g}");
    }
}

/// `kgctl graph -o svg`: an SVG document naming every node and peer of the fixture; `-o dot`
/// is the default.
#[test]
fn graph_svg_names_every_node_and_peer() {
    let dir = fixture_dir();
    std::fs::write(
        dir.path().join("99-phone.yaml"),
        "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata: {name: phone}\nspec:\n  allowedIPs: [10.5.9.1/32]\n  publicKey: a2V5OQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n",
    )
    .unwrap();
    for g in ["location", "full"] {
        let dot = kgctl(dir.path(), &["--mesh-granularity", g, "graph", "-o", "dot"]);
        let plain = kgctl(dir.path(), &["--mesh-granularity", g, "graph"]);
        assert_eq!(stdout(&dot), stdout(&plain));
        let out = kgctl(dir.path(), &["--mesh-granularity", g, "graph", "-o", "svg"]);
        let svg = stdout(&out);
        let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("{e}: {svg}"));
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        let texts: Vec<&str> = doc.descendants().filter_map(|n| n.text()).collect();
        // Nodes a..d; peers a, b and phone.
        for name in ["a", "b", "c", "d", "phone"] {
            assert!(
                texts.iter().any(|t| t.trim() == name),
                "{g}: {name} in {texts:?}"
            );
        }
        // Every label line of the DOT graph is drawn (locations, CIDRs, endpoints).
        for needle in ["10.2.3.0/24", "192.168.0.2"] {
            assert!(texts.iter().any(|t| t.contains(needle)), "{g}: {needle}");
        }
    }
}

#[test]
fn as_peer_yaml_is_a_peer_object() {
    let dir = fixture_dir();
    let out = kgctl(
        dir.path(),
        &[
            "--mesh-granularity",
            "location",
            "showconf",
            "node",
            "b",
            "--as-peer",
            "-o",
            "yaml",
            "--allowed-ips",
            "10.96.0.0/12",
        ],
    );
    let y: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).unwrap();
    assert_eq!(y["kind"], "Peer");
    assert_eq!(y["apiVersion"], "kilo.squat.ai/v1alpha1");
    assert_eq!(y["metadata"]["name"], "b");
    let ips: Vec<&str> = y["spec"]["allowedIPs"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(ips.last(), Some(&"10.96.0.0/12"));
}

#[test]
fn auto_granularity_and_bad_files() {
    let dir = fixture_dir();
    // Annotate the first node as Kilo's agent would (`kilo.squat.ai/granularity: full`).
    let p = dir.path().join("00.yaml");
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "annotations:\n",
        "annotations:\n    kilo.squat.ai/granularity: full\n",
    );
    std::fs::write(&p, text).unwrap();
    std::fs::write(
        dir.path().join("99-bad.yaml"),
        "kind: Node\nmetadata: {name: e}\nspec: {podCIDR: nope}\n",
    )
    .unwrap();
    let out = kgctl(dir.path(), &["graph"]);
    let golden = section(&data("full-from-a.txt"), "## graph: Topology.Dot()");
    assert_eq!(stdout(&out), format!("{golden}\n"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node \"e\": spec.podCIDR: invalid CIDR \"nope\""),
        "{err}"
    );
}

#[test]
fn errors_exit_non_zero() {
    let dir = fixture_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_kgctl"))
        .args(["--backend", "file", "--backend-dir"])
        .arg(dir.path())
        .args(["--mesh-granularity", "location", "showconf", "peer", "nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("did not find any peer named \"nope\""));
}
