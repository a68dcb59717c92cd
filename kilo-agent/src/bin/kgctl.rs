//! `kgctl`: inspect the mesh (graph, showconf). Only I/O lives here: reading the backend
//! (a directory of objects, or the Kubernetes API) and writing what `kilo_agent::kgctl` renders.
use std::{
    io::Write as _,
    path::PathBuf,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use ipnet::IpNet;
use kilo_agent::{
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
    /// The WireGuard port.
    #[arg(long, default_value_t = 51820)]
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
    /// Print the version and exit.
    Version,
    /// Show the WireGuard configuration of a node or peer.
    Showconf(Showconf),
}

#[derive(clap::Args, Debug)]
struct Graph {
    /// Output format: dot or svg.
    #[arg(short, long, default_value = "dot", value_parser = ["dot", "svg"])]
    output: String,
}

#[derive(clap::Args, Debug)]
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
    if let Command::Version = cli.command {
        println!("{}", env!("CARGO_PKG_VERSION"));
        return Ok(());
    }
    let (snapshot, errors) = match cli.backend {
        Backend::File => {
            let Some(dir) = &cli.backend_dir else {
                bail!("--backend file needs --backend-dir DIR");
            };
            mesh::objects::load_dir(dir)
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
    let opts = kgctl::Options {
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
                "svg" => kgctl::render_svg(&dot)?,
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
        Command::Version => unreachable!("answered before reading the backend"),
    }
    Ok(())
}

/// Lists Nodes and Peers from the Kubernetes API.
fn kube_snapshot(kubeconfig: Option<&std::path::Path>) -> Result<Snapshot> {
    use kilo_agent::backend::kubernetes::{self, describe};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let config = kubernetes::config(kubeconfig, None).await?;
        let server = config.cluster_url.clone();
        let client = kubernetes::client(config)?;
        let lp = kube::api::ListParams::default();
        let nodes = kube::Api::<KubeNode>::all(client.clone())
            .list(&lp)
            .await
            .map_err(|e| anyhow::anyhow!(describe(&format!("listing nodes from {server}"), &e)))?;
        let peers = kube::Api::<Peer>::all(client)
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
    })
}
