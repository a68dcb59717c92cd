//! Kilo's rules: the nat rules Kilo 0.7 keeps for the topology kg's tries hold, loaded with
//! `iptables-restore` into a router of their own, once through Debian's default iptables
//! (nf_tables) and once through `iptables-legacy`. Each has a lab of its own: a legacy nat table,
//! once made, stays hooked until its namespace goes, and would tax every other case.
use std::fmt::Write as _;

use ipnet::IpNet;
use kilo_agent::plan::DatapathPlan;
use kilo_testkit::netns::sh;

use crate::lab::Lab;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Iptables {
    /// Debian's default `iptables`: rules translated into nf_tables expressions.
    Nft,
    /// `iptables-legacy`: x_tables, one rule after another in `ipt_do_table`.
    Legacy,
}

impl Iptables {
    pub const ALL: [Iptables; 2] = [Iptables::Nft, Iptables::Legacy];

    pub fn name(self) -> &'static str {
        match self {
            Iptables::Nft => "nf_tables",
            Iptables::Legacy => "legacy",
        }
    }

    fn command(self) -> &'static str {
        match self {
            Iptables::Nft => "iptables-nft",
            Iptables::Legacy => "iptables-legacy",
        }
    }
}

/// A lab whose router holds Kilo's rules, through one of the two iptables.
pub struct KiloRouter {
    pub lab: Lab,
    pub iptables: Iptables,
}

impl KiloRouter {
    pub fn new(iptables: Iptables) -> KiloRouter {
        let tag = match iptables {
            Iptables::Nft => "n",
            Iptables::Legacy => "l",
        };
        KiloRouter {
            lab: Lab::new(tag),
            iptables,
        }
    }

    /// Replaces the router's nat table with Kilo's rules for `plan`, in one `iptables-restore`.
    pub fn load(&self, plan: &DatapathPlan) {
        let path = std::env::temp_dir().join(format!("{}.rules", self.lab.rtr));
        std::fs::write(&path, rules(plan)).expect("write the rules");
        sh(&format!(
            "ip netns exec {} {}-restore -w < {}",
            self.lab.rtr,
            self.iptables.command(),
            path.display()
        ));
        let _ = std::fs::remove_file(path);
    }

    /// Packets Kilo's MASQUERADE rule has matched so far (`iptables-save -c`).
    pub fn masqueraded(&self) -> u64 {
        let saved = sh(&format!(
            "ip netns exec {} {}-save -c -t nat",
            self.lab.rtr,
            self.iptables.command()
        ));
        saved
            .lines()
            .filter(|l| l.ends_with("-j MASQUERADE"))
            .filter_map(|l| l.strip_prefix('[')?.split(':').next()?.parse::<u64>().ok())
            .sum()
    }
}

/// The IPv4 half of Kilo 0.7's nat rules (`Topology.Rules`, pkg/mesh/routes.go lines 362 to
/// 423) as `iptables-restore` input, for a node whose pods are `plan`'s NAT source and whose
/// mesh is `plan`'s mesh destinations, each one a segment's allowed IP (an IPv4 packet walks no
/// ip6tables rule). Kilo prepends most rules one by one at position 1 (line 132 of
/// pkg/iptables/iptables.go), so each chain holds them in the reverse of the order they are made:
/// - POSTROUTING: a jump per allowed location IP (line 407), then the pod subnet's jump
///   (line 367, with `--cni`, Kilo's default);
/// - KILO-NAT: a RETURN per allowed IP (line 400), then the MASQUERADE appended at the end
///   (line 420).
///
/// A new connection from a pod to the internet walks the whole of KILO-NAT to its MASQUERADE.
pub fn rules(plan: &DatapathPlan) -> String {
    let v4 = |net: &&IpNet| matches!(net, IpNet::V4(_));
    let mut out = String::from(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
         :POSTROUTING ACCEPT [0:0]\n:KILO-NAT - [0:0]\n",
    );
    let mut post = Vec::new();
    for pods in plan.nat_sources.keys().filter(v4) {
        post.push(format!(
            "-A POSTROUTING -s {pods} -m comment --comment \"Kilo: jump to KILO-NAT chain\" -j KILO-NAT"
        ));
    }
    for alip in plan.masquerade_destinations.keys().filter(v4) {
        post.push(format!(
            "-A POSTROUTING -d {alip} -m comment --comment \"Kilo: jump to NAT chain\" -j KILO-NAT"
        ));
    }
    let nat: Vec<String> = plan
        .mesh_destinations
        .keys()
        .filter(v4)
        .map(|aip| {
            format!(
                "-A KILO-NAT -d {aip} -m comment --comment \"Kilo: do not NAT packets destined \
                 for known IPs\" -j RETURN"
            )
        })
        .collect();
    for rule in post.iter().rev().chain(nat.iter().rev()) {
        writeln!(out, "{rule}").unwrap();
    }
    out.push_str(
        "-A KILO-NAT -m comment --comment \"Kilo: NAT remaining packets\" -j MASQUERADE\nCOMMIT\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_in_kilos_order() {
        let plan = crate::router::plan(3);
        let r = rules(&plan);
        let lines: Vec<&str> = r.lines().filter(|l| l.starts_with("-A")).collect();
        assert!(lines[0].starts_with("-A POSTROUTING -d 192.168.50.0/24"));
        assert!(lines[1].starts_with("-A POSTROUTING -s 10.10.1.0/24"));
        assert!(lines.last().unwrap().ends_with("-j MASQUERADE"));
        let returns = lines.iter().filter(|l| l.ends_with("-j RETURN")).count();
        let v4 = plan
            .mesh_destinations
            .keys()
            .filter(|n| matches!(n, IpNet::V4(_)));
        assert_eq!(returns, v4.count());
    }
}
