//! The node's WireGuard private key: read from `--private-key` (default `/var/lib/kilo/key`,
//! base64 as `wg genkey` writes it), or generated on first start and stored with mode 0600
//! ([`crate::files::replace`], durable: a crash never leaves half a key). The key is never
//! logged; only its public half leaves this module's callers.
use std::{os::unix::fs::PermissionsExt, path::Path};

use crate::mesh::Key;

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("private key {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("private key {path}: {message}")]
    Invalid { path: String, message: String },
}

/// The public key of a private key.
pub fn public_key(private: &Key) -> Key {
    Key(wireguard_control::Key(private.0).get_public().0)
}

/// Loads the private key if the file exists (never writes; for `--dry-run`).
pub fn load(path: &Path) -> Result<Option<Key>, KeyFileError> {
    match std::fs::read_to_string(path) {
        Ok(text) => text
            .trim()
            .parse()
            .map(Some)
            .map_err(|e: crate::mesh::KeyError| KeyFileError::Invalid {
                path: path.display().to_string(),
                message: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(KeyFileError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// Loads the private key, generating and storing one when the file does not exist.
/// Returns the key and whether it was generated.
pub fn load_or_generate(path: &Path) -> Result<(Key, bool), KeyFileError> {
    let io = |source| KeyFileError::Io {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let key: Key =
                text.trim()
                    .parse()
                    .map_err(|e: crate::mesh::KeyError| KeyFileError::Invalid {
                        path: path.display().to_string(),
                        message: e.to_string(),
                    })?;
            let mode = std::fs::metadata(path).map_err(io)?.permissions().mode();
            if mode & 0o077 != 0 {
                tracing::warn!(path = %path.display(), mode = format!("{:o}", mode & 0o777), "private key readable by others; setting mode 0600");
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                    .map_err(io)?;
            }
            Ok((key, false))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Key(wireguard_control::Key::generate_private().0);
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(io)?;
            }
            crate::files::replace(
                path,
                format!("{key}\n").as_bytes(),
                crate::files::Mode::Exact(0o600),
                true,
            )
            .map_err(io)?;
            tracing::info!(path = %path.display(), public_key = %public_key(&key), "generated a new WireGuard key");
            Ok((key, true))
        }
        Err(e) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_never_creates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        assert!(load(&path).unwrap().is_none());
        assert!(!path.exists());
        let (k, _) = load_or_generate(&path).unwrap();
        assert_eq!(load(&path).unwrap(), Some(k));
    }

    #[test]
    fn generated_once_with_mode_0600_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/key");
        let (k1, fresh) = load_or_generate(&path).unwrap();
        assert!(fresh);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (k2, fresh) = load_or_generate(&path).unwrap();
        assert!(!fresh);
        assert_eq!(k1, k2);
        assert_ne!(public_key(&k1), k1);
        std::fs::write(&path, "nonsense").unwrap();
        let e = load_or_generate(&path).unwrap_err().to_string();
        assert!(e.contains("sub/key") && !e.contains(&k1.to_string()), "{e}");
    }
}
