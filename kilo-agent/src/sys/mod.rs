//! Every raw system call the agent makes itself, so that no other module uses `unsafe`: the
//! BPF batch lookup ([`bpf`]), the mapped counters ([`mmap`]), capabilities ([`caps`]), the
//! synchronous netlink requests ([`netlink`]) and the program's log buffer polled ([`poll`]).
//! Each is hand-written only where no crate offers the call (the reason is in each module's doc).
pub mod bpf;
pub mod caps;
pub mod mmap;
pub mod netlink;
pub mod poll;

/// Values as the kernel stores them in maps: plain data, for which every bit pattern is a value.
///
/// # Safety
/// Implement only for `repr(C)` types of integers and byte arrays without padding.
pub unsafe trait Pod: Copy {}

// SAFETY: `repr(C)` structs of u32s, u64s and byte arrays (kilo-common), and aya's packed
// `{ prefix_len: u32, data }` around one.
unsafe impl Pod for kilo_common::LpmData {}
unsafe impl Pod for kilo_common::EntryValue {}
unsafe impl Pod for kilo_common::Counter {}
unsafe impl<K: Pod> Pod for aya::maps::lpm_trie::Key<K> {}
