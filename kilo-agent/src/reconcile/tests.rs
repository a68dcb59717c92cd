//! The reconcilers on the in-memory kernel and WireGuard: convergence, realms, the CNI file.
use super::{wireguard::FakeWireGuard, *};
use crate::datapath::{DatapathOpsError, NoDatapath};
use crate::plan::{
    DatapathPlan, Device, KILO_TABLE, MAIN_TABLE, Route, Rule, WireGuardPeer, WireGuardPlan,
};
use crate::writes::Write;

fn plan() -> Plan {
    Plan {
        addresses: vec!["10.4.0.1/16".parse().unwrap()],
        wireguard: WireGuardPlan {
            listen_port: 51820,
            peers: vec![WireGuardPeer {
                public_key: Key([1; 32]),
                preshared_key: None,
                endpoint: Some("192.0.2.1:51820".parse().unwrap()),
                allowed_ips: vec!["10.2.1.0/24".parse().unwrap()],
                persistent_keepalive: 0,
            }],
        },
        routes: vec![Route {
            dst: "10.2.1.0/24".parse().unwrap(),
            gateway: Some("10.4.0.2".parse().unwrap()),
            src: None,
            device: Device::WireGuard,
            onlink: true,
            table: MAIN_TABLE,
        }],
        rules: vec![Rule {
            src: Some("10.2.0.0/24".parse().unwrap()),
            dst: None,
            iif: None,
            table: KILO_TABLE,
        }],
        datapath: DatapathPlan::default(),
        ipip: Default::default(),
        cni_ranges: Vec::new(),
        forward: Vec::new(),
    }
}

fn reconciler() -> Reconciler<FakeKernel, FakeWireGuard, NoDatapath> {
    Reconciler::new(
        FakeKernel::default(),
        FakeWireGuard::default(),
        NoDatapath,
        DeviceSettings {
            devices: Devices {
                wireguard: "kilo0".into(),
                private: None,
                tunnel: None,
            },
            create_interface: true,
            mtu: Some(1420),
            private_key: Key([9; 32]),
            dns: Box::new(wireguard::system_resolver),
        },
    )
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn converges_then_writes_nothing_then_cleans_up() {
    block_on(async {
        let mut r = reconciler();
        let first = r.reconcile(&plan()).await.unwrap();
        assert!(first.problems.is_empty(), "{:?}", first.problems);
        for kind in [
            Write::LinkAdd,
            Write::LinkSet,
            Write::AddressAdd,
            Write::RouteAdd,
            Write::RuleAdd,
        ] {
            assert_eq!(first.writes.get(kind), 1, "{kind}: {}", first.writes);
        }
        assert_eq!(first.writes.get(Write::WireguardPeerAdd), 1);
        let second = r.reconcile(&plan()).await.unwrap();
        assert!(second.writes.is_empty(), "{}", second.writes);
        assert!(r.dry_run(&plan()).await.unwrap().to_string().is_empty());

        let clean = r.clean_up(true).await.unwrap();
        assert_eq!(clean.writes.get(Write::RouteDel), 1);
        assert_eq!(clean.writes.get(Write::RuleDel), 1);
        assert_eq!(clean.writes.get(Write::LinkDel), 1);
        assert!(r.kernel.state.routes.is_empty() && r.kernel.state.rules.is_empty());
    });
}

/// A pass that adds WireGuard peers names their WireGuard IPs (the single addresses of their
/// allowed IPs inside the local WireGuard subnet), to start the handshakes; one that adds none
/// names none.
#[test]
fn added_peers_are_named_by_their_wireguard_ip() {
    block_on(async {
        let mut r = reconciler();
        let mut p = plan();
        p.wireguard.peers[0].allowed_ips = ["10.2.1.0/24", "192.168.1.5/32", "10.4.0.2/32"]
            .map(|c| c.parse().unwrap())
            .to_vec();
        assert_eq!(
            r.reconcile(&p).await.unwrap().new_peers,
            ["10.4.0.2".parse::<IpAddr>().unwrap()]
        );
        assert!(r.reconcile(&p).await.unwrap().new_peers.is_empty());
        // A peer without one (a Peer's allowed IPs outside the subnet) is not knocked on.
        p.wireguard.peers.push(WireGuardPeer {
            public_key: Key([2; 32]),
            allowed_ips: vec!["10.9.0.0/24".parse().unwrap()],
            ..p.wireguard.peers[0].clone()
        });
        assert!(r.reconcile(&p).await.unwrap().new_peers.is_empty());
    });
}

/// The plan's FORWARD accepts reach the rules' keeper at each reconcile (two rules each; none
/// written when they are there), the dry run names the missing ones, clean-up removes them.
#[test]
fn forward_rules_follow_the_plan_and_go_on_clean_up() {
    use crate::{
        datapath::forward::FakeForward,
        plan::{ForwardAccept, ForwardWhat},
    };
    block_on(async {
        let mut r = reconciler().with_forward_rules(Box::new(FakeForward::default()));
        let accept = |net: &str| ForwardAccept {
            net: net.parse().unwrap(),
            what: ForwardWhat::NodePodSubnet,
        };
        let with = |nets: &[&str]| Plan {
            forward: nets.iter().map(|n| accept(n)).collect(),
            ..plan()
        };
        let dry = r
            .dry_run(&with(&["10.2.0.0/24"]))
            .await
            .unwrap()
            .to_string();
        assert!(
            dry.contains("+ iptables -I FORWARD -s 10.2.0.0/24"),
            "{dry}"
        );
        let first = r.reconcile(&with(&["10.2.0.0/24"])).await.unwrap();
        assert_eq!(
            first.writes.get(Write::ForwardRuleAdd),
            2,
            "{}",
            first.writes
        );
        let again = r.reconcile(&with(&["10.2.0.0/24"])).await.unwrap();
        assert!(again.writes.is_empty(), "{}", again.writes);
        let moved = r.reconcile(&with(&["10.2.9.0/24"])).await.unwrap();
        assert_eq!(moved.writes.get(Write::ForwardRuleAdd), 2);
        assert_eq!(moved.writes.get(Write::ForwardRuleDel), 2);
        let clean = r.clean_up(true).await.unwrap();
        assert_eq!(
            clean.writes.get(Write::ForwardRuleDel),
            2,
            "{}",
            clean.writes
        );
    });
}

#[test]
fn the_cni_configuration_follows_the_plans_pod_cidrs() {
    block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("10-kilo.conflist");
        std::fs::write(
            &path,
            r#"{"name":"kilo","plugins":[{"type":"bridge","ipam":{"type":"host-local"}}]}"#,
        )
        .unwrap();
        let mut r = reconciler().with_cni(path.clone());
        let plan = Plan {
            cni_ranges: vec!["10.2.1.0/24".parse().unwrap()],
            ..plan()
        };
        let first = r.reconcile(&plan).await.unwrap();
        assert_eq!(first.writes.get(Write::CniConfig), 1, "{}", first.writes);
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .contains("10.2.1.0/24")
        );
        assert!(r.dry_run(&plan).await.unwrap().to_string().is_empty());
        assert!(r.reconcile(&plan).await.unwrap().writes.is_empty());
        // A moved pod CIDR: the dry run says so, the reconcile writes it.
        let moved = Plan {
            cni_ranges: vec!["10.2.9.0/24".parse().unwrap()],
            ..plan.clone()
        };
        let dry = r.dry_run(&moved).await.unwrap().to_string();
        assert!(dry.contains("10.2.9.0/24"), "{dry}");
        assert_eq!(
            r.reconcile(&moved)
                .await
                .unwrap()
                .writes
                .get(Write::CniConfig),
            1
        );
    });
}

#[test]
fn our_address_on_another_link_is_a_problem_and_still_added() {
    block_on(async {
        let mut r = reconciler();
        (r.kernel.state.elsewhere).insert("10.4.0.1".parse().unwrap(), "eth0".into());
        let report = r.reconcile(&plan()).await.unwrap();
        assert_eq!(report.writes.get(Write::AddressAdd), 1, "{}", report.writes);
        assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
        assert!(
            report.problems[0].contains("10.4.0.1 is also on eth0"),
            "{:?}",
            report.problems
        );
    });
}

/// A datapath that only remembers what it was told of route realms.
#[derive(Default)]
struct RealmDatapath(bool);

impl DatapathOps for RealmDatapath {
    fn apply(
        &mut self,
        _: &DatapathPlan,
        _: &crate::plan::IpipPlan,
        _: Option<&BTreeMap<String, u32>>,
    ) -> Result<Writes, DatapathOpsError> {
        Ok(Writes::default())
    }
    fn clean_up(&mut self) -> Result<Writes, DatapathOpsError> {
        Ok(Writes::default())
    }
    fn route_realm(&mut self, hold: bool) -> Result<Writes, DatapathOpsError> {
        let mut w = Writes::default();
        if self.0 != hold {
            self.0 = hold;
            w.add(Write::MapConfig, 1);
        }
        Ok(w)
    }
}

/// The plan with a route the datapath encapsulates (through `tunl0`, no tunnel device),
/// reconciled by a kernel that keeps realms or drops them.
fn realm_reconciler(
    drops_realms: bool,
) -> (Reconciler<FakeKernel, FakeWireGuard, RealmDatapath>, Plan) {
    let r = reconciler();
    let datapath = RealmDatapath::default();
    let mut r = Reconciler::new(r.kernel, r.wireguard, datapath, r.settings);
    r.settings.devices.private = Some("eth0".into());
    r.kernel.drops_realms = drops_realms;
    let eth0 = LinkState {
        index: 2,
        up: true,
        mtu: 1500,
    };
    r.kernel.state.links.insert("eth0".into(), eth0);
    let mut plan = plan();
    plan.routes.push(Route {
        dst: "192.168.0.2/32".parse().unwrap(),
        gateway: Some("192.168.0.2".parse().unwrap()),
        src: None,
        device: Device::Tunnel,
        onlink: true,
        table: KILO_TABLE,
    });
    (r, plan)
}

#[test]
fn tunnel_routes_carry_our_realm_and_the_datapath_learns_it_holds() {
    block_on(async {
        let (mut r, plan) = realm_reconciler(false);
        let first = r.reconcile(&plan).await.unwrap();
        assert!(first.problems.is_empty(), "{:?}", first.problems);
        let tunnel: Vec<_> = (r.kernel.state.routes.iter())
            .filter(|k| k.oif == 2)
            .collect();
        assert_eq!(tunnel.len(), 1);
        assert_eq!(tunnel[0].realm, Some(KILO_REALM), "{}", tunnel[0]);
        assert!(
            r.kernel
                .state
                .routes
                .iter()
                .all(|k| k.oif == 2 || k.realm.is_none()),
            "only the encapsulated routes carry it"
        );
        // Read back in the same pass: the datapath checks realms from now on.
        assert_eq!(r.realms(), Realms::Hold);
        assert!(r.datapath.0);
        assert_eq!(first.writes.get(Write::MapConfig), 1, "{}", first.writes);
        assert!(r.reconcile(&plan).await.unwrap().writes.is_empty());
        // A new agent (restart) learns it from the routes it finds.
        let (mut again, _) = realm_reconciler(false);
        again.kernel.state = r.kernel.state.clone();
        let report = again.reconcile(&plan).await.unwrap();
        assert_eq!(again.realms(), Realms::Hold);
        assert_eq!(
            report.writes.get(Write::RouteReplace),
            0,
            "{}",
            report.writes
        );
        assert!(again.datapath.0);
    });
}

#[test]
fn a_kernel_that_drops_realms_is_not_asked_again() {
    block_on(async {
        let (mut r, plan) = realm_reconciler(true);
        let first = r.reconcile(&plan).await.unwrap();
        assert!(first.problems.is_empty(), "{:?}", first.problems);
        assert_eq!(r.realms(), Realms::Dropped);
        assert!(!r.datapath.0, "the full lookup stays on");
        // No replacing the route pass after pass.
        let second = r.reconcile(&plan).await.unwrap();
        assert!(second.writes.is_empty(), "{}", second.writes);
        assert!(r.dry_run(&plan).await.unwrap().to_string().is_empty());
        assert!(r.kernel.state.routes.iter().all(|k| k.realm.is_none()));
    });
}

#[test]
fn missing_interface_without_create_is_a_problem() {
    block_on(async {
        let mut r = reconciler();
        r.settings.create_interface = false;
        let report = r.reconcile(&plan()).await.unwrap();
        assert_eq!(
            report.problems,
            [KernelError::NoInterface("kilo0".into()).to_string()]
        );
        assert!(report.writes.is_empty(), "{}", report.writes);
    });
}

/// What the kernel and the device were asked to write, in order.
type Log = Arc<Mutex<Vec<String>>>;

/// A fake that logs its writes in a [`Log`] shared with the other fake.
struct Logged<T>(T, Log);

impl Kernel for Logged<FakeKernel> {
    async fn observe(&mut self, d: &Devices) -> Result<KernelState, KernelError> {
        self.0.observe(d).await
    }
    async fn create_wireguard(&mut self, name: &str) -> Result<Writes, KernelError> {
        self.0.create_wireguard(name).await
    }
    async fn delete_link(&mut self, index: u32) -> Result<Writes, KernelError> {
        self.0.delete_link(index).await
    }
    async fn apply(&mut self, d: &KernelDiff) -> (Writes, Vec<KernelError>) {
        let dels = d.route_del.iter().map(|r| format!("- route {}", r.dst));
        let adds = d
            .route_add
            .iter()
            .map(|(r, _)| format!("+ route {}", r.dst));
        self.1.lock().unwrap().extend(dels.chain(adds));
        self.0.apply(d).await
    }
}

impl WireGuard for Logged<FakeWireGuard> {
    fn observe(&mut self) -> Result<Option<wireguard::DeviceState>, wireguard::WgError> {
        self.0.observe()
    }
    fn apply(&mut self, d: &WgDiff) -> Result<Writes, wireguard::WgError> {
        let adds = d.add.iter().map(|(k, _)| format!("+ peer {}", k.0[0]));
        self.1.lock().unwrap().extend(adds);
        self.0.apply(d)
    }
}

/// A node that becomes its location's leader adds a peer whose endpoint its last plan routed
/// elsewhere (through the old leader, or into the tunnel): the peer answers handshakes as soon
/// as it exists, so that route goes first, else the answer takes it and is lost.
#[test]
fn a_new_peer_comes_after_the_routes_to_its_endpoint() {
    block_on(async {
        let log = Log::default();
        let r = reconciler();
        let mut r = Reconciler::new(
            Logged(FakeKernel::default(), log.clone()),
            Logged(FakeWireGuard::default(), log.clone()),
            NoDatapath,
            r.settings,
        );
        let mut before = plan();
        before.routes.push(Route {
            dst: "198.51.100.7/32".parse().unwrap(),
            ..before.routes[0].clone()
        });
        r.reconcile(&before).await.unwrap();
        log.lock().unwrap().clear();

        let mut after = plan();
        after.wireguard.peers[0].public_key = Key([3; 32]);
        after.wireguard.peers[0].endpoint = Some("198.51.100.7:51820".parse().unwrap());
        r.reconcile(&after).await.unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            ["- route 198.51.100.7/32", "+ peer 3"]
        );
    });
}
