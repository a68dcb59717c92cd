//! `kilo_child_processes` counts the agent's live children from /proc: a test (which may start
//! processes, unlike the agent) starts one and watches the count follow it.
use kilo_agent::telemetry::ProcessStats;

#[test]
fn counts_children_while_they_live() {
    let before = ProcessStats::read().unwrap().children;
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    assert!(ProcessStats::read().unwrap().children >= Some(1));
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(ProcessStats::read().unwrap().children, before);
}
