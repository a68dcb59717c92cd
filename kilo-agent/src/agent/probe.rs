//! The failover probe (I/O): one ICMP echo per `--failover-probe-period` to the address this
//! node's [`Duty`] names, answered by the kernel that holds it, and what the agent writes when a
//! run of results calls for it (the leader's demotion, or the lifting of its own). And the knock
//! ([`knock`]) that starts WireGuard's handshake with peers just added, so that a new leader, or a
//! re-created device, carries traffic within a round trip.
//!
//! The echo goes through a datagram ICMP socket where `net.ipv4.ping_group_range` allows it,
//! else a raw one, which needs NET_RAW: [`Icmp::open`] runs at start, before kg drops its
//! capabilities, and the socket stays open.
use std::{io, net::IpAddr, sync::Arc, time::Duration};

use futures::{FutureExt as _, future::BoxFuture};
use tokio::sync::{mpsc, watch};

use super::{
    Agent, Planner,
    failover::{Act, Duty},
};
use crate::{
    backend::Annotations,
    datapath::DatapathOps,
    mesh::annotations::DEMOTED,
    reconcile::{Kernel, wireguard::WireGuard},
};

/// Sends one echo and says whether it was answered within `timeout`.
pub trait Prober: Send + Sync + 'static {
    fn echo(&self, dst: IpAddr, seq: u16, timeout: Duration) -> BoxFuture<'_, bool>;
}

/// ICMP echo sockets, one per family.
pub struct Icmp {
    v4: surge_ping::Client,
    v6: Option<surge_ping::Client>,
}

impl Icmp {
    /// Opens the sockets (IPv6's only where the host has IPv6). Must run inside the runtime.
    pub fn open() -> io::Result<Icmp> {
        let client =
            |kind| surge_ping::Client::new(&surge_ping::Config::builder().kind(kind).build());
        Ok(Icmp {
            v4: client(surge_ping::ICMP::V4)?,
            v6: client(surge_ping::ICMP::V6).ok(),
        })
    }
}

impl Prober for Icmp {
    fn echo(&self, dst: IpAddr, seq: u16, timeout: Duration) -> BoxFuture<'_, bool> {
        async move {
            let client = match dst {
                IpAddr::V4(_) => &self.v4,
                IpAddr::V6(_) => match &self.v6 {
                    Some(c) => c,
                    None => return false,
                },
            };
            let mut pinger = client
                .pinger(dst, surge_ping::PingIdentifier(rand::random()))
                .await;
            pinger.timeout(timeout);
            pinger
                .ping(surge_ping::PingSequence(seq), &[0; 8])
                .await
                .is_ok()
        }
        .boxed()
    }
}

/// Sends one datagram to each of `targets` (peers' WireGuard IPs, see
/// [`crate::reconcile::handshake_target`]), so that WireGuard shakes hands with them now: the
/// datagram itself goes to the discard port and is dropped.
pub async fn knock(targets: &[IpAddr]) {
    for ip in targets {
        let bind: std::net::SocketAddr = match ip {
            IpAddr::V4(_) => ([0, 0, 0, 0], 0).into(),
            IpAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let sent = match tokio::net::UdpSocket::bind(bind).await {
            Ok(s) => s.send_to(&[0], (*ip, 9)).await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            tracing::debug!(%ip, error = %e, "no handshake started with a new peer");
        }
    }
}

/// What the probe task probes: a duty's generation and address (none: it only ticks).
type Target = Option<(u64, Option<IpAddr>)>;

/// One period's result, for the duty of `generation`.
#[derive(Debug, Clone, Copy)]
pub struct Probed {
    generation: u64,
    answered: bool,
}

/// The agent's end of the probe task.
pub(super) struct Link {
    target: watch::Sender<Target>,
    pub(super) results: Option<mpsc::Receiver<Probed>>,
    generation: u64,
}

/// Probes every `period` what `target` last named, reporting each result.
async fn run(
    prober: Arc<dyn Prober>,
    period: Duration,
    mut target: watch::Receiver<Target>,
    results: mpsc::Sender<Probed>,
) {
    let mut every = tokio::time::interval(period);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq: u16 = 0;
    loop {
        every.tick().await;
        let Some((generation, ip)) = *target.borrow_and_update() else {
            // Nothing to do until there is a duty.
            if target.changed().await.is_err() {
                return;
            }
            every.reset();
            continue;
        };
        seq = seq.wrapping_add(1);
        let answered = match ip {
            Some(ip) => prober.echo(ip, seq, period).await,
            None => true,
        };
        if results
            .send(Probed {
                generation,
                answered,
            })
            .await
            .is_err()
        {
            return;
        }
    }
}

impl<P: Planner, K: Kernel, W: WireGuard, D: DatapathOps> Agent<P, K, W, D> {
    /// Fails over this node's location's leader (see [`super::failover`]), probing with
    /// `prober` every `period`.
    pub fn with_probe(mut self, prober: Arc<dyn Prober>, period: Duration) -> Self {
        let (target, rx) = watch::channel(None);
        let (tx, results) = mpsc::channel(4);
        tokio::spawn(run(prober, period, rx, tx));
        self.probe = Some(Link {
            target,
            results: Some(results),
            generation: 0,
        });
        self
    }

    /// Takes the duty of the latest plan: a new one restarts the count and the probe.
    pub(super) fn set_duty(&mut self, duty: &Duty, blocked: Option<&String>) {
        if blocked != self.failover_blocked.as_ref() && self.probe.is_some() {
            match blocked {
                Some(why) => tracing::info!(
                    reason = %why,
                    "this location keeps Kilo's choice of leader: no failover while a Kilo agent could disagree"
                ),
                None => tracing::info!(
                    "every node of this location and every leader runs kg: failover is on"
                ),
            }
        }
        self.failover_blocked = blocked.cloned();
        let Some(link) = self.probe.as_mut() else {
            return;
        };
        if !self
            .failover
            .set(duty.clone(), self.settings.clock.now_ms())
        {
            return;
        }
        link.generation += 1;
        let generation = link.generation;
        link.target
            .send_replace((*duty != Duty::Idle).then(|| (generation, duty.target())));
        tracing::debug!(?duty, "failover duty");
    }

    /// One probe result: writes what a run of them calls for.
    pub(super) async fn probed(&mut self, r: Probed) {
        if self.probe.as_ref().map(|l| l.generation) != Some(r.generation) {
            return;
        }
        let healthy = match self.failover.duty() {
            Duty::Recover { .. } => self.healthy && self.backend.updates().borrow().connected,
            _ => true,
        };
        let act = self
            .failover
            .observe(r.answered && healthy, self.settings.clock.now_ms());
        let (node, value) = match &act {
            None => return,
            Some(Act::Demote { leader, .. }) => (leader.clone(), Some(self.local.hostname.clone())),
            Some(Act::Restore { .. }) => (self.local.hostname.clone(), None),
        };
        let changes = Annotations::from([(DEMOTED.to_string(), value)]);
        match (self.backend.publish(&node, &changes).await, act) {
            (Err(e), _) => {
                self.failover.retry();
                self.metrics.error("failover");
                tracing::warn!(error = %e, node, "writing {DEMOTED} failed; trying again at the next probe");
            }
            (
                Ok(_),
                Some(Act::Demote {
                    location,
                    leader,
                    outage_ms,
                }),
            ) => {
                self.metrics
                    .failovers
                    .get_or_create(&crate::telemetry::LocationLabel {
                        location: location.clone(),
                    })
                    .inc();
                self.metrics
                    .failover_duration
                    .observe(outage_ms as f64 / 1000.0);
                tracing::warn!(
                    %location,
                    %leader,
                    outage_ms,
                    "the location's leader stopped answering probes: demoted it, this node is next in line"
                );
            }
            (Ok(_), Some(Act::Restore { location })) => {
                self.metrics
                    .recoveries
                    .get_or_create(&crate::telemetry::LocationLabel {
                        location: location.clone(),
                    })
                    .inc();
                tracing::info!(%location, "healthy again: lifted this node's demotion");
            }
            (Ok(_), None) => {}
        }
    }
}
