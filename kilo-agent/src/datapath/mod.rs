//! The eBPF datapath from userspace: loads, attaches, pins and adopts the TC program, syncs its maps, reads its counters, and installs the one static masquerade rule.
