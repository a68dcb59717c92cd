//! `kgctl connect` in network namespaces against a demo-style mesh (`xtask/scripts/demo.sh`):
//! two nodes in two locations, each with a pod behind a bridge, wireguard-go and the real `kg`
//! on the file backend, with a private address (192.168.50.0/24) and a public endpoint
//! (203.0.113.0/24); a "laptop" namespace on the public side runs the real `kgctl connect`
//! on its own wireguard-go device, pings the pods of both locations through the mesh, and on
//! SIGTERM removes its Peer and its routes.
use kilo_testkit as support;

use std::path::Path;

use support::{
    eventually,
    kg::{Kg, Launch},
    netns::{NetNs, WgGo, veth},
};

fn spawn(ns: &NetNs, launch: Launch, args: &[String], log: &Path) -> Kg {
    launch.netns(&ns.name).args(args).log_file(log).spawn()
}

#[test]
fn laptop_connects_reaches_both_locations_and_leaves() {
    if !support::require_root("laptop_connects_reaches_both_locations_and_leaves") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("objects");
    std::fs::create_dir(&dir).unwrap();
    let under = NetNs::new("cu");
    under.sh("ip link add br0 type bridge && ip link set br0 up");
    let mut nodes = Vec::new();
    let mut kgs = Vec::new();
    for (i, location) in [(1, "east"), (3, "west")] {
        let n = NetNs::new(&format!("cn{i}"));
        let pod = NetNs::new(&format!("cp{i}"));
        veth(&n, "eth0", &under, &format!("n{i}"));
        under.sh(&format!("ip link set n{i} master br0"));
        n.sh(&format!(
            "ip addr add 192.168.50.{i}/24 dev eth0 && ip addr add 203.0.113.{i}/24 dev eth0 && sysctl -qw net.ipv4.ip_forward=1 && \
             ip link add kube-bridge type bridge && ip addr add 10.42.{i}.1/24 dev kube-bridge && \
             ip link set kube-bridge up"
        ));
        veth(&pod, "eth0", &n, "vpod");
        n.sh("ip link set vpod master kube-bridge");
        pod.sh(&format!(
            "ip addr add 10.42.{i}.2/24 dev eth0 && ip route add default via 10.42.{i}.1"
        ));
        let wg = WgGo::start(&n);
        std::fs::write(
            dir.join(format!("node-n{i}.yaml")),
            format!(
                "apiVersion: v1\nkind: Node\nmetadata:\n  name: n{i}\n  annotations:\n    \
                 kilo.squat.ai/location: {location}\n    \
                 kilo.squat.ai/force-endpoint: 203.0.113.{i}:51820\n\
                 spec:\n  podCIDR: 10.42.{i}.0/24\n"
            ),
        )
        .unwrap();
        let bpffs = format!("/sys/fs/bpf/{}", n.name);
        let args: Vec<String> = [
            "--backend=file",
            &format!("--backend-dir={}", dir.display()),
            &format!("--hostname=n{i}"),
            "--create-interface=false",
            &format!("--interface={}", wg.name),
            "--encapsulate=never",
            &format!("--private-key={}/n{i}.key", work.path().display()),
            &format!("--bpffs-dir={bpffs}"),
            "--listen=127.0.0.1:1107",
            "--resync-period=2s",
        ]
        .map(String::from)
        .to_vec();
        let log = work.path().join(format!("kg-n{i}.log"));
        kgs.push(spawn(&n, Launch::kg(), &args, &log));
        nodes.push((n, pod, wg, bpffs));
    }

    let laptop = NetNs::new("cl");
    veth(&laptop, "eth0", &under, "laptop");
    under.sh("ip link set laptop master br0");
    laptop.sh("ip addr add 203.0.113.9/24 dev eth0");
    let wg = WgGo::start(&laptop);
    let peer_file = dir.join("laptop.yaml");
    let args: Vec<String> = [
        "--backend=file",
        &format!("--backend-dir={}", dir.display()),
        "connect",
        "laptop",
        "--allowed-ip=10.5.0.9/32",
        "--allowed-ips=10.96.0.0/12",
        "--create-interface=false",
        &format!("--interface={}", wg.name),
        "--resync-period=1s",
        "--persistent-keepalive=1",
        &format!("--private-key={}/laptop.key", work.path().display()),
    ]
    .map(String::from)
    .to_vec();
    let connect_log = work.path().join("connect.log");
    let mut connect = spawn(&laptop, Launch::kgctl(), &args, &connect_log);
    let logs = || {
        let mut all = String::new();
        for f in ["kg-n1.log", "kg-n3.log", "connect.log"] {
            let text = std::fs::read_to_string(work.path().join(f)).unwrap_or_default();
            all.push_str(&format!("--- {f}\n{text}\n"));
        }
        all
    };

    eventually("the laptop's Peer object exists", || peer_file.exists());
    let peer = std::fs::read_to_string(&peer_file).unwrap();
    assert!(
        peer.contains("kind: Peer") && peer.contains("10.5.0.9/32"),
        "{peer}"
    );
    let ping = |ip: &str| {
        laptop
            .try_sh(&format!("busybox ping -c1 -W1 {ip}"))
            .status
            .success()
    };
    let mut reached = false;
    for _ in 0..60 {
        if ping("10.42.1.2") && ping("10.42.3.2") {
            reached = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    assert!(
        reached,
        "laptop cannot reach both pods\n{}\n{}\n{}",
        laptop.sh("ip route"),
        laptop.sh(&format!("wg show {}", wg.name)),
        logs()
    );
    let routes = laptop.sh("ip route");
    // Every location's pod CIDR and --allowed-ips through the WireGuard interface.
    for dst in ["10.42.1.0/24", "10.42.3.0/24", "10.96.0.0/12"] {
        assert!(
            routes
                .lines()
                .any(|l| l.starts_with(dst) && l.contains(&wg.name)),
            "{dst} in {routes}"
        );
    }
    assert!(laptop.sh("ip addr").contains("10.5.0.9/32"));

    let status = connect.terminate();
    assert!(
        status.success(),
        "kgctl connect exited with {status}\n{}",
        logs()
    );
    assert!(!peer_file.exists(), "the Peer is removed on exit");
    let routes = laptop.sh("ip route");
    assert!(!routes.contains("10.42."), "routes left behind: {routes}");
    for mut kg in kgs {
        assert!(kg.terminate().success(), "{}", logs());
    }
    for (_, _, _, bpffs) in &nodes {
        let _ = std::fs::remove_dir_all(bpffs);
    }
}
