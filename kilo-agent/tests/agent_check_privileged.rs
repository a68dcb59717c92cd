//! `/check`, the per-node check, on the demo's mesh with real kg agents: in sync once the mesh
//! converged, out of sync (naming what differs) after a WireGuard peer is removed behind kg's
//! back, and the check itself writes nothing.
use kilo_testkit as support;

use support::{bpffs::BpfFs, eventually, kg::Kg, mesh::DemoMesh, metrics::metric_sum};

const IN_SYNC: &str = "in sync: the kernel matches the plan\n";

#[test]
fn check_says_whether_the_kernel_matches_the_plan() {
    if !support::require_root("check_says_whether_the_kernel_matches_the_plan") {
        return;
    }
    let mesh = DemoMesh::up("ck");
    let bpffs = BpfFs::new();
    // No resync within the test: a drift kg is not told of stays until kg stops.
    let mut kg: Vec<Kg> = (1..=3)
        .map(|i| mesh.start_kg(i, &bpffs, &["--resync-period=1h"]))
        .collect();
    eventually("pods reach each other across locations", || {
        mesh.pings("pod1", "10.42.3.2")
    });
    let n1 = &kg[0];
    eventually("n1 is in sync", || {
        n1.get("/check") == (200, IN_SYNC.into())
    });

    let writes = || metric_sum(&n1.get("/metrics").1, "kilo_writes_total");
    let before = writes();
    for _ in 0..3 {
        assert_eq!(n1.get("/check"), (200, IN_SYNC.into()));
    }
    assert_eq!(writes(), before, "a check wrote to the kernel");

    // n1 leads its location and peers with n3 alone; WireGuard tells nobody of the removal.
    let wg = mesh.wg(1);
    let key = mesh
        .sh("n1", &format!("wg show {wg} peers"))
        .trim()
        .to_owned();
    assert_eq!(key.lines().count(), 1, "n1's peers: {key}");
    mesh.sh("n1", &format!("wg set {wg} peer {key} remove"));
    let (status, body) = n1.get("/check");
    assert_eq!(status, 503, "{body}");
    assert!(
        body.starts_with("out of sync: the kernel differs from the plan\n"),
        "{body}"
    );
    assert!(
        body.lines()
            .any(|l| l.starts_with(&format!("+ wireguard peer {key} allowed-ips "))),
        "{body}"
    );
    for kg in &mut kg {
        let log = kg.stop();
        assert!(!log.contains("panicked"), "{log}");
    }
}
