//! Start-up, apart from the running loop: from `kg`'s flags to an [`Agent`] wired to its
//! backend, reconcilers and metrics ([`start`]: the host name, the key file, address
//! detection, the datapath, the WireGuard and tunnel devices), then the lock-down before the
//! loop ([`Started::run`]: capabilities dropped, seccomp); likewise for `kg webhook`
//! ([`webhook`]). The functions that decide something from the flags are pure and tested here.
use std::{
    future::Future,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use super::{
    Agent, AgentError, Local, LoopSettings, Planner, Stats, caps,
    config::{BackendKind, Compatibility, Encapsulate, Flags, LogLevel, Mtu, WebhookFlags},
    detect::{self, Detected},
    key_file, planner, prerequisites, seccomp,
};
use crate::{
    backend::{Backend, BackendError, file::FileBackend, kubernetes},
    datapath::{
        Datapath, DatapathConfig, DatapathError, DatapathOps, DatapathReconciler, NoDatapath,
        forward::ForwardKeeper, kernel, logs,
    },
    http::ServeError,
    mesh::Key,
    plan::{self, Devices},
    reconcile::{
        DeviceSettings, KernelError, Reconciler,
        netlink::{self, NetlinkKernel},
        wireguard::{WgApi, WgControl, WgError, system_resolver},
    },
    telemetry::{self, Metrics},
    webhook::{self as peer_webhook, WebhookError, WebhookSettings},
};

/// Why `kg` could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("reading the host name")]
    Hostname(#[source] std::io::Error),
    #[error(transparent)]
    Key(#[from] key_file::KeyFileError),
    #[error(transparent)]
    Detect(#[from] detect::DetectError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("the backend stopped before its first complete view")]
    BackendStopped,
    #[error(transparent)]
    WireGuard(#[from] WgError),
    #[error(transparent)]
    Unsupported(#[from] kernel::Unsupported),
    #[error("loading the eBPF datapath")]
    Datapath(#[source] DatapathError),
    #[error("reading the eBPF program's logs")]
    DatapathLogs(#[source] DatapathError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error(transparent)]
    Caps(#[from] caps::CapsError),
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
    #[error(transparent)]
    Webhook(#[from] WebhookError),
}

/// What the pure planner needs from the flags.
pub fn plan_settings(flags: &Flags, hostname: &str) -> plan::Settings {
    plan::Settings {
        hostname: hostname.to_string(),
        granularity: flags.mesh_granularity,
        subnet: flags.subnet,
        port: flags.port,
        service_cidrs: flags.service_cidr.clone(),
        local: flags.local,
        encapsulate: flags.encapsulate,
        compatibility: flags.compatibility,
        cni: flags.cni,
        iptables_forward_rules: flags.iptables_forward_rules,
        topology_label: flags.topology_label.clone(),
        // Liveness is the agent's (see `agent::liveness`), applied before planning.
        now: None,
        runs_kg: true,
        ..plan::Settings::default()
    }
}

/// How the loop runs, from the flags: a dry run never cleans up.
pub fn loop_settings(flags: &Flags) -> LoopSettings {
    LoopSettings {
        resync: flags.resync(),
        check_in: flags.check_in(),
        clean_up: flags.clean_up && !flags.dry_run,
        clean_up_interface: flags.clean_up_interface,
        knock: true,
        ..LoopSettings::default()
    }
}

/// The encapsulating device of Kilo's encapsulators (`cilium_tunl` when the host has one);
/// for its own (IPIP) none: the datapath encapsulates at the private interface (without the
/// datapath, a `tunl0` made by hand, if any).
pub fn tunnel_device(flags: &Flags, has_cilium_tunl: bool) -> Option<&'static str> {
    match flags.compatibility {
        _ if flags.encapsulate == Encapsulate::Never => None,
        Compatibility::Flannel => Some("flannel.1"),
        Compatibility::Cilium if has_cilium_tunl => Some("cilium_tunl"),
        Compatibility::Cilium => Some("tunl0"),
        Compatibility::None if flags.datapath => None,
        Compatibility::None => Some("tunl0"),
    }
}

/// Whether to load the eBPF datapath: not with `--datapath=false`, nor in a dry run before any
/// datapath exists (which must not create one).
pub fn loads_datapath(flags: &Flags) -> bool {
    flags.datapath && !(flags.dry_run && !flags.bpffs_dir.exists())
}

/// What this node publishes about itself, from the detected addresses: the endpoint is the
/// public IP (the private one first with `--prioritise-private-addresses`) on `--port`.
pub fn local(flags: &Flags, hostname: &str, public_key: Key, ips: &Detected) -> Local {
    let endpoint_ip = if flags.prioritise_private_addresses {
        ips.private.as_ref().or(ips.public.as_ref())
    } else {
        ips.public.as_ref()
    };
    Local {
        hostname: hostname.to_string(),
        public_key,
        endpoint: endpoint_ip.map(|a| SocketAddr::new(a.address.addr(), flags.port)),
        internal_ip: ips.private.as_ref().map(|a| a.address),
        granularity: flags.mesh_granularity.as_str().into(),
        // Read at every pass (`with_cni_compatibility_probe`).
        cni_compatibility_ip: None,
    }
}

/// Warns about the capabilities `flags` need and this process lacks, before anything fails
/// for want of them.
fn warn_missing_capabilities(flags: &Flags) {
    let bpffs = std::path::Path::new("/sys/fs/bpf");
    caps::warn_missing(caps::Needs {
        datapath: flags.datapath && !flags.dry_run,
        mount_bpffs: flags.bpffs_dir.starts_with(bpffs) && !crate::datapath::is_bpffs(bpffs),
    });
}

/// `--hostname`, else the kernel's.
fn hostname(flags: &Flags) -> Result<String, StartError> {
    if let Some(h) = &flags.hostname {
        return Ok(h.clone());
    }
    let name =
        std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(StartError::Hostname)?;
    Ok(name.trim().to_string())
}

/// The key file's key, generated when missing; a dry run changes nothing, not even the key
/// file, and uses a throwaway key when there is none yet.
fn private_key(flags: &Flags) -> Result<Key, StartError> {
    if !flags.dry_run {
        return Ok(key_file::load_or_generate(&flags.private_key)?.0);
    }
    Ok(match key_file::load(&flags.private_key)? {
        Some(k) => k,
        None => {
            tracing::warn!(path = %flags.private_key.display(), "no key yet; the dry run uses a throwaway one");
            Key(wireguard_control::Key::generate_private().0)
        }
    })
}

/// The eBPF datapath loaded (its pins adopted, or the programs loaded and verified), or none
/// (see [`loads_datapath`]).
fn load_datapath(flags: &Flags) -> Result<Option<Datapath>, StartError> {
    if !loads_datapath(flags) {
        return Ok(None);
    }
    kernel::check()?;
    let mut loaded = Datapath::open(DatapathConfig {
        pin_dir: Some(flags.bpffs_dir.clone()),
        fast_path: flags.fast_path,
        log_level: flags.datapath_log_level.program_level(),
        max_entries: flags.datapath_max_entries,
        counter_slots: flags.datapath_counter_slots,
        ..DatapathConfig::default()
    })
    .map_err(StartError::Datapath)?;
    if flags.datapath_log_level != LogLevel::None {
        let logger = loaded
            .logger(logs::TracingLog)
            .map_err(StartError::DatapathLogs)?;
        tokio::spawn(logs::forward(logger));
    }
    Ok(Some(loaded))
}

/// How long each phase of [`start`] took, for its log line.
struct Laps {
    start: Instant,
    last: Instant,
    laps: Vec<(&'static str, Duration)>,
}

impl Laps {
    fn new(start: Instant) -> Self {
        Laps {
            start,
            last: start,
            laps: Vec::new(),
        }
    }

    /// Ends the phase `name`.
    fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.laps.push((name, now - self.last));
        self.last = now;
    }
}

impl std::fmt::Display for Laps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, d)) in self.laps.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{name} {:.1} ms", d.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}

/// How long the host name's lookup may hold start-up: getaddrinfo can block on a resolver that
/// does not answer.
const LOOKUP_BOUND: Duration = Duration::from_secs(2);

async fn backend(flags: &Flags, metrics: &Metrics) -> Result<Arc<dyn Backend>, StartError> {
    Ok(match flags.backend {
        BackendKind::File => Arc::new(FileBackend::start(
            flags.backend_dir.clone().expect("validated"),
        )?),
        BackendKind::Kubernetes => {
            let config =
                kubernetes::config(flags.kubeconfig.as_deref(), flags.master.as_deref()).await?;
            tracing::info!(server = %config.cluster_url, "Kubernetes API server");
            Arc::new(kubernetes::KubeBackend::start(
                kubernetes::client(config)?,
                metrics.backend_retries.clone(),
            ))
        }
    })
}

/// The agent `kg` runs, built and not yet running.
pub struct Started<P> {
    agent: Agent<P, NetlinkKernel, WgControl, Box<dyn DatapathOps>>,
    changes: netlink::Changes,
    listen: SocketAddr,
    datapath: bool,
    seccomp: bool,
    failover: Option<std::time::Duration>,
}

/// Builds the agent `flags` describe: reads the host name and the key, detects this node's
/// addresses, starts the backend (whose first listing proceeds meanwhile), opens the WireGuard
/// device, the datapath and the netlink connection. The host name's lookup runs beside all of
/// these. Logs the time each phase took (target [`super::START_UP`]).
pub async fn start(flags: &Flags) -> Result<Started<impl Planner + use<>>, StartError> {
    let mut laps = Laps::new(Instant::now());
    warn_missing_capabilities(flags);
    prerequisites::warn_missing(flags);
    let hostname = hostname(flags)?;
    // Before seccomp, threads are fine.
    let name = hostname.clone();
    let lookup = tokio::time::timeout(
        LOOKUP_BOUND,
        tokio::task::spawn_blocking(move || detect::resolve_hostname(&name)),
    );
    let private_key = private_key(flags)?;
    let public_key = key_file::public_key(&private_key);
    laps.lap("prerequisites and key");
    let host = detect::observe().await?;
    laps.lap("addresses");
    let metrics = Metrics::new();
    let backend = backend(flags, &metrics).await?;
    laps.lap("backend started");
    let wireguard = if flags.create_interface {
        WgControl::new(&flags.interface, WgApi::Kernel)?
    } else {
        WgControl::detect(&flags.interface)?
    };
    tracing::info!(api = ?wireguard.api(), interface = %flags.interface, "WireGuard device");
    laps.lap("WireGuard device");
    let loaded = load_datapath(flags)?;
    laps.lap("datapath");
    let mut kernel = NetlinkKernel::connect()?;
    let changes = netlink::Changes::default();
    kernel.follow(changes.clone());
    laps.lap("netlink");
    let hostname_ips = lookup.await.ok().and_then(Result::ok).unwrap_or_default();
    laps.lap("host name lookup");

    let ignored = [flags.interface.as_str(), "tunl0", "kube-bridge"];
    let ips = detect::choose(&host, &hostname_ips, &ignored, &flags.internal_cidr);
    let local = local(flags, &hostname, public_key, &ips);
    tracing::info!(
        node = %hostname,
        public_key = %public_key,
        endpoint = ?local.endpoint,
        internal_ip = ?local.internal_ip,
        "starting"
    );
    let mtu = match flags.mtu {
        Mtu::Auto => detect::auto_mtu(&host),
        Mtu::Fixed(m) => m,
    };
    let devices = Devices {
        wireguard: flags.interface.clone(),
        private: ips.private.map(|a| a.interface),
        tunnel: tunnel_device(flags, host.mtus.contains_key("cilium_tunl")).map(str::to_string),
    };
    let datapath: Box<dyn DatapathOps> = match loaded {
        Some(loaded) => Box::new(DatapathReconciler::new(
            loaded,
            devices.clone(),
            &flags.datapath_interfaces,
            flags.fast_path,
        )),
        None => Box::new(NoDatapath),
    };
    let reconciler = Reconciler::new(
        kernel,
        wireguard,
        datapath,
        DeviceSettings {
            devices,
            create_interface: flags.create_interface,
            mtu: Some(mtu),
            private_key,
            dns: Box::new(system_resolver),
        },
    );
    let reconciler = if flags.cni {
        reconciler.with_cni(flags.cni_path.clone())
    } else {
        reconciler
    };
    // Always kept, the flag or not: without it, it removes the rules of an earlier run (the
    // manifests do not clean up on exit), reading the chains only now and then.
    let reconciler =
        reconciler.with_forward_rules(Box::new(ForwardKeeper::new(crate::writes::READ_BACK_EVERY)));
    let planner = planner::planner(plan_settings(flags, &hostname));
    let mut agent = Agent::new(
        backend,
        planner,
        reconciler,
        local,
        loop_settings(flags),
        metrics,
    );
    if flags.compatibility == Compatibility::Cilium {
        let cilium = detect::CiliumHost::connect()?;
        agent = agent.with_cni_compatibility_probe(Box::new(move || {
            let cilium = cilium.clone();
            Box::pin(async move { cilium.address().await.map_err(|e| e.to_string()) })
        }));
    }
    laps.lap("agent");
    tracing::info!(
        target: super::START_UP,
        after_ms = laps.start.elapsed().as_millis() as u64,
        phases = %laps,
        "built"
    );
    Ok(Started {
        agent: agent.timed_from(laps.start),
        changes,
        listen: flags.listen,
        datapath: flags.datapath,
        seccomp: flags.seccomp,
        failover: flags.failover().filter(|_| !flags.dry_run),
    })
}

impl<P: Planner> Started<P> {
    /// `--dry-run`: the difference between the plan and the kernel once the backend has a
    /// complete view, changing nothing.
    pub async fn dry_run(mut self) -> Result<String, StartError> {
        let mut rx = self.agent.backend.updates();
        rx.wait_for(|u| u.generation > 0)
            .await
            .map_err(|_| StartError::BackendStopped)?;
        Ok(self.agent.dry_run().await?)
    }

    /// Serves the metrics, watches the kernel, keeps only the capabilities the steady state
    /// uses and forbids exec, then runs the loop until `shutdown`.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<Stats, StartError> {
        let (checks, answers) = tokio::sync::mpsc::channel(4);
        let (_bound, _server) =
            telemetry::serve(self.listen, self.agent.metrics.clone(), Some(checks)).await?;
        self.agent = self.agent.answer_checks(answers);
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let _watch = netlink::watch(self.agent.event_filter(), tx, self.changes)?;
        if let Some(period) = self.failover {
            // A raw socket needs NET_RAW: opened now, before the capabilities go.
            match super::probe::Icmp::open() {
                Ok(icmp) => self.agent = self.agent.with_probe(std::sync::Arc::new(icmp), period),
                Err(e) => tracing::warn!(
                    error = %e,
                    "no leader failover from this node: it cannot open an ICMP socket (a raw one needs NET_RAW)"
                ),
            }
        }
        // Start-up is done (programs loaded, bpffs mounted, sockets bound): keep only what the
        // steady state uses.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let keep = caps::steady_state(self.datapath, release.trim());
        let dropped = caps::drop_all_but(keep)?;
        tracing::info!(
            dropped = ?caps::names(dropped.dropped),
            kept = ?caps::names(keep),
            bounding_set = dropped.bounding,
            "capabilities dropped on every thread"
        );
        if self.seccomp {
            if seccomp::install()? {
                tracing::info!(
                    "seccomp filter installed: this process can no longer exec, load BPF programs, trace or mount"
                );
            }
        } else {
            tracing::warn!("--seccomp=false: exec is not forbidden");
        }
        let stats = self.agent.run(Some(rx), shutdown).await;
        tracing::info!(reconciles = stats.reconciles, writes = %stats.writes, "stopped");
        Ok(stats)
    }
}

/// `kg webhook`: serves the Peer validation webhook, with no capability and (with `seccomp`)
/// no exec, until `shutdown`.
pub async fn webhook(
    flags: &WebhookFlags,
    seccomp: bool,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let settings = WebhookSettings {
        listen: flags.listen,
        listen_metrics: flags.listen_metrics,
        cert_file: flags.cert_file.clone(),
        key_file: flags.key_file.clone(),
    };
    let (addr, metrics_addr, _tasks) = peer_webhook::start(&settings).await?;
    tracing::info!(%addr, metrics = %metrics_addr, "serving the Peer validation webhook");
    // It needs none.
    caps::drop_all_but(0)?;
    if seccomp {
        seccomp::install()?;
    }
    shutdown.await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::agent::detect::IfAddr;

    fn flags(args: &[&str]) -> Flags {
        Flags::try_parse_from(std::iter::once("kg").chain(args.iter().copied())).unwrap()
    }

    /// Kilo's encapsulators keep their devices; Kilo's own IPIP needs none with the datapath,
    /// `tunl0` without it, and `--encapsulate=never` none at all.
    #[test]
    fn tunnel_device_follows_the_encapsulator() {
        let cases: [(&[&str], bool, Option<&str>); 8] = [
            (&[], false, None),
            (&["--datapath=false"], false, Some("tunl0")),
            (&["--compatibility=flannel"], false, Some("flannel.1")),
            (&["--compatibility=cilium"], false, Some("tunl0")),
            (&["--compatibility=cilium"], true, Some("cilium_tunl")),
            (
                &["--compatibility=flannel", "--encapsulate=never"],
                false,
                None,
            ),
            (&["--datapath=false", "--encapsulate=never"], false, None),
            (
                &["--compatibility=cilium", "--encapsulate=never"],
                true,
                None,
            ),
        ];
        for (args, cilium_tunl, want) in cases {
            assert_eq!(tunnel_device(&flags(args), cilium_tunl), want, "{args:?}");
        }
    }

    /// A dry run loads the datapath only where one is already pinned; `--datapath=false` never.
    #[test]
    fn a_dry_run_never_creates_a_datapath() {
        let pinned = tempfile::tempdir().unwrap();
        let pinned = format!("--bpffs-dir={}", pinned.path().display());
        let missing = format!("--bpffs-dir={}/none", std::env::temp_dir().display());
        assert!(loads_datapath(&flags(&[&missing])));
        assert!(!loads_datapath(&flags(&["--dry-run", &missing])));
        assert!(loads_datapath(&flags(&["--dry-run", &pinned])));
        assert!(!loads_datapath(&flags(&["--datapath=false", &pinned])));
    }

    #[test]
    fn plan_and_loop_settings_from_flags() {
        let f = flags(&[
            "--mesh-granularity=full",
            "--port=51821",
            "--service-cidr=10.96.0.0/12",
            "--subnet=10.5.0.0/16",
            "--local=false",
            "--cni=false",
            "--resync-period=0",
            "--clean-up=false",
        ]);
        let s = plan_settings(&f, "node-a");
        assert_eq!(s.hostname, "node-a");
        assert_eq!(s.granularity, crate::mesh::Granularity::Full);
        assert_eq!(s.port, 51821);
        assert_eq!(s.service_cidrs, ["10.96.0.0/12".parse().unwrap()]);
        assert_eq!(s.subnet, "10.5.0.0/16".parse().unwrap());
        assert!(!s.local && !s.cni);
        assert_eq!(s.now, None, "liveness is the agent's");
        let l = loop_settings(&f);
        assert_eq!(l.resync, None);
        assert!(!l.clean_up);
        assert!(loop_settings(&flags(&[])).clean_up);
        assert!(!loop_settings(&flags(&["--dry-run"])).clean_up, "a dry run");
    }

    #[test]
    fn the_endpoint_is_public_unless_private_is_prioritised() {
        let addr = |interface: &str, a: &str| IfAddr {
            interface: interface.into(),
            address: a.parse().unwrap(),
        };
        let ips = Detected {
            private: Some(addr("eth0", "192.168.0.2/24")),
            public: Some(addr("eth1", "203.0.113.2/24")),
        };
        let key = Key([1; 32]);
        let l = local(&flags(&["--port=51821"]), "a", key, &ips);
        assert_eq!(l.endpoint, Some("203.0.113.2:51821".parse().unwrap()));
        assert_eq!(l.internal_ip, Some("192.168.0.2/24".parse().unwrap()));
        let f = flags(&["--prioritise-private-addresses"]);
        let l = local(&f, "a", key, &ips);
        assert_eq!(l.endpoint, Some("192.168.0.2:51820".parse().unwrap()));
        let only_private = Detected {
            public: None,
            ..ips.clone()
        };
        assert_eq!(local(&flags(&[]), "a", key, &only_private).endpoint, None);
        assert_eq!(
            local(
                &f,
                "a",
                key,
                &Detected {
                    private: None,
                    ..ips
                }
            )
            .endpoint,
            Some("203.0.113.2:51820".parse().unwrap())
        );
    }
}
