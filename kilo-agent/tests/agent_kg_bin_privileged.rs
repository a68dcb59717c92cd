//! The `kg` binary end to end in a network namespace with the file backend: it generates its
//! key (0600), publishes its annotations, serves /health, /metrics and /graph (SVG laid out
//! in-process) under its seccomp filter, and on SIGTERM removes its annotations and exits 0.
use kilo_testkit as support;

use std::os::unix::fs::PermissionsExt;

use support::{
    agent::peer_yaml,
    eventually,
    kg::Launch,
    netns::{NetNs, veth},
};

#[test]
fn kg_starts_publishes_serves_and_cleans_up_on_sigterm() {
    if !support::require_root("kg_starts_publishes_serves_and_cleans_up_on_sigterm") {
        return;
    }
    let ns = NetNs::new("kg");
    let gw = NetNs::new("kgw");
    veth(&ns, "eth0", &gw, "eth0");
    ns.sh("ip addr add 10.9.0.1/24 dev eth0 && ip route add default via 10.9.0.254 dev eth0");
    let dir = tempfile::tempdir().unwrap();
    let objects = dir.path().join("objects");
    std::fs::create_dir(&objects).unwrap();
    std::fs::write(
        objects.join("laptop.yaml"),
        peer_yaml(
            "laptop",
            "a2V5OQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            "10.5.0.1/32",
        ),
    )
    .unwrap();
    // The node's pod CIDR, which Kubernetes would assign: it makes the node ready (a graph).
    std::fs::write(
        objects.join("kgtest.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: kgtest\nspec:\n  podCIDR: 10.42.1.0/24\n",
    )
    .unwrap();
    let key = dir.path().join("state/key");
    let mut kg = Launch::kg()
        .netns(&ns.name)
        .args([
            "--backend=file",
            &format!("--backend-dir={}", objects.display()),
            "--hostname=kgtest",
            &format!("--private-key={}", key.display()),
            // Go's form: every address, IPv6 and IPv4.
            "--listen=:1107",
            "--iptables-forward-rules",
            &format!(
                "--cni-path={}",
                dir.path().join("10-kilo.conflist").display()
            ),
            "--log-level=debug",
            // The program's own log records are forwarded (starting fails if they cannot be).
            "--datapath-log-level=debug",
            // Map sizes other than the defaults.
            "--datapath-counter-slots=64",
            "--datapath-max-entries=4096",
        ])
        .spawn();
    let mine = objects.join("kgtest.yaml");
    eventually("kg publishes its node", || {
        std::fs::read_to_string(&mine).is_ok_and(|s| s.contains("kilo.squat.ai/key"))
    });
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let private = std::fs::read_to_string(&key).unwrap();
    let text = std::fs::read_to_string(&mine).unwrap();
    assert!(
        text.contains("kilo.squat.ai/endpoint: 10.9.0.1:51820"),
        "{text}"
    );
    assert!(
        text.contains("kilo.squat.ai/internal-ip: 10.9.0.1/24"),
        "{text}"
    );
    assert!(
        text.contains("kilo.squat.ai/granularity: location"),
        "{text}"
    );
    assert!(text.contains("kilo.squat.ai/last-seen"), "{text}");
    assert!(!text.contains(private.trim()), "private key published");

    let get = |path: &str| ns.try_sh(&format!("busybox wget -q -O - http://127.0.0.1:1107{path}"));
    eventually("/health answers", || get("/health").status.success());
    let metrics = String::from_utf8(get("/metrics").stdout).unwrap();
    assert!(metrics.contains("kilo_reconciles_total"), "{metrics}");
    // The process metrics Kilo's dashboard reads, from /proc under the seccomp filter.
    for name in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            metrics.contains(&format!("\n{name} ")),
            "{name} in {metrics}"
        );
    }
    let v6 = ns.try_sh("busybox wget -q -O - 'http://[::1]:1107/health'");
    assert!(
        v6.status.success(),
        "--listen=:1107 answers on IPv6: {v6:?}"
    );
    // Kilo's /graph: SVG by default (rendered in-process: kg may not exec), DOT on request.
    let mut svg = String::new();
    eventually("/graph answers", || {
        let out = get("/graph");
        svg = String::from_utf8_lossy(&out.stdout).into_owned();
        out.status.success()
    });
    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("{e}: {svg}"));
    let texts: Vec<&str> = doc.descendants().filter_map(|n| n.text()).collect();
    for name in ["kgtest", "laptop"] {
        assert!(
            texts.iter().any(|t| t.trim() == name),
            "{name} in {texts:?}"
        );
    }
    let dot = String::from_utf8(get("/graph?format=dot&layout=circo").stdout).unwrap();
    assert!(
        dot.starts_with("digraph kilo {") && dot.contains("\"laptop\""),
        "{dot}"
    );
    assert!(!get("/graph?format=png").status.success());

    // SIGTERM (to kg itself, the child of `ip netns exec`, which execs it).
    let log = kg.stop();
    // The loader's relocation chatter stays out at --log-level=debug.
    assert!(!log.contains("aya_obj"), "{log}");
    // The default --log-format is JSON, one object per line, as Kilo logs.
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("log line is not JSON ({e}): {line}"));
        assert!(
            v["level"].is_string() && v["message"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
    }
    assert!(log.contains("seccomp filter installed"), "{log}");
    assert!(log.contains("datapath: maps ready"), "{log}");
    for size in ["table_capacity\":4096", "counter_slots\":64"] {
        assert!(log.contains(size), "{size} in {log}");
    }
    // Honoured now, not warned about (tests/forward_rules_privileged.rs covers what it does).
    assert!(
        !log.contains("--iptables-forward-rules is ignored"),
        "{log}"
    );
    assert!(!log.contains(private.trim()), "private key logged");
    let text = std::fs::read_to_string(&mine).unwrap();
    assert!(
        !text.contains("kilo.squat.ai/"),
        "annotations left behind: {text}"
    );
}
