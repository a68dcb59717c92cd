//! Telemetry against a real Prometheus. `kg` runs in a network namespace with wireguard-go, a
//! pod behind its bridge, and a Peer (a laptop: wireguard-go in the "internet" namespace); a
//! Prometheus in kg's namespace scrapes it every second while the test's traffic flows. PromQL
//! then returns the node and peer counts, the pod's masqueraded packets, the bytes the laptop's
//! pings carried through WireGuard, a handshake age, and no child process; `promtool check
//! metrics` accepts the exposition, and every query of the Grafana dashboard
//! (`manifests/monitoring/grafana-dashboard.json`) and of Kilo's own has data.
use kilo_testkit as support;

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    os::unix::fs::PermissionsExt as _,
    path::Path,
    process::Command,
};

use support::{
    agent::peer_yaml,
    eventually,
    kg::{Kg, Launch},
    netns::{NetNs, WgGo, sh, veth},
};

/// Pings the pod sends to the internet host (each one masqueraded) and the laptop sends to the
/// node through WireGuard, and the laptop's payload size.
const POD_PINGS: u64 = 5;
const LAPTOP_PINGS: u64 = 4;
const PAYLOAD: u64 = 1000;

/// The queries of Kilo's Grafana dashboard (`docs/grafana/kilo.json` in Kilo's repository), one
/// per panel. The first three read wg-exporter's series, which kg serves itself; `pod` is the
/// label Prometheus' Kubernetes discovery adds (here a static label of the scrape).
const KILO_DASHBOARD: [&str; 10] = [
    "sum by (pod) (rate(wireguard_received_bytes_total[1h])) + sum by (pod) (rate(wireguard_sent_bytes_total[1h]))",
    "(sum(rate(wireguard_sent_bytes_total[5m])) - sum(rate(wireguard_received_bytes_total[5m])))/(sum(rate(wireguard_sent_bytes_total[5m])) + sum(rate(wireguard_received_bytes_total[5m])))",
    "sum by (public_key) (time() - (wireguard_latest_handshake_seconds!=0))",
    "sum by (instance) (rate(kilo_reconciles_total[30m]))",
    "avg(kilo_peers)",
    "avg(kilo_nodes)",
    "sum(kilo_leader)",
    "sum by (instance) (rate(kilo_errors_total[10m]))",
    "sum by (instance) (rate(process_cpu_seconds_total{pod=~\"kilo-.*\"}[1m]))",
    "sum by (instance) (process_resident_memory_bytes{pod=~\"kilo-.*\"})",
];

/// Starts `program` in `ns` with `args`, logging to `log` (printed on a failure); SIGTERM on
/// every path.
fn start_in(ns: &NetNs, program: Launch, args: &[&str], log: &Path) -> Kg {
    program.netns(&ns.name).args(args).log_file(log).spawn()
}

/// One HTTP/1.0 GET on the namespace's loopback; the body, or `None` on any failure.
fn get(ns: &NetNs, port: u16, path: &str) -> Option<String> {
    ns.run(|| {
        let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let (head, body) = out.split_once("\r\n\r\n")?;
        let status = head.split_whitespace().nth(1);
        (status == Some("200")).then(|| body.to_string())
    })
}

/// The value of a PromQL query's first sample at the Prometheus in `ns`; `None` while it has
/// none.
fn query(ns: &NetNs, promql: &str) -> Option<f64> {
    let v = query_json(ns, promql)?;
    v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}

/// The JSON answer of the Prometheus in `ns` to an instant query (`None`: no answer, or an
/// error such as a PromQL syntax error).
fn query_json(ns: &NetNs, promql: &str) -> Option<serde_json::Value> {
    let encoded: String = promql
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let body = get(ns, 9090, &format!("/api/v1/query?query={encoded}"))?;
    serde_json::from_str(&body).ok()
}

/// Waits until `promql` returns a value that `ok` accepts, and returns it.
fn until(ns: &NetNs, promql: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let mut last = None;
    eventually(promql, || {
        last = query(ns, promql);
        last.is_some_and(&ok)
    });
    last.unwrap()
}

fn wg_key() -> (String, String) {
    let private = sh("wg genkey").trim().to_string();
    let public = sh(&format!("echo {private} | wg pubkey"))
        .trim()
        .to_string();
    (private, public)
}

#[test]
fn prometheus_scrapes_kg_while_traffic_flows() {
    if !support::require_root("prometheus_scrapes_kg_while_traffic_flows") {
        return;
    }
    // The node: an underlay link to the internet host, a pod behind kube-bridge.
    let node = NetNs::new("pn");
    let pod = NetNs::new("pp");
    let inet = NetNs::new("pi");
    veth(&node, "eth0", &inet, "eth0");
    veth(&pod, "eth0", &node, "vpod");
    node.sh(
        "ip addr add 192.168.60.1/24 dev eth0 && ip route add default via 192.168.60.100 && \
         sysctl -qw net.ipv4.ip_forward=1 && ip link add kube-bridge type bridge && \
         ip addr add 10.42.1.1/24 dev kube-bridge && ip link set kube-bridge up && \
         ip link set vpod master kube-bridge",
    );
    pod.sh("ip addr add 10.42.1.2/24 dev eth0 && ip route add default via 10.42.1.1");
    inet.sh("ip addr add 192.168.60.100/24 dev eth0");
    let node_wg = WgGo::start(&node);
    let laptop_wg = WgGo::start(&inet);

    let dir = tempfile::tempdir().unwrap();
    let (node_private, node_public) = wg_key();
    let (laptop_private, laptop_public) = wg_key();
    let key = dir.path().join("key");
    std::fs::write(&key, format!("{node_private}\n")).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let laptop_key = dir.path().join("laptop.key");
    std::fs::write(&laptop_key, format!("{laptop_private}\n")).unwrap();
    let objects = dir.path().join("objects");
    std::fs::create_dir(&objects).unwrap();
    std::fs::write(
        objects.join("laptop.yaml"),
        peer_yaml("laptop", &laptop_public, "10.5.0.1/32"),
    )
    .unwrap();
    std::fs::write(
        objects.join("pnode.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: pnode\nspec:\n  podCIDR: 10.42.1.0/24\n",
    )
    .unwrap();

    let pins = format!("/sys/fs/bpf/krs-prom-{}", std::process::id());
    let kg = start_in(
        &node,
        Launch::kg(),
        &[
            "--backend=file",
            &format!("--backend-dir={}", objects.display()),
            "--hostname=pnode",
            &format!("--private-key={}", key.display()),
            "--create-interface=false",
            &format!("--interface={}", node_wg.name),
            "--encapsulate=never",
            &format!("--bpffs-dir={pins}"),
            "--listen=127.0.0.1:1107",
            &format!("--cni-path={}", dir.path().join("cni.conflist").display()),
        ],
        &dir.path().join("kg.log"),
    );
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
         scrape_configs:\n  - job_name: kg\n    static_configs:\n      - targets: ['127.0.0.1:1107']\n        labels: {pod: kilo-pnode}\n",
    )
    .unwrap();
    let prometheus = start_in(
        &node,
        Launch::program("prometheus"),
        &[
            &format!("--config.file={}", config.display()),
            &format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()),
            "--web.listen-address=127.0.0.1:9090",
        ],
        &dir.path().join("prometheus.log"),
    );

    // The laptop dials the node as `kgctl showconf peer` would configure it.
    eventually("kg configures the laptop on its device", || {
        node.try_sh(&format!("wg show {} peers", node_wg.name))
            .stdout
            .starts_with(laptop_public.as_bytes())
    });
    inet.sh(&format!(
        "wg set {dev} private-key {key} peer {node_public} endpoint 192.168.60.1:51820 \
         allowed-ips 10.4.0.0/16 && ip addr add 10.5.0.1/32 dev {dev} && ip link set {dev} up && \
         ip route add 10.4.0.0/16 dev {dev}",
        dev = laptop_wg.name,
        key = laptop_key.display(),
    ));
    eventually("the node has its WireGuard IP", || {
        node.try_sh(&format!("ip -4 addr show {}", node_wg.name))
            .stdout
            .windows(8)
            .any(|w| w == b"10.4.0.1")
    });
    // The traffic: the laptop pings the node through WireGuard; the pod pings the internet host
    // (the eBPF program marks each echo request, the static nft rule masquerades it).
    inet.sh(&format!(
        "busybox ping -c {LAPTOP_PINGS} -s {PAYLOAD} -W 5 10.4.0.1"
    ));
    pod.sh(&format!("busybox ping -c {POD_PINGS} -W 5 192.168.60.100"));

    until(&node, "up{job=\"kg\"}", |v| v == 1.0);
    until(&node, "kilo_nodes", |v| v == 1.0);
    until(&node, "kilo_peers", |v| v == 1.0);
    until(
        &node,
        "kilo_datapath_packets_total{decision=\"masquerade\"}",
        |v| v == POD_PINGS as f64,
    );
    until(
        &node,
        "kilo_datapath_entry_packets_total{role=\"nat_source\",cidr=\"10.42.1.0/24\",owner=\"pnode\"}",
        |v| v == POD_PINGS as f64,
    );
    // Echo requests in, replies out: at least the payloads, at most a few kilobytes more
    // (headers, the handshake, keepalives).
    let carried = (LAPTOP_PINGS * PAYLOAD) as f64;
    for direction in ["receive", "transmit"] {
        until(
            &node,
            &format!(
                "kilo_wireguard_peer_{direction}_bytes_total{{name=\"laptop\",public_key=\"{laptop_public}\"}}"
            ),
            |v| v >= carried && v < carried + 4096.0,
        );
    }
    let age = until(
        &node,
        "time() - kilo_wireguard_peer_last_handshake_timestamp_seconds{name=\"laptop\"}",
        |v| v > -1.0,
    );
    assert!(age < 600.0, "a handshake {age} s ago");
    until(&node, "kilo_child_processes", |v| v == 0.0);
    until(&node, "kilo_reconcile_duration_seconds_count", |v| v >= 1.0);
    until(
        &node,
        "kilo_reconcile_triggers_total{cause=\"start\"}",
        |v| v == 1.0,
    );
    until(
        &node,
        "kilo_datapath_map_capacity{map=\"nat_source\"}",
        |v| v == f64::from(kilo_common::DEFAULT_MAX_ENTRIES),
    );
    until(
        &node,
        "kilo_datapath_map_entries{map=\"nat_source\"}",
        |v| v >= 1.0,
    );

    // Every query of the Grafana dashboard is valid PromQL over these series, and each has
    // data, but the errors' (no error, no series, as in Kilo).
    let dashboard = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/monitoring/grafana-dashboard.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dashboard).unwrap()).unwrap();
    let exprs: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .map(|t| t["expr"].as_str().unwrap())
        .collect();
    assert!(exprs.len() > 15, "{exprs:?}");
    // Kilo's own dashboard too: an operator's panels keep their data after the switch.
    for expr in exprs.into_iter().chain(KILO_DASHBOARD) {
        let promql = expr
            .replace("$job", "kg")
            .replace("$instance", ".*")
            .replace("$__rate_interval", "30s");
        let may_be_empty = promql.contains("kilo_errors_total");
        eventually(&promql, || {
            query_json(&node, &promql).is_some_and(|v| {
                v["status"] == "success"
                    && (may_be_empty || !v["data"]["result"].as_array().unwrap().is_empty())
            })
        });
    }

    // The exposition as curl or promtool get it (text format 0.0.4), linted by promtool.
    let exposition = get(&node, 1107, "/metrics").expect("kg's /metrics");
    assert!(!exposition.contains(&node_private) && !exposition.contains(&laptop_private));
    let file = dir.path().join("metrics.txt");
    std::fs::write(&file, &exposition).unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("promtool check metrics < {}", file.display()))
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{exposition}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    drop(prometheus);
    drop(kg);
    let log = std::fs::read_to_string(dir.path().join("kg.log")).unwrap();
    assert!(!log.contains(&node_private), "private key logged");
    assert!(!Path::new(&pins).exists(), "kg left its pins:\n{log}");
}
