//! Backends: where nodes and peers come from (Kubernetes, or a local directory) and where the local node publishes its own annotations.
