//! `cargo xtask bench --quick` runs every benchmark (debug builds, which `cargo test` has just
//! made) into a temporary directory and writes a report whose sections, tables, numbers and
//! plots are all there, and whose targets fail closed: a quick run judges no target named for
//! a size it did not reach, a missing figure never reads as a pass, and the README's summary
//! shows the same states. No figure is judged: this checks the machinery, not the speed.
use std::{path::Path, process::Command};

/// Whether a table cell reads as a number, a number with its range, or words.
fn cell_ok(cell: &str) -> bool {
    let cell = cell.trim();
    if !cell.starts_with(|c: char| c.is_ascii_digit() || c == '-') {
        return true; // words: "not run", "yes", process counts "1 / 1 / 2" start with digits
    }
    if cell.contains(" / ") {
        return cell
            .split(" / ")
            .all(|p| p == "–" || p.parse::<u64>().is_ok());
    }
    let (median, range) = match cell.split_once(" (") {
        Some((m, r)) => (m, Some(r.trim_end_matches(')'))),
        None => (cell, None),
    };
    let number = |s: &str| s.trim().parse::<f64>().is_ok();
    // A negative bound of a range reads "-3.0–-1.0"; split at the en dash.
    number(median) && range.is_none_or(|r| r.split('–').all(number))
}

#[test]
fn quick_bench_writes_the_report() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = std::env::temp_dir().join(format!("kilo-bench-report-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    // A README with the summary's markers: the run fills them.
    std::fs::write(
        out.join("README.md"),
        "# kilo-rs\n\n<!-- bench-summary -->\nold\n<!-- /bench-summary -->\n\nafter\n",
    )
    .unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(root)
        .args(["bench", "--quick", "--debug", "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(
        status.success(),
        "cargo xtask bench --quick --debug: {status}"
    );
    let report = std::fs::read_to_string(out.join("BENCHMARKS.md")).unwrap();
    let root_user = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"));

    for heading in [
        "# Benchmarks",
        "## Targets",
        "| date |",
        "| kernel |",
        "| mode | quick",
    ] {
        assert!(report.contains(heading), "{heading} in\n{report}");
    }
    // A section per bench_<what> example.
    let examples = root.join("kilo-agent/examples");
    for e in std::fs::read_dir(&examples).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if let Some(what) = name
            .strip_prefix("bench_")
            .and_then(|n| n.strip_suffix(".rs"))
        {
            assert!(
                report.contains(&format!("## {what} (`bench_{what}`")),
                "a section for {what} in\n{report}"
            );
        }
    }
    if !root_user {
        assert!(
            std::env::var_os("KILO_REQUIRE_ALL").is_none(),
            "not root: the benchmarks did not run (KILO_REQUIRE_ALL is set)"
        );
        eprintln!("not root: the benchmarks skipped; only the report's frame is checked");
        std::fs::remove_dir_all(&out).unwrap();
        return;
    }
    // Every table's cells read as numbers, ranges or words; each target reads as one state.
    let mut tables = 0;
    let mut targets = Vec::new();
    let (mut in_targets, mut in_table) = (false, false);
    for line in report.lines() {
        if line.starts_with("## ") {
            in_targets = line == "## Targets";
            in_table = false;
        }
        if line.starts_with("### ") {
            tables += 1;
            in_table = true;
        }
        let row = line.starts_with("| ") && !line.starts_with("|---") && !line.starts_with("| |");
        if !row || !(in_targets || in_table) {
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").collect();
        if in_targets {
            if cells[0] != " target" {
                let (name, figure, state) = (cells[0].trim(), cells[1], cells[2].trim());
                assert!(
                    ["yes", "**no**", "not measured", "not judged (quick)"].contains(&state),
                    "{line}"
                );
                // A figure that was not read is never a pass.
                if figure.contains("not measured") || figure.contains("not read") {
                    assert_ne!(state, "yes", "{line}");
                }
                // Sizes a quick run does not reach are not judged.
                if ["10,000", "5,000"].iter().any(|n| name.contains(n)) {
                    assert_eq!(state, "not judged (quick)", "{line}");
                }
                targets.push((name.to_owned(), state.to_owned()));
            }
            continue;
        }
        for c in &cells[1..] {
            assert!(cell_ok(c), "cell {c:?} in {line}");
        }
    }
    assert!(tables >= 10, "{tables} tables in\n{report}");
    // The program is measured beside its floor, the lookups alone, in both benchmarks, and new
    // connections beside the TC hook's own share.
    for row in [
        "| lookups only: mesh hit (v4) | ",
        "| masquerade: the lookups alone (lookups only - empty) | ",
        "| mesh hit: the rest (ours - lookups only) | ",
        "| NAT everything, the empty program attached (same-CPU) | ",
        "| same-CPU: the TC hook alone (NAT everything, empty program / none) | ",
    ] {
        assert!(report.contains(row), "{row} in\n{report}");
    }
    assert!(targets.len() >= 10, "{targets:?} in\n{report}");
    assert!(
        targets.iter().any(|(_, s)| s == "not judged (quick)"),
        "a quick run judges no size it did not reach: {targets:?}"
    );
    // The README's summary: the same targets in the same states, the text around it kept.
    let readme = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(
        readme.starts_with("# kilo-rs\n\n<!-- bench-summary -->\n")
            && readme.ends_with("<!-- /bench-summary -->\n\nafter\n")
            && !readme.contains("\nold\n"),
        "{readme}"
    );
    for (name, state) in &targets {
        let row = format!("| {name} | {state} |");
        assert!(readme.contains(&row), "{row} in\n{readme}");
    }
    // The plots it links exist and are SVG.
    let mut plots = 0;
    for (i, _) in report.match_indices("](docs/bench/") {
        let rest = &report[i + 2..];
        let path = &rest[..rest.find(')').unwrap()];
        let svg = std::fs::read_to_string(out.join(path)).unwrap();
        assert!(svg.starts_with("<svg"), "{path}");
        plots += 1;
    }
    assert!(plots >= 5, "{plots} plots");
    std::fs::remove_dir_all(&out).unwrap();
}
