//! The process metrics Prometheus' Go client exports and Kilo's Grafana dashboard reads
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_open_fds`,
//! `process_start_time_seconds`, and their companions), read from `/proc/self` at each scrape;
//! and `kilo_child_processes`, the processes whose parent is this one, counted in `/proc` (kg
//! starts none, so it stays 0: measured, not a constant).
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

/// One reading of `/proc/self`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub open_fds: u64,
    pub max_fds: Option<u64>,
    pub start_time_seconds: f64,
    /// Processes whose parent is this process (`None`: `/proc` cannot be listed).
    pub children: Option<u64>,
}

/// The processes whose parent is this process, found in `/proc` (`None` where it cannot be
/// listed: no count rather than a false 0).
pub fn child_pids() -> Option<Vec<i32>> {
    let me = std::process::id() as i32;
    let all = procfs::process::all_processes().ok()?;
    Some(
        all.filter_map(|p| p.ok()?.stat().ok())
            .filter(|s| s.ppid == me)
            .map(|s| s.pid)
            .collect(),
    )
}

impl ProcessStats {
    /// Reads this process's statistics; `None` where `/proc` is not mounted.
    pub fn read() -> Option<ProcessStats> {
        let me = procfs::process::Process::myself().ok()?;
        let stat = me.stat().ok()?;
        let ticks = procfs::ticks_per_second() as f64;
        let boot = procfs::boot_time_secs().ok()? as f64;
        let max_fds = me
            .limits()
            .ok()
            .and_then(|l| match l.max_open_files.soft_limit {
                procfs::process::LimitValue::Value(v) => Some(v),
                procfs::process::LimitValue::Unlimited => None,
            });
        Some(ProcessStats {
            cpu_seconds: (stat.utime + stat.stime) as f64 / ticks,
            resident_bytes: stat.rss * procfs::page_size(),
            virtual_bytes: stat.vsize,
            open_fds: me.fd_count().ok()? as u64,
            max_fds,
            start_time_seconds: boot + stat.starttime as f64 / ticks,
            children: child_pids().map(|c| c.len() as u64),
        })
    }
}

/// Encodes [`ProcessStats::read`] at each scrape (nothing when `/proc` cannot be read).
#[derive(Debug)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = ProcessStats::read() else {
            return Ok(());
        };
        ConstCounter::new(s.cpu_seconds).encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            MetricType::Counter,
        )?)?;
        let mut gauges = vec![
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_bytes as f64,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_bytes as f64,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds as f64,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                s.start_time_seconds,
            ),
        ];
        if let Some(children) = s.children {
            gauges.push((
                "kilo_child_processes",
                "Processes whose parent is kg, counted in /proc (kg starts none)",
                children as f64,
            ));
        }
        if let Some(max) = s.max_fds {
            gauges.push((
                "process_max_fds",
                "Maximum number of open file descriptors",
                max as f64,
            ));
        }
        for (name, help, value) in gauges {
            ConstGauge::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let before = ProcessStats::read().unwrap();
        // Burn a little CPU so the counter can only grow.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let after = ProcessStats::read().unwrap();
        assert!(after.cpu_seconds > 0.0 && after.cpu_seconds >= before.cpu_seconds);
        // stdin, stdout and stderr at least.
        assert!(after.open_fds >= 3, "{after:?}");
        assert!(after.resident_bytes > 1 << 20, "{after:?}");
        assert!(after.virtual_bytes >= after.resident_bytes, "{after:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        // The test process started before now, and within the last day.
        assert!(after.start_time_seconds <= now + 1.0, "{after:?} {now}");
        assert!(after.start_time_seconds > now - 86_400.0, "{after:?} {now}");
    }
}
