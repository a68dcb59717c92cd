//! The bpf filesystem the datapath pins to: checking and mounting it, listing a pin
//! directory, removing pins.
use std::{fs, io, path::Path};

use super::{DatapathError, io_err};

/// Removes the pins under `maps` not named in `keep` (with an empty `keep`, every one: the maps
/// are replaced; with the object's pinned maps (`load.rs`), those of maps an upgrade renamed or dropped, which a
/// program still attached keeps until `attach` moves its link to ours). Returns how many.
pub(super) fn remove_pins(maps: &Path, keep: &[&str]) -> Result<u64, DatapathError> {
    let mut removed = 0;
    for pin in list_dir(maps)? {
        if !keep.contains(&pin.as_str()) {
            tracing::debug!(pin = %pin, "datapath: removing a map pin");
            let path = maps.join(pin);
            fs::remove_file(&path).map_err(io_err(&path))?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// The names in `dir` (none when it does not exist).
pub(super) fn list_dir(dir: &Path) -> Result<Vec<String>, DatapathError> {
    match fs::read_dir(dir) {
        Ok(rd) => Ok(rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(io_err(dir)(e)),
    }
}

/// Makes sure `dir` can hold pins: mounts bpffs on `/sys/fs/bpf` when `dir` is under it and
/// nothing is mounted there yet; otherwise `dir` must already be on a bpffs.
pub(super) fn ensure_bpffs(dir: &Path) -> Result<(), DatapathError> {
    let root = Path::new("/sys/fs/bpf");
    if dir.starts_with(root) && !is_bpffs(root) {
        nix::mount::mount(
            Some("bpf"),
            root,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(|e| io_err(root)(e.into()))?;
        tracing::info!("datapath: mounted bpffs on /sys/fs/bpf");
    }
    // The nearest existing ancestor must be on bpffs.
    let mut probe = dir;
    while !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new("/"));
    }
    if !is_bpffs(probe) {
        return Err(DatapathError::Config(format!(
            "pin directory {} is not on a bpf filesystem",
            dir.display()
        )));
    }
    Ok(())
}

/// Whether `path` is on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|st| st.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}
