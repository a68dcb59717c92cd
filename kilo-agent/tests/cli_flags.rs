//! The binaries' command lines as a Kilo user types them: `version`, `completion` for every
//! shell Kilo's cobra commands support, and kgctl's flags in Go's forms.
use std::process::{Command, Output};

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .unwrap()
}

/// `kg version` and `kgctl version` print the version, as Kilo's do.
#[test]
fn version_subcommands() {
    for bin in [env!("CARGO_BIN_EXE_kg"), env!("CARGO_BIN_EXE_kgctl")] {
        let out = run(bin, &["version"]);
        assert!(out.status.success(), "{bin}: {out:?}");
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            format!("{}\n", env!("CARGO_PKG_VERSION"))
        );
    }
}

/// `kg completion SHELL` and `kgctl completion SHELL` print a script naming the subcommands
/// and flags; an unknown shell fails.
#[test]
fn completion_scripts() {
    let bins = [
        (env!("CARGO_BIN_EXE_kg"), ["webhook", "--clean-up", "--mtu"]),
        (
            env!("CARGO_BIN_EXE_kgctl"),
            ["showconf", "--as-peer", "--backend-dir"],
        ),
    ];
    for (bin, words) in bins {
        for shell in ["bash", "zsh", "fish", "powershell"] {
            let out = run(bin, &["completion", shell]);
            assert!(out.status.success(), "{bin} completion {shell}: {out:?}");
            let script = String::from_utf8(out.stdout).unwrap();
            for word in words.iter().chain(&["completion"]) {
                // fish and powershell name long flags without their dashes.
                let word = word.trim_start_matches('-');
                assert!(script.contains(word), "{bin} completion {shell}: no {word}");
            }
        }
        let out = run(bin, &["completion", "tcsh"]);
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("tcsh"));
    }
}

/// kgctl refuses `--port=0` as Kilo does, and reads Go's boolean forms.
#[test]
fn kgctl_go_flags() {
    let kgctl = env!("CARGO_BIN_EXE_kgctl");
    let dir = tempfile::tempdir().unwrap();
    let backend = [
        "--backend=file",
        "--backend-dir",
        dir.path().to_str().unwrap(),
    ];
    let out = run(kgctl, &[&backend[..], &["--port=0", "graph"]].concat());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--port") && err.contains('0'), "{err}");
    // Parsed, then refused for the empty mesh (not for the flag).
    for value in ["--as-peer=T", "--as-peer=0", "--as-peer"] {
        let out = run(
            kgctl,
            &[&backend[..], &["showconf", value, "node", "a"]].concat(),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("--as-peer"), "{value}: {err}");
    }
    let out = run(
        kgctl,
        &[&backend[..], &["showconf", "--as-peer=yes", "node", "a"]].concat(),
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("--as-peer"));
}
