//! The topology as WireGuard peers: Kilo's `Conf()`, `PeerConf()`, `AsPeer()` and
//! `updateEndpoint`.
use super::WireGuardPeer;
use crate::{
    mesh::{Endpoint, Key, MeshPeer},
    topology::{Segment, Topology},
};

impl Topology {
    /// Kilo's `updateEndpoint`: a discovered endpoint replaces the configured one only for
    /// NAT-ed (non-zero keepalive) segments and peers.
    pub fn update_endpoint(
        &self,
        endpoint: Option<&Endpoint>,
        key: &Key,
        keepalive: u16,
    ) -> Option<Endpoint> {
        if keepalive == 0 {
            return endpoint.cloned();
        }
        match self.discovered_endpoints.get(key) {
            Some(a) => Some(Endpoint::from(*a)),
            None => endpoint.cloned(),
        }
    }

    /// A segment as a WireGuard peer: its allowed IPs, then its allowed-location IPs.
    fn segment_as_peer(&self, s: &Segment, psk: Option<Key>, keepalive: u16) -> WireGuardPeer {
        WireGuardPeer {
            public_key: s.key,
            preshared_key: psk,
            endpoint: self.update_endpoint(s.endpoint.as_ref(), &s.key, s.persistent_keepalive),
            allowed_ips: s
                .allowed_ips
                .iter()
                .chain(&s.allowed_location_ips)
                .copied()
                .collect(),
            persistent_keepalive: keepalive,
        }
    }

    /// A Peer as a WireGuard peer.
    fn mesh_peer_as_peer(&self, p: &MeshPeer, psk: Option<Key>, keepalive: u16) -> WireGuardPeer {
        WireGuardPeer {
            public_key: p.public_key,
            preshared_key: psk,
            endpoint: self.update_endpoint(
                p.endpoint.as_ref(),
                &p.public_key,
                p.persistent_keepalive,
            ),
            allowed_ips: p.allowed_ips.clone(),
            persistent_keepalive: keepalive,
        }
    }

    /// Kilo's `Conf()` peers: one per segment of another group, then one per Peer.
    /// CIDRs as written, in Kilo's order (what `kgctl showconf node` prints).
    pub fn conf(&self) -> Vec<WireGuardPeer> {
        let ka = self.persistent_keepalive;
        let segments = self.segments.iter().filter(|s| s.group != self.group);
        let peers = self
            .peers
            .iter()
            .map(|p| self.mesh_peer_as_peer(p, p.preshared_key, ka));
        segments
            .map(|s| self.segment_as_peer(s, None, ka))
            .chain(peers)
            .collect()
    }

    /// Kilo's `PeerConf(name)`: every segment, then every other Peer, with the named peer's
    /// keepalive (and its preshared key on the segment entries).
    pub fn peer_conf(&self, name: &str) -> Vec<WireGuardPeer> {
        let me = self.peers.iter().find(|p| p.name == name);
        let pka = me.map_or(0, |p| p.persistent_keepalive);
        let psk = me.and_then(|p| p.preshared_key);
        let others = self.peers.iter().filter(|p| p.name != name);
        self.segments
            .iter()
            .map(|s| self.segment_as_peer(s, psk, pka))
            .chain(others.map(|p| self.mesh_peer_as_peer(p, None, pka)))
            .collect()
    }

    /// Kilo's `AsPeer()`: the local segment as a peer (allowed IPs without the
    /// allowed-location IPs, configured endpoint, no keepalive).
    pub fn as_peer(&self) -> Option<WireGuardPeer> {
        self.local_segment().map(|s| WireGuardPeer {
            public_key: s.key,
            preshared_key: None,
            endpoint: s.endpoint.clone(),
            allowed_ips: s.allowed_ips.clone(),
            persistent_keepalive: 0,
        })
    }
}
