//! What kg needs from the host besides capabilities (`caps`) and kernel features, checked once
//! at start: one warning line per prerequisite missing, each saying what fails without it and
//! what to do. [`missing`] decides from [`HostFacts`] (pure, tested here); [`observe`] reads
//! them (a few `stat`s and small reads, nothing written); [`warn_missing`] logs.
//!
//! - bpffs on `/sys/fs/bpf` when the pin directory is under it: without it kg mounts one itself
//!   (with CAP_SYS_ADMIN), which in a container lives and dies with the pod's mount namespace,
//!   so the pinned datapath would not outlive a restart; a pin directory elsewhere must already
//!   be on a bpffs.
//! - With `--cni`: the CNI plugins the configuration (`--cni-path`) names, plus `loopback`, in
//!   `--cni-bin-dir`; without them the container runtime can start no pod on this node.
//! - `net.ipv4.ip_forward`: without it the node forwards neither pod nor mesh traffic.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use super::config::Flags;
use crate::datapath::is_bpffs;

const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// The plugins Kilo's (and kg's) bridge configuration names, for when the file is not there yet.
const DEFAULT_PLUGINS: [&str; 3] = ["bridge", "host-local", "portmap"];

/// What the checks read from the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// `/sys/fs/bpf` is a bpffs.
    pub bpffs_root: bool,
    /// The pin directory's nearest existing ancestor is on a bpffs.
    pub pin_dir_on_bpffs: bool,
    /// The plugin types the CNI configuration names (`None`: no readable file).
    pub cni_plugins: Option<BTreeSet<String>>,
    /// Those of the needed plugins found as files in `--cni-bin-dir`.
    pub cni_bin_present: BTreeSet<String>,
    /// `--cni-bin-dir` exists.
    pub cni_bin_dir: bool,
    /// `net.ipv4.ip_forward`, `None` when unreadable.
    pub ip_forward: Option<bool>,
}

/// The plugins needed: those the configuration names (its `type`s and IPAM `type`s), else
/// Kilo's, and `loopback`, which the runtime runs for every pod.
pub fn needed_plugins(facts: &HostFacts) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = match &facts.cni_plugins {
        Some(named) => named.clone(),
        None => DEFAULT_PLUGINS.iter().map(|s| s.to_string()).collect(),
    };
    out.insert("loopback".into());
    out
}

/// One line per prerequisite `flags` need and `facts` say is missing. Pure.
pub fn missing(flags: &Flags, facts: &HostFacts) -> Vec<String> {
    let mut out = Vec::new();
    if flags.datapath && !flags.dry_run {
        if flags.bpffs_dir.starts_with(BPFFS_ROOT) {
            if !facts.bpffs_root {
                out.push(format!(
                    "bpffs is not mounted on {BPFFS_ROOT}: kg mounts one itself (needs \
                     CAP_SYS_ADMIN), but in a container it goes with the pod, and the datapath \
                     pinned under {} with it; mount bpffs on the host (systemd does: \
                     `mount -t bpf bpf {BPFFS_ROOT}`)",
                    flags.bpffs_dir.display()
                ));
            }
        } else if !facts.pin_dir_on_bpffs {
            out.push(format!(
                "--bpffs-dir={} is not on a bpf filesystem: the datapath cannot pin its maps \
                 there (mount bpffs on it or choose a directory under {BPFFS_ROOT})",
                flags.bpffs_dir.display()
            ));
        }
    }
    if flags.cni {
        let dir = flags.cni_bin_dir.display();
        if !facts.cni_bin_dir {
            out.push(format!(
                "--cni-bin-dir={dir} does not exist: with kg as the CNI (--cni), the container \
                 runtime needs the plugins {} there to start pods (install the CNI plugins, \
                 or mount the host's plugin directory there when kg runs in a container)",
                join(&needed_plugins(facts))
            ));
        } else {
            let absent: BTreeSet<String> = needed_plugins(facts)
                .difference(&facts.cni_bin_present)
                .cloned()
                .collect();
            if !absent.is_empty() {
                out.push(format!(
                    "CNI plugins missing from {dir}: {}; the container runtime cannot start \
                     pods on this node with {} until they are installed",
                    join(&absent),
                    flags.cni_path.display()
                ));
            }
        }
    }
    if facts.ip_forward == Some(false) {
        out.push(
            "net.ipv4.ip_forward is 0: this node forwards no pod or mesh traffic (set \
             net.ipv4.ip_forward=1, as kubeadm's and k3s' prerequisites ask)"
                .into(),
        );
    }
    out
}

fn join(names: &BTreeSet<String>) -> String {
    names.iter().cloned().collect::<Vec<_>>().join(", ")
}

/// The plugin types a CNI configuration list names (`plugins[].type`, `plugins[].ipam.type`).
pub fn plugin_types(conflist: &str) -> Option<BTreeSet<String>> {
    let v: serde_json::Value = serde_json::from_str(conflist).ok()?;
    let plugins = v.get("plugins")?.as_array()?;
    Some(
        plugins
            .iter()
            .flat_map(|p| [p.get("type"), p.get("ipam").and_then(|i| i.get("type"))])
            .flatten()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
    )
}

fn nearest_existing(dir: &Path) -> PathBuf {
    let mut probe = dir;
    while !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new("/"));
    }
    probe.to_path_buf()
}

/// Reads the facts `flags` need (only those).
pub fn observe(flags: &Flags) -> HostFacts {
    let mut facts = HostFacts {
        bpffs_root: is_bpffs(Path::new(BPFFS_ROOT)),
        pin_dir_on_bpffs: is_bpffs(&nearest_existing(&flags.bpffs_dir)),
        ip_forward: std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .ok()
            .map(|v| v.trim() == "1"),
        ..HostFacts::default()
    };
    if flags.cni {
        facts.cni_plugins = std::fs::read_to_string(&flags.cni_path)
            .ok()
            .and_then(|t| plugin_types(&t));
        facts.cni_bin_dir = flags.cni_bin_dir.is_dir();
        facts.cni_bin_present = needed_plugins(&facts)
            .into_iter()
            .filter(|p| flags.cni_bin_dir.join(p).is_file())
            .collect();
    }
    facts
}

/// Logs one warning per missing prerequisite (see the module doc).
pub fn warn_missing(flags: &Flags) {
    for line in missing(flags, &observe(flags)) {
        tracing::warn!("prerequisite missing: {line}");
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn flags(args: &[&str]) -> Flags {
        Flags::try_parse_from(std::iter::once("kg").chain(args.iter().copied())).unwrap()
    }

    fn all_there() -> HostFacts {
        HostFacts {
            bpffs_root: true,
            pin_dir_on_bpffs: true,
            cni_plugins: None,
            cni_bin_present: ["bridge", "host-local", "portmap", "loopback"]
                .map(String::from)
                .into(),
            cni_bin_dir: true,
            ip_forward: Some(true),
        }
    }

    #[test]
    fn nothing_missing_says_nothing() {
        assert!(missing(&flags(&[]), &all_there()).is_empty());
    }

    /// One line per missing prerequisite, naming it.
    #[test]
    fn each_missing_prerequisite_is_one_line() {
        let cases: [(&[&str], HostFacts, &str); 6] = [
            (
                &[],
                HostFacts {
                    bpffs_root: false,
                    ..all_there()
                },
                "bpffs is not mounted on /sys/fs/bpf",
            ),
            (
                &["--bpffs-dir=/run/kilo"],
                HostFacts {
                    pin_dir_on_bpffs: false,
                    ..all_there()
                },
                "--bpffs-dir=/run/kilo is not on a bpf filesystem",
            ),
            (
                &[],
                HostFacts {
                    cni_bin_dir: false,
                    ..all_there()
                },
                "--cni-bin-dir=/opt/cni/bin does not exist",
            ),
            (
                &[],
                HostFacts {
                    cni_bin_present: ["bridge", "loopback"].map(String::from).into(),
                    ..all_there()
                },
                "CNI plugins missing from /opt/cni/bin: host-local, portmap;",
            ),
            (
                &[],
                HostFacts {
                    cni_plugins: Some(["bridge", "host-local", "flannel"].map(String::from).into()),
                    ..all_there()
                },
                "CNI plugins missing from /opt/cni/bin: flannel;",
            ),
            (
                &[],
                HostFacts {
                    ip_forward: Some(false),
                    ..all_there()
                },
                "net.ipv4.ip_forward is 0",
            ),
        ];
        for (args, facts, want) in cases {
            let lines = missing(&flags(args), &facts);
            assert_eq!(lines.len(), 1, "{args:?} {lines:?}");
            assert!(lines[0].starts_with(want), "{:?} vs {want:?}", lines[0]);
        }
    }

    /// What is not needed is not checked: the CNI plugins without --cni, bpffs without the
    /// datapath or in a dry run.
    #[test]
    fn unneeded_prerequisites_are_not_reported() {
        let bare = HostFacts {
            bpffs_root: false,
            pin_dir_on_bpffs: false,
            cni_bin_dir: false,
            cni_bin_present: BTreeSet::new(),
            ..all_there()
        };
        assert!(missing(&flags(&["--cni=false", "--datapath=false"]), &bare).is_empty());
        assert!(missing(&flags(&["--cni=false", "--dry-run"]), &bare).is_empty());
    }

    #[test]
    fn plugin_types_of_the_kubeadm_configuration() {
        let conf = include_str!("../../../manifests/overlays/kubeadm/cni-conf.json");
        let types: Vec<String> = plugin_types(conf).unwrap().into_iter().collect();
        assert_eq!(types, ["bridge", "host-local", "portmap"]);
        assert_eq!(plugin_types("not json"), None);
    }
}
