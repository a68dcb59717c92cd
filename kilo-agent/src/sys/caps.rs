//! Capability system calls (capget/capset, prctl) applied on every thread of the process: the
//! threads already running apply them in a handler of [`signal`], like glibc's `setxid` does for
//! `setuid`. Hand-written because the calls run inside a signal handler, where only
//! async-signal-safe code may run (the `caps` crate allocates).
use std::{
    io,
    sync::atomic::{AtomicU32, AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// The highest capability number the kernel knows (linux/capability.h's CAP_LAST_CAP today).
const LAST_CAP: u32 = 40;

/// The realtime signal whose handler drops a thread's capabilities.
pub fn signal() -> libc::c_int {
    libc::SIGRTMIN() + 3
}
/// See [`signal`].
pub const SIGNAL: &str = "SIGRTMIN+3";

// What the handler applies (written before any signal is sent).
static KEEP: AtomicU64 = AtomicU64::new(0);
static DROP_BOUNDING: AtomicU32 = AtomicU32::new(0);
static DONE: AtomicU32 = AtomicU32::new(0);
static FAILED: AtomicU32 = AtomicU32::new(0);

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// Drops everything but [`KEEP`] on the calling thread. Async-signal-safe: system calls and
/// atomics only. Returns false if a call failed.
fn drop_on_this_thread() -> bool {
    let keep = KEEP.load(Ordering::SeqCst);
    let mut ok = true;
    if DROP_BOUNDING.load(Ordering::SeqCst) == 1 {
        for cap in 0..=LAST_CAP {
            if keep & (1 << cap) == 0 {
                // SAFETY: prctl with integer arguments. EINVAL for a capability this kernel
                // does not know is fine.
                let rc =
                    unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
                ok &= rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL);
            }
        }
    }
    // SAFETY: prctl with integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: a version-3 header and two data structs, as capget(2) wants.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    if rc != 0 {
        return false;
    }
    for (i, d) in data.iter_mut().enumerate() {
        let keep = (keep >> (32 * i)) as u32;
        d.effective &= keep;
        d.permitted &= keep;
        d.inheritable = 0;
    }
    // SAFETY: as above, for capset(2) on the calling thread (pid 0).
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) };
    ok && rc == 0
}

extern "C" fn handler(_: libc::c_int) {
    let errno = io::Error::last_os_error().raw_os_error();
    if !drop_on_this_thread() {
        FAILED.fetch_add(1, Ordering::SeqCst);
    }
    DONE.fetch_add(1, Ordering::SeqCst);
    // Restore errno for the interrupted code.
    if let Some(e) = errno {
        // SAFETY: errno is thread-local.
        unsafe { *libc::__errno_location() = e };
    }
}

/// A system call that failed, by name.
#[derive(Debug, thiserror::Error)]
#[error("{call}: {source}")]
pub struct CallError {
    pub call: &'static str,
    #[source]
    pub source: io::Error,
}

fn call(call: &'static str) -> impl FnOnce(io::Error) -> CallError {
    move |source| CallError { call, source }
}

/// The thread IDs of this process.
pub fn threads() -> Result<Vec<String>, CallError> {
    Ok(std::fs::read_dir("/proc/self/task")
        .map_err(call("listing /proc/self/task"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect())
}

/// Keeps only the capabilities in the bit mask `keep` (effective and permitted; inheritable and
/// ambient cleared; the bounding set too with `bounding`) on every thread, the calling one
/// last. Returns once every signalled thread ran the handler, or after 2 s (the caller checks
/// the result in `/proc`).
pub fn keep_only_on_every_thread(keep: u64, bounding: bool) -> Result<(), CallError> {
    KEEP.store(keep, Ordering::SeqCst);
    DROP_BOUNDING.store(u32::from(bounding), Ordering::SeqCst);
    DONE.store(0, Ordering::SeqCst);
    FAILED.store(0, Ordering::SeqCst);
    // SAFETY: a handler that only makes system calls and touches atomics; SA_RESTART so that
    // interrupted calls resume where they can.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as extern "C" fn(libc::c_int) as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(signal(), &action, std::ptr::null_mut()) != 0 {
            return Err(call("sigaction")(io::Error::last_os_error()));
        }
    }
    // SAFETY: no arguments.
    let me = unsafe { libc::gettid() }.to_string();
    let pid = std::process::id() as libc::c_int;
    let mut sent = 0;
    for tid in threads()?.into_iter().filter(|t| *t != me) {
        let Ok(t) = tid.parse::<libc::c_int>() else {
            continue;
        };
        // SAFETY: a signal to a thread of this process, whose handler is installed above.
        if unsafe { libc::syscall(libc::SYS_tgkill, pid, t, signal()) } == 0 {
            sent += 1;
        }
    }
    if !drop_on_this_thread() {
        return Err(call("capset")(io::Error::last_os_error()));
    }
    // Handlers run as soon as their thread is scheduled; bounded so a stuck thread is reported
    // by the caller rather than hanging start-up.
    let deadline = Instant::now() + Duration::from_secs(2);
    while DONE.load(Ordering::SeqCst) < sent && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}
