//! Multi-cluster (Kilo's docs/multi-cluster-services.md) in network namespaces: two clusters,
//! each two nodes in one location on its own private network with a pod behind a bridge,
//! wireguard-go and the real `kg` on the file backend; their leaders share a public network.
//! Each cluster's leader is printed by the real `kgctl showconf node <leader> --as-peer -o yaml
//! --allowed-ips <its service-like range>` and the output written as a Peer into the other
//! cluster's objects. Then pods reach the other cluster's pods (leader and non-leader) through
//! WireGuard and back, unmasqueraded, and an address in the other cluster's `--allowed-ips`
//! range answers.
use kilo_testkit as support;

use std::{net::IpAddr, path::Path};

use support::{
    bpffs::{BpfFs, udp_source},
    eventually,
    kg::Launch,
    netns::{NetNs, WgGo, veth},
};

/// One cluster: `c` is 1 or 2. Private network 192.168.1c.0/24, pods 10.4c.<j>.0/24, WireGuard
/// subnet 10.4.c.0/24, the leader's public address 203.0.113.c, and a service-like range
/// 10.3c.0.0/16 whose 10.3c.0.10 is an address of the leader (as a ClusterIP is answered on
/// the node that receives it).
struct Cluster {
    name: &'static str,
    c: u8,
    dir: tempfile::TempDir,
}

impl Cluster {
    fn node(&self, j: u8) -> String {
        format!("{}{j}", self.name)
    }
    fn pod_ip(&self, j: u8) -> String {
        format!("10.4{}.{j}.2", self.c)
    }
    fn service_range(&self) -> String {
        format!("10.3{}.0.0/16", self.c)
    }
    fn service_ip(&self) -> String {
        format!("10.3{}.0.10", self.c)
    }
    fn objects(&self) -> &Path {
        self.dir.path()
    }
}

/// A node's namespaces and device, dropped after its kg.
struct Node {
    ns: NetNs,
    pod: NetNs,
    wg: WgGo,
}

fn kgctl(cluster: &Cluster, args: &[&str]) -> std::process::Output {
    Launch::kgctl()
        .arg("--backend=file")
        .arg(format!("--backend-dir={}", cluster.objects().display()))
        .args(args)
        .output()
}

#[test]
fn two_clusters_joined_as_peers_reach_each_others_pods_and_services() {
    if !support::require_root("two_clusters_joined_as_peers_reach_each_others_pods_and_services") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let net = NetNs::new("mcnet");
    net.sh("ip link add br0 type bridge && ip link set br0 up");
    let bpffs = BpfFs::new();
    let clusters = [1u8, 2].map(|c| Cluster {
        name: ["a", "b"][c as usize - 1],
        c,
        dir: tempfile::tempdir().unwrap(),
    });
    let mut nodes = Vec::new();
    for cl in &clusters {
        let c = cl.c;
        for j in [1u8, 2] {
            let name = cl.node(j);
            let ns = NetNs::new(&format!("mc{name}"));
            let pod = NetNs::new(&format!("mcp{name}"));
            veth(&ns, "eth0", &net, &name);
            net.sh(&format!("ip link set {name} master br0"));
            ns.sh(&format!(
                "ip addr add 192.168.1{c}.{j}/24 dev eth0 && sysctl -qw net.ipv4.ip_forward=1 && \
                 ip link add kube-bridge type bridge && ip addr add 10.4{c}.{j}.1/24 dev kube-bridge && \
                 ip link set kube-bridge up"
            ));
            veth(&pod, "eth0", &ns, "vpod");
            ns.sh("ip link set vpod master kube-bridge");
            pod.sh(&format!(
                "ip addr add {}/24 dev eth0 && ip route add default via 10.4{c}.{j}.1",
                cl.pod_ip(j)
            ));
            let mut annotations = format!("    kilo.squat.ai/location: {}\n", cl.name);
            if j == 1 {
                ns.sh(&format!(
                    "ip addr add 203.0.113.{c}/24 dev eth0 && ip addr add {}/32 dev lo",
                    cl.service_ip()
                ));
                annotations.push_str(&format!(
                    "    kilo.squat.ai/leader: \"true\"\n    \
                     kilo.squat.ai/force-endpoint: 203.0.113.{c}:51820\n"
                ));
            }
            std::fs::write(
                cl.objects().join(format!("node-{name}.yaml")),
                format!(
                    "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  annotations:\n\
                     {annotations}spec:\n  podCIDR: 10.4{c}.{j}.0/24\n"
                ),
            )
            .unwrap();
            let wg = WgGo::start(&ns);
            nodes.push((cl.c, j, Node { ns, pod, wg }));
        }
    }
    let node = |c: u8, j: u8| &nodes.iter().find(|n| n.0 == c && n.1 == j).unwrap().2;
    let mut kgs = Vec::new();
    for cl in &clusters {
        for j in [1u8, 2] {
            let name = cl.node(j);
            let n = node(cl.c, j);
            let flags: Vec<String> = vec![
                "--backend=file".into(),
                format!("--backend-dir={}", cl.objects().display()),
                format!("--hostname={name}"),
                "--create-interface=false".into(),
                format!("--interface={}", n.wg.name),
                "--encapsulate=never".into(),
                "--cni=false".into(),
                format!("--subnet=10.4.{}.0/24", cl.c),
                // The private network, not the service-like address on lo.
                format!("--internal-cidr=192.168.1{}.0/24", cl.c),
                format!(
                    "--private-key={}",
                    work.path().join(format!("{name}.key")).display()
                ),
                format!("--bpffs-dir={}", bpffs.pin_dir(&name).display()),
                "--listen=127.0.0.1:1107".into(),
                "--log-format=text".into(),
            ];
            kgs.push(
                Launch::kg()
                    .netns(&n.ns.name)
                    .args(flags)
                    .append_log(work.path().join(format!("kg-{name}.log")))
                    .spawn(),
            );
        }
    }
    let logs = || {
        kgs.iter()
            .map(|k| format!("--- {}\n{}", k.log_path().display(), k.log()))
            .collect::<String>()
    };

    // Each leader as a Peer of the other cluster, as Kilo's multi-cluster guide does it.
    for (from, to) in [(&clusters[0], &clusters[1]), (&clusters[1], &clusters[0])] {
        let leader = from.node(1);
        let range = from.service_range();
        let args = [
            "showconf",
            "node",
            leader.as_str(),
            "--as-peer",
            "-o",
            "yaml",
            "--allowed-ips",
            range.as_str(),
        ];
        // Both nodes' pod CIDRs and the extra range, once both nodes have published themselves.
        let want = [
            format!("10.4{}.1.0/24", from.c),
            format!("10.4{}.2.0/24", from.c),
            range.clone(),
        ];
        let mut yaml = String::new();
        eventually(&format!("{leader} prints its location as a Peer"), || {
            let out = kgctl(from, &args);
            yaml = String::from_utf8_lossy(&out.stdout).into_owned();
            out.status.success()
                && yaml.contains("203.0.113.")
                && want.iter().all(|w| yaml.contains(w.as_str()))
        });
        let peer: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(peer["kind"], "Peer", "{yaml}");
        assert_eq!(peer["metadata"]["name"], leader.as_str(), "{yaml}");
        let allowed: Vec<&str> = peer["spec"]["allowedIPs"]
            .as_sequence()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        for w in &want {
            assert!(allowed.contains(&w.as_str()), "{w} in {yaml}");
        }
        std::fs::write(to.objects().join(format!("peer-{leader}.yaml")), &yaml).unwrap();
    }

    let pings = |from: &NetNs, to: &str| {
        from.try_sh(&format!("busybox ping -c1 -W1 {to}"))
            .status
            .success()
    };
    let (a, b) = (&clusters[0], &clusters[1]);
    // Leader's pod to leader's pod, non-leader's to non-leader's (through both leaders), and
    // each cluster to the other's service-like address.
    let paths = [
        (node(1, 1), b.pod_ip(1)),
        (node(1, 2), b.pod_ip(2)),
        (node(2, 2), a.pod_ip(2)),
        (node(1, 2), b.service_ip()),
        (node(2, 1), a.service_ip()),
    ];
    for (from, to) in &paths {
        let mut ok = false;
        for _ in 0..60 {
            if pings(&from.pod, to) {
                ok = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
        assert!(
            ok,
            "{} cannot reach {to}\n{}\n{}\n{}",
            from.pod.name,
            node(1, 1)
                .ns
                .sh(&format!("ip route; wg show {}", node(1, 1).wg.name)),
            node(2, 1)
                .ns
                .sh(&format!("ip route; wg show {}", node(2, 1).wg.name)),
            logs()
        );
    }
    // Through WireGuard: each leader routes the other cluster's ranges to its WireGuard device,
    // which carried traffic both ways; non-leaders route them to their leader.
    for (c, other) in [(1u8, b), (2, a)] {
        let leader = node(c, 1);
        let routes = leader.ns.sh("ip route");
        for dst in [format!("10.4{}.2.0/24", other.c), other.service_range()] {
            assert!(
                routes
                    .lines()
                    .any(|l| l.starts_with(&dst) && l.contains(&leader.wg.name)),
                "{dst} via {} in {routes}",
                leader.wg.name
            );
        }
        let transfer = leader
            .ns
            .sh(&format!("wg show {} transfer", leader.wg.name));
        // One line per peer: key, bytes received, bytes sent.
        let (rx, tx) = transfer.lines().fold((0u64, 0u64), |(r, t), l| {
            let f: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .map(|v| v.parse().unwrap())
                .collect();
            (r + f[0], t + f[1])
        });
        assert!(rx > 0 && tx > 0, "{transfer}");
        let routes = node(c, 2).ns.sh("ip route");
        assert!(
            routes
                .lines()
                .any(|l| l.starts_with(&format!("10.4{}.2.0/24 via 192.168.1{c}.1", other.c))),
            "{routes}"
        );
    }
    // Pods see each other's own addresses: nothing between the clusters is masqueraded.
    let seen = udp_source(
        &node(1, 2).pod,
        &node(2, 2).pod,
        b.pod_ip(2).parse::<IpAddr>().unwrap(),
        7101,
    );
    assert_eq!(seen, Some(a.pod_ip(2).parse().unwrap()), "{}", logs());

    drop(kgs);
    drop(nodes);
    drop(net);
    let left = support::netns::sh("ip netns list");
    let ours = format!("-{}-", std::process::id());
    assert!(
        !left
            .lines()
            .any(|l| l.starts_with("krs-mc") && l.contains(&ours)),
        "namespaces left behind: {left}"
    );
}
