//! The Kubernetes backend (written next).
