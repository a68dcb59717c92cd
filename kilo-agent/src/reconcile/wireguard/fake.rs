//! FakeWireGuard: the WireGuard device in memory, for fast tests.
use super::{DeviceState, WgDiff, WgError, WireGuard, count};
use crate::writes::Writes;

/// An in-memory device for fast tests: applies diffs to its state and counts writes.
#[derive(Debug, Default)]
pub struct FakeWireGuard {
    pub device: Option<DeviceState>,
    pub writes: Writes,
}

impl WireGuard for FakeWireGuard {
    fn observe(&mut self) -> Result<Option<DeviceState>, WgError> {
        Ok(self.device.clone())
    }

    fn apply(&mut self, diff: &WgDiff) -> Result<Writes, WgError> {
        let dev = self.device.get_or_insert_with(DeviceState::default);
        if let Some(k) = diff.private_key {
            dev.private_key = Some(k);
        }
        if let Some(p) = diff.listen_port {
            dev.listen_port = p;
        }
        for k in &diff.remove {
            dev.peers.remove(k);
        }
        for (k, p) in &diff.add {
            dev.peers.insert(*k, p.clone());
        }
        for (k, c) in &diff.update {
            let p = dev.peers.get_mut(k).expect("update of a known peer");
            if let Some(psk) = c.preshared_key {
                p.preshared_key = psk;
            }
            if let Some(e) = c.endpoint {
                p.endpoint = Some(e);
            }
            if let Some(ips) = &c.allowed_ips {
                p.allowed_ips = ips.clone();
            }
            if let Some(ka) = c.keepalive {
                p.keepalive = ka;
            }
        }
        let w = count(diff);
        self.writes += w.clone();
        Ok(w)
    }
}
