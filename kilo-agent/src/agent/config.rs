//! `kg`'s flags: Kilo's names and defaults (Kilo's `cmd/kg/main.go`) where they still mean
//! something, plus ours (`--backend-dir`, `--dry-run`, `--private-key`, `--seccomp`,
//! `--check-in-period`).
//! Flags are read as Go's flag package reads Kilo's: booleans ([`go_bool_flag`]), durations
//! ([`parse_duration`]), listen addresses ([`parse_listen`]) and `--mtu` take Go's forms.
use std::{
    io::Write,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs},
    path::PathBuf,
    time::Duration,
};

use clap::{Arg, ArgAction, Parser, ValueEnum};
use ipnet::IpNet;

pub use crate::{
    mesh::Granularity,
    plan::{Compatibility, Encapsulation as Encapsulate},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    Kubernetes,
    File,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    All,
    Debug,
    Info,
    Warn,
    Error,
    None,
}

impl LogLevel {
    /// The `tracing` filter directive for this level.
    pub fn directive(self) -> &'static str {
        match self {
            LogLevel::All => "trace",
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
            LogLevel::None => "off",
        }
    }

    /// The eBPF program's level for this one (aya-log: 0 off ... 5 trace).
    pub fn program_level(self) -> u32 {
        match self {
            LogLevel::All => 5,
            LogLevel::Debug => 4,
            LogLevel::Info => 3,
            LogLevel::Warn => 2,
            LogLevel::Error => 1,
            LogLevel::None => 0,
        }
    }
}

/// `--log-format`: how log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line (`timestamp`, `level`, `message`, the event's fields, `target`),
    /// as Kilo logs (go-kit's JSON logger), so existing log pipelines keep parsing it.
    Json,
    /// Human-readable lines (for a terminal).
    Text,
}

/// `--mtu`: `auto` (the default-route interface's MTU minus WireGuard's 80 bytes) or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mtu {
    Auto,
    Fixed(u32),
}

/// WireGuard's overhead that `--mtu=auto` subtracts (Kilo's `WireGuardOverhead`).
pub const WIREGUARD_OVERHEAD: u32 = 80;
/// The MTU when `auto` finds no default route (Kilo's `DefaultMTU`).
pub const DEFAULT_MTU: u32 = 1420;

/// IPv6's minimum link MTU: below it `--mtu` is accepted with a warning.
const IPV6_MIN_MTU: u32 = 1280;

/// `--mtu` as Kilo reads it: `auto`, or any decimal number that fits 32 bits (Go's
/// `strconv.ParseUint(s, 10, 32)`: digits only, no sign).
fn parse_mtu(s: &str) -> Result<Mtu, String> {
    if s == "auto" {
        return Ok(Mtu::Auto);
    }
    s.bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| s.parse().ok())
        .flatten()
        .map(Mtu::Fixed)
        .ok_or_else(|| format!("{s:?}: expected auto or a number from 0 to {}", u32::MAX))
}

/// Go's `strconv.ParseBool`: the values Kilo's boolean flags take.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!(
            "{s:?}: expected true or false (or 1, t, T, TRUE, True, 0, f, F, FALSE, False)"
        )),
    }
}

/// Gives a boolean switch (a `bool` field, clap's `SetTrue`) the syntax of Go's flag package:
/// `--flag` alone is true, `--flag=VALUE` takes [`parse_go_bool`]'s forms, and in
/// `--flag VALUE` the VALUE is the next argument, not the flag's (pflag never gives a boolean
/// the following word). Applied to every argument of a command with
/// `#[command(mut_args = go_bool_flag)]`; other arguments are returned unchanged.
pub fn go_bool_flag(arg: Arg) -> Arg {
    if !matches!(arg.get_action(), ArgAction::SetTrue) {
        return arg;
    }
    let arg = arg
        .action(ArgAction::Set)
        .num_args(0..=1)
        .require_equals(true)
        .default_missing_value("true")
        .value_name("BOOL")
        .value_parser(parse_go_bool);
    if arg.get_default_values().is_empty() {
        arg.default_value("false")
    } else {
        arg
    }
}

/// The shells `completion` writes a script for (those of Kilo's cobra commands).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
    Powershell,
}

impl Shell {
    /// Writes the completion script of `cmd` (named as the binary) for this shell.
    pub fn write(self, mut cmd: clap::Command, out: &mut dyn Write) {
        let shell = match self {
            Shell::Bash => clap_complete::Shell::Bash,
            Shell::Zsh => clap_complete::Shell::Zsh,
            Shell::Fish => clap_complete::Shell::Fish,
            Shell::Powershell => clap_complete::Shell::PowerShell,
        };
        let name = cmd.get_name().to_string();
        clap_complete::generate(shell, &mut cmd, name, out);
    }
}

/// The default `--resync-period` and `--check-in-period` (Kilo's 30 s).
pub const DEFAULT_PERIOD: &str = "30s";

/// Parses Go's duration syntax as Kilo's flags take it: `30s`, `1m30s`, `500ms`, `2h`, `0`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?}: expected a duration like 30s, 5m or 1h30m");
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = 0f64;
    let mut rest = s;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        if num_len == 0 {
            return Err(bad());
        }
        let n: f64 = rest[..num_len].parse().map_err(|_| bad())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += n * scale;
        rest = &rest[unit_len..];
    }
    Ok(Duration::from_secs_f64(total))
}

/// `--listen`: Go's `host:port`. `:1107` is all addresses, IPv6 and IPv4 (`[::]:1107`, which
/// `telemetry::serve` binds dual-stack); an IPv6 address is bracketed (`[::1]:1107`); a host
/// name (`localhost:1107`) is resolved here, and, as Go listens, its first IPv4 address is
/// taken (else its first address).
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    let bad = |why: String| format!("{s:?}: {why} (expected :PORT, HOST:PORT or [IPv6]:PORT)");
    let (host, port) = s.rsplit_once(':').ok_or_else(|| bad("no port".into()))?;
    let port: u16 = port
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| port.parse().ok())
        .flatten()
        .ok_or_else(|| bad(format!("port {port:?} is not a number from 0 to 65535")))?;
    if let Some(ip) = host.strip_prefix('[') {
        return ip
            .strip_suffix(']')
            .and_then(|ip| ip.parse::<Ipv6Addr>().ok())
            .map(|ip| (ip, port).into())
            .ok_or_else(|| bad(format!("{host:?} is not an IPv6 address in brackets")));
    }
    if host.contains(':') {
        return Err(bad("an IPv6 address needs brackets".into()));
    }
    if host.is_empty() {
        return Ok((Ipv6Addr::UNSPECIFIED, port).into());
    }
    if let Ok(ip) = host.parse::<Ipv4Addr>() {
        return Ok((ip, port).into());
    }
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("{s:?}: cannot resolve {host:?}: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{s:?}: {host:?} has no address"))
}

/// kg's subcommands (Kilo's).
#[derive(Debug, Clone, clap::Subcommand)]
pub enum KgCommand {
    /// Print the version and exit.
    Version,
    /// Serve the validating admission webhook for Peers (see `manifests/webhook`).
    Webhook(WebhookFlags),
    /// Generate the autocompletion script for the specified shell.
    Completion {
        #[arg(value_enum)]
        shell: Shell,
    },
}

/// `kg webhook`'s flags (Kilo's names and defaults).
#[derive(Debug, Clone, clap::Args)]
#[command(mut_args = go_bool_flag)]
pub struct WebhookFlags {
    /// The TLS certificate (PEM, with its chain) the webhook serves.
    #[arg(long)]
    pub cert_file: PathBuf,
    /// The certificate's private key (PEM).
    #[arg(long)]
    pub key_file: PathBuf,
    /// Where the webhook listens (HTTPS; the API server calls POST /validate).
    #[arg(long, default_value = ":8443", value_parser = parse_listen)]
    pub listen: SocketAddr,
    /// Where metrics (/metrics) and /health are served (plain HTTP).
    #[arg(long, default_value = ":1107", value_parser = parse_listen)]
    pub listen_metrics: SocketAddr,
}

#[derive(Debug, Clone, Parser)]
#[command(
    name = "kg",
    version,
    about = "kilo-rs agent: keeps this node's WireGuard mesh, routes and eBPF datapath equal to the topology",
    mut_args = go_bool_flag
)]
pub struct Flags {
    #[command(subcommand)]
    pub command: Option<KgCommand>,
    /// Where nodes and peers come from.
    #[arg(long, value_enum, default_value = "kubernetes")]
    pub backend: BackendKind,
    /// Directory of Node and Peer objects (YAML or JSON, one per file) for --backend=file.
    #[arg(long)]
    pub backend_dir: Option<PathBuf>,
    /// Undo routes, rules, addresses, datapath and annotations on shutdown.
    #[arg(long, default_value_t = true)]
    pub clean_up: bool,
    /// Also delete the WireGuard interface on shutdown.
    #[arg(long, default_value_t = false)]
    pub clean_up_interface: bool,
    /// Manage the local pod CIDR's NAT (Kilo as the CNI).
    #[arg(long, default_value_t = true)]
    pub cni: bool,
    /// Path of the CNI configuration (Kilo's flag; CNI configuration is written by the install step).
    #[arg(long, default_value = "/etc/cni/net.d/10-kilo.conflist")]
    pub cni_path: PathBuf,
    /// Where the CNI plugins the configuration names are (checked at start with --cni; in a
    /// container, the host's directory mounted there).
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// `flannel` or `cilium`: Kilo's encapsulators for running on top of that CNI (a node of
    /// the location is reached through its pod CIDR, or Cilium's address, on the CNI's device).
    #[arg(long, default_value = "", value_parser = str::parse::<Compatibility>)]
    pub compatibility: Compatibility,
    /// Create the WireGuard interface (false: use an existing one, e.g. wireguard-go's).
    #[arg(long, default_value_t = true)]
    pub create_interface: bool,
    /// Intra-location encapsulation.
    #[arg(long, default_value = "always", value_parser = str::parse::<Encapsulate>)]
    pub encapsulate: Encapsulate,
    /// Path to a kubeconfig (in-cluster configuration when empty).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The Kubernetes API server address (overrides the kubeconfig's).
    #[arg(long)]
    pub master: Option<String>,
    /// This node's name (default: the host name).
    #[arg(long)]
    pub hostname: Option<String>,
    /// The WireGuard interface.
    #[arg(long, default_value = "kilo0")]
    pub interface: String,
    /// Address of the metrics/health server.
    #[arg(long, default_value = ":1107", value_parser = parse_listen)]
    pub listen: SocketAddr,
    /// Manage routes within the location.
    #[arg(long, default_value_t = true)]
    pub local: bool,
    /// MTU of the WireGuard interface: auto (default-route MTU − 80) or a number (below
    /// 1280, IPv6 cannot cross the mesh: accepted, with a warning).
    #[arg(long, default_value = "auto", value_parser = parse_mtu)]
    pub mtu: Mtu,
    /// Which nodes are in one location.
    #[arg(long, default_value = "location", value_parser = str::parse::<Granularity>)]
    pub mesh_granularity: Granularity,
    /// Node label giving its location.
    #[arg(long, default_value = crate::mesh::DEFAULT_TOPOLOGY_LABEL)]
    pub topology_label: String,
    /// WireGuard listen port (1 to 65535).
    #[arg(long, default_value_t = 51820, value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// A service CIDR (repeatable, or comma-separated): traffic to it is never masqueraded. Added to
    /// those of the cluster's ServiceCIDR objects, where the API serves them (Kubernetes 1.33+).
    #[arg(long, value_delimiter = ',')]
    pub service_cidr: Vec<IpNet>,
    /// Restrict private-IP auto-detection to these CIDRs (repeatable, or comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub internal_cidr: Vec<IpNet>,
    /// The WireGuard overlay CIDR.
    #[arg(long, default_value = "10.4.0.0/16")]
    pub subnet: IpNet,
    /// Periodic reconcile (0 disables; events still trigger reconciles).
    #[arg(long, default_value = DEFAULT_PERIOD, value_parser = parse_duration)]
    pub resync_period: Duration,
    /// How often to refresh the kilo.squat.ai/last-seen heartbeat (Kilo's fixed 30s); a node
    /// without one for 2 × this is down. 0 writes none and judges nodes by their Ready condition.
    #[arg(long, default_value = DEFAULT_PERIOD, value_parser = parse_duration)]
    pub check_in_period: Duration,
    /// How often the node next in line after its location's leader probes that leader (kg's
    /// leader failover; Kilo has none): three missed probes in a row demote the leader. 0 turns
    /// failover off, as in Kilo.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub failover_probe_period: Duration,
    /// Use the private IP as the endpoint.
    #[arg(long, default_value_t = false)]
    pub prioritise_private_addresses: bool,
    /// all, debug, info, warn, error or none.
    #[arg(long, value_enum, default_value = "info")]
    pub log_level: LogLevel,
    /// json (one object per line, like Kilo's logs) or text (for a terminal).
    #[arg(long, value_enum, default_value = "json")]
    pub log_format: LogFormat,
    /// Print the difference between the plan and the kernel, change nothing, exit.
    #[arg(long, default_value_t = false)]
    pub dry_run: bool,
    /// The WireGuard private key (generated with mode 0600 when absent).
    #[arg(long, default_value = "/var/lib/kilo/key")]
    pub private_key: PathBuf,
    /// Forbid execve/execveat after start-up.
    #[arg(long, default_value_t = true)]
    pub seccomp: bool,
    /// Kilo's FORWARD rules (with --cni): ACCEPT traffic from and to the location's pod CIDRs,
    /// allowed-location IPs and private IPs (a leader) or the node's pod CIDR (any other node),
    /// at the top of iptables' FORWARD chain, for hosts whose FORWARD policy is DROP. Written
    /// over netlink into the `ip filter` / `ip6 filter` tables of iptables-nft; on a host using
    /// iptables-legacy kg says once which rules to add by hand.
    #[arg(long, default_value_t = false)]
    pub iptables_forward_rules: bool,
    /// Pod-facing interfaces whose ingress runs the datapath (besides the WireGuard interface);
    /// those that do not exist (yet) are attached when they appear.
    #[arg(
        long = "datapath-interface",
        default_value = "kube-bridge",
        value_delimiter = ','
    )]
    pub datapath_interfaces: Vec<String>,
    /// bpffs directory where the datapath's maps and links are pinned (they outlive the agent).
    #[arg(long, default_value = "/sys/fs/bpf/kilo")]
    pub bpffs_dir: PathBuf,
    /// Redirect mesh traffic straight to its egress device, skipping routing, conntrack and
    /// netfilter. Off by default: it also bypasses NetworkPolicy enforced in netfilter's FORWARD.
    #[arg(long, default_value_t = false)]
    pub fast_path: bool,
    /// What the eBPF program itself logs (malformed packets and the fast path declining at
    /// debug, IPv4 lookups sent to the hash tables at all), as this agent's log lines with target
    /// `kilo_ebpf` (still subject to --log-level). The program pays for it only on those paths.
    #[arg(long, value_enum, default_value_t = LogLevel::None)]
    pub datapath_log_level: LogLevel,
    /// Capacity of each of the datapath's three tables (mesh destinations, NAT sources,
    /// masquerade destinations). Changing it (like the flag below) replaces the pinned maps
    /// at start: entries are written again and counters start from zero.
    #[arg(long, default_value_t = kilo_common::DEFAULT_MAX_ENTRIES)]
    pub datapath_max_entries: u32,
    /// Per-entry traffic counter slots (16 bytes per slot and CPU); entries past them are not
    /// counted per entry.
    #[arg(long, default_value_t = kilo_common::DEFAULT_COUNTER_SLOTS)]
    pub datapath_counter_slots: u32,
    /// Run without the eBPF datapath (no masquerading decisions: only WireGuard, routes and rules).
    #[arg(long, default_value_t = true)]
    pub datapath: bool,
}

impl Flags {
    /// Warnings about flags that are accepted for compatibility but mean something else here.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if let Mtu::Fixed(m) = self.mtu
            && m < IPV6_MIN_MTU
        {
            w.push(format!(
                "--mtu={m} is below IPv6's minimum MTU ({IPV6_MIN_MTU}): IPv6 packets cannot \
                 cross the mesh, and the kernel may refuse the MTU"
            ));
        }
        if self.iptables_forward_rules && !self.cni {
            w.push(
                "--iptables-forward-rules has no effect with --cni=false (as in Kilo): the FORWARD \
                 ACCEPT rules are for the pod CIDRs of a node that is the CNI"
                    .to_string(),
            );
        }
        w
    }

    /// Rejects combinations that cannot work.
    pub fn validate(&self) -> Result<(), String> {
        if self.backend == BackendKind::File && self.backend_dir.is_none() {
            return Err("--backend=file needs --backend-dir".into());
        }
        self.interface
            .parse::<wireguard_control::InterfaceName>()
            .map_err(|e| format!("--interface={:?}: {e}", self.interface))?;
        Ok(())
    }

    /// The resync period, `None` when disabled.
    pub fn resync(&self) -> Option<Duration> {
        (!self.resync_period.is_zero()).then_some(self.resync_period)
    }

    /// The failover probe's period, `None` when failover is off.
    pub fn failover(&self) -> Option<Duration> {
        (!self.failover_probe_period.is_zero()).then_some(self.failover_probe_period)
    }

    pub fn check_in(&self) -> Option<Duration> {
        (!self.check_in_period.is_zero()).then_some(self.check_in_period)
    }
}

#[cfg(test)]
mod tests;
