//! The one static masquerade rule, over netfilter netlink.

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("netlink: {0}")]
    Io(#[from] std::io::Error),
}
