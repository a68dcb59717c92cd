//! Reconcilers: observe kernel state, diff it against the plan, apply only the difference.
//! Each effect sits behind a small trait with a real implementation and an in-memory fake:
//! [`Kernel`] (links, addresses, routes, rules over rtnetlink), [`wireguard::WireGuard`]
//! (the device, per peer), [`DatapathOps`] (the eBPF maps and NAT rule: the datapath
//! module's trait; the datapath never imports this module) and, optionally, [`ForwardRules`]
//! (`--iptables-forward-rules`, also the datapath module's). [`Reconciler`] runs them in the
//! order a change needs (the datapath, then links, addresses and routes, then WireGuard) and
//! returns the [`Writes`] it made.
//!
//! The writes are counted by kind ([`Write`](crate::writes::Write)); a reconcile of a node that
//! matches its plan returns none.
//!
//! Route realms: the routes the datapath encapsulates carry [`KILO_REALM`], so its
//! encapsulation skips the host's other traffic after one helper call ([`Realms`]). A kernel
//! without CONFIG_IP_ROUTE_CLASSID drops the realm silently: seen once, it is no longer asked
//! for (the encapsulation then looks up every packet: correct, slower).
//!
//! Ownership marker: our routes and rules carry protocol [`RTPROT_KILO`] (107, from Kilo's table
//! 1107; unused by iproute2's `rt_protos`, bird, FRR, Calico (80) or Cilium), so the agent never
//! reads, replaces or deletes anybody else's routes, even in the main table.
pub mod cni;
#[cfg(any(test, feature = "testing"))]
mod fake;
pub mod netlink;
pub mod state;
pub mod wireguard;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::{Arc, Mutex},
};

use ipnet::IpNet;
use kilo_common::KILO_REALM;

#[cfg(any(test, feature = "testing"))]
pub use fake::FakeKernel;

use self::{
    netlink::EventFilter,
    state::{KRoute, KRule, KernelDiff, KernelState, LinkState, LinkWant},
    wireguard::{DnsLookup, WgDiff, WireGuard},
};
use crate::{
    datapath::{DatapathOps, forward::ForwardRules},
    mesh::Key,
    plan::{Devices, Plan},
    writes::Writes,
};

/// The `rtm_protocol` / `FRA_PROTOCOL` value marking routes and rules as ours.
pub const RTPROT_KILO: u8 = 107;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("netlink socket: {0}")]
    Socket(String),
    #[error("{op}: {message}")]
    Netlink { op: String, message: String },
    #[error("WireGuard interface {0} does not exist and --create-interface=false")]
    NoInterface(String),
}

/// Links, addresses, routes and rules.
#[allow(async_fn_in_trait)]
pub trait Kernel {
    /// The named links, the addresses on the WireGuard link, our routes and our rules.
    async fn observe(&mut self, devices: &Devices) -> Result<KernelState, KernelError>;
    async fn create_wireguard(&mut self, name: &str) -> Result<Writes, KernelError>;
    async fn delete_link(&mut self, index: u32) -> Result<Writes, KernelError>;
    /// Applies every change it can; one failure does not stop the others.
    async fn apply(&mut self, diff: &KernelDiff) -> (Writes, Vec<KernelError>);
    /// The gateway of the kernel's route to each of `targets` that is not on the `private`
    /// link itself (IPIP's outer destinations behind a router). Default: all on the link.
    async fn underlay(
        &mut self,
        _targets: &BTreeSet<IpAddr>,
        _private: u32,
    ) -> Result<BTreeMap<IpAddr, IpAddr>, KernelError> {
        Ok(BTreeMap::new())
    }

    /// The port that kernel notifications of our own writes carry, if it has one (see
    /// [`EventFilter::own_port`]).
    fn echo_port(&self) -> Option<u32> {
        None
    }
}

/// What the reconciler needs beyond the plan.
pub struct DeviceSettings {
    pub devices: Devices,
    /// Create the WireGuard link when it is missing (kernel module required).
    pub create_interface: bool,
    /// `None` leaves the link's MTU as it is.
    pub mtu: Option<u32>,
    /// The node's private key; never logged.
    pub private_key: Key,
    pub dns: Box<DnsLookup>,
}

/// The result of one reconcile: what was written and what could not be done.
#[derive(Debug, Default)]
pub struct Report {
    pub writes: Writes,
    /// One line per object that could not be applied (the rest was).
    pub problems: Vec<String>,
    /// The indexes of the devices seen, for the kernel event filter.
    pub links: BTreeMap<String, LinkState>,
    /// The endpoints WireGuard currently uses for peers that completed a handshake (what Kilo
    /// publishes as discovered endpoints for peers behind NAT).
    pub handshaken_endpoints: BTreeMap<Key, std::net::SocketAddr>,
    /// The WireGuard IPs of the peers this pass added (see [`handshake_target`]).
    pub new_peers: Vec<IpAddr>,
}

/// Where to send a packet so that WireGuard shakes hands with a peer just added at once: its
/// WireGuard IP, the single address of its allowed IPs inside this node's WireGuard subnet.
/// Without it a remote peer still holding a session with this device's previous life (the device
/// re-created, a new leader) keeps sending into it until its rekey timer, 15 s later.
pub fn handshake_target(allowed_ips: &BTreeSet<IpNet>, subnets: &[IpNet]) -> Option<IpAddr> {
    allowed_ips
        .iter()
        .find(|n| {
            n.prefix_len() == n.max_prefix_len() && subnets.iter().any(|s| s.contains(&n.addr()))
        })
        .map(IpNet::addr)
}

/// The differences between plan and kernel, as `--dry-run` prints them.
#[derive(Debug, Default)]
pub struct DryRun {
    pub kernel: KernelDiff,
    pub wireguard: WgDiff,
    pub datapath: Vec<String>,
    /// What the CNI configuration file would get.
    pub cni: Option<String>,
    /// What the FORWARD chains would get (`--iptables-forward-rules`).
    pub forward: Vec<String>,
    pub link_missing: bool,
    pub problems: Vec<String>,
}

impl std::fmt::Display for DryRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.link_missing {
            writeln!(f, "+ link (WireGuard interface)")?;
        }
        write!(f, "{}{}", self.wireguard, self.kernel)?;
        for l in self.datapath.iter().chain(&self.cni).chain(&self.forward) {
            writeln!(f, "{l}")?;
        }
        for p in &self.problems {
            writeln!(f, "! {p}")?;
        }
        Ok(())
    }
}

/// What the kernel does with the realm of the routes the datapath encapsulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Realms {
    /// None of ours read back yet: asked for; the datapath looks up every packet.
    #[default]
    Unknown,
    /// One of ours was read back carrying it: the datapath checks it first.
    Hold,
    /// One of ours was read back without it (no CONFIG_IP_ROUTE_CLASSID): no longer asked for.
    Dropped,
}

/// Runs the reconcilers in dependency order: link, WireGuard device, datapath (before the
/// routes that send into its encapsulation), addresses, routes, rules, (with
/// [`Reconciler::with_cni`]) the CNI configuration file, and (with
/// [`Reconciler::with_forward_rules`]) the FORWARD chains' accepts.
/// It owns the [`EventFilter`] a [`netlink::watch`] applies and keeps it on the devices it
/// observed last.
pub struct Reconciler<K, W, D> {
    kernel: K,
    wireguard: W,
    datapath: D,
    settings: DeviceSettings,
    cni: Option<cni::CniFile>,
    forward: Option<Box<dyn ForwardRules + Send>>,
    realms: Realms,
    events: Arc<Mutex<EventFilter>>,
}

impl<K, W, D> Reconciler<K, W, D> {
    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    pub fn kernel_mut(&mut self) -> &mut K {
        &mut self.kernel
    }

    pub fn wireguard(&self) -> &W {
        &self.wireguard
    }

    pub fn wireguard_mut(&mut self) -> &mut W {
        &mut self.wireguard
    }

    pub fn datapath(&self) -> &D {
        &self.datapath
    }

    /// The kernel notifications that concern our objects, for [`netlink::watch`]: kept on the
    /// devices' current indexes after each reconcile.
    pub fn event_filter(&self) -> Arc<Mutex<EventFilter>> {
        self.events.clone()
    }

    /// Records the links a reconcile observed, in the report and in the event filter.
    fn observed_links(&self, report: &mut Report, links: BTreeMap<String, LinkState>) {
        let wireguard = &self.settings.devices.wireguard;
        (self.events.lock().expect("event filter lock")).follow(&links, wireguard);
        report.links = links;
    }
}

impl<K: Kernel, W: WireGuard, D: DatapathOps> Reconciler<K, W, D> {
    pub fn new(kernel: K, wireguard: W, datapath: D, settings: DeviceSettings) -> Self {
        let events = EventFilter::new(&settings.devices, kernel.echo_port());
        Reconciler {
            kernel,
            wireguard,
            datapath,
            settings,
            cni: None,
            forward: None,
            realms: Realms::Unknown,
            events: Arc::new(Mutex::new(events)),
        }
    }

    /// The WireGuard, private and tunnel devices it manages.
    pub fn devices(&self) -> &Devices {
        &self.settings.devices
    }

    /// What the kernel has shown of route realms so far.
    pub fn realms(&self) -> Realms {
        self.realms
    }

    /// The realm to give the routes the datapath encapsulates.
    fn realm(&self) -> Option<u16> {
        (self.realms != Realms::Dropped).then_some(KILO_REALM)
    }

    /// Learns from our routes read from the kernel whether it keeps realms: one carrying ours
    /// says it does; one of `written` (just written with ours) read back without says it does
    /// not (logged once).
    fn learn_realms(&mut self, routes: &BTreeSet<KRoute>, written: &[(KRoute, bool)]) {
        if self.realms != Realms::Unknown {
            return;
        }
        if routes.iter().any(|r| r.realm == Some(KILO_REALM)) {
            self.realms = Realms::Hold;
            tracing::info!(
                realm = KILO_REALM,
                "route realms hold: the encapsulation skips other traffic"
            );
            return;
        }
        let stripped = written
            .iter()
            .filter(|(r, _)| r.realm.is_some())
            .any(|(r, _)| {
                routes.contains(&KRoute {
                    realm: None,
                    ..r.clone()
                })
            });
        if stripped {
            self.realms = Realms::Dropped;
            tracing::warn!(
                realm = KILO_REALM,
                "the kernel drops route realms (no CONFIG_IP_ROUTE_CLASSID?): routes keep none, \
                 and the encapsulation looks up every packet out of the private interface"
            );
        }
    }

    /// Also keeps the bridge CNI configuration at `path` in step with the plan's pod CIDRs
    /// (`--cni`, `--cni-path`).
    pub fn with_cni(mut self, path: std::path::PathBuf) -> Self {
        self.cni = Some(cni::CniFile::new(path));
        self
    }

    /// Also keeps the plan's [`forward`](Plan::forward) accepts in iptables' FORWARD chains
    /// (and, with none planned, removes those of an earlier run).
    pub fn with_forward_rules(mut self, forward: Box<dyn ForwardRules + Send>) -> Self {
        self.forward = Some(forward);
        self
    }

    fn link_want(&self) -> LinkWant {
        LinkWant {
            up: true,
            mtu: self.settings.mtu,
        }
    }

    /// Where the underlay sends the outer packets of what the datapath encapsulates (see
    /// [`Kernel::underlay`]); all on the link when it cannot say (logged).
    async fn underlay(&mut self, plan: &Plan, observed: &KernelState) -> BTreeMap<IpAddr, IpAddr> {
        let devices = &self.settings.devices;
        let targets = state::ipip_gateways(plan, devices);
        let private = devices.private.as_ref().and_then(|p| observed.links.get(p));
        let (Some(private), false) = (private, targets.is_empty()) else {
            return BTreeMap::new();
        };
        match self.kernel.underlay(&targets, private.index).await {
            Ok(hops) => hops,
            Err(e) => {
                tracing::warn!(error = %e, "the underlay's routes to IPIP next hops");
                BTreeMap::new()
            }
        }
    }

    /// Makes the node match the plan, writing only the difference.
    pub async fn reconcile(&mut self, plan: &Plan) -> Result<Report, KernelError> {
        let mut report = Report::default();
        let devices = self.settings.devices.clone();
        let mut observed = self.kernel.observe(&devices).await?;
        if !observed.links.contains_key(&devices.wireguard) {
            if !self.settings.create_interface {
                // What needs no link still applies: the datapath's maps (its program is
                // attached to the link once it is back) and the CNI file.
                let missing = KernelError::NoInterface(devices.wireguard.clone());
                report.problems.push(missing.to_string());
                self.apply_datapath(plan, &observed.indexes, &mut report);
                self.apply_cni(plan, &mut report);
                self.apply_forward(plan, &mut report);
                self.observed_links(&mut report, observed.links);
                return Ok(report);
            }
            report.writes += self.kernel.create_wireguard(&devices.wireguard).await?;
            observed = self.kernel.observe(&devices).await?;
        }
        let link = *observed
            .links
            .get(&devices.wireguard)
            .ok_or_else(|| KernelError::NoInterface(devices.wireguard.clone()))?;

        // The datapath before the routes: what they send out of the private interface must find
        // the encapsulation there already.
        self.apply_datapath(plan, &observed.indexes, &mut report);

        self.learn_realms(&observed.routes, &[]);
        let d = self
            .kernel_diff(plan, &observed, &link, &mut report.problems)
            .await;
        if !d.is_empty() {
            tracing::info!(changes = %d.to_string().trim_end(), "updating links, addresses, routes, rules");
            let (w, errors) = self.kernel.apply(&d).await;
            report.writes += w;
            report
                .problems
                .extend(errors.into_iter().map(|e| e.to_string()));
            // Read back at once (rarely: until realms are known) so the datapath need not wait
            // for the next pass, and so a kernel that drops them is never asked again.
            if self.realms == Realms::Unknown && d.route_add.iter().any(|(r, _)| r.realm.is_some())
            {
                match self.kernel.observe(&devices).await {
                    Ok(after) => self.learn_realms(&after.routes, &d.route_add),
                    Err(e) => report.problems.push(e.to_string()),
                }
            }
        }
        // WireGuard after the routes: a peer answers handshakes as soon as it exists, and its
        // answers must leave by the routes of this plan. A node that becomes its location's
        // leader first drops the route that sent the new peer's endpoint through the old leader.
        match self.wireguard.observe() {
            Ok(dev) => {
                let dev = dev.unwrap_or_default();
                report.handshaken_endpoints = dev
                    .peers
                    .iter()
                    .filter(|(k, _)| {
                        dev.stats
                            .get(*k)
                            .is_some_and(|s| s.last_handshake.is_some())
                    })
                    .filter_map(|(k, p)| Some((*k, p.endpoint?)))
                    .collect();
                let d = self.wireguard_diff(plan, &dev, &mut report.problems);
                if !d.is_empty() {
                    tracing::info!(changes = %d.to_string().trim_end(), "updating WireGuard device");
                    match self.wireguard.apply(&d) {
                        Ok(w) => {
                            report.writes += w;
                            report.new_peers = (d.add.iter())
                                .filter_map(|(_, p)| {
                                    handshake_target(&p.allowed_ips, &plan.addresses)
                                })
                                .collect();
                        }
                        Err(e) => report.problems.push(e.to_string()),
                    }
                }
            }
            Err(e) => report.problems.push(e.to_string()),
        }

        match self.datapath.route_realm(self.realms == Realms::Hold) {
            Ok(w) => report.writes += w,
            Err(e) => report.problems.push(e.to_string()),
        }
        self.apply_cni(plan, &mut report);
        self.apply_forward(plan, &mut report);
        self.observed_links(&mut report, observed.links);
        Ok(report)
    }

    /// What the WireGuard device lacks of the plan (the same for a reconcile and a dry run).
    fn wireguard_diff(
        &self,
        plan: &Plan,
        device: &wireguard::DeviceState,
        problems: &mut Vec<String>,
    ) -> WgDiff {
        let want = wireguard::desired(
            &plan.wireguard,
            self.settings.private_key,
            Some(device),
            &*self.settings.dns,
            problems,
        );
        wireguard::diff(&want, device)
    }

    /// What the links, addresses, routes and rules lack of the plan (the same for a reconcile
    /// and a dry run), with the problems seen on the way.
    async fn kernel_diff(
        &mut self,
        plan: &Plan,
        observed: &KernelState,
        link: &LinkState,
        problems: &mut Vec<String>,
    ) -> KernelDiff {
        let underlay = self.underlay(plan, observed).await;
        let devices = &self.settings.devices;
        let want = state::desired(plan, devices, &observed.links, &underlay, self.realm());
        problems.extend(want.problems.iter().cloned());
        // Added anyway (the kernel allows it), but the other link's prefix route may take the
        // mesh's traffic: somebody has to remove one of them.
        for a in &want.addresses {
            if let Some(other) = observed.elsewhere.get(&a.addr()) {
                problems.push(format!(
                    "address {a} of {}: {} is also on {other}, whose routes may take the mesh's traffic",
                    devices.wireguard,
                    a.addr()
                ));
            }
        }
        state::diff(link, self.link_want(), &want, observed)
    }

    fn apply_datapath(
        &mut self,
        plan: &Plan,
        indexes: &BTreeMap<String, u32>,
        report: &mut Report,
    ) {
        match self
            .datapath
            .apply(&plan.datapath, &plan.ipip, Some(indexes))
        {
            Ok(w) => report.writes += w,
            Err(e) => report.problems.push(e.to_string()),
        }
    }

    fn apply_cni(&mut self, plan: &Plan, report: &mut Report) {
        if let Some(cni) = &mut self.cni {
            let (w, problem) = cni.apply(&plan.cni_ranges);
            report.writes += w;
            report.problems.extend(problem);
        }
    }

    fn apply_forward(&mut self, plan: &Plan, report: &mut Report) {
        if let Some(forward) = &mut self.forward {
            match forward.ensure(&plan.forward) {
                Ok(w) => report.writes += w,
                Err(e) => report
                    .problems
                    .push(format!("FORWARD rules (--iptables-forward-rules): {e}")),
            }
        }
    }

    /// What `reconcile` would change, without changing anything.
    pub async fn dry_run(&mut self, plan: &Plan) -> Result<DryRun, KernelError> {
        let mut out = DryRun::default();
        let devices = self.settings.devices.clone();
        let observed = self.kernel.observe(&devices).await?;
        let dev = self
            .wireguard
            .observe()
            .map_err(|e| out.problems.push(e.to_string()))
            .ok()
            .flatten()
            .unwrap_or_default();
        out.wireguard = self.wireguard_diff(plan, &dev, &mut out.problems);
        let link = match observed.links.get(&devices.wireguard) {
            Some(l) => *l,
            None => {
                out.link_missing = true;
                LinkState {
                    index: 0,
                    up: false,
                    mtu: 0,
                }
            }
        };
        out.kernel = self
            .kernel_diff(plan, &observed, &link, &mut out.problems)
            .await;
        match self.datapath.describe(&plan.datapath, &plan.ipip) {
            Ok(lines) => out.datapath = lines,
            Err(e) => out.problems.push(e.to_string()),
        }
        if let Some(cni) = &self.cni {
            match cni.describe(&plan.cni_ranges) {
                Ok(line) => out.cni = line,
                Err(e) => out.problems.push(e.to_string()),
            }
        }
        if let Some(forward) = &mut self.forward {
            match forward.describe(&plan.forward) {
                Ok(lines) => out.forward = lines,
                Err(e) => out.problems.push(e.to_string()),
            }
        }
        Ok(out)
    }

    /// Removes our routes, rules, the WireGuard link's addresses, the datapath and our FORWARD
    /// rules; with `remove_interface` the WireGuard link too.
    pub async fn clean_up(&mut self, remove_interface: bool) -> Result<Report, KernelError> {
        let mut report = Report::default();
        let devices = self.settings.devices.clone();
        let observed = self.kernel.observe(&devices).await?;
        let link = observed.links.get(&devices.wireguard).copied();
        let d = KernelDiff {
            link_set: None,
            link_index: link.map(|l| l.index).unwrap_or(0),
            address_add: vec![],
            address_del: if link.is_some() {
                observed.addresses.iter().copied().collect()
            } else {
                vec![]
            },
            route_add: vec![],
            route_del: observed.routes.iter().cloned().collect::<Vec<KRoute>>(),
            rule_add: vec![],
            rule_del: observed
                .rules
                .iter()
                .map(|(r, p)| (r.clone(), *p))
                .collect::<Vec<(KRule, Option<u32>)>>(),
        };
        let (w, errors) = self.kernel.apply(&d).await;
        report.writes += w;
        report
            .problems
            .extend(errors.into_iter().map(|e| e.to_string()));
        match self.datapath.clean_up() {
            Ok(w) => report.writes += w,
            Err(e) => report.problems.push(e.to_string()),
        }
        if let Some(forward) = &mut self.forward {
            match forward.clean_up() {
                Ok(w) => report.writes += w,
                Err(e) => report.problems.push(e.to_string()),
            }
        }
        if remove_interface && let Some(l) = link {
            match self.kernel.delete_link(l.index).await {
                Ok(w) => report.writes += w,
                Err(e) => report.problems.push(e.to_string()),
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests;
