//! Kilo as the cluster's CNI (`--cni`, `--cni-path`): the node's pod CIDRs in the host-local
//! IPAM ranges of the bridge CNI configuration list.
//!
//! As Kilo: the file (Kilo's manifests install it as `/etc/cni/net.d/10-kilo.conflist`) is left
//! alone when its first IPAM range already is the node's pod CIDR; otherwise every plugin with
//! an `ipam` section gets `ranges` set to the pod CIDRs, one range set per CIDR (so a dual-stack
//! node gets an IPv4 and an IPv6 address per pod; Kilo writes the first CIDR only), and the rest
//! of the file keeps its values. Unlike Kilo, a missing or malformed file is an error that names
//! the file and what is wrong, and nothing is written over it; a write replaces the file whole
//! ([`crate::files::replace`], same mode, durable), so the container runtime never reads half a file.
use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use ipnet::IpNet;
use serde_json::{Value, json};

use super::Writes;
use crate::writes::Write;

/// The configuration file kg keeps (`--cni-path`), and the problem last reported about it, so
/// that a file that stays missing or malformed is reported once, not at every reconcile.
#[derive(Debug)]
pub struct CniFile {
    pub path: PathBuf,
    reported: Option<String>,
}

impl CniFile {
    pub fn new(path: PathBuf) -> Self {
        CniFile {
            path,
            reported: None,
        }
    }

    /// What [`CniFile::apply`] would change, as a dry-run line; `None` when nothing.
    pub fn describe(&self, ranges: &[IpNet]) -> Result<Option<String>, CniError> {
        if ranges.is_empty() {
            return Ok(None);
        }
        let change = rewritten(&self.path, ranges)?;
        let ranges: Vec<String> = ranges.iter().map(ToString::to_string).collect();
        Ok(change.map(|_| {
            format!(
                "~ CNI configuration {}: ranges {}",
                self.path.display(),
                ranges.join(", ")
            )
        }))
    }

    /// Brings the file in step with `ranges` (nothing to do when empty: `--cni=false`, or no
    /// pod CIDR yet). Returns the writes (`cni_config`) and a problem when there is a new one.
    pub fn apply(&mut self, ranges: &[IpNet]) -> (Writes, Option<String>) {
        let mut writes = Writes::default();
        match write_ranges(&self.path, ranges) {
            Ok(wrote) => {
                if wrote {
                    tracing::info!(path = %self.path.display(), ?ranges, "set the pod CIDRs in the CNI configuration");
                    writes.add(Write::CniConfig, 1);
                }
                self.reported = None;
                (writes, None)
            }
            Err(e) => {
                let problem = e.to_string();
                if self.reported.as_ref() == Some(&problem) {
                    tracing::debug!(%problem, "CNI configuration still not usable");
                    return (writes, None);
                }
                self.reported = Some(problem.clone());
                (writes, Some(problem))
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CniError {
    #[error("CNI configuration {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CNI configuration {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The configuration list `text` with its IPAM ranges set to `pod_cidrs`, or `None` when it
/// already starts with them. Pure.
pub fn with_pod_cidrs(text: &str, pod_cidrs: &[IpNet]) -> Result<Option<String>, String> {
    let mut conf: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let plugins = conf
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or("no \"plugins\" list")?;
    let mut ipams: Vec<&mut serde_json::Map<String, Value>> = Vec::new();
    for (i, plugin) in plugins.iter_mut().enumerate() {
        match plugin.get_mut("ipam") {
            None => {}
            Some(Value::Object(ipam)) => ipams.push(ipam),
            Some(_) => return Err(format!("plugins[{i}].ipam is not an object")),
        }
    }
    if ipams.is_empty() {
        return Err("no plugin has an \"ipam\" section".into());
    }
    let first = ipams[0]
        .get("ranges")
        .and_then(|r| r.pointer("/0/0/subnet"))
        .and_then(Value::as_str)
        .and_then(|s| s.parse::<IpNet>().ok());
    if first.is_some() && first.map(|c| c.trunc()) == pod_cidrs.first().map(IpNet::trunc) {
        return Ok(None);
    }
    let ranges: Vec<Value> = pod_cidrs
        .iter()
        .map(|c| json!([{ "subnet": c.trunc().to_string() }]))
        .collect();
    for ipam in ipams {
        ipam.insert("ranges".into(), Value::Array(ranges.clone()));
    }
    let mut out = serde_json::to_string_pretty(&conf).map_err(|e| e.to_string())?;
    out.push('\n');
    Ok(Some(out))
}

/// The file at `path` rewritten to carry `pod_cidrs`, or `None` when it already does.
fn rewritten(path: &Path, pod_cidrs: &[IpNet]) -> Result<Option<String>, CniError> {
    let text = std::fs::read_to_string(path).map_err(|source| CniError::Io {
        path: path.to_owned(),
        source,
    })?;
    with_pod_cidrs(&text, pod_cidrs).map_err(|message| CniError::Invalid {
        path: path.to_owned(),
        message,
    })
}

/// Brings the file at `path` to carry `pod_cidrs`; returns whether it wrote.
pub fn write_ranges(path: &Path, pod_cidrs: &[IpNet]) -> Result<bool, CniError> {
    if pod_cidrs.is_empty() {
        return Ok(false);
    }
    let Some(new) = rewritten(path, pod_cidrs)? else {
        return Ok(false);
    };
    let io = |source| CniError::Io {
        path: path.to_owned(),
        source,
    };
    let mode = std::fs::metadata(path).map_err(io)?.permissions().mode();
    crate::files::replace(path, new.as_bytes(), crate::files::Mode::Exact(mode), true)
        .map_err(io)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration Kilo's manifests install (its `kilo-kubeadm.yaml` ConfigMap).
    const KILO: &str = r#"{
  "cniVersion":"0.4.0",
  "name":"kilo",
  "plugins":[
    {
      "name":"kubernetes",
      "type":"bridge",
      "bridge":"kube-bridge",
      "isDefaultGateway":true,
      "forceAddress":true,
      "mtu": 1420,
      "ipam":{
        "type":"host-local"
      }
    },
    {
      "type":"portmap",
      "snat":true,
      "capabilities":{
        "portMappings":true
      }
    }
  ]
}"#;

    fn cidrs(s: &[&str]) -> Vec<IpNet> {
        s.iter().map(|c| c.parse().unwrap()).collect()
    }

    #[test]
    fn kilos_file_gets_the_pod_cidr_and_keeps_everything_else() {
        let out = with_pod_cidrs(KILO, &cidrs(&["10.2.1.0/24"]))
            .unwrap()
            .unwrap();
        let got: Value = serde_json::from_str(&out).unwrap();
        let mut want: Value = serde_json::from_str(KILO).unwrap();
        want["plugins"][0]["ipam"]["ranges"] = json!([[{"subnet": "10.2.1.0/24"}]]);
        assert_eq!(got, want);
        // Already right: nothing to write.
        assert_eq!(with_pod_cidrs(&out, &cidrs(&["10.2.1.0/24"])), Ok(None));
        // A new pod CIDR replaces the old one.
        let moved = with_pod_cidrs(&out, &cidrs(&["10.2.9.0/24"]))
            .unwrap()
            .unwrap();
        let moved: Value = serde_json::from_str(&moved).unwrap();
        assert_eq!(
            moved["plugins"][0]["ipam"]["ranges"],
            json!([[{"subnet": "10.2.9.0/24"}]])
        );
    }

    #[test]
    fn dual_stack_gets_one_range_set_per_family() {
        let out = with_pod_cidrs(KILO, &cidrs(&["10.2.1.0/24", "fd00:2:1::/64"]))
            .unwrap()
            .unwrap();
        let got: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            got["plugins"][0]["ipam"]["ranges"],
            json!([[{"subnet": "10.2.1.0/24"}], [{"subnet": "fd00:2:1::/64"}]])
        );
    }

    #[test]
    fn files_it_cannot_use_are_named_errors() {
        for (text, says) in [
            ("{", "not valid JSON"),
            (r#"{"name":"x"}"#, "no \"plugins\" list"),
            (
                r#"{"plugins":[{"type":"bridge"}]}"#,
                "no plugin has an \"ipam\"",
            ),
            (
                r#"{"plugins":[{"ipam":3}]}"#,
                "plugins[0].ipam is not an object",
            ),
        ] {
            let err = with_pod_cidrs(text, &cidrs(&["10.2.1.0/24"])).unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn a_lasting_problem_is_reported_once_and_a_fix_is_noticed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("10-kilo.conflist");
        let mut file = CniFile::new(path.clone());
        let pods = cidrs(&["10.2.1.0/24"]);
        let (w, p) = file.apply(&pods);
        assert!(w.is_empty());
        assert!(p.unwrap().contains("10-kilo.conflist"));
        assert_eq!(file.apply(&pods).1, None, "reported once");
        std::fs::write(&path, KILO).unwrap();
        let (w, p) = file.apply(&pods);
        assert_eq!((w.get(Write::CniConfig), p), (1, None));
        assert!(file.apply(&pods).0.is_empty());
        std::fs::write(&path, "{").unwrap();
        assert!(file.apply(&pods).1.is_some(), "a new problem is reported");
    }

    #[test]
    fn ranges_written_once_atomically_and_never_over_a_bad_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("10-kilo.conflist");
        let pods = cidrs(&["10.2.1.0/24"]);
        // Missing: an error naming the file.
        let err = write_ranges(&path, &pods).unwrap_err().to_string();
        assert!(err.contains("10-kilo.conflist"), "{err}");
        assert!(!path.exists());
        // Malformed: an error, and the file is left as it was.
        std::fs::write(&path, "{ not json").unwrap();
        assert!(matches!(
            write_ranges(&path, &pods),
            Err(CniError::Invalid { .. })
        ));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{ not json");
        // Kilo's file: one write, keeping the file's mode; then nothing more to do.
        std::fs::write(&path, KILO).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(write_ranges(&path, &pods).unwrap());
        assert!(!write_ranges(&path, &pods).unwrap());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        let entries: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(entries.len(), 1, "no temporary file left behind");
        // No pod CIDR yet: nothing written.
        assert!(!write_ranges(&path, &[]).unwrap());
    }
}
