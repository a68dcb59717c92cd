//! Leader failover (kg's own; Kilo has none), pure: what this node watches ([`Duty`]) and when
//! a run of probe results calls for the one write of a failover or a recovery ([`Tracker`]).
//!
//! In a location, the next node in line after the leader ([`Segment::successor`]) probes the
//! location's WireGuard IP, which lives on the leader's `kilo0` and which the successor routes
//! to the leader over the private network. The leader's kernel answers: a leader whose kg is
//! killed keeps answering (its kernel state stays), one that lost its link or its device does
//! not. After [`MISSES`] missed probes in a row the successor writes `kg.kilo.squat.ai/demoted`
//! on the leader, once; every kg then skips the leader in Kilo's order (see `topology`).
//!
//! A demoted node removes its own annotation after [`RECOVERY`] healthy periods in a row (its
//! last pass left the kernel matching its plan, its backend is connected, and the location's
//! leader answers its probe): the hysteresis that keeps a flapping leader from flapping the
//! location.
//!
//! [`Segment::successor`]: crate::topology::Segment::successor
use std::net::IpAddr;

use crate::topology::Topology;

/// Missed probes in a row that demote the leader.
pub const MISSES: u32 = 3;
/// Healthy periods in a row after which a demoted node lifts its demotion.
pub const RECOVERY: u32 = 10;

/// What this node watches.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Duty {
    /// Nothing: a leader, a node not next in line, a location that cannot fail over.
    #[default]
    Idle,
    /// Next in line: probe `ip` (the location's WireGuard IP, on `leader`) and demote `leader`
    /// when it stops answering.
    Watch {
        location: String,
        leader: String,
        ip: IpAddr,
    },
    /// Demoted: lift the demotion once healthy, probing `ip` (the location's WireGuard IP, now
    /// on another leader) when there is one.
    Recover {
        location: String,
        ip: Option<IpAddr>,
    },
}

impl Duty {
    /// The address to probe, if any.
    pub fn target(&self) -> Option<IpAddr> {
        match self {
            Duty::Idle => None,
            Duty::Watch { ip, .. } => Some(*ip),
            Duty::Recover { ip, .. } => *ip,
        }
    }
}

/// This node's duty in `t`.
pub fn duty(t: &Topology) -> Duty {
    let Some(s) = t.local_segment() else {
        return Duty::Idle;
    };
    let Some(me) = s.nodes.iter().position(|n| n.name == t.hostname) else {
        return Duty::Idle;
    };
    let location = location_name(&s.location).to_string();
    if s.nodes[me].demoted_by.is_some() {
        return Duty::Recover {
            location,
            ip: (s.leader != me).then_some(s.wireguard_ip),
        };
    }
    if s.successor == Some(me) {
        return Duty::Watch {
            location,
            leader: s.leader_name().to_string(),
            ip: s.wireguard_ip,
        };
    }
    Duty::Idle
}

/// A location's name without the segment key's `location:` prefix.
pub fn location_name(segment: &str) -> &str {
    segment.strip_prefix("location:").unwrap_or(segment)
}

/// The write a run of probes calls for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Act {
    /// Write `kg.kilo.squat.ai/demoted` on `leader`; `outage_ms` since its last answer.
    Demote {
        location: String,
        leader: String,
        outage_ms: i64,
    },
    /// Remove this node's `kg.kilo.squat.ai/demoted`.
    Restore { location: String },
}

/// Counts the probe results of the current duty.
#[derive(Debug, Default)]
pub struct Tracker {
    duty: Duty,
    /// Results in a row that count toward the duty's act (misses, or healthy periods).
    run: u32,
    /// When the watched leader last answered (unix ms).
    last_answer: Option<i64>,
    /// The act was done (or is being written): not again for this duty.
    done: bool,
}

impl Tracker {
    pub fn duty(&self) -> &Duty {
        &self.duty
    }

    /// Takes `duty`; a different one starts counting afresh. Returns whether it changed.
    pub fn set(&mut self, duty: Duty, now_ms: i64) -> bool {
        if duty == self.duty {
            return false;
        }
        *self = Tracker {
            duty,
            last_answer: Some(now_ms),
            ..Tracker::default()
        };
        true
    }

    /// One period's result at `now_ms`: `ok` when the probe was answered (and, when
    /// recovering, this node is healthy).
    pub fn observe(&mut self, ok: bool, now_ms: i64) -> Option<Act> {
        match &self.duty {
            Duty::Idle => None,
            Duty::Watch {
                location, leader, ..
            } => {
                if ok {
                    self.run = 0;
                    self.last_answer = Some(now_ms);
                    return None;
                }
                self.run += 1;
                (self.run >= MISSES && !std::mem::replace(&mut self.done, true)).then(|| {
                    Act::Demote {
                        location: location.clone(),
                        leader: leader.clone(),
                        outage_ms: now_ms - self.last_answer.unwrap_or(now_ms),
                    }
                })
            }
            Duty::Recover { location, .. } => {
                self.run = if ok { self.run + 1 } else { 0 };
                (self.run >= RECOVERY && !std::mem::replace(&mut self.done, true)).then(|| {
                    Act::Restore {
                        location: location.clone(),
                    }
                })
            }
        }
    }

    /// The act could not be written: it is due again at the next result that still calls for
    /// it.
    pub fn retry(&mut self) {
        self.done = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch() -> Duty {
        Duty::Watch {
            location: "east".into(),
            leader: "n1".into(),
            ip: "10.4.0.1".parse().unwrap(),
        }
    }

    /// Period by period on a fake clock (1 s periods, then 0.2 s ones): a miss or two is
    /// forgiven, the third in a row demotes once, and a failed write is retried.
    #[test]
    fn three_misses_in_a_row_demote_once() {
        for period in [1000, 200] {
            let mut t = Tracker::default();
            assert!(t.set(watch(), 0));
            assert!(!t.set(watch(), 0), "the same duty keeps its count");
            let mut acts = Vec::new();
            let results = [true, false, false, true, false, false, false, false, false];
            for (i, ok) in results.into_iter().enumerate() {
                let now = (i as i64 + 1) * period;
                if let Some(a) = t.observe(ok, now) {
                    acts.push((i, a));
                }
            }
            assert_eq!(
                acts,
                [(
                    6,
                    Act::Demote {
                        location: "east".into(),
                        leader: "n1".into(),
                        outage_ms: 3 * period
                    }
                )]
            );
            t.retry();
            assert!(matches!(t.observe(false, 0), Some(Act::Demote { .. })));
            assert_eq!(t.observe(true, 0), None);
        }
    }

    /// A demoted node lifts its demotion after ten healthy periods in a row, not before; an
    /// unhealthy period starts the count again.
    #[test]
    fn recovery_needs_ten_healthy_periods_in_a_row() {
        let mut t = Tracker::default();
        t.set(
            Duty::Recover {
                location: "east".into(),
                ip: None,
            },
            0,
        );
        let mut seq = vec![true; 9];
        seq.push(false);
        seq.extend([true; 10]);
        let acted: Vec<usize> = seq
            .into_iter()
            .enumerate()
            .filter_map(|(i, ok)| t.observe(ok, i as i64).map(|_| i))
            .collect();
        assert_eq!(acted, [19]);
        assert_eq!(t.observe(true, 20), None, "once");
        // A new duty starts afresh.
        t.set(watch(), 21);
        assert_eq!(t.observe(false, 22), None);
    }

    /// The duty of each node of a location, from the topology: the successor watches the
    /// leader; a demoted node recovers, probing the new leader; others are idle.
    #[test]
    fn duties_follow_the_topology() {
        use crate::topology::testutil::{by_name, node};
        let mut a = node(
            "a",
            "eu",
            "192.168.1.1/24",
            "10.2.1.0/24",
            "1.1.1.1:51820",
            1,
        );
        let b = node(
            "b",
            "eu",
            "192.168.1.2/24",
            "10.2.2.0/24",
            "1.1.1.2:51820",
            2,
        );
        let c = node(
            "c",
            "eu",
            "192.168.1.3/24",
            "10.2.3.0/24",
            "1.1.1.3:51820",
            3,
        );
        let duty_of = |nodes: &[&crate::mesh::Node], host: &str| {
            let nodes = by_name(nodes.iter().map(|n| (*n).clone()).collect(), |n| {
                n.name.clone()
            });
            let t = Topology::new(
                &nodes,
                &Default::default(),
                &crate::topology::Options {
                    granularity: crate::mesh::Granularity::Location,
                    hostname: host.into(),
                    port: 51820,
                    subnet: "10.4.0.0/16".parse().unwrap(),
                    service_cidrs: Vec::new(),
                    persistent_keepalive: 0,
                    kg_nodes: ["a", "b", "c"].map(String::from).into(),
                },
            )
            .unwrap();
            duty(&t)
        };
        let ip: IpAddr = "10.4.0.1".parse().unwrap();
        let watching = |leader: &str| Duty::Watch {
            location: "eu".into(),
            leader: leader.into(),
            ip,
        };
        assert_eq!(duty_of(&[&a, &b, &c], "a"), Duty::Idle);
        assert_eq!(duty_of(&[&a, &b, &c], "b"), watching("a"));
        assert_eq!(duty_of(&[&a, &b, &c], "c"), Duty::Idle);
        a.demoted_by = Some("b".into());
        let recovering = Duty::Recover {
            location: "eu".into(),
            ip: Some(ip),
        };
        assert_eq!(duty_of(&[&a, &b, &c], "a"), recovering);
        assert_eq!(duty_of(&[&a, &b, &c], "b"), Duty::Idle);
        assert_eq!(duty_of(&[&a, &b, &c], "c"), watching("b"));
        // Alone, a demoted node still leads: nothing to probe.
        assert_eq!(
            duty_of(&[&a], "a"),
            Duty::Recover {
                location: "eu".into(),
                ip: None
            }
        );
    }
}
