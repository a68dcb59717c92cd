//! The alerts of `manifests/monitoring/prometheusrule.yaml`: their metrics are ones kg serves,
//! every alert has a unit test that expects it to fire, and `promtool test rules` passes those
//! tests (`manifests/monitoring/alerts-test.yaml`). promtool comes with Debian's `prometheus`
//! package, which `cargo xtask setup` installs; without it the promtool part skips (fails under
//! `cargo xtask test`).
use kilo_testkit as support;

use std::{path::PathBuf, process::Command};

use serde_yaml::Value;

fn monitoring() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests/monitoring")
}

fn yaml(file: &str) -> Value {
    serde_yaml::from_str(&std::fs::read_to_string(monitoring().join(file)).unwrap()).unwrap()
}

/// The rules as a plain Prometheus rule file: the PrometheusRule's spec.
fn rules() -> Value {
    let rule = yaml("prometheusrule.yaml");
    assert_eq!(rule["kind"], "PrometheusRule");
    rule["spec"].clone()
}

fn alerts(rules: &Value) -> Vec<(String, String)> {
    rules["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap())
        .map(|r| {
            (
                r["alert"].as_str().unwrap().to_string(),
                r["expr"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Metric names of kg's exposition, as docs/metrics.md lists them (the telemetry tests check
/// the exposition against the same names).
fn documented_metrics() -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"))
        .unwrap()
}

#[test]
fn every_alert_reads_metrics_kg_serves_and_has_a_firing_test() {
    let rules = rules();
    let alerts = alerts(&rules);
    let names: Vec<&str> = alerts.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "KiloWireGuardHandshakeTooOld",
        "KiloNoServiceCIDRs",
        "KiloReconcileErrors",
        "KiloDatapathMapNearlyFull",
        "KiloDatapathMapFull",
        "KiloDatapathMalformedPackets",
    ] {
        assert!(names.contains(&want), "{want} in {names:?}");
    }
    let docs = documented_metrics();
    for (name, expr) in &alerts {
        let metrics: Vec<&str> = expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("kilo_"))
            .collect();
        assert!(!metrics.is_empty(), "{name}: no kilo_ metric in {expr}");
        for m in metrics {
            assert!(
                docs.contains(&format!("`{m}")),
                "{name}: {m} is not in docs/metrics.md"
            );
        }
    }
    let tests = yaml("alerts-test.yaml");
    let fired: Vec<&str> = tests["tests"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_sequence().into_iter().flatten())
        .filter(|t| t["exp_alerts"].as_sequence().is_some_and(|a| !a.is_empty()))
        .filter_map(|t| t["alertname"].as_str())
        .collect();
    for name in &names {
        assert!(
            fired.contains(name),
            "{name}: no test in alerts-test.yaml expects it to fire"
        );
    }
}

#[test]
fn promtool_passes_the_alerts_unit_tests() {
    let found = Command::new("promtool").arg("--version").output();
    if !support::skip_unless(
        "promtool_passes_the_alerts_unit_tests",
        (!found.is_ok_and(|o| o.status.success()))
            .then(|| "no promtool (Debian's prometheus package)".to_string()),
    ) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let tests = yaml("alerts-test.yaml");
    let rule_file = tests["rule_files"][0].as_str().unwrap();
    std::fs::write(
        tmp.path().join(rule_file),
        serde_yaml::to_string(&rules()).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        monitoring().join("alerts-test.yaml"),
        tmp.path().join("alerts-test.yaml"),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(tmp.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = run(&["check", "rules", rule_file]);
    assert!(ok, "promtool check rules: {text}");
    let (ok, text) = run(&["test", "rules", "alerts-test.yaml"]);
    assert!(ok, "promtool test rules: {text}");
    assert!(text.contains("SUCCESS"), "{text}");

    // The tests can fail: with one alert's threshold changed, promtool says so.
    let broken = serde_yaml::to_string(&rules())
        .unwrap()
        .replace("kilo_service_cidrs == 0", "kilo_service_cidrs == 1");
    std::fs::write(tmp.path().join(rule_file), broken).unwrap();
    let (ok, text) = run(&["test", "rules", "alerts-test.yaml"]);
    assert!(!ok, "promtool test rules passed a broken rule: {text}");
    assert!(text.contains("KiloNoServiceCIDRs"), "{text}");
}
