//! The Linux capabilities kg needs, checked once at start so that a DaemonSet missing one says
//! which, instead of failing later with a bare `EPERM` from netlink or bpf(2).
//!
//! NET_ADMIN: links, addresses, routes, rules, WireGuard, the nftables rule. BPF and PERFMON:
//! loading the TC programs and their maps. SYS_ADMIN: pinning in bpffs and, on kernels older
//! than 5.8 (no CAP_BPF), everything BPF.

/// A capability kg uses, with its bit number (linux/capability.h) and what it is for.
pub const NEEDED: [(&str, u32, &str); 4] = [
    (
        "CAP_NET_ADMIN",
        12,
        "WireGuard, addresses, routes and the nftables rule",
    ),
    ("CAP_SYS_ADMIN", 21, "pinning the datapath in bpffs"),
    ("CAP_PERFMON", 38, "loading the datapath"),
    ("CAP_BPF", 39, "loading the datapath"),
];

/// The effective capability set from the text of `/proc/self/status`. Pure.
pub fn effective(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
}

/// The needed capabilities missing from `effective`, with what each is for. Pure.
pub fn missing(effective: u64) -> Vec<(&'static str, &'static str)> {
    NEEDED
        .iter()
        .filter(|(_, bit, _)| effective & (1 << bit) == 0)
        .map(|(name, _, what)| (*name, *what))
        .collect()
}

/// Logs a warning per missing capability (reading `/proc/self/status`).
pub fn warn_missing() {
    let Some(eff) = std::fs::read_to_string("/proc/self/status")
        .ok()
        .as_deref()
        .and_then(effective)
    else {
        return;
    };
    for (name, what) in missing(eff) {
        tracing::warn!(capability = name, needed_for = what, "capability missing");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_what_is_missing() {
        let status = "Name:\tkg\nCapInh:\t0000000000000000\nCapEff:\t000000c000001000\n";
        let eff = effective(status).unwrap();
        assert_eq!(eff, (1 << 12) | (1 << 38) | (1 << 39));
        assert_eq!(
            missing(eff),
            vec![("CAP_SYS_ADMIN", "pinning the datapath in bpffs")]
        );
        assert!(missing(u64::MAX).is_empty());
        assert_eq!(missing(0).len(), 4);
        assert_eq!(effective("Name:\tkg\n"), None);
    }
}
