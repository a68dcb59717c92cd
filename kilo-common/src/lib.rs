//! Map keys and values shared by the eBPF program (`kilo-ebpf`) and the agent.
//! `#[repr(C)]`, plain old data; the `user` feature adds `aya::Pod` for userspace.
#![no_std]
