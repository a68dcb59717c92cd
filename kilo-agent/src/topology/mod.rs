//! Topology (pure): segments, leaders, WireGuard IPs and allowed IPs from nodes and peers, with Kilo semantics.
