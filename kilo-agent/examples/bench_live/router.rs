//! The router's configurations: no program, the sink, the empty program, the lookups alone or
//! ours at its ingress, behind no nftables table, ours or NAT-everything; and the plan its tries
//! hold at N mesh entries.
use std::{collections::BTreeMap, net::Ipv4Addr};

use aya::programs::{
    LinkOrder, SchedClassifier, TcAttachType,
    tc::{SchedClassifierLink, TcAttach},
};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use kilo_agent::{
    datapath::{AttachMode, Datapath, DatapathConfig, Framing, ifindex, nft},
    plan::{DatapathEntry, DatapathPlan, Device, EntryKind, NextHop},
};
use kilo_common::PROG_LOOKUPS;
use kilo_testkit::{self as support, netns::sh};

use crate::lab::{DROP_TABLE, drop_at_ingress, enter};

const NAT_ALL_TABLE: &str = "benchnatall";
const KILO_TABLE: &str = "kilobench";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Prog {
    None,
    /// Dropped by an nftables netdev-ingress rule at the router's ingress (calibration).
    Sink,
    Empty,
    /// The lookups alone (`kilo_lookups`), in copies of our tries.
    Lookups,
    Ours,
    OursFast,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Nf {
    /// No nftables table: no conntrack in the router namespace.
    Off,
    /// Our table: `meta mark & M == M masquerade` (conntrack on).
    Kilo,
    /// NAT everything without a list: an unconditional `masquerade` (conntrack on).
    NatAll,
}

pub struct Router {
    ns: String,
    pub dp: Datapath,
    noop: aya::Ebpf,
    pub lookups: Option<aya::Ebpf>,
    /// The attached baseline's link (the empty program or the lookups alone).
    baseline_link: Option<SchedClassifierLink>,
    prog: Prog,
    nf: Nf,
}

impl Router {
    /// Loads ours and the baselines; the calling thread must be in the router namespace.
    pub fn new(ns: &str) -> Router {
        let dp = Datapath::open(DatapathConfig {
            pin_dir: None,
            attach: AttachMode::Tcx,
            max_entries: 1 << 18,
            counter_slots: 131_072,
            nft_table: KILO_TABLE.into(),
            ..Default::default()
        })
        .expect("load the datapath");
        let noop = support::noop();
        Router {
            ns: ns.to_owned(),
            dp,
            noop,
            lookups: None,
            baseline_link: None,
            prog: Prog::None,
            nf: Nf::Off,
        }
    }

    /// (run time ns, run count) of the attached BPF program, from BPF_ENABLE_STATS.
    pub fn prog_stats(&self) -> Option<(u64, u64)> {
        let prog = match self.prog {
            Prog::Empty => support::noop_program(&self.noop),
            Prog::Lookups => support::baseline(self.lookups.as_ref()?, PROG_LOOKUPS),
            Prog::Ours | Prog::OursFast => self.dp.program(Framing::L2),
            Prog::None | Prog::Sink => return None,
        };
        let info = prog.info().expect("program info");
        Some((info.run_time().as_nanos() as u64, info.run_count()))
    }

    /// Fills our tries with [`plan`]`(n)`, the mesh next hop on `out0`; the map writes it took.
    pub fn apply_plan(&mut self, n: usize) -> u64 {
        enter(&self.ns);
        let out0 = ifindex("out0").expect("out0");
        let resolver = move |d: Device| (d == Device::Private).then_some(out0);
        self.dp.apply(&plan(n), &resolver).expect("apply").total()
    }

    /// Attaches `prog` and sets up `nf` (from the router namespace, whatever the thread's).
    pub fn set(&mut self, prog: Prog, nf: Nf) {
        enter(&self.ns);
        if nf != self.nf {
            match self.nf {
                Nf::Off => {}
                Nf::Kilo => {
                    nft::remove_masquerade(KILO_TABLE).expect("remove our table");
                }
                Nf::NatAll => {
                    sh(&format!(
                        "ip netns exec {} nft delete table ip {NAT_ALL_TABLE}",
                        self.ns
                    ));
                }
            }
            match nf {
                Nf::Off => {}
                Nf::Kilo => {
                    self.dp.ensure_masquerade().expect("our table");
                }
                Nf::NatAll => {
                    sh(&format!(
                        "ip netns exec {} nft 'add table ip {t}; \
                         add chain ip {t} post {{ type nat hook postrouting priority srcnat; }}; \
                         add rule ip {t} post masquerade'",
                        self.ns,
                        t = NAT_ALL_TABLE
                    ));
                }
            }
            self.nf = nf;
        }
        if prog != self.prog {
            match self.prog {
                Prog::None => {}
                Prog::Sink => {
                    sh(&format!(
                        "ip netns exec {} nft delete table netdev {DROP_TABLE}",
                        self.ns
                    ));
                }
                Prog::Empty | Prog::Lookups => self.baseline_link = None,
                Prog::Ours | Prog::OursFast => {
                    self.dp.detach("pod0").expect("detach ours");
                }
            }
            match prog {
                Prog::None => {}
                Prog::Sink => {
                    sh(&drop_at_ingress(&self.ns, "pod0"));
                }
                Prog::Empty | Prog::Lookups => {
                    let (ebpf, name) = if prog == Prog::Empty {
                        (&mut self.noop, kilo_common::PROG_NOOP)
                    } else {
                        let lookups = self.lookups.as_mut().expect("lookups loaded");
                        (lookups, PROG_LOOKUPS)
                    };
                    let p: &mut SchedClassifier =
                        ebpf.program_mut(name).unwrap().try_into().unwrap();
                    let id = p
                        .attach(
                            ifindex("pod0").unwrap(),
                            TcAttach::Tcx {
                                attach_type: TcAttachType::Ingress,
                                order: LinkOrder::default(),
                            },
                        )
                        .expect("attach a baseline program");
                    self.baseline_link = Some(p.take_link(id).unwrap());
                }
                Prog::Ours | Prog::OursFast => {
                    self.dp.attach("pod0").expect("attach ours");
                }
            }
            self.prog = prog;
        }
        self.dp
            .set_fast_path(prog == Prog::OursFast)
            .expect("fast path flag");
    }
}

fn entry(kind: EntryKind, owner: String, next_hop: Option<NextHop>) -> DatapathEntry {
    DatapathEntry {
        kind,
        owner,
        next_hop,
    }
}

/// The live plan: the mesh /24 behind the receiver (next hop the receiver on out0, for the fast
/// path), the local pods (a NAT source and a mesh destination), plus `filler` cluster-shaped
/// mesh destinations (per node a pod /24 in 10.64.0.0/10, an internal /32 in 172.16.0.0/12 and
/// an IPv6 /64), none of which covers the benchmark's internet destinations (198.18.0.0/15).
pub fn plan(filler: usize) -> DatapathPlan {
    let mut mesh = BTreeMap::new();
    let hop = NextHop::Gateway {
        address: "192.0.2.2".parse().unwrap(),
        device: Device::Private,
    };
    mesh.insert(
        "10.20.0.0/24".parse().unwrap(),
        entry(EntryKind::Node, "receiver".into(), Some(hop)),
    );
    mesh.insert(
        "10.10.1.0/24".parse().unwrap(),
        entry(EntryKind::Node, "router".into(), None),
    );
    let mut i = 0usize;
    while mesh.len() < filler + 2 {
        let k = (i / 3) as u32;
        let net = match i % 3 {
            0 => IpNet::V4(Ipv4Net::new(Ipv4Addr::from(0x0a40_0000u32 + (k << 8)), 24).unwrap()),
            1 => IpNet::V4(Ipv4Net::new(Ipv4Addr::from(0xac10_0000u32 + k), 32).unwrap()),
            _ => IpNet::V6(
                Ipv6Net::new(
                    std::net::Ipv6Addr::from((0xfd00_u128 << 112) | (u128::from(k) << 64)),
                    64,
                )
                .unwrap(),
            ),
        };
        mesh.insert(net, entry(EntryKind::Node, format!("node-{k}"), None));
        i += 1;
    }
    DatapathPlan {
        mesh_destinations: mesh,
        nat_sources: BTreeMap::from([(
            "10.10.1.0/24".parse().unwrap(),
            entry(EntryKind::LocalPods, "router".into(), None),
        )]),
        masquerade_destinations: BTreeMap::from([(
            "192.168.50.0/24".parse().unwrap(),
            entry(EntryKind::AllowedLocation, "location".into(), None),
        )]),
    }
}
