//! The agent cannot start processes once its seccomp filter is installed, nor trace, mount or
//! load BPF programs.
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
    assert!(
        kilo_agent::agent::seccomp::install().expect("install the filter"),
        "this architecture has a filter"
    );
    after.wait();
    let here = spawn_true().expect_err("exec must be refused");
    let there = other
        .join()
        .unwrap()
        .expect_err("exec must be refused on the other thread");
    assert_eq!(here.raw_os_error(), Some(libc::EPERM), "{here}");
    assert_eq!(there.raw_os_error(), Some(libc::EPERM), "{there}");
    let errno = |rc: libc::c_long| {
        assert_eq!(rc, -1);
        std::io::Error::last_os_error().raw_os_error()
    };
    // SAFETY: PTRACE_TRACEME takes no pointers.
    let rc = unsafe { libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) };
    assert_eq!(errno(rc), Some(libc::EPERM), "ptrace");
    let target = tempfile::tempdir().unwrap();
    let path = std::ffi::CString::new(target.path().to_str().unwrap()).unwrap();
    // SAFETY: valid C strings; no data argument.
    let rc = unsafe {
        libc::mount(
            c"none".as_ptr(),
            path.as_ptr(),
            c"tmpfs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        // SAFETY: as above.
        unsafe { libc::umount(path.as_ptr()) };
    }
    assert_eq!(errno(rc.into()), Some(libc::EPERM), "mount");
    // bpf(2): loading a program or creating a map is refused; other commands (a lookup in
    // a map, here with no map) reach the kernel.
    let attr = [0u8; 128];
    let bpf = |cmd: libc::c_long| {
        // SAFETY: a zeroed attribute buffer of the size passed.
        unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_ptr(), attr.len()) }
    };
    assert_eq!(errno(bpf(5)), Some(libc::EPERM), "BPF_PROG_LOAD");
    assert_eq!(errno(bpf(0)), Some(libc::EPERM), "BPF_MAP_CREATE");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        assert_ne!(errno(bpf(1)), Some(libc::EPERM), "BPF_MAP_LOOKUP_ELEM");
    }
    // Everything else still works: files, sockets, threads.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    assert!(listener.local_addr().is_ok());
    assert!(std::thread::spawn(|| 1 + 1).join().unwrap() == 2);
    println!("exec refused with EPERM on both threads");
}
