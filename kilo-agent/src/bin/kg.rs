//! `kg`: the kilo-rs agent. Parses Kilo's flags, loads (or generates) the key, detects local
//! addresses, starts the backend, the metrics server and the kernel watcher, forbids exec, then
//! runs the event loop until SIGTERM/SIGINT (cleaning up with `--clean-up`). `kg webhook`
//! serves the Peer validation webhook instead ([`kilo_agent::webhook`]). Logs go to stderr
//! as JSON lines (`--log-format=json`, the default, as Kilo logs) or text.
use std::{net::SocketAddr, process::ExitCode, sync::Arc};

use anyhow::Context as _;
use clap::{CommandFactory as _, Parser as _};
use kilo_agent::{
    agent::{
        Agent, Local, LoopSettings, caps,
        config::{
            BackendKind, Compatibility, Encapsulate, Flags, KgCommand, LogFormat, LogLevel, Mtu,
        },
        detect, key,
        planner::planner,
        seccomp,
    },
    backend::{Backend, file::FileBackend, kubernetes},
    datapath::{Datapath, DatapathConfig, DatapathReconciler, DatapathSync, NoDatapath, logs},
    plan::{self, Devices},
    reconcile::{
        Reconciler, Settings,
        netlink::{self, NetlinkKernel},
        wireguard::{WgApi, WgControl, system_resolver},
    },
    telemetry::{self, Metrics},
    webhook,
};

/// What the pure planner needs from the flags.
fn plan_settings(flags: &Flags, hostname: &str) -> plan::Settings {
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
        topology_label: flags.topology_label.clone(),
        // Liveness is the agent's (see `agent::liveness`), applied before planning.
        now: None,
        ..plan::Settings::default()
    }
}

/// The eBPF datapath, or none with `--datapath=false` (and in a dry run before any datapath
/// exists, which must not create one).
fn datapath(flags: &Flags, devices: Devices) -> anyhow::Result<Box<dyn DatapathSync>> {
    if !flags.datapath || (flags.dry_run && !flags.bpffs_dir.exists()) {
        return Ok(Box::new(NoDatapath));
    }
    let mut loaded = Datapath::open(DatapathConfig {
        pin_dir: Some(flags.bpffs_dir.clone()),
        fast_path: flags.fast_path,
        log_level: flags.datapath_log_level.program_level(),
        max_entries: flags.datapath_max_entries,
        counter_slots: flags.datapath_counter_slots,
        ..DatapathConfig::default()
    })
    .context("loading the eBPF datapath")?;
    if flags.datapath_log_level != LogLevel::None {
        let logger = loaded
            .logger(logs::TracingLog)
            .context("reading the eBPF program's logs")?;
        tokio::spawn(logs::forward(logger));
    }
    Ok(Box::new(DatapathReconciler::new(
        loaded,
        devices,
        &flags.datapath_interfaces,
        flags.fast_path,
    )))
}

fn hostname() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the host name")?
        .trim()
        .to_string())
}

async fn run(flags: Flags) -> anyhow::Result<()> {
    let hostname = match &flags.hostname {
        Some(h) => h.clone(),
        None => hostname()?,
    };
    let private_key = if flags.dry_run {
        // --dry-run changes nothing, not even the key file.
        match key::load(&flags.private_key)? {
            Some(k) => k,
            None => {
                tracing::warn!(path = %flags.private_key.display(), "no key yet; the dry run uses a throwaway one");
                kilo_agent::mesh::Key(wireguard_control::Key::generate_private().0)
            }
        }
    } else {
        key::load_or_generate(&flags.private_key)?.0
    };
    let public_key = key::public_key(&private_key);

    let host = detect::observe().await?;
    let ignored = [flags.interface.as_str(), "tunl0", "kube-bridge"];
    // getaddrinfo can block on an unreachable resolver: bound it (before seccomp, threads are fine).
    let name = hostname.clone();
    let hostname_ips = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        tokio::task::spawn_blocking(move || detect::resolve_hostname(&name)),
    )
    .await
    .ok()
    .and_then(Result::ok)
    .unwrap_or_default();
    let ips = detect::choose(&host, &hostname_ips, &ignored, &flags.internal_cidr);
    let endpoint_ip = if flags.prioritise_private_addresses {
        ips.private.clone().or(ips.public.clone())
    } else {
        ips.public.clone()
    };
    let local = Local {
        hostname: hostname.clone(),
        public_key,
        endpoint: endpoint_ip.map(|a| SocketAddr::new(a.address.addr(), flags.port)),
        internal_ip: ips.private.as_ref().map(|a| a.address),
        granularity: flags.mesh_granularity.as_str().into(),
        // Read at every pass (`with_cni_compatibility_probe` below).
        cni_compatibility_ip: None,
    };
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

    let metrics = Metrics::new();
    let backend: Arc<dyn Backend> = match flags.backend {
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
    };
    let wireguard = if flags.create_interface {
        WgControl::new(&flags.interface, WgApi::Kernel)?
    } else {
        WgControl::detect(&flags.interface)?
    };
    tracing::info!(api = ?wireguard.api(), interface = %flags.interface, "WireGuard device");
    let devices = Devices {
        wireguard: flags.interface.clone(),
        private: ips.private.map(|a| a.interface),
        // The encapsulating device of Kilo's encapsulators; for its own (IPIP) none: the
        // datapath encapsulates at the private interface (without the datapath, a `tunl0`
        // made by hand, if any).
        tunnel: match flags.compatibility {
            _ if flags.encapsulate == Encapsulate::Never => None,
            Compatibility::Flannel => Some("flannel.1"),
            Compatibility::Cilium if host.mtus.contains_key("cilium_tunl") => Some("cilium_tunl"),
            Compatibility::Cilium => Some("tunl0"),
            Compatibility::None if flags.datapath => None,
            Compatibility::None => Some("tunl0"),
        }
        .map(str::to_string),
    };
    let datapath = datapath(&flags, devices.clone())?;
    let mut kernel = NetlinkKernel::connect()?;
    let own_port = kernel.port();
    let changes = netlink::Changes::default();
    kernel.follow(changes.clone());
    let reconciler = Reconciler::new(
        kernel,
        wireguard,
        datapath,
        Settings {
            devices,
            create_interface: flags.create_interface,
            mtu: Some(mtu),
            private_key,
            resolver: Box::new(system_resolver),
        },
    );
    let reconciler = if flags.cni {
        reconciler.with_cni(flags.cni_path.clone())
    } else {
        reconciler
    };
    let planner = planner(plan_settings(&flags, &hostname));
    let mut agent = Agent::new(
        backend.clone(),
        planner,
        reconciler,
        local,
        LoopSettings {
            resync: flags.resync(),
            check_in: flags.check_in(),
            clean_up: flags.clean_up && !flags.dry_run,
            clean_up_interface: flags.clean_up_interface,
            ..LoopSettings::default()
        },
        metrics.clone(),
    );
    if flags.compatibility == Compatibility::Cilium {
        let cilium = detect::CiliumHost::connect()?;
        agent = agent.with_cni_compatibility_probe(Box::new(move || {
            let cilium = cilium.clone();
            Box::pin(async move { cilium.address().await.map_err(|e| e.to_string()) })
        }));
    }

    if flags.dry_run {
        let mut rx = backend.updates();
        rx.wait_for(|u| u.generation > 0).await?;
        print!("{}", agent.dry_run().await?);
        return Ok(());
    }

    let (_bound, _server) = telemetry::serve(flags.listen, metrics).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    agent.filter.lock().expect("filter lock").own_port = Some(own_port);
    let _watch = netlink::watch(agent.filter.clone(), tx, changes)?;
    // Start-up is done (programs loaded, bpffs mounted, sockets bound): keep only what the
    // steady state uses.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let keep = caps::steady_state(flags.datapath, release.trim());
    let dropped = caps::drop_all_but(keep)?;
    tracing::info!(
        dropped = ?caps::names(dropped.dropped),
        kept = ?caps::names(keep),
        bounding_set = dropped.bounding,
        "capabilities dropped on every thread"
    );
    if flags.seccomp {
        if seccomp::install()? {
            tracing::info!(
                "seccomp filter installed: this process can no longer exec, load BPF programs, trace or mount"
            );
        }
    } else {
        tracing::warn!("--seccomp=false: exec is not forbidden");
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
        }
    };
    let stats = agent.run(Some(rx), shutdown).await;
    tracing::info!(reconciles = stats.reconciles, writes = %stats.writes, "stopped");
    Ok(())
}

/// `kg webhook`: serves until SIGTERM/SIGINT.
async fn serve_webhook(settings: webhook::WebhookSettings, seccomp: bool) -> anyhow::Result<()> {
    let (addr, metrics_addr, _tasks) = webhook::start(&settings).await?;
    tracing::info!(%addr, metrics = %metrics_addr, "serving the Peer validation webhook");
    // It needs none.
    caps::drop_all_but(0)?;
    if seccomp {
        seccomp::install()?;
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
    }
    Ok(())
}

/// Logs to stderr at `--log-level` (or `RUST_LOG`), in `--log-format`. The object loader's
/// own debug chatter (hundreds of relocation lines per load) stays out below `all`; the
/// Kubernetes client's lines about requests and watches (an ERROR for every retry while the
/// API server is down, a WARN for every watch it cuts: the backend reports outages itself)
/// below `debug`, its TLS lines kept.
fn init_logging(flags: &Flags) {
    let directive = match flags.log_level {
        LogLevel::Debug => "debug,aya_obj=info,aya=info".to_string(),
        level @ (LogLevel::All | LogLevel::None) => level.directive().to_string(),
        level => {
            let l = level.directive();
            format!("{l},kube_client::client=off,kube_client::client::tls={l}")
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(directive));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match flags.log_format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

fn main() -> ExitCode {
    let flags = Flags::parse();
    match flags.command {
        Some(KgCommand::Version) => {
            println!("{}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Some(KgCommand::Completion { shell }) => {
            shell.write(Flags::command(), &mut std::io::stdout().lock());
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    init_logging(&flags);
    if let Some(KgCommand::Webhook(w)) = &flags.command {
        let settings = webhook::WebhookSettings {
            listen: w.listen,
            listen_metrics: w.listen_metrics,
            cert_file: w.cert_file.clone(),
            key_file: w.key_file.clone(),
        };
        return block_on(serve_webhook(settings, flags.seccomp));
    }
    if let Err(e) = flags.validate() {
        eprintln!("kg: {e}");
        return ExitCode::from(2);
    }
    for w in flags.warnings() {
        tracing::warn!("{w}");
    }
    let bpffs = std::path::Path::new("/sys/fs/bpf");
    caps::warn_missing(caps::Needs {
        datapath: flags.datapath && !flags.dry_run,
        mount_bpffs: flags.bpffs_dir.starts_with(bpffs) && !kilo_agent::datapath::is_bpffs(bpffs),
    });
    block_on(run(flags))
}

/// Runs `f` on a single-threaded runtime; an error is logged and fails the process.
fn block_on(f: impl Future<Output = anyhow::Result<()>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kg: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(f);
    // Do not wait for a getaddrinfo still blocked on an unreachable resolver.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
