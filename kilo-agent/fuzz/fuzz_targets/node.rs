//! A Node's annotations, labels and pod CIDRs, one `key<TAB>value` per line (`spec.podCIDR` and
//! `label:<name>` are keys too): parsing never panics, and every invalid value names its field.
#![no_main]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::NodeSpec;
use kilo_agent::mesh::{DEFAULT_TOPOLOGY_LABEL, KubeNode, Node, parse_snapshot, Snapshot};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut node = KubeNode::default();
    node.metadata.name = Some("fuzzed".into());
    let (mut annotations, mut labels) = (BTreeMap::new(), BTreeMap::new());
    let mut spec = NodeSpec::default();
    for line in text.lines() {
        let (k, v) = line.split_once('\t').unwrap_or((line, ""));
        if k == "spec.podCIDR" {
            spec.pod_cidr = Some(v.into());
        } else if k == "spec.podCIDRs" {
            spec.pod_cidrs = Some(v.split(',').map(Into::into).collect());
        } else if let Some(l) = k.strip_prefix("label:") {
            labels.insert(l.to_owned(), v.to_owned());
        } else {
            annotations.insert(k.to_owned(), v.to_owned());
        }
    }
    node.metadata.annotations = Some(annotations);
    node.metadata.labels = Some(labels);
    node.spec = Some(spec);
    let (parsed, errors) = Node::from_kube(&node, DEFAULT_TOPOLOGY_LABEL);
    assert_eq!(parsed.name, "fuzzed");
    for e in &errors {
        assert!(
            e.field.starts_with("annotation kilo.squat.ai/")
                || e.field.starts_with("spec.")
                || e.field.starts_with("label "),
            "an error that names no field: {e}"
        );
    }
    let _ = parsed.ready(Some(0));
    let snapshot = Snapshot {
        nodes: BTreeMap::from([("fuzzed".to_owned(), node)]),
        ..Default::default()
    };
    assert_eq!(parse_snapshot(&snapshot, DEFAULT_TOPOLOGY_LABEL).errors, errors);
});
