//! `kgctl`: inspect the mesh (graph, showconf), ask the agents whether their nodes match their
//! plans (check) and join the mesh as a peer (connect). Only I/O lives
//! here: reading the backend (a directory of objects, or the Kubernetes API), writing what
//! `kilo_agent::kgctl` renders, and, for `connect`, the Peer object and the agent's reconcilers.
use std::{
    io::Write as _,
    path::PathBuf,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};
use clap::{CommandFactory as _, Parser, Subcommand, ValueEnum};
use ipnet::IpNet;
use kilo_agent::{
    agent::config::{LogLevel, Shell, go_bool_flag, parse_duration},
    files, graph,
    kgctl::{self, GranularityArg, OutputFormat, ShowOptions},
    mesh::{self, KubeNode, Peer, Snapshot},
};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    Kubernetes,
    File,
}

#[derive(Parser, Debug)]
#[command(name = "kgctl", version, about = "Manage and inspect a Kilo network")]
struct Cli {
    /// Where to read Nodes and Peers from.
    #[arg(long, value_enum, default_value = "kubernetes")]
    backend: Backend,
    /// The directory of Node and Peer objects (one YAML or JSON object per file) for `--backend file`.
    #[arg(long, value_name = "DIR")]
    backend_dir: Option<PathBuf>,
    /// Path to a kubeconfig (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// location, full, cross, or auto (read kilo.squat.ai/granularity of the first node).
    #[arg(long, default_value = "auto")]
    mesh_granularity: GranularityArg,
    /// The WireGuard port (1 to 65535).
    #[arg(long, default_value_t = 51820, value_parser = clap::value_parser!(u16).range(1..))]
    port: u16,
    /// The label naming a node's location when it has no kilo.squat.ai/location annotation.
    #[arg(long, default_value = mesh::DEFAULT_TOPOLOGY_LABEL)]
    topology_label: String,
    /// The WireGuard subnet (default: the subnet of the nodes' kilo.squat.ai/wireguard-ip, else 10.4.0.0/16).
    #[arg(long)]
    subnet: Option<IpNet>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print a graph of the Kilo network (Graphviz DOT, or SVG laid out in-process).
    Graph(Graph),
    /// Connect to the Kilo network as a peer over WireGuard, until SIGINT or SIGTERM.
    Connect(ConnectArgs),
    /// Print the version and exit.
    Version,
    /// Show the WireGuard configuration of a node or peer.
    Showconf(Showconf),
    /// Ask each node's kg (through the API server's pod proxy) whether its kernel matches its
    /// plan; fails unless every one answers in sync.
    Check(Check),
    /// Generate the autocompletion script for the specified shell.
    Completion {
        #[arg(value_enum)]
        shell: Shell,
    },
}

#[derive(clap::Args, Debug)]
struct Check {
    /// The nodes to check (default: every node running an agent's pod).
    nodes: Vec<String>,
    /// The agents' namespace.
    #[arg(short, long, default_value = "kube-system")]
    namespace: String,
}

#[derive(clap::Args, Debug)]
struct Graph {
    /// Output format: dot or svg.
    #[arg(short, long, default_value = "dot", value_parser = ["dot", "svg"])]
    output: String,
}

/// Kilo's `kgctl connect` flags (plus `--create-interface`, as kg's).
#[derive(clap::Args, Debug)]
#[command(mut_args = go_bool_flag)]
struct ConnectArgs {
    /// The Peer's name (default: the host name).
    name: Option<String>,
    /// Allowed IP of the peer: this machine's address in the mesh.
    #[arg(short = 'a', long, default_value = "10.10.10.10/32")]
    allowed_ip: IpNet,
    /// Additional allowed IPs of the cluster, e.g. the service CIDR (repeatable, or comma-separated).
    #[arg(long, value_delimiter = ',')]
    allowed_ips: Vec<IpNet>,
    /// all, debug, info, warn, error or none.
    #[arg(long, value_enum, default_value = "info")]
    log_level: LogLevel,
    /// The WireGuard private key file (generated with mode 0600 when absent); without it a key
    /// is generated for this run only.
    #[arg(long)]
    private_key: Option<PathBuf>,
    /// Remove the routes, the addresses, the interface (when created here) and the Peer (when
    /// created here) on exit.
    #[arg(long, default_value_t = true)]
    clean_up: bool,
    /// The MTU of the WireGuard interface.
    #[arg(long, default_value_t = 1420)]
    mtu: u32,
    /// How often to read the mesh and reconcile.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    resync_period: Duration,
    /// The WireGuard interface; created when missing (kernel module required).
    #[arg(short = 'i', long, default_value = "kilo0")]
    interface: String,
    /// Create the WireGuard interface (false: use an existing one, e.g. wireguard-go's).
    #[arg(long, default_value_t = true)]
    create_interface: bool,
    /// Seconds between WireGuard keepalives (0 disables them).
    #[arg(long, default_value_t = 10)]
    persistent_keepalive: u16,
}

#[derive(clap::Args, Debug)]
#[command(mut_args = go_bool_flag)]
struct Showconf {
    /// Show the resource as a peer (to configure it as a peer of another WireGuard interface).
    #[arg(long, global = true)]
    as_peer: bool,
    /// wireguard, json or yaml (json and yaml emit a Peer object; only with --as-peer).
    #[arg(
        short = 'o',
        long = "output",
        default_value = "wireguard",
        global = true
    )]
    output: OutputFormat,
    /// Add these CIDRs to the allowed IPs (only with --as-peer).
    #[arg(long, value_delimiter = ',', global = true)]
    allowed_ips: Vec<IpNet>,
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand, Debug)]
enum What {
    /// The configuration a node applies (leaders only).
    Node { name: String },
    /// The configuration an external peer should apply.
    Peer { name: String },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with every cause, never a panic or a backtrace.
            eprintln!("kgctl: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match &cli.command {
        Command::Version => {
            println!("{}", env!("CARGO_PKG_VERSION"));
            return Ok(());
        }
        Command::Completion { shell } => {
            shell.write(Cli::command(), &mut std::io::stdout().lock());
            return Ok(());
        }
        _ => {}
    }
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    match &cli.command {
        Command::Connect(args) => return runtime()?.block_on(connect(&cli, args)),
        Command::Check(args) => return runtime()?.block_on(check(&cli, args)),
        _ => {}
    }
    let (snapshot, errors) = match cli.backend {
        Backend::File => {
            let Some(dir) = &cli.backend_dir else {
                bail!("--backend file needs --backend-dir DIR");
            };
            kilo_agent::backend::file::load_dir(dir)
        }
        Backend::Kubernetes => (kube_snapshot(cli.kubeconfig.as_deref())?, Vec::new()),
    };
    let mut stderr = std::io::stderr().lock();
    for e in &errors {
        writeln!(stderr, "warning: skipped {e}")?;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .ok();
    let opts = kgctl::GlobalOptions {
        granularity: cli.mesh_granularity,
        port: cli.port,
        subnet: cli.subnet,
        topology_label: cli.topology_label.clone(),
        now,
    };
    let cluster = kgctl::cluster(&snapshot, &opts).context("failed to read the cluster")?;
    for e in &cluster.errors {
        writeln!(stderr, "warning: {e}")?;
    }
    let mut stdout = std::io::stdout().lock();
    match cli.command {
        Command::Graph(g) => {
            let dot = kgctl::graph(&cluster)?;
            let out = match g.output.as_str() {
                "svg" => graph::render_svg(&dot)?,
                _ => dot,
            };
            // Kilo prints the graph with Println: one extra newline.
            writeln!(stdout, "{out}")?;
        }
        Command::Showconf(s) => {
            let o = ShowOptions {
                as_peer: s.as_peer,
                output: s.output,
                allowed_ips: s.allowed_ips,
            };
            let shown = match &s.what {
                What::Node { name } => kgctl::showconf_node(&cluster, name, &o)?,
                What::Peer { name } => kgctl::showconf_peer(&cluster, name, &o)?,
            };
            stdout.write_all(shown.stdout.as_bytes())?;
            stderr.write_all(shown.stderr.as_bytes())?;
        }
        Command::Version | Command::Connect(_) | Command::Check(_) | Command::Completion { .. } => {
            unreachable!("answered before reading the backend")
        }
    }
    Ok(())
}

/// `kgctl check`: each target's `/check` through the pod proxy, one line per node.
async fn check(cli: &Cli, args: &Check) -> Result<()> {
    use http_body_util::BodyExt as _;
    use k8s_openapi::api::core::v1::Pod;
    use kilo_agent::{backend::kubernetes::describe, kgctl::check};
    if !matches!(cli.backend, Backend::Kubernetes) {
        bail!("kgctl check asks the agents through the Kubernetes API: not with --backend file");
    }
    let (client, server) = kube_client(cli.kubeconfig.as_deref()).await?;
    let lp = kube::api::ListParams::default().labels(check::AGENT_SELECTOR);
    let pods = kube::Api::<Pod>::namespaced(client.clone(), &args.namespace)
        .list(&lp)
        .await
        .map_err(|e| {
            anyhow::anyhow!(describe(
                &format!("listing {}'s agent pods from {server}", args.namespace),
                &e
            ))
        })?;
    let (targets, missing) = check::targets(&pods.items, &args.nodes);
    let mut failed = missing.len();
    let mut stdout = std::io::stdout().lock();
    for node in &missing {
        writeln!(stdout, "{node}: no running kg pod in {}", args.namespace)?;
    }
    if targets.is_empty() && missing.is_empty() {
        bail!(
            "no running agent pod ({}) in {}",
            check::AGENT_SELECTOR,
            args.namespace
        );
    }
    for t in &targets {
        let path = format!(
            "/api/v1/namespaces/{}/pods/{}:{}/proxy/check",
            args.namespace, t.pod, t.port
        );
        let request = hyper::Request::get(&path).body(kube::client::Body::empty())?;
        let answer = match client.send(request).await {
            Ok(response) => {
                let status = response.status().as_u16();
                let body = response.into_body().collect().await?.to_bytes();
                check::Answer::read(status, &String::from_utf8_lossy(&body))
            }
            Err(e) => check::Answer::NoAnswer(kilo_agent::backend::kubernetes::error_chain(&e)),
        };
        failed += usize::from(!answer.in_sync());
        writeln!(stdout, "{}", answer.line(t))?;
    }
    if failed > 0 {
        bail!(
            "{failed} of {} nodes not in sync",
            targets.len() + missing.len()
        );
    }
    Ok(())
}

/// Lists Nodes and Peers from the Kubernetes API.
fn kube_snapshot(kubeconfig: Option<&std::path::Path>) -> Result<Snapshot> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (client, server) = kube_client(kubeconfig).await?;
        kube_list(&client, &server).await
    })
}

/// A client of the API server, and the server's address.
async fn kube_client(kubeconfig: Option<&std::path::Path>) -> Result<(kube::Client, String)> {
    use kilo_agent::backend::kubernetes;
    let config = kubernetes::config(kubeconfig, None).await?;
    let server = config.cluster_url.to_string();
    Ok((kubernetes::client(config)?, server))
}

async fn kube_list(client: &kube::Client, server: &str) -> Result<Snapshot> {
    use kilo_agent::backend::kubernetes::describe;
    let lp = kube::api::ListParams::default();
    let nodes = kube::Api::<KubeNode>::all(client.clone())
        .list(&lp)
        .await
        .map_err(|e| anyhow::anyhow!(describe(&format!("listing nodes from {server}"), &e)))?;
    let peers = kube::Api::<Peer>::all(client.clone())
        .list(&lp)
        .await
        .map_err(|e| {
            anyhow::anyhow!(describe(
                &format!("listing peers.kilo.squat.ai from {server}"),
                &e
            ))
        })?;
    let mut s = Snapshot::default();
    for n in nodes {
        s.nodes
            .insert(n.metadata.name.clone().unwrap_or_default(), n);
    }
    for p in peers {
        s.peers
            .insert(p.metadata.name.clone().unwrap_or_default(), p);
    }
    Ok(s)
}

/// Where `connect` reads the mesh and keeps its Peer object.
enum Objects {
    Dir(PathBuf),
    /// A client and the server's address.
    Kube(kube::Client, String),
}

impl Objects {
    async fn snapshot(&self) -> Result<Snapshot> {
        match self {
            Objects::Dir(dir) => {
                let (snapshot, errors) = kilo_agent::backend::file::load_dir(dir);
                for e in errors {
                    tracing::warn!(error = %e, "skipped");
                }
                Ok(snapshot)
            }
            Objects::Kube(client, server) => kube_list(client, server).await,
        }
    }

    /// Creates the Peer, or updates its spec when it differs. Returns whether it was created.
    async fn put_peer(&self, current: Option<&Peer>, peer: &Peer) -> Result<bool> {
        if current.is_some_and(|c| c.spec == peer.spec) {
            return Ok(false);
        }
        let name = peer.metadata.name.clone().unwrap_or_default();
        match self {
            Objects::Dir(dir) => {
                let yaml = serde_yaml::to_string(peer)?;
                let path = dir.join(format!("{name}.yaml"));
                files::replace(&path, yaml.as_bytes(), files::Mode::Default, false)?;
            }
            Objects::Kube(client, _) => {
                let api = kube::Api::<Peer>::all(client.clone());
                match current {
                    None => {
                        api.create(&Default::default(), peer).await?;
                    }
                    Some(c) => {
                        let mut p = peer.clone();
                        p.metadata.resource_version = c.metadata.resource_version.clone();
                        api.replace(&name, &Default::default(), &p).await?;
                    }
                }
            }
        }
        Ok(current.is_none())
    }

    async fn delete_peer(&self, name: &str) -> Result<()> {
        match self {
            Objects::Dir(dir) => std::fs::remove_file(dir.join(format!("{name}.yaml")))?,
            Objects::Kube(client, _) => {
                kube::Api::<Peer>::all(client.clone())
                    .delete(name, &Default::default())
                    .await?;
            }
        }
        Ok(())
    }
}

/// `kgctl connect`: keeps this machine a peer of the mesh until SIGINT or SIGTERM.
async fn connect(cli: &Cli, args: &ConnectArgs) -> Result<()> {
    use kilo_agent::{
        agent::key_file,
        datapath::NoDatapath,
        plan::Devices,
        reconcile::{
            DeviceSettings, Reconciler,
            netlink::NetlinkKernel,
            wireguard::{WgApi, WgControl, system_resolver},
        },
    };
    use tokio::signal::unix::{SignalKind, signal};
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            args.log_level.directive(),
        ))
        .init();
    let name = match &args.name {
        Some(n) => n.clone(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("reading the host name")?
            .trim()
            .to_string(),
    };
    let private_key = match &args.private_key {
        Some(path) => key_file::load_or_generate(path)?.0,
        None => mesh::Key(wireguard_control::Key::generate_private().0),
    };
    let public_key = key_file::public_key(&private_key);
    tracing::info!(key = %public_key, peer = %name, "public key");
    let objects = match cli.backend {
        Backend::File => Objects::Dir(
            cli.backend_dir
                .clone()
                .context("--backend file needs --backend-dir DIR")?,
        ),
        Backend::Kubernetes => {
            let (client, server) = kube_client(cli.kubeconfig.as_deref()).await?;
            Objects::Kube(client, server)
        }
    };
    let want = kgctl::Connect {
        name: name.clone(),
        allowed_ip: args.allowed_ip,
        allowed_ips: args.allowed_ips.clone(),
        persistent_keepalive: args.persistent_keepalive,
        port: cli.port,
    };
    let wireguard = if args.create_interface {
        WgControl::new(&args.interface, WgApi::Kernel)?
    } else {
        WgControl::detect(&args.interface)?
    };
    let mut reconciler = Reconciler::new(
        NetlinkKernel::connect()?,
        wireguard,
        NoDatapath,
        DeviceSettings {
            devices: Devices {
                wireguard: args.interface.clone(),
                private: None,
                tunnel: None,
            },
            create_interface: args.create_interface,
            mtu: Some(args.mtu),
            private_key,
            dns: Box::new(system_resolver),
        },
    );
    let opts = kgctl::GlobalOptions {
        granularity: cli.mesh_granularity,
        port: cli.port,
        subnet: cli.subnet,
        topology_label: cli.topology_label.clone(),
        now: None,
    };
    let (mut term, mut int) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    let mut created = false;
    loop {
        let synced = async {
            let snapshot = objects.snapshot().await?;
            let peer = want.peer(public_key);
            created |= objects.put_peer(snapshot.peers.get(&name), &peer).await?;
            let mut snapshot = snapshot;
            snapshot.peers.insert(name.clone(), peer);
            let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64;
            let cluster = kgctl::cluster(
                &snapshot,
                &kgctl::GlobalOptions {
                    now: Some(now),
                    ..opts.clone()
                },
            )?;
            let plan = want.plan(&cluster)?;
            let report = reconciler.reconcile(&plan).await?;
            for p in &report.problems {
                tracing::warn!(problem = %p, "not applied");
            }
            anyhow::Ok(())
        };
        if let Err(e) = synced.await {
            tracing::error!(error = format!("{e:#}"), "failed to sync");
        }
        tokio::select! {
            _ = tokio::time::sleep(args.resync_period) => {}
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    if args.clean_up {
        let report = reconciler.clean_up(args.create_interface).await?;
        for p in &report.problems {
            tracing::warn!(problem = %p, "not cleaned up");
        }
        if created {
            objects.delete_peer(&name).await?;
            tracing::info!(peer = %name, "deleted peer");
        }
    }
    Ok(())
}
