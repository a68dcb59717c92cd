//! `--iptables-forward-rules` against the real kernel: a router namespace running the real `kg`
//! (file backend, wireguard-go, its pod bridge) whose iptables FORWARD policy is DROP, as
//! Docker sets it, a pod namespace behind the bridge and a destination namespace beyond eth0.
//! The pod reaches the destination only once kg's ACCEPT rules are in iptables' own
//! `ip filter` FORWARD chain; `iptables-nft` lists them as its own; a resync with the rules in
//! place writes nothing; clean-up removes exactly kg's rules.
//!
//! Tests may run `iptables-nft` and `busybox ping`; kg itself never starts a process.
use kilo_testkit as support;

use kilo_agent::writes::Write;
use kilo_agent::{
    datapath::forward::{self, ForwardKeeper, ForwardRules as _},
    plan::{ForwardAccept, ForwardWhat},
};
use support::{
    bpffs::BpfFs,
    eventually,
    kg::{Kg, Launch},
    metrics,
    netns::{NetNs, WgGo, veth},
};

/// The router (kg's node, pod CIDR 10.42.1.0/24 on `kube-bridge`, eth0 10.9.0.1/24), a pod
/// (10.42.1.2) behind the bridge and a destination (10.9.0.254) beyond eth0, which routes the
/// pod CIDR back through the router (so the replies cross FORWARD too, unmasqueraded).
struct Setup {
    router: NetNs,
    pod: NetNs,
    _dest: NetNs,
}

fn setup(tag: &str) -> Setup {
    setup_with(tag, "iptables-nft")
}

/// [`setup`] with the FORWARD chain's policy and the foreign rule set by `iptables`
/// (`iptables-nft` or `iptables-legacy`).
fn setup_with(tag: &str, iptables: &str) -> Setup {
    let router = NetNs::new(tag);
    let pod = NetNs::new(&format!("{tag}p"));
    let dest = NetNs::new(&format!("{tag}d"));
    for ns in [&router, &pod, &dest] {
        ns.sh("sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1");
    }
    veth(&router, "eth0", &dest, "eth0");
    router.sh("ip addr add 10.9.0.1/24 dev eth0 && sysctl -qw net.ipv4.ip_forward=1");
    dest.sh("ip addr add 10.9.0.254/24 dev eth0 && ip route add 10.42.1.0/24 via 10.9.0.1");
    router.sh(
        "ip link add kube-bridge type bridge && ip addr add 10.42.1.1/24 dev kube-bridge && \
         ip link set kube-bridge up",
    );
    veth(&router, "pod0", &pod, "eth0");
    router.sh("ip link set pod0 master kube-bridge");
    pod.sh("ip addr add 10.42.1.2/24 dev eth0 && ip route add default via 10.42.1.1");
    // What Docker does to the host: iptables' FORWARD chain drops what nothing accepted. And
    // a rule of somebody else's, which kg must leave alone.
    router.sh(&format!("{iptables} -P FORWARD DROP"));
    router.sh(&format!("{iptables} -A FORWARD -s 192.0.2.0/24 -j DROP"));
    Setup {
        router,
        pod,
        _dest: dest,
    }
}

fn pod_reaches_destination(s: &Setup) -> bool {
    s.pod
        .try_sh("busybox ping -c 1 -W 1 10.9.0.254")
        .status
        .success()
}

fn forward_chain(ns: &NetNs) -> String {
    ns.sh("iptables-nft -S FORWARD")
}

/// kg's lines of `iptables-nft -S FORWARD`.
fn kg_rules(ns: &NetNs) -> Vec<String> {
    forward_chain(ns)
        .lines()
        .filter(|l| l.contains("kilo-rs"))
        .map(str::to_owned)
        .collect()
}

/// The real kg in the router namespace: the node `kgtest` with the pod CIDR of [`setup`], as
/// the CNI (`--cni`, the default, a configuration file of its own), a resync every second.
fn start_kg(s: &Setup, dir: &tempfile::TempDir, bpffs: &BpfFs, wg: &WgGo, args: &[&str]) -> Kg {
    let objects = dir.path().join("objects");
    std::fs::create_dir_all(&objects).unwrap();
    std::fs::write(
        objects.join("kgtest.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: kgtest\nspec:\n  podCIDR: 10.42.1.0/24\n",
    )
    .unwrap();
    let cni = dir.path().join("10-kilo.conflist");
    std::fs::write(
        &cni,
        r#"{"cniVersion":"0.4.0","name":"kilo","plugins":[{"type":"bridge","bridge":"kube-bridge","ipam":{"type":"host-local"}}]}"#,
    )
    .unwrap();
    let kg = Launch::kg()
        .netns(&s.router.name)
        .args([
            "--backend=file".to_string(),
            format!("--backend-dir={}", objects.display()),
            "--hostname=kgtest".into(),
            format!("--private-key={}", dir.path().join("key").display()),
            format!("--interface={}", wg.name),
            "--create-interface=false".into(),
            format!("--bpffs-dir={}", bpffs.pin_dir("kilo").display()),
            format!("--cni-path={}", cni.display()),
            "--resync-period=1s".into(),
            "--listen=127.0.0.1:1107".into(),
        ])
        .args(args)
        .spawn();
    kg.wait_ready();
    kg
}

fn writes(kg: &Kg, kind: &str) -> u64 {
    let text = kg.metrics().unwrap_or_default();
    metrics::metric(&text, &format!("kilo_writes_total{{kind=\"{kind}\"}}")).unwrap_or(0)
}

fn reconciles(kg: &Kg) -> u64 {
    let text = kg.metrics().unwrap_or_default();
    metrics::metric(&text, "kilo_reconciles_total").unwrap_or(0)
}

#[test]
fn forward_rules_let_pods_through_a_drop_policy_and_go_on_clean_up() {
    if !support::require_root("forward_rules_let_pods_through_a_drop_policy_and_go_on_clean_up") {
        return;
    }
    let s = setup("fw");
    let before = forward_chain(&s.router);
    assert!(
        !pod_reaches_destination(&s),
        "FORWARD DROP must stop the pod's traffic before kg runs:\n{before}"
    );

    let dir = tempfile::tempdir().unwrap();
    let bpffs = BpfFs::new();
    let wg = WgGo::start(&s.router);

    // Without the flag, kg adds nothing to FORWARD, and the policy still drops the pod's traffic.
    let mut kg = start_kg(&s, &dir, &bpffs, &wg, &[]);
    let seen = reconciles(&kg);
    eventually("two more reconciles", || reconciles(&kg) >= seen + 2);
    assert!(
        kg_rules(&s.router).is_empty(),
        "{}",
        forward_chain(&s.router)
    );
    assert!(!pod_reaches_destination(&s), "no flag, no forwarding");
    kg.stop();

    let mut kg = start_kg(&s, &dir, &bpffs, &wg, &["--iptables-forward-rules=true"]);
    eventually("the pod reaches the destination through FORWARD", || {
        pod_reaches_destination(&s)
    });
    // The rules of Kilo's leader (the node is its location's only node): from and to the pod
    // CIDR and the node's private IP, read back by iptables-nft as its own.
    let mut rules = kg_rules(&s.router);
    rules.sort();
    let want = [
        r#"-A FORWARD -d 10.42.1.0/24 -m comment --comment "kilo-rs: forward packets to the pod subnet" -j ACCEPT"#,
        r#"-A FORWARD -d 10.9.0.1/32 -m comment --comment "kilo-rs: forward packets to private IPs" -j ACCEPT"#,
        r#"-A FORWARD -s 10.42.1.0/24 -m comment --comment "kilo-rs: forward packets from the pod subnet" -j ACCEPT"#,
        r#"-A FORWARD -s 10.9.0.1/32 -m comment --comment "kilo-rs: forward packets from private IPs" -j ACCEPT"#,
    ];
    assert_eq!(rules, want, "{}", forward_chain(&s.router));
    assert_eq!(writes(&kg, "forward_rule_add"), 4);

    // Resyncs with the rules in place write nothing (and the rules stay where they are).
    let listed = forward_chain(&s.router);
    let seen = reconciles(&kg);
    eventually("three more reconciles", || reconciles(&kg) >= seen + 3);
    assert_eq!(writes(&kg, "forward_rule_add"), 4, "an idle resync wrote");
    assert_eq!(writes(&kg, "forward_rule_del"), 0);
    assert_eq!(forward_chain(&s.router), listed);

    // A rule removed by hand is put back (nftables announced the change).
    s.router.sh(
        r#"iptables-nft -D FORWARD -s 10.42.1.0/24 -m comment --comment "kilo-rs: forward packets from the pod subnet" -j ACCEPT"#,
    );
    eventually("kg restores its rule", || kg_rules(&s.router).len() == 4);
    assert_eq!(writes(&kg, "forward_rule_add"), 5);

    // Clean-up (SIGTERM, --clean-up defaults to true) removes exactly kg's rules: the policy
    // and the other rule stay, and the pod's traffic is dropped again.
    kg.stop();
    assert_eq!(forward_chain(&s.router), before);
    assert!(!pod_reaches_destination(&s));
}

fn accept(net: &str, what: ForwardWhat) -> ForwardAccept {
    ForwardAccept {
        net: net.parse().unwrap(),
        what,
    }
}

/// The keeper alone: IPv4 and IPv6 rules read back by iptables-nft and ip6tables-nft, calls with
/// nothing new neither read nor write, a change of accepts replaces only what changed, and a
/// family without a FORWARD chain gets nothing.
#[test]
fn the_keeper_writes_both_families_and_only_the_difference() {
    if !support::require_root("the_keeper_writes_both_families_and_only_the_difference") {
        return;
    }
    let ns = NetNs::new("fwk");
    ns.sh("iptables-nft -P FORWARD DROP && ip6tables-nft -P FORWARD DROP");
    let v4 = accept("10.42.1.0/24", ForwardWhat::NodePodSubnet);
    let v6 = accept("fd00:42:1::/64", ForwardWhat::NodePodSubnet);
    let (first, idle, checks) = ns.run(|| {
        let mut k = ForwardKeeper::new(100);
        let first = k.ensure(&[v4, v6]).unwrap();
        let checks = k.checks();
        let idle = k.ensure(&[v4, v6]).unwrap();
        (first, idle, k.checks() - checks)
    });
    assert_eq!(first.get(Write::ForwardRuleAdd), 4, "{first}");
    assert!(idle.is_empty(), "{idle}");
    assert_eq!(checks, 0, "nothing announced, nothing new: no read");
    // iptables escapes the apostrophe of Kilo's comment.
    let v4_rules = ns.sh("iptables-nft -S FORWARD");
    assert!(
        v4_rules.contains(
            r#"-A FORWARD -s 10.42.1.0/24 -m comment --comment "kilo-rs: forward packets from the node\'s pod subnet" -j ACCEPT"#
        ),
        "{v4_rules}"
    );
    let v6_rules = ns.sh("ip6tables-nft -S FORWARD");
    assert!(
        v6_rules.contains(
            r#"-A FORWARD -d fd00:42:1::/64 -m comment --comment "kilo-rs: forward packets to the node\'s pod subnet" -j ACCEPT"#
        ),
        "{v6_rules}"
    );
    assert!(v6_rules.starts_with("-P FORWARD DROP"), "{v6_rules}");

    // A new pod CIDR: its two rules replace the old two; IPv6 is left alone.
    let moved = accept("10.42.9.0/24", ForwardWhat::NodePodSubnet);
    let (w, again) = ns.run(|| {
        let mut k = ForwardKeeper::new(100);
        let w = k.ensure(&[moved, v6]).unwrap();
        (w, k.ensure(&[moved, v6]).unwrap())
    });
    assert_eq!(
        (w.get(Write::ForwardRuleAdd), w.get(Write::ForwardRuleDel)),
        (2, 2),
        "{w}"
    );
    assert!(again.is_empty());
    assert!(ns.sh("iptables-nft -S FORWARD").contains("-s 10.42.9.0/24"));
    assert_eq!(ns.sh("ip6tables-nft -S FORWARD"), v6_rules);

    // No ip6 filter table: nothing to write there, and no error.
    let bare = NetNs::new("fwb");
    bare.sh("iptables-nft -P FORWARD DROP");
    let w = bare.run(|| ForwardKeeper::new(100).ensure(&[v4, v6]).unwrap());
    assert_eq!(w.get(Write::ForwardRuleAdd), 2, "{w}");
    assert!(!bare.sh("nft list tables").contains("ip6 filter"));
}

/// On iptables-legacy, kg writes nothing (it cannot without the `iptables` binary) and sees the
/// legacy table, which it reports.
#[test]
fn iptables_legacy_is_detected_and_left_alone() {
    if !support::require_root("iptables_legacy_is_detected_and_left_alone") {
        return;
    }
    let ns = NetNs::new("fwl");
    assert!(!ns.run(forward::legacy_filter));
    ns.sh("iptables-legacy -P FORWARD DROP");
    assert!(ns.run(forward::legacy_filter));
    let w = ns.run(|| {
        ForwardKeeper::new(100)
            .ensure(&[accept("10.42.1.0/24", ForwardWhat::PodSubnet)])
            .unwrap()
    });
    assert!(w.is_empty(), "{w}");
    assert!(
        !ns.sh("nft list tables").contains("filter"),
        "no nftables table made"
    );
    assert!(
        !ns.sh("iptables-legacy -S FORWARD").contains("kilo-rs"),
        "nothing in the legacy table"
    );
}

/// The real kg on an iptables-legacy host: it writes nothing (not even an nftables table) and
/// says once, at warning level, which rules to add by hand.
#[test]
fn on_iptables_legacy_kg_says_once_what_to_add_by_hand() {
    if !support::require_root("on_iptables_legacy_kg_says_once_what_to_add_by_hand") {
        return;
    }
    let s = setup_with("fwg", "iptables-legacy");
    let dir = tempfile::tempdir().unwrap();
    let bpffs = BpfFs::new();
    let wg = WgGo::start(&s.router);
    let mut kg = start_kg(&s, &dir, &bpffs, &wg, &["--iptables-forward-rules=true"]);
    let seen = reconciles(&kg);
    eventually("three more reconciles", || reconciles(&kg) >= seen + 3);
    let text = kg.metrics().expect("kg answers");
    assert_eq!(
        metrics::metric(&text, r#"kilo_writes_total{kind="forward_rule_add"}"#),
        None,
        "{text}"
    );
    let log = kg.stop();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("this host uses iptables-legacy"))
        .collect();
    assert_eq!(said.len(), 1, "{log}");
    assert!(said[0].contains(r#""level":"WARN""#), "{}", said[0]);
    assert!(
        said[0].contains("iptables -I FORWARD -s 10.42.1.0/24"),
        "{}",
        said[0]
    );
    assert!(!s.router.sh("nft list tables").contains("filter"));
}
