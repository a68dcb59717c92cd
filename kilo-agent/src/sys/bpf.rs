//! `BPF_MAP_LOOKUP_BATCH` on a map's file descriptor: aya has no batch lookup, and one call per
//! 1,024 entries replaces two per entry (get_next_key, lookup).
use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd},
};

use super::Pod;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
struct Batch {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const CHUNK: usize = 1024;

/// Every entry of the map behind `fd`, whose keys are `K` and values `V`. `Err` with the
/// kernel's errno when it refuses (EINVAL, EOPNOTSUPP or ENOTSUPP where the map type has no
/// batch lookups).
pub fn lookup_batch<K: Pod, V: Pod>(fd: BorrowedFd<'_>) -> io::Result<Vec<(K, V)>> {
    // SAFETY: `Pod` types are valid for every bit pattern, zero included.
    let zero_key = unsafe { std::mem::zeroed::<K>() };
    let zero_value = unsafe { std::mem::zeroed::<V>() };
    let mut keys = vec![zero_key; CHUNK];
    let mut values = vec![zero_value; CHUNK];
    // Where the kernel's walk stopped (a key), given back to resume it.
    let mut token = zero_key;
    let mut out = Vec::new();
    loop {
        let mut attr = Batch {
            in_batch: if out.is_empty() {
                0
            } else {
                &raw const token as u64
            },
            out_batch: &raw mut token as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd.as_raw_fd() as u32,
            elem_flags: 0,
            flags: 0,
        };
        // SAFETY: the attribute points at buffers of `count` keys and values of the map's sizes
        // (`Pod`) and at a key-sized token, all alive for the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &raw mut attr,
                size_of::<Batch>(),
            )
        };
        let error = (rc < 0).then(io::Error::last_os_error);
        let n = (attr.count as usize).min(CHUNK);
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        match error {
            None if n > 0 => {}
            // ENOENT: the walk is done (with the last entries in `count`).
            None => return Ok(out),
            Some(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            Some(e) => return Err(e),
        }
    }
}
