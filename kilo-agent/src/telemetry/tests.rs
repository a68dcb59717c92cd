//! The metrics' names and values, the endpoints' answers and the server, as Prometheus and
//! Kilo's users see them.
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::datapath::DatapathStats;
use crate::writes::Write;

#[test]
fn kilo_metric_names_are_exposed() {
    let m = Metrics::new();
    m.nodes.set(3);
    m.reconciles.inc();
    m.error("apply");
    let mut w = Writes::default();
    w.add(Write::RouteAdd, 2);
    m.record_writes(&w);
    m.trigger(Trigger::Kernel);
    m.reconcile_duration.observe(0.003);
    let text = m.encode();
    for needle in [
        "kilo_nodes 3",
        "kilo_peers 0",
        "kilo_leader 0",
        "kilo_reconciles_total 1",
        "kilo_errors_total{event=\"apply\"} 1",
        "kilo_writes_total{kind=\"route_add\"} 2",
        "\nprocess_cpu_seconds_total ",
        "\nprocess_resident_memory_bytes ",
        "\nprocess_open_fds ",
        "\nprocess_start_time_seconds ",
        "\nkilo_child_processes ",
        "kilo_reconcile_triggers_total{cause=\"kernel\"} 1",
        "kilo_reconcile_triggers_total{cause=\"resync\"} 0",
        "kilo_reconcile_duration_seconds_bucket{le=\"0.0025\"} 0",
        "kilo_reconcile_duration_seconds_bucket{le=\"0.005\"} 1",
        "kilo_reconcile_duration_seconds_count 1",
        "\nkilo_service_cidrs 0\n",
        "\nkilo_backend_retries_total 0\n",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }
    assert_eq!(m.respond("/ready", "").0, 503);
    m.set_ready(true);
    assert_eq!(m.respond("/ready", "").0, 200);
    m.set_backend_connected(false);
    let (status, _, body) = m.respond("/ready", "");
    assert_eq!(status, 503);
    assert!(body.contains("backend disconnected"), "{body}");
    m.set_backend_connected(true);
    assert_eq!(
        m.respond("/ready", ""),
        (200, "text/plain", "ready\n".into())
    );
    // The service CIDRs planned with, or what their absence means; the status unchanged.
    m.set_service_cidrs(&[]);
    let (status, _, body) = m.respond("/ready", "");
    assert_eq!(status, 200);
    assert!(
        body.starts_with("ready\nwarning: no service CIDR known: traffic"),
        "{body}"
    );
    let cidrs = [
        "10.96.0.0/12".parse().unwrap(),
        "fd00:10:96::/112".parse().unwrap(),
    ];
    m.set_service_cidrs(&cidrs);
    assert_eq!(
        m.respond("/ready", "").2,
        "ready\nservice CIDRs: 10.96.0.0/12, fd00:10:96::/112\n"
    );
    assert!(m.encode().contains("\nkilo_service_cidrs 2\n"));
    assert_eq!(m.respond("/health", "").0, 200);
    assert_eq!(m.respond("/nope", "").0, 404);
}

#[test]
fn graph_like_kilo() {
    let m = Metrics::new();
    assert_eq!(m.respond("/graph", "").0, 500, "no graph before a plan");
    m.set_graph(Some(Graph::new(|| {
        "digraph kilo {\n\t\"n1\" [ label=\"n1\" ];\n}\n".into()
    })));
    let (status, ctype, body) = m.respond("/graph", "");
    assert_eq!((status, ctype), (200, "image/svg+xml"));
    roxmltree::Document::parse(&body).unwrap();
    assert!(body.contains(">n1<"), "{body}");
    assert_eq!(m.respond("/graph?layout=circo&format=svg", "").0, 200);
    let (status, _, body) = m.respond("/graph?format=dot", "");
    assert_eq!((status, body.starts_with("digraph kilo")), (200, true));
    assert_eq!(m.respond("/graph?format=gv", "").0, 200);
    assert_eq!(m.respond("/graph?format=png", "").0, 500);
    assert_eq!(m.respond("/graph?layout=sideways", "").0, 500);
}

#[derive(Debug)]
struct Source(Mutex<u64>);

impl DatapathStatsSource for Source {
    fn read(&self) -> Result<DatapathStats, crate::datapath::DatapathOpsError> {
        // Each read sees more traffic, as the kernel's counters would.
        let mut n = self.0.lock().unwrap();
        *n += 1;
        let c = crate::datapath::Counter {
            packets: *n,
            bytes: *n * 100,
        };
        Ok(DatapathStats {
            decisions: vec![("pass", Default::default()), ("masquerade", c)],
            entries: vec![crate::datapath::EntryStats {
                role: "nat_source",
                cidr: "10.42.1.0/24".parse().unwrap(),
                kind: "local_pods",
                owner: "n1".into(),
                counter: c,
            }],
            maps: vec![
                crate::datapath::MapUsage {
                    map: "mesh_destination",
                    entries: 4,
                    capacity: 64,
                },
                crate::datapath::MapUsage {
                    map: "entry_counters",
                    entries: 1,
                    capacity: 16,
                },
            ],
        })
    }
}

#[test]
fn datapath_counters_are_read_at_each_scrape() {
    let m = Metrics::new();
    assert!(
        !m.encode().contains("kilo_datapath"),
        "no source, no series"
    );
    m.set_datapath(Some(Arc::new(Source(Mutex::new(0)))));
    let first = m.encode();
    for needle in [
        "# TYPE kilo_datapath_packets counter",
        "kilo_datapath_packets_total{decision=\"pass\"} 0",
        "kilo_datapath_packets_total{decision=\"masquerade\"} 1",
        "kilo_datapath_bytes_total{decision=\"masquerade\"} 100",
        "kilo_datapath_entry_packets_total{role=\"nat_source\",cidr=\"10.42.1.0/24\",kind=\"local_pods\",owner=\"n1\"} 1",
        "kilo_datapath_entry_bytes_total{role=\"nat_source\",cidr=\"10.42.1.0/24\",kind=\"local_pods\",owner=\"n1\"} 100",
        "# TYPE kilo_datapath_map_entries gauge",
        "kilo_datapath_map_entries{map=\"mesh_destination\"} 4",
        "kilo_datapath_map_capacity{map=\"mesh_destination\"} 64",
        "kilo_datapath_map_entries{map=\"entry_counters\"} 1",
        "kilo_datapath_map_capacity{map=\"entry_counters\"} 16",
    ] {
        assert!(first.contains(needle), "{needle} missing from\n{first}");
    }
    assert!(first.trim_end().ends_with("# EOF"), "{first}");
    let second = m.encode();
    assert!(
        second.contains("kilo_datapath_packets_total{decision=\"masquerade\"} 2"),
        "{second}"
    );
    m.set_datapath(None);
    assert!(!m.encode().contains("kilo_datapath"));
}

#[test]
fn serves_over_http() {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let m = Metrics::new();
            m.peers.set(7);
            m.reconciles.inc();
            let (checks, mut asked) = tokio::sync::mpsc::channel(1);
            let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), m, Some(checks))
                .await
                .unwrap();
            let request = |path: &'static str, headers: &'static str| async move {
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n");
                s.write_all(req.as_bytes()).await.unwrap();
                let mut out = String::new();
                s.read_to_string(&mut out).await.unwrap();
                out
            };
            let get = |headers| request("/metrics", headers);
            // `/check`: answered by whoever holds the other end (the agent's loop).
            let answers = tokio::spawn(async move {
                for answer in [Ok(String::new()), Ok("+ route 10.1.0.0/16\n".into()), Err("no plan yet".into())] {
                    let reply: crate::telemetry::CheckRequest = asked.recv().await.unwrap();
                    reply.send(answer).unwrap();
                }
            });
            let check = request("/check", "").await;
            assert!(check.starts_with("HTTP/1.1 200 OK"), "{check}");
            assert!(check.ends_with("\r\n\r\nin sync: the kernel matches the plan\n"), "{check}");
            let check = request("/check", "").await;
            assert!(check.starts_with("HTTP/1.1 503"), "{check}");
            assert!(check.ends_with("out of sync: the kernel differs from the plan\n+ route 10.1.0.0/16\n"), "{check}");
            let check = request("/check", "").await;
            assert!(check.starts_with("HTTP/1.1 503"), "{check}");
            assert!(check.ends_with("cannot check: no plan yet\n"), "{check}");
            answers.await.unwrap();
            // Without an Accept header (curl, promtool's input): text format 0.0.4.
            let text = get("").await;
            assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
            for needle in [
                "Content-Type: text/plain; version=0.0.4",
                "kilo_peers 7",
                "# HELP kilo_reconciles_total Number of reconciliation attempts.",
                "# TYPE kilo_reconciles_total counter\nkilo_reconciles_total 1\n",
                "# TYPE kilo_peers gauge\n",
            ] {
                assert!(text.contains(needle), "{needle} missing from\n{text}");
            }
            assert!(!text.contains("# EOF"), "{text}");
            // Prometheus asks for OpenMetrics.
            let om = get(
                "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n",
            )
            .await;
            for needle in [
                "Content-Type: application/openmetrics-text; version=1.0.0",
                "# TYPE kilo_reconciles counter\nkilo_reconciles_total 1\n",
                "# EOF",
            ] {
                assert!(om.contains(needle), "{needle} missing from\n{om}");
            }
            task.abort();
        });
}

/// A device with two peers, one that never completed a handshake.
struct Device;

impl PeerStatsSource for Device {
    fn peer_stats(
        &self,
    ) -> Result<
        BTreeMap<Key, crate::reconcile::wireguard::PeerStats>,
        crate::reconcile::wireguard::WgError,
    > {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        Ok(BTreeMap::from([
            (
                Key([1; 32]),
                crate::reconcile::wireguard::PeerStats {
                    last_handshake: Some(at),
                    rx_bytes: 1234,
                    tx_bytes: 5678,
                    allowed_ips: vec![
                        "10.4.0.1/32".parse().unwrap(),
                        "10.2.1.0/24".parse().unwrap(),
                    ],
                },
            ),
            (Key([2; 32]), Default::default()),
        ]))
    }

    fn interface(&self) -> &str {
        "kilo0"
    }
}

#[test]
fn wireguard_peers_are_read_at_each_scrape_with_their_names() {
    let m = Metrics::new();
    assert!(
        !m.encode().contains("kilo_wireguard"),
        "no source, no series"
    );
    m.set_wireguard(Some(Arc::new(Device)));
    m.set_peer_names(BTreeMap::from([(Key([1; 32]), "laptop".to_string())]));
    let text = m.encode();
    let one = format!("{{public_key=\"{}\",name=\"laptop\"}}", Key([1; 32]));
    let two = format!("{{public_key=\"{}\",name=\"\"}}", Key([2; 32]));
    for needle in [
        format!("kilo_wireguard_peer_receive_bytes_total{one} 1234"),
        format!("kilo_wireguard_peer_transmit_bytes_total{one} 5678"),
        format!("kilo_wireguard_peer_last_handshake_timestamp_seconds{one} 1700000000.0"),
        format!("kilo_wireguard_peer_last_handshake_timestamp_seconds{two} 0.0"),
        format!("kilo_wireguard_peer_receive_bytes_total{two} 0"),
        // wg-exporter's names and labels, which Kilo's dashboard reads.
        format!(
            "wireguard_sent_bytes_total{{interface=\"kilo0\",public_key=\"{}\",allowed_ips=\"10.4.0.1/32,10.2.1.0/24\"}} 5678",
            Key([1; 32])
        ),
        format!(
            "wireguard_received_bytes_total{{interface=\"kilo0\",public_key=\"{}\",allowed_ips=\"10.4.0.1/32,10.2.1.0/24\"}} 1234",
            Key([1; 32])
        ),
        format!(
            "wireguard_latest_handshake_seconds{{interface=\"kilo0\",public_key=\"{}\",allowed_ips=\"10.4.0.1/32,10.2.1.0/24\"}} 1700000000.0",
            Key([1; 32])
        ),
        format!(
            "wireguard_latest_handshake_seconds{{interface=\"kilo0\",public_key=\"{}\",allowed_ips=\"\"}} 0.0",
            Key([2; 32])
        ),
    ] {
        assert!(text.contains(&needle), "{needle} missing from\n{text}");
    }
    m.set_wireguard(None);
    assert!(!m.encode().contains("kilo_wireguard"));
    assert!(!m.encode().contains("wireguard_sent_bytes"));
}
