//! The agent cannot start processes once its seccomp filter is installed.
//!
//! The filter is irreversible and process-wide, so the check runs in a child process: the test
//! re-executes this test binary, asking it to run only `seccomp_child_role`, which installs the
//! filter exactly as `kg` does and then tries to spawn a process from two threads.
use std::{
    process::Command,
    sync::{Arc, Barrier},
};

const ROLE: &str = "KILO_SECCOMP_CHILD";

fn spawn_true() -> std::io::Result<std::process::ExitStatus> {
    Command::new("/bin/true").status()
}

#[test]
fn forbids_exec_after_install() {
    // Before the filter (in this process, which never installs it) spawning works.
    assert!(spawn_true().unwrap().success());
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "seccomp_child_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(
        text.contains("exec refused with EPERM on both threads"),
        "{text}"
    );
}

/// Runs only as the child of `forbids_exec_after_install`.
#[test]
fn seccomp_child_role() {
    if std::env::var_os(ROLE).is_none() {
        eprintln!("seccomp_child_role runs only as a child of forbids_exec_after_install");
        return;
    }
    // A thread that exists before the filter is installed must be covered too (TSYNC).
    let before = Arc::new(Barrier::new(2));
    let after = Arc::new(Barrier::new(2));
    let other = {
        let (before, after) = (before.clone(), after.clone());
        std::thread::spawn(move || {
            before.wait();
            after.wait();
            spawn_true()
        })
    };
    before.wait();
    kilo_agent::agent::seccomp::forbid_exec().expect("install the filter");
    after.wait();
    let here = spawn_true().expect_err("exec must be refused");
    let there = other
        .join()
        .unwrap()
        .expect_err("exec must be refused on the other thread");
    assert_eq!(here.raw_os_error(), Some(libc::EPERM), "{here}");
    assert_eq!(there.raw_os_error(), Some(libc::EPERM), "{there}");
    // Everything else still works: files, sockets, threads.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    assert!(listener.local_addr().is_ok());
    assert!(std::thread::spawn(|| 1 + 1).join().unwrap() == 2);
    println!("exec refused with EPERM on both threads");
}
