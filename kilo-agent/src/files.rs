//! Files replaced whole ([`replace`]): the private key, the file backend's node objects, the CNI
//! configuration and `kgctl connect`'s Peer. A reader sees the old file or the new one, never
//! half of either.
use std::{io::Write as _, os::unix::fs::PermissionsExt as _, path::Path};

/// The mode of a file [`replace`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// As `File::create` makes it: 0o666 less the umask.
    Default,
    /// Exactly this mode, from before the first byte is written.
    Exact(u32),
}

/// Replaces `path` with `contents`: written to a hidden temporary file beside it
/// (`.NAME.XXXXXX.tmp`, which readers of object files and CNI configurations skip, removed on
/// failure), flushed to disk, then renamed over `path`. With `durable`, the directory is
/// flushed too, so that the new name survives a crash.
pub fn replace(path: &Path, contents: &[u8], mode: Mode, durable: bool) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let prefix = format!(
        ".{}.",
        path.file_name().unwrap_or_default().to_string_lossy()
    );
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    // Created 0o600 unless widened here: an exact mode is set before anything is written.
    if mode == Mode::Default {
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder.tempfile_in(dir)?;
    if let Mode::Exact(m) = mode {
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(m))?;
    }
    tmp.write_all(contents)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    if durable {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn replaces_whole_with_the_mode_asked_and_leaves_nothing_beside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        replace(&path, b"one\n", Mode::Exact(0o600), true).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one\n");
        assert_eq!(mode(&path), 0o600);
        replace(&path, b"two\n", Mode::Exact(0o644), false).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two\n");
        assert_eq!(mode(&path), 0o644);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["key"]);
        // Default: whatever `File::create` makes under this process's umask.
        let plain = dir.path().join("plain");
        std::fs::File::create(&plain).unwrap();
        let other = dir.path().join("other");
        replace(&other, b"x", Mode::Default, false).unwrap();
        assert_eq!(mode(&other), mode(&plain));
        // A missing directory fails and creates nothing.
        assert!(replace(&dir.path().join("no/such"), b"x", Mode::Default, true).is_err());
    }
}
