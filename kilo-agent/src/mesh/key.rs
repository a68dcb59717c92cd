//! WireGuard keys: 32 bytes, base64 on the wire and in annotations.
use std::{fmt, str::FromStr};

use base64::{
    Engine as _, alphabet,
    engine::{GeneralPurpose, GeneralPurposeConfig, general_purpose::STANDARD},
};

/// Go's `base64.StdEncoding` as `wgtypes.ParseKey` decodes: padding required, unused bits of
/// the last character ignored.
const GO_STD: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_allow_trailing_bits(true),
);

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

    /// Exactly Kilo's `wgtypes.ParseKey`: base64 of 32 bytes, nothing trimmed, but line breaks
    /// (`\r`, `\n`) anywhere are skipped, as Go's decoder skips them.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let text: String = s.chars().filter(|c| !matches!(c, '\r' | '\n')).collect();
        let bytes = GO_STD.decode(&text).map_err(|e| {
            KeyError::Base64(match super::space(&text) {
                Some(why) => why.to_string(),
                None => e.to_string(),
            })
        })?;
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

    /// As Go's decoder: no space trimmed, line breaks skipped, padding required, the unused
    /// bits of the last character ignored.
    #[test]
    fn decodes_as_go() {
        let s = "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
        let k = s.parse::<Key>().unwrap();
        assert_eq!(format!("{s}\n").parse::<Key>(), Ok(k));
        assert_eq!(
            "a2V5MQAAAAAAAAAAAAAAAAAAAAAA\r\nAAAAAAAAAAAAAAA=".parse::<Key>(),
            Ok(k)
        );
        assert_eq!(
            format!(" {s}").parse::<Key>(),
            Err(KeyError::Base64("leading space".into()))
        );
        assert!(s.trim_end_matches('=').parse::<Key>().is_err());
        // `B` sets a bit the 32 bytes do not use: Go accepts it.
        assert_eq!(
            "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAB=".parse::<Key>(),
            Ok(k)
        );
    }

    #[test]
    fn debug_hides_the_bytes() {
        assert_eq!(format!("{:?}", Key([7; 32])), "Key(..)");
    }
}
