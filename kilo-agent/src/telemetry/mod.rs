//! Telemetry: Prometheus metrics (Kilo's names plus ours), health and readiness.
