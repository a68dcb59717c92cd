//! kilo-rs: a Kilo-compatible WireGuard mesh agent whose datapath is a TC eBPF program.
//!
//! Modules follow the data flow, one direction:
//! backend → mesh → topology → plan → reconcilers (reconcile, which drives datapath) → telemetry.
//! Everything up to and including `plan` is pure: no I/O. `graph` draws a topology (pure), for
//! `kgctl graph` and telemetry's `/graph`. Leaves any module may use: `writes` (what reconcilers
//! report), `sys` (the raw system calls), `files` (files replaced whole) and `http` (the HTTP
//! server of `telemetry` and `webhook`). On top: `agent` (kg: it builds the others from the
//! flags and runs the loop that drives them; none of them imports it), `kgctl` (the CLI's
//! renderings) and `webhook`.

pub mod agent;
pub mod backend;
pub mod datapath;
pub mod files;
pub mod graph;
pub mod http;
pub mod kgctl;
pub mod mesh;
pub mod plan;
pub mod reconcile;
pub mod sys;
pub mod telemetry;
pub mod topology;
pub mod webhook;
pub mod writes;
