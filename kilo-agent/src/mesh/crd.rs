//! The Peer custom resource, `kilo.squat.ai/v1alpha1`, cluster-scoped: exactly Kilo's schema.
//! These are the raw objects backends deliver; validation happens when they become mesh peers.
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kilo.squat.ai",
    version = "v1alpha1",
    kind = "Peer",
    plural = "peers",
    singular = "peer"
)]
#[serde(rename_all = "camelCase")]
pub struct PeerSpec {
    /// CIDRs routed to this peer (at least one). Kilo spells it `allowedIPs`, which
    /// `camelCase` would turn into `allowedIps`.
    #[serde(rename = "allowedIPs")]
    pub allowed_ips: Vec<String>,
    /// Base64 WireGuard public key (32 bytes).
    pub public_key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<PeerEndpoint>,
    /// Seconds; also marks the peer as behind NAT (its endpoint may roam).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_keepalive: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preshared_key: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PeerEndpoint {
    #[serde(rename = "dnsOrIP")]
    pub dns_or_ip: DnsOrIp,
    pub port: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DnsOrIp {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
}
