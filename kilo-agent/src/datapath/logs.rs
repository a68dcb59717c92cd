//! The program's aya-log records as `tracing` events (target `kilo_ebpf`). The program logs
//! only on rare paths and only when the config map's level asks for it (off by default), so the
//! fast path never pays for logging; the level can change at run time without a reload.
use aya_log::EbpfLogger;

use crate::sys;

/// A `log::Log` that re-emits every record as a `tracing` event.
#[derive(Debug, Clone, Copy, Default)]
pub struct TracingLog;

impl log::Log for TracingLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let message = record.args();
        match record.level() {
            log::Level::Error => tracing::error!(target: "kilo_ebpf", "{message}"),
            log::Level::Warn => tracing::warn!(target: "kilo_ebpf", "{message}"),
            log::Level::Info => tracing::info!(target: "kilo_ebpf", "{message}"),
            log::Level::Debug => tracing::debug!(target: "kilo_ebpf", "{message}"),
            log::Level::Trace => tracing::trace!(target: "kilo_ebpf", "{message}"),
        }
    }

    fn flush(&self) {}
}

/// The program's log records, read as they arrive.
pub type ProgramLogger<L = TracingLog> = EbpfLogger<L>;

/// Forwards records as they arrive until the ring buffer can no longer be polled.
pub async fn forward<L: log::Log + Send + 'static>(logger: ProgramLogger<L>) {
    let Ok(mut fd) = sys::poll::readable(logger) else {
        tracing::warn!("datapath: cannot poll the program's log buffer; its logs are dropped");
        return;
    };
    loop {
        let Ok(mut ready) = fd.readable_mut().await else {
            return;
        };
        ready.get_inner_mut().0.flush();
        ready.clear_ready();
    }
}
