//! The overlays in `manifests/overlays`, rendered, against what their distribution documents:
//! each overlay's kg flags (the mode of the Kilo manifest it replaces, the distribution's service
//! range) and the host paths it mounts (the kubelet's kubeconfig, the CNI configuration
//! directory). Pure: no root, no API server. Rendered by `kubectl kustomize` where a kubectl is
//! found, else by merging the overlays' patches here; when both run, they must agree. The init
//! container that writes kg's kubeconfig is run on a kubelet kubeconfig. Every kustomization uses
//! only kustomize's current fields; every rendered container is hardened (security context, seccomp,
//! memory limit) and names the published image by tag, which the e2e renames to its local build.
use kilo_testkit as support;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize as _;
use serde_yaml::Value;

/// A distribution's facts, each with where it is documented.
struct Distribution {
    /// The kubelet's kubeconfig, whose `server:` kg uses. kubeadm: "Implementation details" of
    /// kubeadm (kubernetes.io/docs/reference/setup-tools/kubeadm/implementation-details/), the
    /// kubelet's kubeconfig file /etc/kubernetes/kubelet.conf. k3s: the agent's data directory
    /// /var/lib/rancher/k3s/agent (docs.k3s.io/cli/agent, --data-dir), where k3s writes
    /// kubelet.kubeconfig; Kilo's kilo-k3s*.yaml read the server from the same file.
    kubelet_kubeconfig: &'static str,
    /// Where the container runtime reads CNI configurations. kubeadm: the kubelet's and
    /// containerd's default /etc/cni/net.d (kubernetes.io/docs/concepts/extend-kubernetes/
    /// compute-storage-net/network-plugins/). k3s: the `conf_dir` of the containerd
    /// configuration k3s generates (/var/lib/rancher/k3s/agent/etc/containerd/config.toml),
    /// also given as cniConfDir in Istio's k3s platform prerequisites
    /// (istio.io/latest/docs/ambient/install/platform-prerequisites/#k3s), whose cniBinDir,
    /// /var/lib/rancher/k3s/data/current/bin, holds the bridge, host-local, loopback and
    /// portmap plugins kg's configuration names.
    cni_conf_dir: &'static str,
    /// The default service range. kubeadm: `kubeadm init --service-cidr` defaults to
    /// 10.96.0.0/12 (kubernetes.io/docs/reference/setup-tools/kubeadm/kubeadm-init/). k3s:
    /// `k3s server --service-cidr` defaults to 10.43.0.0/16 (docs.k3s.io/cli/server).
    service_cidr: &'static str,
    /// Paths of the other distribution that must not appear.
    foreign: &'static [&'static str],
}

const KUBEADM: Distribution = Distribution {
    kubelet_kubeconfig: "/etc/kubernetes/kubelet.conf",
    cni_conf_dir: "/etc/cni/net.d",
    service_cidr: "10.96.0.0/12",
    foreign: &["/var/lib/rancher"],
};

const K3S: Distribution = Distribution {
    kubelet_kubeconfig: "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",
    cni_conf_dir: "/var/lib/rancher/k3s/agent/etc/cni/net.d",
    service_cidr: "10.43.0.0/16",
    foreign: &["/etc/kubernetes", "/etc/cni", "/opt/cni"],
};

/// kg's arguments for each mode, as Kilo's manifests of that mode pass them (Kilo's
/// manifests/, tag 0.7.0; docs/deploying.md lists which Kilo manifest each overlay replaces).
const CNI: &[&str] = &[];
const FLANNEL: &[&str] = &[
    "--cni=false",
    "--compatibility=flannel",
    "--local=false",
    "--internal-cidr=$(NODE_IP)/32",
];
const CILIUM: &[&str] = &[
    "--cni=false",
    "--compatibility=cilium",
    "--local=false",
    "--encapsulate=crosssubnet",
    "--clean-up-interface=true",
    "--internal-cidr=$(NODE_IP)/32",
];
const USERSPACE: &[&str] = &["--create-interface=false", "--interface=kilo0"];

struct Overlay {
    name: &'static str,
    distribution: Distribution,
    mode: &'static [&'static str],
    /// Arguments beyond the mode's (kilo-kubeadm-cilium.yaml's --subnet).
    extra: &'static [&'static str],
    /// Whether the overlay must pass the distribution's --service-cidr (every overlay that
    /// passes one must pass the distribution's).
    service_cidr: bool,
}

const OVERLAYS: &[Overlay] = &[
    Overlay {
        name: "kubeadm",
        distribution: KUBEADM,
        mode: CNI,
        extra: &[],
        service_cidr: true,
    },
    Overlay {
        name: "flannel",
        distribution: KUBEADM,
        mode: FLANNEL,
        extra: &[],
        service_cidr: true,
    },
    Overlay {
        name: "userspace",
        distribution: KUBEADM,
        mode: USERSPACE,
        extra: &[],
        service_cidr: true,
    },
    Overlay {
        name: "kubeadm-cilium",
        distribution: KUBEADM,
        mode: CILIUM,
        extra: &["--subnet=172.31.254.0/24"],
        service_cidr: true,
    },
    Overlay {
        name: "k3s",
        distribution: K3S,
        mode: CNI,
        extra: &[],
        service_cidr: true,
    },
    Overlay {
        name: "k3s-flannel",
        distribution: K3S,
        mode: FLANNEL,
        extra: &[],
        service_cidr: true,
    },
    Overlay {
        name: "k3s-userspace",
        distribution: K3S,
        mode: USERSPACE,
        extra: &[],
        service_cidr: true,
    },
    Overlay {
        name: "k3s-cilium",
        distribution: K3S,
        mode: CILIUM,
        extra: &[],
        service_cidr: true,
    },
];

fn manifests() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests")
}

/// A kubectl: the pinned one (`cargo xtask setup`), else one on $PATH.
fn kubectl() -> Option<PathBuf> {
    let cached = support::apiserver::kubectl();
    if cached.exists() {
        return Some(cached);
    }
    let out = Command::new("kubectl")
        .args(["version", "--client"])
        .output();
    out.is_ok_and(|o| o.status.success())
        .then(|| PathBuf::from("kubectl"))
}

/// The overlay's DaemonSets as `kubectl kustomize` renders them.
fn kustomize(kubectl: &Path, dir: &Path) -> Vec<Value> {
    render(kubectl, dir)
        .into_iter()
        .filter(|v| v["kind"] == "DaemonSet")
        .collect()
}

/// Every object of the kustomization in `dir`, as `kubectl kustomize` renders it.
fn render(kubectl: &Path, dir: &Path) -> Vec<Value> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_yaml::Deserializer::from_slice(&out.stdout)
        .map(|d| Value::deserialize(d).unwrap())
        .collect()
}

/// What the checks read from the DaemonSets: kg's args, the env names and hostPath volumes by
/// name (of kg's DaemonSet), and the container names (of every DaemonSet: the userspace
/// overlays run wireguard-go in one of its own).
#[derive(Debug, PartialEq)]
struct Rendered {
    args: Vec<String>,
    env: Vec<String>,
    host_paths: BTreeMap<String, String>,
    containers: Vec<String>,
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| {
            s.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn named(v: &Value) -> impl Iterator<Item = (&str, &Value)> {
    v.as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|x| Some((x["name"].as_str()?, x)))
}

impl Rendered {
    fn from_daemonsets(all: &[Value]) -> Self {
        let ds = all
            .iter()
            .find(|d| d["metadata"]["name"] == "kilo")
            .expect("kg's DaemonSet");
        let spec = &ds["spec"]["template"]["spec"];
        let kilo = named(&spec["containers"])
            .find(|(n, _)| *n == "kilo")
            .map(|(_, c)| c)
            .expect("a kilo container");
        let mut env: Vec<String> = named(&kilo["env"]).map(|(n, _)| n.to_string()).collect();
        env.sort();
        let mut containers: Vec<String> = all
            .iter()
            .flat_map(|d| named(&d["spec"]["template"]["spec"]["containers"]))
            .map(|(n, _)| n.into())
            .collect();
        containers.sort();
        Rendered {
            args: strings(&kilo["args"]),
            env,
            host_paths: named(&spec["volumes"])
                .filter_map(|(n, v)| Some((n.to_string(), v["hostPath"]["path"].as_str()?.into())))
                .collect(),
            containers,
        }
    }

    /// The overlay without kubectl: its patches over the overlay it builds on (a directory in
    /// `resources`), down to `base`. A patch's args replace the list (as a strategic merge
    /// does); env, volumes and containers merge by name.
    fn merged(dir: &Path) -> Self {
        let kustomization: Value =
            serde_yaml::from_str(&std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap())
                .unwrap();
        let resources: Vec<PathBuf> = strings(&kustomization["resources"])
            .iter()
            .map(|r| dir.join(r))
            .collect();
        let patches = kustomization["patches"]
            .as_sequence()
            .cloned()
            .unwrap_or_default();
        let files: Vec<PathBuf> = (resources.iter().filter(|f| f.is_file()).cloned())
            .chain(
                patches
                    .iter()
                    .filter_map(|p| Some(dir.join(p["path"].as_str()?))),
            )
            .collect();
        let mut rendered = match resources.iter().find(|r| r.is_dir()) {
            Some(base) => Rendered::merged(base),
            None => Rendered {
                args: Vec::new(),
                env: Vec::new(),
                host_paths: BTreeMap::new(),
                containers: Vec::new(),
            },
        };
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let doc = Value::deserialize(doc).unwrap();
                if doc["kind"] != "DaemonSet" {
                    continue;
                }
                let kg = doc["metadata"]["name"] == "kilo";
                let spec = &doc["spec"]["template"]["spec"];
                for (name, c) in named(&spec["containers"]) {
                    if !rendered.containers.iter().any(|n| n == name) {
                        rendered.containers.push(name.into());
                    }
                    if kg && name == "kilo" {
                        if !c["args"].is_null() {
                            rendered.args = strings(&c["args"]);
                        }
                        for (e, _) in named(&c["env"]) {
                            if !rendered.env.iter().any(|n| n == e) {
                                rendered.env.push(e.into());
                            }
                        }
                    }
                }
                for (name, v) in named(&spec["volumes"]).filter(|_| kg) {
                    rendered.host_paths.remove(name);
                    if let Some(p) = v["hostPath"]["path"].as_str() {
                        rendered.host_paths.insert(name.into(), p.into());
                    }
                }
            }
        }
        rendered.env.sort();
        rendered.containers.sort();
        rendered
    }
}

#[test]
fn every_overlay_has_its_distributions_paths_and_its_modes_flags() {
    let overlays = manifests().join("overlays");
    let mut on_disk: Vec<String> = std::fs::read_dir(&overlays)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut tabled: Vec<String> = OVERLAYS.iter().map(|o| o.name.to_string()).collect();
    tabled.sort();
    assert_eq!(on_disk, tabled, "every overlay has a row in OVERLAYS");

    let kubectl = kubectl();
    if kubectl.is_none() {
        // Under `cargo xtask test` (which installs one) kubectl's rendering must be checked.
        assert!(
            std::env::var_os(support::REQUIRE_ALL).is_none(),
            "no kubectl ({} is set)",
            support::REQUIRE_ALL
        );
        eprintln!("no kubectl: checking the overlays as merged here");
    }
    for o in OVERLAYS {
        let dir = overlays.join(o.name);
        let merged = Rendered::merged(&dir);
        let r = match &kubectl {
            Some(k) => {
                let r = Rendered::from_daemonsets(&kustomize(k, &dir));
                assert_eq!(
                    r, merged,
                    "{}: kubectl's rendering and the merge here",
                    o.name
                );
                r
            }
            None => merged,
        };
        let d = &o.distribution;
        let name = o.name;
        assert!(
            r.args.contains(&"--hostname=$(NODE_NAME)".into()),
            "{name}: {r:?}"
        );
        for want in o.mode.iter().chain(o.extra) {
            assert!(
                r.args.iter().any(|a| a == want),
                "{name}: {want} in {:?}",
                r.args
            );
        }
        // Nothing of another mode: Kilo as the CNI passes no --cni=false, an add-on no
        // userspace flags.
        for other in [FLANNEL, CILIUM, USERSPACE] {
            for a in other.iter().filter(|a| !o.mode.contains(a)) {
                assert!(
                    !r.args.contains(&a.to_string()),
                    "{name}: {a} in {:?}",
                    r.args
                );
            }
        }
        let cidrs: Vec<&String> = r
            .args
            .iter()
            .filter(|a| a.starts_with("--service-cidr="))
            .collect();
        for c in &cidrs {
            assert_eq!(
                c.as_str(),
                format!("--service-cidr={}", d.service_cidr),
                "{name}"
            );
        }
        assert!(
            !o.service_cidr || !cidrs.is_empty(),
            "{name}: no --service-cidr"
        );
        if r.args.iter().any(|a| a.contains("$(NODE_IP)")) {
            assert!(
                r.env.contains(&"NODE_IP".into()),
                "{name}: NODE_IP in {:?}",
                r.env
            );
        }
        assert!(r.env.contains(&"KUBECONFIG".into()), "{name}: {:?}", r.env);

        assert_eq!(
            r.host_paths.get("kubelet-kubeconfig").map(String::as_str),
            Some(d.kubelet_kubeconfig),
            "{name}"
        );
        // Kilo as the CNI (userspace included, as Kilo's kilo-kubeadm-userspace.yaml) mounts the
        // runtime's CNI configuration directory; an add-on none.
        let cni_dir = r.host_paths.get("cni-conf-dir").map(String::as_str);
        let is_cni = !o.mode.contains(&"--cni=false");
        assert_eq!(cni_dir, is_cni.then_some(d.cni_conf_dir), "{name}");
        for path in r.host_paths.values() {
            for foreign in d.foreign {
                assert!(!path.starts_with(foreign), "{name}: {path}");
            }
        }
        let wireguard_go = r.containers.iter().any(|c| c == "wireguard");
        assert_eq!(
            wireguard_go,
            o.mode == USERSPACE,
            "{name}: {:?}",
            r.containers
        );
    }
}

/// The base's init container writes a kubeconfig with the kubelet's server and the pod's own
/// service account, which kg then reads from $KUBECONFIG.
#[test]
fn the_init_container_writes_a_kubeconfig_for_the_kubelets_server() {
    let ds: Value = serde_yaml::from_str(
        &std::fs::read_to_string(manifests().join("base/daemonset.yaml")).unwrap(),
    )
    .unwrap();
    let spec = &ds["spec"]["template"]["spec"];
    let init = named(&spec["initContainers"])
        .find(|(n, _)| *n == "kubeconfig")
        .map(|(_, c)| c)
        .expect("the kubeconfig init container");
    let script = strings(&init["command"]).pop().unwrap();
    let mount = |volume: &str| {
        named(&init["volumeMounts"])
            .find(|(n, _)| *n == volume)
            .and_then(|(_, m)| m["mountPath"].as_str())
            .unwrap()
            .to_string()
    };
    let kilo = named(&spec["containers"])
        .find(|(n, _)| *n == "kilo")
        .unwrap()
        .1;
    let kubeconfig_env = named(&kilo["env"])
        .find(|(n, _)| *n == "KUBECONFIG")
        .and_then(|(_, e)| e["value"].as_str())
        .unwrap();
    let kilo_mount = named(&kilo["volumeMounts"])
        .find(|(n, _)| *n == "kubeconfig")
        .and_then(|(_, m)| m["mountPath"].as_str())
        .unwrap();
    let file = Path::new(kubeconfig_env)
        .strip_prefix(kilo_mount)
        .expect("$KUBECONFIG in the kubeconfig volume");

    let tmp = tempfile::tempdir().unwrap();
    let kubelet = tmp.path().join("kubelet.conf");
    let out_dir = tmp.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    // A kubelet kubeconfig as kubeadm writes it on a worker.
    std::fs::write(
        &kubelet,
        "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: AAAA\n    \
         server: https://203.0.113.10:6443\n  name: default-cluster\ncontexts: []\nusers:\n- \
         name: default-auth\n  user:\n    client-certificate: /var/lib/kubelet/pki/kubelet-client-current.pem\n",
    )
    .unwrap();
    let script = script
        .replace(&mount("kubelet-kubeconfig"), kubelet.to_str().unwrap())
        .replace(
            &format!("{}/", mount("kubeconfig")),
            &format!("{}/", out_dir.display()),
        );
    let status = Command::new("sh").args(["-c", &script]).status().unwrap();
    assert!(status.success());

    let kc = kube::config::Kubeconfig::read_from(out_dir.join(file)).unwrap();
    let cluster = kc.clusters[0].cluster.as_ref().unwrap();
    assert_eq!(cluster.server.as_deref(), Some("https://203.0.113.10:6443"));
    let sa = "/var/run/secrets/kubernetes.io/serviceaccount";
    assert_eq!(
        cluster.certificate_authority.as_deref(),
        Some(format!("{sa}/ca.crt").as_str())
    );
    let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
    assert_eq!(
        user.token_file.as_deref(),
        Some(format!("{sa}/token").as_str())
    );
    assert!(
        user.client_certificate.is_none(),
        "not the kubelet's credentials"
    );
    assert_eq!(kc.current_context.as_deref(), Some("kilo"));

    // Without a server line the init container fails rather than write a kubeconfig kg would
    // reject later.
    std::fs::write(&kubelet, "apiVersion: v1\n").unwrap();
    std::fs::remove_file(out_dir.join(file)).unwrap();
    let status = Command::new("sh").args(["-c", &script]).status().unwrap();
    assert!(!status.success());
    assert!(!out_dir.join(file).exists());
}

/// Every kustomization in the repository: the overlays, their bases, the webhook, monitoring
/// and the e2e's.
fn kustomizations() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.file_name().is_some_and(|n| n == "kustomization.yaml") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&manifests(), &mut out);
    walk(&manifests().join("../xtask/e2e"), &mut out);
    out.sort();
    out
}

/// Fields kustomize v5 deprecates (its warning names the replacement): `bases` (a directory in
/// `resources`), `commonLabels` (`labels`), `patchesStrategicMerge` and `patchesJson6902`
/// (`patches`), `vars` (`replacements`).
const DEPRECATED_FIELDS: &[&str] = &[
    "bases",
    "commonLabels",
    "patchesStrategicMerge",
    "patchesJson6902",
    "vars",
];

#[test]
fn every_kustomization_uses_current_fields_and_renders() {
    let all = kustomizations();
    assert!(all.len() >= 12, "{all:?}");
    for k in &all {
        let v: Value = serde_yaml::from_str(&std::fs::read_to_string(k).unwrap()).unwrap();
        for (field, _) in v.as_mapping().unwrap() {
            let field = field.as_str().unwrap();
            assert!(
                !DEPRECATED_FIELDS.contains(&field),
                "{}: {field} is deprecated",
                k.display()
            );
        }
    }
    // Rendered by the pinned kubectl (`cargo xtask setup`), else one on $PATH; kustomize warns
    // on stderr of any field it deprecates.
    let Some(kubectl) = kubectl() else {
        support::skip_unless(
            "every_kustomization_uses_current_fields_and_renders (rendering)",
            Some("no kubectl".into()),
        );
        return;
    };
    for k in &all {
        let dir = k.parent().unwrap();
        let out = Command::new(&kubectl)
            .arg("kustomize")
            .arg(dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {stderr}", dir.display());
        assert!(stderr.is_empty(), "{}: {stderr}", dir.display());
        assert!(!render(&kubectl, dir).is_empty(), "{}", dir.display());
    }
    let monitoring = render(&kubectl, &manifests().join("monitoring"));
    let kinds: Vec<&str> = monitoring
        .iter()
        .filter_map(|o| o["kind"].as_str())
        .collect();
    for want in ["PodMonitor", "PrometheusRule", "ConfigMap"] {
        assert!(kinds.contains(&want), "monitoring: {want} in {kinds:?}");
    }
    let dashboard = monitoring
        .iter()
        .find(|o| o["kind"] == "ConfigMap")
        .unwrap();
    assert_eq!(dashboard["metadata"]["name"], "kilo-grafana-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
}

/// The published image, by tag, in every workload; the e2e renames it to its local build.
#[test]
fn workloads_name_the_published_image_by_tag_and_the_e2e_its_local_build() {
    let Some(kubectl) = kubectl() else {
        support::skip_unless(
            "workloads_name_the_published_image_by_tag_and_the_e2e_its_local_build",
            Some("no kubectl".into()),
        );
        return;
    };
    let version = env!("CARGO_PKG_VERSION");
    let images = |dir: &Path| -> Vec<String> {
        render(&kubectl, dir)
            .iter()
            .flat_map(|o| workload_containers(o).map(|(_, c)| c.clone()))
            .filter_map(|c| c["image"].as_str().map(str::to_string))
            .filter(|i| i.contains("kilo-rs"))
            .collect()
    };
    for dir in [
        manifests().join("overlays/kubeadm"),
        manifests().join("overlays/k3s-userspace"),
        manifests().join("webhook"),
    ] {
        let found = images(&dir);
        assert!(!found.is_empty(), "{}", dir.display());
        for i in found {
            assert_eq!(i, format!("ghcr.io/kilo-rs/kilo-rs:{version}"));
        }
    }
    let e2e = images(&manifests().join("../xtask/e2e"));
    assert_eq!(e2e.len(), 2, "kg and the webhook: {e2e:?}");
    for i in e2e {
        // `cargo xtask image`'s docker-archive (xtask/src/image.rs), loaded into the nodes.
        assert_eq!(i, format!("kilo-rs:{version}"));
    }
}

/// The containers and init containers of a DaemonSet or Deployment, with its pod spec.
fn workload_containers(o: &Value) -> impl Iterator<Item = (&Value, &Value)> {
    let spec = &o["spec"]["template"]["spec"];
    ["initContainers", "containers"]
        .into_iter()
        .flat_map(move |k| named(&spec[k]).map(move |(_, c)| (spec, c)))
}

/// Every container of every overlay and of the webhook: no privilege escalation, a read-only
/// root filesystem (kg's writes go to volumes), no capability beyond the ones it names, the
/// runtime's default seccomp profile, and a memory limit.
#[test]
fn every_container_is_hardened() {
    let Some(kubectl) = kubectl() else {
        support::skip_unless("every_container_is_hardened", Some("no kubectl".into()));
        return;
    };
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(manifests().join("overlays"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    dirs.push(manifests().join("webhook"));
    dirs.push(manifests().join("webhook-cert-manager"));
    let mut checked = 0;
    for dir in &dirs {
        let d = dir.file_name().unwrap().to_string_lossy().into_owned();
        for o in render(&kubectl, dir) {
            let owner = o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            for (pod, c) in workload_containers(&o) {
                let name = format!("{d}: {owner}/{}", c["name"].as_str().unwrap());
                let sc = &c["securityContext"];
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}");
                assert!(sc["privileged"].as_bool() != Some(true), "{name}");
                assert!(
                    strings(&sc["capabilities"]["drop"]).contains(&"ALL".into()),
                    "{name}: drops ALL"
                );
                let added = strings(&sc["capabilities"]["add"]);
                let allowed: &[&str] = match c["name"].as_str().unwrap() {
                    "kilo" => &["NET_ADMIN", "BPF", "PERFMON", "NET_RAW"],
                    "wireguard" => &["NET_ADMIN"],
                    _ => &[],
                };
                for cap in &added {
                    assert!(allowed.contains(&cap.as_str()), "{name}: adds {cap}");
                }
                let seccomp = if sc["seccompProfile"].is_null() {
                    &pod["securityContext"]["seccompProfile"]
                } else {
                    &sc["seccompProfile"]
                };
                assert_eq!(seccomp["type"], "RuntimeDefault", "{name}");
                assert!(
                    c["resources"]["limits"]["memory"].is_string(),
                    "{name}: a memory limit"
                );
                if owner == "kilo-peer-validation" {
                    assert_eq!(sc["runAsNonRoot"], true, "{name}");
                }
                if c["name"] == "kilo" {
                    kg_writes_only_to_volumes(&name, c);
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "{checked} containers");
}

/// kg's container has a volume at every path it writes with a read-only root filesystem.
fn kg_writes_only_to_volumes(name: &str, c: &Value) {
    let args = strings(&c["args"]);
    let mounts: Vec<(String, bool)> = named(&c["volumeMounts"])
        .map(|(_, m)| {
            (
                m["mountPath"].as_str().unwrap().to_string(),
                m["readOnly"] == true,
            )
        })
        .collect();
    let mut writes = vec!["/var/lib/kilo", "/sys/fs/bpf"];
    if !args.iter().any(|a| a == "--cni=false") {
        writes.push("/etc/cni/net.d");
    }
    if args.iter().any(|a| a == "--create-interface=false") {
        writes.push("/var/run/wireguard");
    }
    for path in writes {
        assert!(
            mounts.iter().any(|(m, ro)| m == path && !ro),
            "{name}: {path} is a writable volume in {mounts:?}"
        );
    }
}

/// The node-by-node migration (docs/migrating.md): `manifests/migrate` renders kg's DaemonSet
/// under another name and selector than Kilo's (`kilo`, selecting Kilo's labels
/// `app.kubernetes.io/name: kilo, app.kubernetes.io/part-of: kilo`), so neither adopts the
/// other's pods, on the nodes labelled `kilo.squat.ai/agent=kg` only and cleaning up when it
/// stops; `finish/not-kg.yaml`, the patch for Kilo's DaemonSet, and the `finish` overlay (kg's
/// regular DaemonSet) run on exactly the other nodes, and restart no pod when patched. A userspace
/// overlay's wireguard-go DaemonSet follows kg's nodes.
#[test]
fn the_migration_overlay_splits_the_nodes_between_kilo_and_kg() {
    use std::collections::BTreeMap;
    type Labels = BTreeMap<String, String>;
    fn labels(v: &Value) -> Labels {
        v.as_mapping()
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| Some((k.as_str()?.to_string(), v.as_str()?.to_string())))
            .collect()
    }
    fn selects(selector: &Labels, pod: &Labels) -> bool {
        selector.iter().all(|(k, v)| pod.get(k) == Some(v))
    }
    /// Whether a node with `node` labels satisfies the pod spec's required node affinity.
    fn schedules(pod_spec: &Value, node: &Labels) -> bool {
        let terms = &pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        let terms = terms.as_sequence().expect("a required node affinity");
        terms.iter().any(|t| {
            t["matchExpressions"]
                .as_sequence()
                .unwrap()
                .iter()
                .all(|e| {
                    let value = node.get(e["key"].as_str().unwrap());
                    let values = strings(&e["values"]);
                    let listed = value.is_some_and(|v| values.contains(v));
                    match e["operator"].as_str().unwrap() {
                        "In" => listed,
                        "NotIn" => !listed,
                        op => panic!("operator {op}"),
                    }
                })
        })
    }
    fn args(ds: &Value) -> Vec<String> {
        let spec = &ds["spec"]["template"]["spec"];
        strings(
            &named(&spec["containers"])
                .find(|(n, _)| *n == "kilo")
                .unwrap()
                .1["args"],
        )
    }

    let Some(kubectl) = kubectl() else {
        assert!(!support::skip_unless(
            "the_migration_overlay_splits_the_nodes_between_kilo_and_kg",
            Some("no kubectl".into())
        ));
        return;
    };
    let dir = manifests().join("migrate");
    let rendered = kustomize(&kubectl, &dir);
    let kg = rendered
        .iter()
        .find(|d| args(d).iter().any(|a| a.starts_with("--hostname")))
        .expect("kg's DaemonSet");
    assert_eq!(rendered.len(), 1, "only kg's DaemonSet");
    // Kilo's DaemonSet (Kilo's manifests/kilo-*.yaml), patched as docs/migrating.md says.
    let kilo_selector: Labels = [
        ("app.kubernetes.io/name", "kilo"),
        ("app.kubernetes.io/part-of", "kilo"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let not_kg: Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("finish/not-kg.yaml")).unwrap())
            .unwrap();
    assert_eq!(not_kg["metadata"]["name"], "kilo");
    assert_eq!(not_kg["spec"]["updateStrategy"]["type"], "OnDelete");

    assert_ne!(kg["metadata"]["name"], "kilo");
    let kg_selector = labels(&kg["spec"]["selector"]["matchLabels"]);
    let kg_pods = labels(&kg["spec"]["template"]["metadata"]["labels"]);
    assert!(selects(&kg_selector, &kg_pods));
    assert_ne!(kg_selector, kilo_selector);
    assert!(
        !selects(&kg_selector, &kilo_selector),
        "kg would adopt Kilo's pods"
    );
    assert!(
        !selects(&kilo_selector, &kg_pods),
        "Kilo would adopt kg's pods"
    );
    assert!(
        args(kg).contains(&"--clean-up=true".to_string()),
        "{:?}",
        args(kg)
    );

    // The regular overlay's DaemonSet, as the finish step applies it.
    let finish = kustomize(&kubectl, &dir.join("finish"));
    let regular = finish
        .iter()
        .find(|d| d["metadata"]["name"] == "kilo")
        .expect("kg's regular DaemonSet");
    assert_eq!(regular["spec"]["updateStrategy"]["type"], "OnDelete");
    assert!(args(regular).contains(&"--clean-up=false".to_string()));

    let node = |agent: Option<&str>| -> Labels {
        let mut l: Labels = [("kubernetes.io/os".to_string(), "linux".to_string())].into();
        if let Some(a) = agent {
            l.insert("kilo.squat.ai/agent".into(), a.into());
        }
        l
    };
    for n in [
        node(None),
        node(Some("kg")),
        node(Some("kilo")),
        node(Some("")),
    ] {
        let on_kg = schedules(&kg["spec"]["template"]["spec"], &n);
        let on_kilo = schedules(&not_kg["spec"]["template"]["spec"], &n);
        let on_regular = schedules(&regular["spec"]["template"]["spec"], &n);
        assert!(on_kg != on_kilo, "exactly one agent on {n:?}");
        assert_eq!(on_kilo, on_regular, "{n:?}");
        assert_eq!(
            on_kg,
            n.get("kilo.squat.ai/agent").map(String::as_str) == Some("kg")
        );
    }

    // With the userspace overlay named in `resources`, as the document says to change it, its
    // wireguard-go DaemonSet runs where kg does: on Kilo's nodes, Kilo's own wireguard-go holds
    // kilo0.
    let copy = tempfile::tempdir().unwrap();
    let status = Command::new("cp")
        .arg("-r")
        .arg(manifests())
        .arg(copy.path())
        .status()
        .unwrap();
    assert!(status.success());
    let k = copy.path().join("manifests/migrate/kustomization.yaml");
    let text = std::fs::read_to_string(&k).unwrap();
    assert!(text.contains("- ../overlays/kubeadm\n"));
    std::fs::write(
        &k,
        text.replace("- ../overlays/kubeadm\n", "- ../overlays/userspace\n"),
    )
    .unwrap();
    let userspace = kustomize(&kubectl, &copy.path().join("manifests/migrate"));
    let wireguard = userspace
        .iter()
        .find(|d| d["metadata"]["name"] == "kilo-wireguard")
        .expect("the userspace overlay's wireguard-go DaemonSet");
    for n in [node(None), node(Some("kg")), node(Some("kilo"))] {
        assert_eq!(
            schedules(&wireguard["spec"]["template"]["spec"], &n),
            schedules(&kg["spec"]["template"]["spec"], &n),
            "{n:?}"
        );
    }
}
