//! kilo-rs: a Kilo-compatible WireGuard mesh agent whose datapath is a TC eBPF program.
//!
//! Modules follow the data flow, one direction:
//! backend → mesh → topology → plan → reconcilers (reconcile, which drives datapath) → telemetry.
//! Everything up to and including `plan` is pure: no I/O. `writes` (what reconcilers report)
//! and `sys` (the raw system calls) sit below the reconcilers. `agent` sits above them all: it
//! builds them from `kg`'s flags (`agent::build`) and runs the loop that drives them; none of
//! them imports it.

pub mod agent;
pub mod backend;
pub mod datapath;
pub mod kgctl;
pub mod mesh;
pub mod plan;
pub mod reconcile;
pub mod sys;
pub mod telemetry;
pub mod topology;
pub mod webhook;
pub mod writes;
