//! Benchmark: topology + plan for N nodes in N/100 locations plus N peers, N = 50 .. 5,000.
//!
//! `cargo xtask bench topology [--quick] [-- --runs R]` (`--quick`: up to 500 nodes).
//!
//! Prints, per size: the time of `plan_for` from the raw snapshot (parse + readiness +
//! topology + plan) and of topology + plan alone from typed nodes, for the local node being a
//! leader, in `location` granularity (and `full`/`cross` at the largest size), plus the
//! process's peak resident memory (VmHWM, which includes the synthetic snapshot itself).
//! Target at 5,000 nodes + 5,000 peers: under 100 ms and 100 MB.
use kilo_testkit as support;

use std::{collections::BTreeMap, time::Instant};

use k8s_openapi::api::core::v1::NodeSpec;
use kilo_agent::{
    mesh::{self, Granularity, Key, KubeNode, Peer, PeerSpec, Snapshot, annotations},
    plan::{self, KeepaliveSource, Settings},
    topology::{Options, Topology},
};
use kube::api::ObjectMeta;
use support::report;

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

/// The process's peak resident memory in MiB; `None` when /proc cannot tell.
fn vm_hwm_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// (median ms, every run's ms, the last result).
fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, Vec<f64>, T) {
    let mut ms = Vec::with_capacity(runs);
    let mut last = None;
    for _ in 0..runs {
        let t = Instant::now();
        let out = f();
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        last = Some(out);
    }
    (support::median::median(&ms), ms, last.expect("runs > 0"))
}

fn main() {
    let runs = std::env::args()
        .skip_while(|a| a != "--runs")
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(if report::quick() { 3 } else { 11usize });
    let sizes: &[usize] = if report::quick() {
        &[50, 500]
    } else {
        &[50, 500, 1000, 2500, 5000]
    };
    let id = "plan";
    report::table(
        id,
        "Topology + plan for N nodes in N/100 locations + N Peers (local node a leader)",
        "ms",
    );
    report::meta("runs per cell", &runs.to_string());
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
    let mut largest = (0, 0.0, None);
    for &n in sizes {
        let locations = (n / 100).max(1);
        let snap = snapshot(n, locations, n);
        // node-00000 leads loc-000 (first public endpoint in name order).
        let settings = Settings {
            hostname: "node-00000".into(),
            service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
            now: Some(1_700_000_010),
            ..Settings::default()
        };
        let (full_t, full_ms, planned) = time(runs, || plan::plan_for(&snap, &settings));
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
            kg_nodes: snap.kg_nodes.clone(),
        };
        let (tp_t, tp_ms, _) = time(runs, || {
            let t = Topology::new(&parsed.nodes, &parsed.peers, &opts).unwrap();
            plan::from_topology(&t, &settings)
        });
        let col = n.to_string();
        report::cell(
            id,
            "plan_for from the raw snapshot (parse, readiness, topology, plan)",
            &col,
            &full_ms,
        );
        report::cell(id, "topology + plan from typed nodes", &col, &tp_ms);
        let hwm = vm_hwm_mib();
        let hwm_row = "peak RSS of the process, snapshot included (MiB)";
        match hwm {
            Some(mib) => report::cell(id, hwm_row, &col, &[mib]),
            None => report::text(id, hwm_row, &col, "not measured"),
        }
        println!(
            "{:>6} {:>5} {:>6} {:>12.2} {:>12.2} {:>7} {:>7} {:>8} {:>9.1}",
            n,
            locations,
            n,
            full_t,
            tp_t,
            p.wireguard.peers.len(),
            p.routes.len(),
            p.datapath.mesh_destinations.len(),
            hwm.unwrap_or(f64::NAN)
        );
        last = Some((snap, settings));
        largest = (n, full_t, hwm);
    }
    report::plot(id, "nodes (and as many Peers)", "time", true, true);
    let (n, ms, mib) = largest;
    let target = "planning at 5,000 nodes + 5,000 Peers under 100 ms and 100 MB";
    match mib {
        Some(mib) => report::target(
            target,
            &format!("{ms:.1} ms, {mib:.0} MiB peak at {n} + {n}"),
            report::State::at_full_size(ms < 100.0 && mib < 100.0),
        ),
        None => report::target(
            target,
            &format!("{ms:.1} ms at {n} + {n}; peak RSS not read"),
            report::State::NotMeasured,
        ),
    }
    let (snap, settings) = last.expect("sizes");
    for g in [Granularity::Full, Granularity::Cross] {
        let s = Settings {
            granularity: g,
            persistent_keepalive: KeepaliveSource::Fixed(0),
            ..settings.clone()
        };
        let (t, ms, planned) = time(runs, || plan::plan_for(&snap, &s));
        let p = planned.plan.unwrap();
        report::cell(
            id,
            &format!("plan_for, {g} granularity"),
            &sizes.last().unwrap().to_string(),
            &ms,
        );
        println!(
            "{g:>8} at {}: plan_for {t:.2} ms, {} WireGuard peers, {} routes, VmHWM {:.1} MiB",
            sizes.last().unwrap(),
            p.wireguard.peers.len(),
            p.routes.len(),
            vm_hwm_mib().unwrap_or(f64::NAN)
        );
    }
}
