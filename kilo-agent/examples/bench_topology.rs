//! Benchmark: topology + plan for N nodes in N/100 locations plus N peers, N = 50 .. 5,000.
//!
//! `cargo +1.99.1 run --release -p kilo-agent --example bench_topology [-- --runs R]`
//!
//! Prints, per size: the time of `plan_for` from the raw snapshot (parse + readiness +
//! topology + plan) and of topology + plan alone from typed nodes, for the local node being a
//! leader, in `location` granularity (and `full`/`cross` at the largest size), plus the
//! process's peak resident memory (VmHWM, which includes the synthetic snapshot itself).
//! Target at 5,000 nodes + 5,000 peers: under 100 ms and 100 MB.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::NodeSpec;
use kilo_agent::{
    mesh::{self, Granularity, Key, KubeNode, Peer, PeerSpec, Snapshot, annotations},
    plan::{self, KeepaliveSource, Settings},
    topology::{Options, Topology},
};
use kube::api::ObjectMeta;

fn key(i: usize, tag: u8) -> String {
    let mut k = [0u8; 32];
    k[0] = tag;
    k[1..9].copy_from_slice(&(i as u64 + 1).to_le_bytes());
    Key(k).to_string()
}

fn snapshot(nodes: usize, locations: usize, peers: usize) -> Snapshot {
    let mut s = Snapshot::default();
    for i in 0..nodes {
        let name = format!("node-{i:05}");
        let loc = i % locations;
        let mut ann: BTreeMap<String, String> = [
            (
                annotations::ENDPOINT,
                format!(
                    "{}.{}.{}.{}:51820",
                    1 + i / 65536,
                    (i / 256) % 256,
                    i % 256,
                    1
                ),
            ),
            (
                annotations::INTERNAL_IP,
                format!("172.{}.{}.{}/12", 16 + i / 65536, (i / 256) % 256, i % 256),
            ),
            (annotations::KEY, key(i, 1)),
            (annotations::LAST_SEEN, "1700000000".into()),
            (annotations::LOCATION, format!("loc-{loc:03}")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if i < locations {
            // One allowed-location IP per location.
            ann.insert(
                annotations::ALLOWED_LOCATION_IPS.into(),
                format!("192.168.{loc}.0/24"),
            );
        }
        s.nodes.insert(
            name.clone(),
            KubeNode {
                metadata: ObjectMeta {
                    name: Some(name),
                    annotations: Some(ann),
                    ..Default::default()
                },
                spec: Some(NodeSpec {
                    pod_cidr: Some(format!("10.{}.{}.0/24", 128 + i / 256, i % 256)),
                    ..Default::default()
                }),
                status: None,
            },
        );
    }
    for i in 0..peers {
        let name = format!("peer-{i:05}");
        s.peers.insert(
            name.clone(),
            Peer::new(
                &name,
                PeerSpec {
                    allowed_ips: vec![format!(
                        "100.{}.{}.{}/32",
                        64 + i / 65536,
                        (i / 256) % 256,
                        i % 256
                    )],
                    public_key: key(i, 2),
                    ..Default::default()
                },
            ),
        );
    }
    s
}

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut times = Vec::with_capacity(runs);
    let mut last = None;
    for _ in 0..runs {
        let t = Instant::now();
        let out = f();
        times.push(t.elapsed());
        last = Some(out);
    }
    (median(times), last.expect("runs > 0"))
}

fn main() {
    let runs = std::env::args()
        .skip_while(|a| a != "--runs")
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(11usize);
    println!(
        "{:>6} {:>5} {:>6} {:>12} {:>12} {:>7} {:>7} {:>8} {:>9}",
        "nodes",
        "locs",
        "peers",
        "plan_for ms",
        "topo+plan ms",
        "wgpeers",
        "routes",
        "mesh_dst",
        "VmHWM MiB"
    );
    let mut last = None;
    for &n in &[50usize, 500, 1000, 2500, 5000] {
        let locations = (n / 100).max(1);
        let snap = snapshot(n, locations, n);
        // node-00000 leads loc-000 (first public endpoint in name order).
        let settings = Settings {
            hostname: "node-00000".into(),
            service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
            now: Some(1_700_000_010),
            ..Settings::default()
        };
        let (full_t, planned) = time(runs, || plan::plan_for(&snap, &settings));
        assert!(planned.errors.is_empty(), "{:?}", &planned.errors[..1]);
        let p = planned.plan.expect("local node ready");
        assert!(planned.topology.as_ref().unwrap().leader);
        let parsed = mesh::parse_snapshot(&snap, mesh::DEFAULT_TOPOLOGY_LABEL);
        let opts = Options {
            granularity: Granularity::Location,
            hostname: settings.hostname.clone(),
            port: 51820,
            subnet: settings.subnet,
            service_cidrs: settings.service_cidrs.clone(),
            persistent_keepalive: 0,
        };
        let (tp_t, _) = time(runs, || {
            let t = Topology::new(&parsed.nodes, &parsed.peers, &opts).unwrap();
            plan::build(&t, &settings)
        });
        println!(
            "{:>6} {:>5} {:>6} {:>12.2} {:>12.2} {:>7} {:>7} {:>8} {:>9.1}",
            n,
            locations,
            n,
            full_t.as_secs_f64() * 1e3,
            tp_t.as_secs_f64() * 1e3,
            p.wireguard.peers.len(),
            p.routes.len(),
            p.datapath.mesh_destinations.len(),
            vm_hwm_kib() as f64 / 1024.0
        );
        last = Some((snap, settings));
    }
    let (snap, settings) = last.expect("sizes");
    for g in [Granularity::Full, Granularity::Cross] {
        let s = Settings {
            granularity: g,
            persistent_keepalive: KeepaliveSource::Fixed(0),
            ..settings.clone()
        };
        let (t, planned) = time(runs, || plan::plan_for(&snap, &s));
        let p = planned.plan.unwrap();
        println!(
            "{g:>8} at 5000: plan_for {:.2} ms, {} WireGuard peers, {} routes, VmHWM {:.1} MiB",
            t.as_secs_f64() * 1e3,
            p.wireguard.peers.len(),
            p.routes.len(),
            vm_hwm_kib() as f64 / 1024.0
        );
    }
}
