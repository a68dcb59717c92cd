//! A BPF array mapped into the agent's memory (through `memmap2`), read and written in place
//! with volatile accesses because the program updates the same words concurrently.
use std::{io, os::fd::AsRawFd, ptr};

use memmap2::{MmapOptions, MmapRaw};

use super::Pod;

/// `len` values of `T` mapped from an array map's file descriptor.
pub struct Mapped<T> {
    mem: MmapRaw,
    len: usize,
    _values: std::marker::PhantomData<T>,
}

impl<T: Pod> Mapped<T> {
    /// Maps `len` values of the array map behind `fd` (created with `BPF_F_MMAPABLE`).
    pub fn new(fd: impl AsRawFd, len: usize) -> io::Result<Self> {
        let mem = MmapOptions::new()
            .len(len * size_of::<T>())
            .map_raw(fd.as_raw_fd())?;
        Ok(Mapped {
            mem,
            len,
            _values: std::marker::PhantomData,
        })
    }

    fn at(&self, index: usize) -> *mut T {
        assert!(
            index < self.len,
            "index {index} outside {} values",
            self.len
        );
        // SAFETY: index < len, inside the mapping of len values.
        unsafe { self.mem.as_mut_ptr().cast::<T>().add(index) }
    }

    /// The value at `index` as the program last wrote it (aligned words: an aligned u64 cannot
    /// be torn on a 64-bit target).
    pub fn read(&self, index: usize) -> T {
        // SAFETY: inside the mapping, aligned (the kernel maps at page boundaries).
        unsafe { ptr::read_volatile(self.at(index)) }
    }

    /// Overwrites the value at `index`.
    pub fn write(&mut self, index: usize, value: T) {
        // SAFETY: inside the mapping, aligned, mapped writable.
        unsafe { ptr::write_volatile(self.at(index), value) }
    }
}
