//! The softirq clock: the NET_RX softirq time of every CPU, summed by two hand-assembled
//! raw-tracepoint programs on `softirq_entry`/`softirq_exit` with `bpf_ktime_get_ns` (without
//! IRQ time accounting, /proc/stat only samples softirq time at the tick and charges it to
//! whatever task the softirq interrupts).
use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

fn bpf(cmd: i32, attr: &mut [u8; 128]) -> io::Result<i32> {
    // SAFETY: the bpf syscall with a zero-padded attr of the size we pass.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as i32)
    }
}

fn put32(a: &mut [u8; 128], off: usize, v: u32) {
    a[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put64(a: &mut [u8; 128], off: usize, v: u64) {
    a[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | (u64::from((src << 4) | dst) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

/// Sums the time spent in the NET_RX softirq, per CPU: slot 0 holds the entry timestamp, slot 1
/// the total ns and the number of softirqs.
pub struct NetRxClock {
    map: OwnedFd,
    _progs: Vec<OwnedFd>,
    _links: Vec<OwnedFd>,
    ncpus: usize,
}

const NET_RX_SOFTIRQ: i32 = 3;

impl NetRxClock {
    pub fn new() -> io::Result<Self> {
        let ncpus = aya::util::nr_cpus().map_err(|(_, e)| e)?.get() as usize;
        let mut a = [0u8; 128];
        put32(&mut a, 0, 6); // BPF_MAP_TYPE_PERCPU_ARRAY
        put32(&mut a, 4, 4);
        put32(&mut a, 8, 16);
        put32(&mut a, 12, 2);
        // SAFETY: a new fd from BPF_MAP_CREATE.
        let map = unsafe { OwnedFd::from_raw_fd(bpf(0, &mut a)?) };
        let fd = map.as_raw_fd();
        let ld_map = |dst: u8| [insn(0x18, dst, 1, 0, fd), insn(0, 0, 0, 0, 0)];
        let (ldx_dw, stx_dw, st_w, st_dw) = (0x79, 0x7b, 0x62, 0x7a);
        let (jne, jeq, mov_x, add_k, add_x, sub_x, call, exit) =
            (0x55, 0x15, 0xbf, 0x07, 0x0f, 0x1f, 0x85, 0x95);
        let (r0, r1, r2, r6, r7, r8, r10) = (0, 1, 2, 6, 7, 8, 10);
        // Not NET_RX: skip `skip` instructions to the exit; else r7 = ktime_get_ns().
        let prologue = |skip: i16| {
            vec![
                insn(ldx_dw, r6, r1, 0, 0),
                insn(jne, r6, 0, skip, NET_RX_SOFTIRQ),
                insn(call, 0, 0, 0, 5), // ktime_get_ns
                insn(mov_x, r7, r0, 0, 0),
            ]
        };
        // r0 = this CPU's value of `slot` (or null).
        let lookup = |slot: i32| {
            let mut v = vec![
                insn(st_w, r10, 0, -4, slot),
                insn(mov_x, r2, r10, 0, 0),
                insn(add_k, r2, 0, 0, -4),
            ];
            v.extend(ld_map(r1));
            v.push(insn(call, 0, 0, 0, 1)); // map_lookup_elem
            v
        };
        let mut entry = prologue(10);
        entry.extend(lookup(0));
        entry.extend([
            insn(jeq, r0, 0, 1, 0),
            insn(stx_dw, r0, r7, 0, 0),
            insn(0xb7, r0, 0, 0, 0),
            insn(exit, 0, 0, 0, 0),
        ]);
        let mut exit_prog = prologue(26);
        exit_prog.extend(lookup(0));
        exit_prog.extend([
            insn(jeq, r0, 0, 17, 0),
            insn(ldx_dw, r8, r0, 0, 0),
            insn(jeq, r8, 0, 15, 0),
            insn(sub_x, r7, r8, 0, 0),
            insn(st_dw, r0, 0, 0, 0),
        ]);
        exit_prog.extend(lookup(1));
        exit_prog.extend([
            insn(jeq, r0, 0, 6, 0),
            insn(ldx_dw, r1, r0, 0, 0),
            insn(add_x, r1, r7, 0, 0),
            insn(stx_dw, r0, r1, 0, 0),
            insn(ldx_dw, r1, r0, 8, 0),
            insn(add_k, r1, 0, 0, 1),
            insn(stx_dw, r0, r1, 8, 0),
            insn(0xb7, r0, 0, 0, 0),
            insn(exit, 0, 0, 0, 0),
        ]);
        let mut progs = Vec::new();
        let mut links = Vec::new();
        // Exit first: it ignores softirqs whose entry it did not see (slot 0 is still 0).
        for (prog, tp) in [(&exit_prog, c"softirq_exit"), (&entry, c"softirq_entry")] {
            let mut log = vec![0u8; 65536];
            let mut a = [0u8; 128];
            put32(&mut a, 0, 17); // BPF_PROG_TYPE_RAW_TRACEPOINT
            put32(&mut a, 4, prog.len() as u32);
            put64(&mut a, 8, prog.as_ptr() as u64);
            put64(&mut a, 16, c"GPL".as_ptr() as u64);
            put32(&mut a, 24, 1);
            put32(&mut a, 28, log.len() as u32);
            put64(&mut a, 32, log.as_mut_ptr() as u64);
            let fd = bpf(5, &mut a).map_err(|e| {
                let end = log.iter().position(|&b| b == 0).unwrap_or(0);
                io::Error::other(format!(
                    "loading the {tp:?} program: {e}\n{}",
                    String::from_utf8_lossy(&log[..end])
                ))
            })?;
            // SAFETY: a new fd from BPF_PROG_LOAD.
            let prog_fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let mut a = [0u8; 128];
            put64(&mut a, 0, tp.as_ptr() as u64);
            put32(&mut a, 8, prog_fd.as_raw_fd() as u32);
            // SAFETY: a new fd from BPF_RAW_TRACEPOINT_OPEN.
            links.push(unsafe { OwnedFd::from_raw_fd(bpf(17, &mut a)?) });
            progs.push(prog_fd);
        }
        Ok(NetRxClock {
            map,
            _progs: progs,
            _links: links,
            ncpus,
        })
    }

    /// Total NET_RX ns and softirq count over all CPUs.
    pub fn read(&self) -> (u64, u64) {
        let key = 1u32;
        let mut vals = vec![0u8; 16 * self.ncpus];
        let mut a = [0u8; 128];
        put32(&mut a, 0, self.map.as_raw_fd() as u32);
        put64(&mut a, 8, (&raw const key) as u64);
        put64(&mut a, 16, vals.as_mut_ptr() as u64);
        bpf(1, &mut a).expect("BPF_MAP_LOOKUP_ELEM");
        let word = |i: usize| u64::from_ne_bytes(vals[i..i + 8].try_into().unwrap());
        (0..self.ncpus).fold((0, 0), |(t, n), c| (t + word(16 * c), n + word(16 * c + 8)))
    }
}
