//! The e2e scenario: a location's leader fails (`--failover-probe-period`, at its default). A
//! probe pod in another location pings the pod on the other node of [`LOCATION`] (the leader's
//! successor: the leader's own pods go down with it) while the leader's kg is killed (no
//! demotion, no loss), then its node is cut from the underlay, then its WireGuard device is
//! deleted: the successor demotes it (`kg.kilo.squat.ai/demoted`) and leads, the outage at most
//! [`MAX_FAILOVER`]; once healthy again the leader removes the annotation and leads again, with no
//! second outage over [`MAX_FAILBACK`]. Each step leaves the links up, no annotation and the same
//! leader, failed or not.
use super::*;

/// The annotation a successor writes on the leader it demotes (its value: the successor).
const DEMOTED: &str = "kg.kilo.squat.ai/demoted";
/// The location whose leader fails (two nodes: the successor is the other one).
const LOCATION: &str = "east";
/// The pinger's log in its pod: the machine's uptime at its start, then busybox ping's output.
const LOG: &str = "/tmp/failover.log";
/// Seconds between pings.
const INTERVAL: f64 = 0.2;
/// The longest outages allowed (s): while the leader is down, and when it takes the lead back.
const MAX_FAILOVER: f64 = 5.0;
const MAX_FAILBACK: f64 = 1.0;

/// Who takes part: the leader, its successor, and the pinger's pods.
struct Cast {
    leader: String,
    successor: String,
    from: String,
    to: String,
    ip: String,
}

/// How the leader fails.
#[derive(Clone, Copy, PartialEq)]
enum Failure {
    /// Both its links down on the underlay's side: its cables pulled, for [`CUT_HOLD`].
    Cut,
    /// `ip link del kilo0` on it: wireguard-go exits and the kubelet restarts it.
    Device,
}

/// How long the links stay cut after the demotion.
const CUT_HOLD: Duration = Duration::from_secs(10);

/// A pinger's log: when it started (the machine's uptime), how many pings it sent (the one in
/// flight at the end not counted, as [`ping_loss`] counts), how many were answered, and which.
struct PingLog {
    start: f64,
    sent: u64,
    received: u64,
    answered: BTreeSet<u64>,
}

impl PingLog {
    /// The longest outage (s) that began between the uptimes `from` and `to`.
    fn outage(&self, from: f64, to: f64) -> f64 {
        longest_gap(
            &self.answered,
            self.sent,
            INTERVAL,
            (from - self.start, to - self.start),
        )
    }
}

impl Cluster {
    pub(super) fn failover(&self, report: &mut Report) {
        report.step("failover: kg killed on a leader loses no packet", || {
            self.failover_step(|c| self.kg_killed(c))
        });
        report.step("failover: the leader cut from the underlay", || {
            self.failover_step(|c| self.leader_down(c, Failure::Cut))
        });
        report.step("failover: the leader's kilo0 deleted", || {
            self.failover_step(|c| self.leader_down(c, Failure::Device))
        });
    }

    /// Runs `scenario` on the current cast; when it fails, puts the links back, prints what to
    /// diagnose it with and waits for the cluster to be as it was (the annotation removed by
    /// hand after 90 s).
    fn failover_step(&self, scenario: impl FnOnce(&Cast) -> Result<String>) -> Result<String> {
        let cast = self.failover_cast()?;
        let out = scenario(&cast);
        if out.is_err() {
            let _ = self.underlay_links(&cast.leader, "up");
            self.failover_dump(&cast);
            self.failover_reset(&cast);
        }
        out
    }

    /// [`LOCATION`]'s leader, the other node there, and the pinger: from the probe pod of the
    /// first node elsewhere to the successor's.
    fn failover_cast(&self) -> Result<Cast> {
        let leaders = self.leaders()?;
        let here: Vec<&str> = NODES
            .iter()
            .filter(|(_, l)| *l == LOCATION)
            .map(|(n, _)| *n)
            .collect();
        let led: Vec<&str> = here
            .iter()
            .copied()
            .filter(|n| leaders.iter().any(|l| l == n))
            .collect();
        let [leader] = led[..] else {
            bail!("{LOCATION} ({here:?}) led by {led:?} (leaders: {leaders:?})");
        };
        let successor = here
            .iter()
            .find(|n| **n != leader)
            .with_context(|| format!("no other node than {leader} in {LOCATION}"))?;
        let (elsewhere, _) = NODES
            .iter()
            .find(|(_, l)| *l != LOCATION)
            .context("a node in another location")?;
        let to = format!("probe-{successor}");
        let ip = self
            .probe_ips()?
            .into_iter()
            .find(|(n, _)| *n == to)
            .with_context(|| format!("{to} has no address"))?
            .1;
        Ok(Cast {
            leader: leader.to_owned(),
            successor: (*successor).to_owned(),
            from: format!("probe-{elsewhere}"),
            to,
            ip,
        })
    }

    /// SIGKILL to kg on the leader: the kubelet restarts it, the kernel's state (the device,
    /// routes, the pinned datapath) stays, so no ping is lost and nobody is demoted.
    fn kg_killed(&self, cast: &Cast) -> Result<String> {
        let Cast {
            leader, from, to, ..
        } = cast;
        let counted: f64 = self.failovers()?.values().sum();
        let mut demoted = None;
        let ((pod, back), pings) = self.ping_during(cast, || {
            let (pod, restarts) = self.kill_kg(leader)?;
            let killed = uptime()?;
            // Restarted and Ready, the annotation read meanwhile.
            let back = poll(
                Duration::from_secs(90),
                Duration::from_millis(500),
                &format!("kg on {leader} restarted and Ready"),
                || {
                    if let Some(by) = self.demoted_by(leader)? {
                        demoted.get_or_insert(by);
                    }
                    let kg = on_node(self.kilo_pods()?, leader)?;
                    let (n, ready) = container_state(&kg, "kilo");
                    (n > restarts && ready).then(uptime).transpose()
                },
            )? - killed;
            wait_for(
                Duration::from_secs(30),
                &format!("{leader} leading"),
                || Ok(self.leads(leader)?.then_some(())),
            )?;
            Ok((pod, back))
        })?;
        let detail = format!(
            "{from} -> {to}: {} of {} pings answered (longest outage {:.1} s); kg on {leader} ({pod}) SIGKILLed, restarted and Ready after {back:.1} s, {leader} leads again",
            pings.received,
            pings.sent,
            pings.outage(f64::NEG_INFINITY, f64::INFINITY),
        );
        if let Some(by) = demoted.or(self.demoted_by(leader)?) {
            bail!("{detail}; but {by} demoted {leader} ({DEMOTED})");
        }
        let now: f64 = self.failovers()?.values().sum();
        if now > counted {
            bail!("{detail}; but kilo_leader_failovers_total went from {counted} to {now}");
        }
        if pings.sent < 20 || pings.received != pings.sent {
            bail!("{detail}");
        }
        Ok(format!("{detail}; no demotion, no failover counted"))
    }

    /// The leader fails (`failure`): the successor demotes it and leads, the outage at most
    /// [`MAX_FAILOVER`]; the leader, back (links restored, or wireguard-go's new device
    /// configured), removes the annotation and leads again, no outage then over
    /// [`MAX_FAILBACK`]. The outages are told apart by when they began: before the links were
    /// restored (a cut) or the annotation was last seen (a deleted device), or after.
    fn leader_down(&self, cast: &Cast, failure: Failure) -> Result<String> {
        let Cast {
            leader,
            successor,
            from,
            to,
            ..
        } = cast;
        let counted = self.failovers()?.get(successor).copied().unwrap_or(0.0);
        let (wg_restarts, _) =
            container_state(&on_node(self.wireguard_pods()?, leader)?, "wireguard");
        // Uptimes: the failure, the links restored, the annotation last seen, and gone; the
        // demotion's delay and its author.
        let (mut down, mut restored, mut last_seen, mut gone) = (0.0, None, None, None);
        let mut demoted = None;
        let ((), pings) = self.ping_during(cast, || {
            down = uptime()?;
            match failure {
                Failure::Cut => self.underlay_links(leader, "down")?,
                Failure::Device => {
                    self.node_exec(leader, &["ip", "link", "del", "kilo0"])?;
                }
            }
            // For a deleted device, a demotion only if kg has not configured wireguard-go's new
            // one within three probes.
            let limit = Duration::from_secs(if failure == Failure::Cut { 30 } else { 15 });
            let seen = poll(
                limit,
                Duration::from_millis(250),
                &format!("{DEMOTED} on {leader}"),
                || {
                    let now = uptime()?;
                    Ok(self.demoted_by(leader)?.map(|by| (now - down, by)))
                },
            );
            demoted = match failure {
                Failure::Cut => Some(seen?),
                Failure::Device => seen.ok(),
            };
            if let Some((after, by)) = &demoted {
                if by != successor {
                    bail!("{leader} demoted by {by}, not by {successor}");
                }
                last_seen = Some(down + after);
                poll(
                    Duration::from_secs(10),
                    Duration::from_millis(500),
                    &format!("{successor} leading after the demotion"),
                    || {
                        let now = uptime()?;
                        if self.demoted_by(leader)?.is_some() {
                            last_seen = Some(now);
                        }
                        Ok(self.leads(successor)?.then_some(()))
                    },
                )?;
            }
            if failure == Failure::Cut {
                std::thread::sleep(CUT_HOLD);
                self.underlay_links(leader, "up")?;
                restored = Some(uptime()?);
            }
            // The fail-back: the annotation removed, and the leader leading again.
            poll(
                Duration::from_secs(90),
                Duration::from_millis(250),
                &format!("{DEMOTED} gone from {leader}, {leader} leading again"),
                || {
                    let now = uptime()?;
                    if self.demoted_by(leader)?.is_some() {
                        (last_seen, gone) = (Some(now), None);
                        return Ok(None);
                    }
                    gone.get_or_insert(now);
                    Ok(self.leads(leader)?.then_some(()))
                },
            )?;
            if failure == Failure::Device {
                wait_for(
                    Duration::from_secs(90),
                    &format!("wireguard-go restarted on {leader}"),
                    || {
                        let wg = on_node(self.wireguard_pods()?, leader)?;
                        let (n, ready) = container_state(&wg, "wireguard");
                        Ok((n > wg_restarts && ready).then_some(()))
                    },
                )?;
            }
            Ok(())
        })?;
        let east = self
            .leaders()?
            .into_iter()
            .filter(|n| NODES.contains(&(n.as_str(), LOCATION)))
            .collect::<Vec<_>>();
        // The failover's window ends when the links came back, or when the annotation was last
        // seen (the fail-back begins with its removal).
        let split = restored.or(last_seen).unwrap_or(f64::INFINITY);
        let (failover, failback) = (
            pings.outage(f64::NEG_INFINITY, split),
            pings.outage(split, f64::INFINITY),
        );
        let since = |t: Option<f64>| t.map_or("-".to_owned(), |t| format!("{:.1} s", t - down));
        let failed = match restored {
            Some(_) => format!("{leader}'s links cut, restored at {}", since(restored)),
            None => format!("{leader}'s kilo0 deleted"),
        };
        let demotion = match &demoted {
            Some((after, by)) => format!(
                "{by} demoted it after {after:.1} s and led; annotation last seen at {}, gone at {}",
                since(last_seen),
                since(gone)
            ),
            None => "no demotion (kg configured wireguard-go's new device first)".to_owned(),
        };
        let now = self.failovers()?.get(successor).copied().unwrap_or(0.0);
        let detail = format!(
            "{failed}: {demotion}; led by {leader}, then {}, then {east:?}; {from} -> {to}: {} of {} pings answered, longest outage {failover:.1} s (at most {MAX_FAILOVER} s), at the fail-back {failback:.1} s (at most {MAX_FAILBACK} s); {successor} counted {} failover(s)",
            if demoted.is_some() { successor } else { leader },
            pings.received,
            pings.sent,
            now - counted,
        );
        let failovers_ok = now - counted == if demoted.is_some() { 1.0 } else { 0.0 };
        if pings.sent < 20
            || failover > MAX_FAILOVER + 1e-9
            || failback > MAX_FAILBACK + 1e-9
            || east != [leader.as_str()]
            || !failovers_ok
        {
            bail!("{detail}");
        }
        Ok(detail)
    }

    /// Runs `f` while the cast's `from` pings `to` every [`INTERVAL`] (from 3 s before to 5 s
    /// after, when `f` succeeds); returns its result and the pinger's log.
    fn ping_during<T>(&self, cast: &Cast, f: impl FnOnce() -> Result<T>) -> Result<(T, PingLog)> {
        let Cast { from, ip, .. } = cast;
        self.kubectl(&["exec", from, "--", "rm", "-f", LOG])?;
        let mut ping = Command::new(self.work.join("kubectl"))
            .args(["exec", from, "--", "sh", "-c"])
            .arg(format!(
                "cut -d ' ' -f 1 /proc/uptime >{LOG}; exec ping -i {INTERVAL} {ip} >>{LOG} 2>&1"
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        std::thread::sleep(Duration::from_secs(3));
        let out = f();
        if out.is_ok() {
            std::thread::sleep(Duration::from_secs(5));
        }
        let _ = self.kubectl(&["exec", from, "--", "killall", "-INT", "ping"]);
        let _ = ping.wait();
        let log = self
            .kubectl(&["exec", from, "--", "cat", LOG])
            .and_then(|log| ping_log(&log));
        match (out, log) {
            (Ok(out), Ok(log)) => Ok((out, log)),
            (Err(e), Ok(log)) => Err(e.context(format!(
                "{} of {} pings answered, longest outage {:.1} s",
                log.received,
                log.sent,
                log.outage(f64::NEG_INFINITY, f64::INFINITY)
            ))),
            (Err(e), Err(_)) | (Ok(_), Err(e)) => Err(e),
        }
    }

    /// SIGKILL to the kilo container's own process on `node` (kg, the image's entrypoint),
    /// found through the node's containerd and checked to be kg (/proc/PID/comm); returns its
    /// pod's name and the container's restart count before.
    fn kill_kg(&self, node: &str) -> Result<(String, u64)> {
        let pod = on_node(self.kilo_pods()?, node)?;
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let (restarts, _) = container_state(&pod, "kilo");
        let (id, pid) = self.kilo_task(&pod, node)?;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))?;
        if comm.trim() != "kg" {
            bail!("{name}: task {id}'s process {pid} is {comm:?}, not kg");
        }
        // `ctr tasks kill` signals the task's own process only (no --all): kg, by its task ID.
        self.node_exec(
            node,
            &["ctr", "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", &id],
        )?;
        eprintln!("e2e: kg (PID {pid}, {name}) on {node} SIGKILLed");
        Ok((name.to_owned(), restarts))
    }

    /// Sets `node`'s two links `down` or `up` on the underlay's side (its veth ends `NODE` on
    /// the public bridge and `l-NODE` on its location's LAN, in namespace krs-e2e-under): its
    /// cables pulled or plugged back.
    fn underlay_links(&self, node: &str, state: &str) -> Result<()> {
        for link in [node.to_owned(), format!("l-{node}")] {
            run(Command::new("nsenter")
                .arg("--net=/run/netns/krs-e2e-under")
                .args(["ip", "link", "set", &link, state]))?;
        }
        Ok(())
    }

    /// Who demoted `node`, by its annotation.
    fn demoted_by(&self, node: &str) -> Result<Option<String>> {
        let n = self.json(&["get", "node", node])?;
        Ok(n["metadata"]["annotations"][DEMOTED]
            .as_str()
            .map(str::to_owned))
    }

    /// Whether kg on `node` says it leads its location (`kilo_leader 1`).
    fn leads(&self, node: &str) -> Result<bool> {
        let pod = on_node(self.kilo_pods()?, node)?;
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        Ok(metric(&self.metrics(name)?, "kilo_leader") == Some(1.0))
    }

    /// `kilo_leader_failovers_total` per node, every location's series summed.
    fn failovers(&self) -> Result<BTreeMap<String, f64>> {
        let mut counted = BTreeMap::new();
        for pod in self.kilo_pods()? {
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            let n: f64 = self
                .metrics(name)?
                .lines()
                .filter_map(|l| l.strip_prefix("kilo_leader_failovers_total"))
                .filter(|l| l.starts_with(['{', ' ']))
                .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
                .sum();
            let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
            counted.insert(node.to_owned(), n);
        }
        Ok(counted)
    }

    /// What a failed step leaves to read: the annotation and the leadership of the location's
    /// nodes, the tail of their kg's logs (and of the previous container's), the pods.
    fn failover_dump(&self, cast: &Cast) {
        eprintln!("e2e: leaders: {:?}", self.leaders());
        for node in [&cast.leader, &cast.successor] {
            eprintln!(
                "e2e: {node}: {DEMOTED} {:?}, leads: {:?}",
                self.demoted_by(node),
                self.leads(node)
            );
            let Ok(pod) = self.kilo_pods().and_then(|pods| on_node(pods, node)) else {
                continue;
            };
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            for previous in [false, true] {
                let mut args = vec!["-n", "kube-system", "logs", "--tail=40", "-c", "kilo", name];
                if previous {
                    args.push("--previous");
                }
                if let Ok(logs) = self.kubectl(&args) {
                    eprintln!("e2e: {}:\n{logs}", args[3..].join(" "));
                }
            }
        }
        if let Ok(pods) = self.kubectl(&["-n", "kube-system", "get", "pods", "-o", "wide"]) {
            eprintln!("{pods}");
        }
    }

    /// Back to the state before the step: the DaemonSets ready, no annotation (removed by hand
    /// after 90 s), the leader leading.
    fn failover_reset(&self, cast: &Cast) {
        let leader = &cast.leader;
        let gone = wait_for(Duration::from_secs(90), "the annotation gone", || {
            Ok(self.demoted_by(leader)?.is_none().then_some(()))
        });
        if gone.is_err() {
            eprintln!("e2e: removing {DEMOTED} from {leader} by hand");
            let _ = self.kubectl(&["annotate", "node", leader, &format!("{DEMOTED}-")]);
        }
        let back = self.rolled_out().and_then(|_| {
            wait_for(
                Duration::from_secs(60),
                &format!("{leader} leading"),
                || Ok(self.leads(leader)?.then_some(())),
            )
        });
        if let Err(e) = back {
            eprintln!("e2e: after the failed step: {e:#}");
        }
    }
}

/// The one pod of `pods` on `node`.
fn on_node(pods: Vec<Value>, node: &str) -> Result<Value> {
    pods.into_iter()
        .find(|p| p["spec"]["nodeName"] == node)
        .with_context(|| format!("no pod on {node}"))
}

/// A pod's container `name`: its restart count, and whether it is ready.
fn container_state(pod: &Value, name: &str) -> (u64, bool) {
    let status = pod["status"]["containerStatuses"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name));
    status.map_or((0, false), |s| {
        (s["restartCount"].as_u64().unwrap_or(0), s["ready"] == true)
    })
}

/// The machine's uptime (s): the pods' /proc/uptime is the same clock, on which the pinger's
/// start and the scenario's events are compared.
fn uptime() -> Result<f64> {
    std::fs::read_to_string("/proc/uptime")?
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .context("/proc/uptime")
}

/// The pinger's log: its first line the uptime it started at, then busybox ping's output.
fn ping_log(log: &str) -> Result<PingLog> {
    let start = log
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
        .with_context(|| format!("no start in {log:?}"))?;
    let (sent, received, _) = ping_loss(log, INTERVAL)?;
    let answered = log
        .split("seq=")
        .skip(1)
        .filter_map(|r| r.split_whitespace().next()?.parse().ok())
        .collect();
    Ok(PingLog {
        start,
        sent,
        received,
        answered,
    })
}

/// The longest run of unanswered pings (s), of `sent` pings `interval` apart (seq N sent N
/// intervals after the first), among the runs that began within `window` (s after the first
/// ping, the end excluded): a run counts in the window it began in, however long it lasts.
fn longest_gap(answered: &BTreeSet<u64>, sent: u64, interval: f64, window: (f64, f64)) -> f64 {
    let (mut longest, mut run) = (0, None::<(u64, u64)>);
    for seq in 0..sent {
        if answered.contains(&seq) {
            run = None;
            continue;
        }
        let (first, len) = run.get_or_insert((seq, 0));
        *len += 1;
        let began = *first as f64 * interval;
        if window.0 <= began && began < window.1 {
            longest = longest.max(*len);
        }
    }
    longest as f64 * interval
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn gaps_count_in_the_window_they_began_in() {
        // Unanswered: 10 to 14 (1.0 s from 2.0 s), 41 (0.2 s from 8.2 s), 48 and 49 at the end.
        let answered: BTreeSet<u64> = (0..10).chain(15..41).chain(42..48).collect();
        let all = (f64::NEG_INFINITY, f64::INFINITY);
        assert!(close(longest_gap(&answered, 50, 0.2, all), 1.0));
        assert!(close(longest_gap(&answered, 50, 0.2, (0.0, 5.0)), 1.0));
        // The run from 2.0 s lasts into (2.1, ...) but began before: not counted there.
        assert!(close(longest_gap(&answered, 50, 0.2, (2.1, 9.0)), 0.2));
        assert!(close(longest_gap(&answered, 50, 0.2, (0.0, 2.0)), 0.0));
        assert!(close(
            longest_gap(&answered, 50, 0.2, (9.0, f64::INFINITY)),
            0.4
        ));
        assert!(close(longest_gap(&(0..50).collect(), 50, 0.2, all), 0.0));
        assert!(close(longest_gap(&BTreeSet::new(), 0, 0.2, all), 0.0));
    }

    #[test]
    fn ping_log_reads_the_start_and_the_answers() {
        let log = "1234.56
PING 10.0.0.2 (10.0.0.2): 56 data bytes
64 bytes from 10.0.0.2: seq=0 ttl=64 time=0.1 ms
64 bytes from 10.0.0.2: seq=1 ttl=64 time=0.1 ms
64 bytes from 10.0.0.2: seq=5 ttl=64 time=0.1 ms

--- 10.0.0.2 ping statistics ---
7 packets transmitted, 3 packets received, 57% packet loss
";
        let pings = ping_log(log).unwrap();
        // seq 6 in flight when ping stopped: not sent, for the outage either.
        assert_eq!((pings.sent, pings.received), (6, 3));
        assert_eq!(pings.answered, BTreeSet::from([0, 1, 5]));
        assert!(close(pings.start, 1234.56));
        // 2 to 4 unanswered, from 0.4 s after the start.
        assert!(close(pings.outage(1234.56, 1234.9), 0.0));
        assert!(close(pings.outage(1234.9, f64::INFINITY), 0.6));
        assert!(ping_log("PING 10.0.0.2").is_err());
    }
}
