//! WireGuard keys: 32 bytes, base64 on the wire and in annotations.
use std::{fmt, str::FromStr};

use base64::{Engine as _, engine::general_purpose::STANDARD};

/// A WireGuard public, private or preshared key.
///
/// `Debug` never prints the bytes, so a private key cannot leak into a log by accident;
/// `Display` prints base64 and is meant for public keys.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(pub [u8; 32]);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("not valid base64: {0}")]
    Base64(String),
    #[error("a WireGuard key is 32 bytes, this one is {0}")]
    Length(usize),
}

impl FromStr for Key {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bytes = STANDARD
            .decode(s.trim())
            .map_err(|e| KeyError::Base64(e.to_string()))?;
        let len = bytes.len();
        Ok(Key(bytes.try_into().map_err(|_| KeyError::Length(len))?))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&STANDARD.encode(self.0))
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_base64() {
        let s = "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
        assert_eq!(s.parse::<Key>().unwrap().to_string(), s);
    }

    #[test]
    fn rejects_bad_keys() {
        assert!(matches!(
            "a2V5MQ==".parse::<Key>(),
            Err(KeyError::Length(4))
        ));
        assert!(matches!("!!".parse::<Key>(), Err(KeyError::Base64(_))));
    }

    #[test]
    fn debug_hides_the_bytes() {
        assert_eq!(format!("{:?}", Key([7; 32])), "Key(..)");
    }
}
