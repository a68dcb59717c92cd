//! The file backend (`--backend file --backend-dir DIR`): Kubernetes-shaped Node and Peer objects,
//! one per file (YAML or JSON), in one directory that several agents may share.
//!
//! The directory is watched with inotify (no polling). A burst of events is coalesced: the
//! directory is rescanned once it has been quiet for [`QUIET`] (or after [`MAX_DELAY`] at most),
//! and only files whose size, mtime or inode changed are parsed again. A file that cannot be
//! read is logged (naming the file and the error), reported in [`Update::errors`] and skipped.
//! A rescan that changed only `last-seen` heartbeats updates [`Update::last_seen`] alone.
//!
//! When the directory cannot be read (removed, renamed, unreadable) the backend reports itself
//! disconnected ([`Update::connected`]) and, only then, retries every [`RETRY`], watching the
//! directory afresh before rescanning it.
//!
//! Publishing annotations rewrites the agent's own node file atomically (write a hidden temporary
//! file, fsync, rename), creating `<node>.yaml` when no file holds that node. Hidden files
//! (starting with `.`) are never read, so temporaries are invisible to every agent.
use std::{
    collections::BTreeMap,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::{FutureExt, future::BoxFuture};
use notify::{EventKind, RecursiveMode, Watcher, event::AccessKind};
use tokio::sync::{mpsc, watch};

use super::{Annotations, Backend, BackendError, Update, apply_annotations};
use crate::mesh::{
    ObjectError, Snapshot,
    objects::{MAX_OBJECT_BYTES, Object, file_err, insert, parse_object, too_large},
};

/// How long the directory must be quiet before a rescan.
pub const QUIET: Duration = Duration::from_millis(50);
/// The longest a rescan waits under a continuous stream of events.
pub const MAX_DELAY: Duration = Duration::from_millis(500);
/// How often an unreadable directory is tried again.
pub const RETRY: Duration = Duration::from_secs(1);

/// What identifies a file's version without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

#[derive(Debug, Default)]
struct Cache {
    files: BTreeMap<PathBuf, (Fingerprint, Result<Object, String>)>,
    generation: u64,
}

/// Whether a file of the directory is read: `*.yaml`, `*.yml`, `*.json`, not hidden.
fn is_object_file(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let ext = path.extension().and_then(|e| e.to_str());
    !hidden && matches!(ext, Some("yaml" | "yml" | "json"))
}

/// Reads every object file of `dir` once (sorted by file name), as `kgctl --backend file` does.
/// Bad files are reported, not fatal.
pub fn load_dir(dir: &Path) -> (Snapshot, Vec<ObjectError>) {
    let mut snapshot = Snapshot::default();
    let mut errors = Vec::new();
    let dir_s = dir.display().to_string();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            errors.push(file_err(&dir_s, "directory", e.to_string()));
            return (snapshot, errors);
        }
    };
    let mut paths: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && is_object_file(p))
        .collect();
    paths.sort();
    for path in paths {
        let p = path.display().to_string();
        let res = std::fs::read(&path)
            .map_err(|e| file_err(&p, "content", e.to_string()))
            .and_then(|b| parse_object(&b, &p))
            .and_then(|o| insert(&mut snapshot, o, &p));
        if let Err(e) = res {
            errors.push(e);
        }
    }
    (snapshot, errors)
}

impl Cache {
    /// Rescans the directory; returns whether any file appeared, changed or disappeared.
    fn rescan(&mut self, dir: &Path) -> Result<bool, BackendError> {
        let io = |source| BackendError::Io {
            path: dir.display().to_string(),
            source,
        };
        let mut seen = BTreeMap::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let Ok(entry) = entry else { continue };
            let path = entry.path();
            if !is_object_file(&path) {
                continue;
            }
            let Ok(meta) = std::fs::metadata(&path) else {
                continue; // removed between readdir and stat
            };
            if !meta.is_file() {
                continue;
            }
            let fp = Fingerprint {
                ino: meta.ino(),
                size: meta.size(),
                mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            };
            seen.insert(path, fp);
        }
        let mut changed = false;
        let before = self.files.len();
        self.files.retain(|p, _| seen.contains_key(p));
        changed |= self.files.len() != before;
        for (path, fp) in seen {
            if self.files.get(&path).is_some_and(|(old, _)| *old == fp) {
                continue;
            }
            let name = path.display().to_string();
            // Refused by size before reading: a huge file costs neither memory nor parsing.
            let parsed = if fp.size > MAX_OBJECT_BYTES {
                Err(too_large(&name, fp.size).to_string())
            } else {
                match std::fs::read(&path) {
                    Ok(bytes) => parse_object(&bytes, &name).map_err(|e| e.to_string()),
                    Err(e) => Err(format!("{name}: {e}")),
                }
            };
            if let Err(e) = &parsed {
                tracing::warn!(file = %path.display(), error = %e, "skipping invalid object file");
            }
            self.files.insert(path, (fp, parsed));
            changed = true;
        }
        if changed {
            self.generation += 1;
        }
        Ok(changed)
    }

    fn update(&self) -> Update {
        let mut snapshot = Snapshot::default();
        let mut errors = Vec::new();
        let mut origin: BTreeMap<(bool, String), &Path> = BTreeMap::new();
        for (path, (_, parsed)) in &self.files {
            match parsed {
                Err(e) => errors.push(format!("{}: {e}", path.display())),
                Ok(obj) => {
                    let key = (
                        matches!(obj, Object::Node(_)),
                        obj.name().unwrap_or_default().to_owned(),
                    );
                    if let Some(first) = origin.get(&key) {
                        errors.push(format!(
                            "{}: {} also defined in {}, ignored",
                            path.display(),
                            key.1,
                            first.display()
                        ));
                        continue;
                    }
                    origin.insert(key, path);
                    match obj {
                        Object::Node(n) => {
                            snapshot
                                .nodes
                                .insert(obj.name().unwrap_or_default().to_owned(), (**n).clone());
                        }
                        Object::Peer(p) => {
                            snapshot
                                .peers
                                .insert(obj.name().unwrap_or_default().to_owned(), (**p).clone());
                        }
                    }
                }
            }
        }
        snapshot.kg_nodes = crate::mesh::annotations::kg_nodes(&snapshot.nodes);
        Update {
            last_seen: Arc::new(super::last_seen_of(&snapshot.nodes)),
            snapshot: Arc::new(snapshot),
            errors,
            generation: self.generation,
            connected: true,
        }
    }

    fn node_file(&self, node: &str) -> Option<PathBuf> {
        self.files.iter().find_map(|(p, (_, parsed))| match parsed {
            Ok(Object::Node(n)) if n.metadata.name.as_deref() == Some(node) => Some(p.clone()),
            _ => None,
        })
    }
}

/// The file backend. Dropping it stops the watcher.
pub struct FileBackend {
    dir: PathBuf,
    cache: Arc<Mutex<Cache>>,
    rx: watch::Receiver<Update>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FileBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FileBackend {
    /// Reads `dir` once and starts watching it. Must be called inside a tokio runtime.
    pub fn start(dir: impl Into<PathBuf>) -> Result<Self, BackendError> {
        let dir = dir.into();
        let mut cache = Cache::default();
        cache.rescan(&dir)?;
        cache.generation = cache.generation.max(1); // the initial scan is a complete view
        let (tx, rx) = watch::channel(cache.update());
        let cache = Arc::new(Mutex::new(cache));
        let (etx, erx) = mpsc::unbounded_channel::<()>();
        let mut watcher =
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
                Ok(ev) if matches!(ev.kind, EventKind::Access(a) if a != AccessKind::Close(notify::event::AccessMode::Write)) => {}
                Ok(_) => {
                    let _ = etx.send(());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "file backend watch error; rescanning");
                    let _ = etx.send(());
                }
            })
            .map_err(|e| BackendError::Watch {
                path: dir.display().to_string(),
                message: e.to_string(),
            })?;
        watch_dir(&mut watcher, &dir)?;
        let task = tokio::spawn(run(dir.clone(), cache.clone(), erx, tx, watcher));
        Ok(FileBackend {
            dir,
            cache,
            rx,
            task,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn watch_dir(watcher: &mut notify::RecommendedWatcher, dir: &Path) -> Result<(), BackendError> {
    watcher
        .watch(dir, RecursiveMode::NonRecursive)
        .map_err(|e| BackendError::Watch {
            path: dir.display().to_string(),
            message: e.to_string(),
        })
}

async fn run(
    dir: PathBuf,
    cache: Arc<Mutex<Cache>>,
    mut events: mpsc::UnboundedReceiver<()>,
    tx: watch::Sender<Update>,
    mut watcher: notify::RecommendedWatcher,
) {
    let mut connected = true;
    loop {
        if connected {
            if events.recv().await.is_none() {
                return;
            }
        } else {
            if let Ok(None) = tokio::time::timeout(RETRY, events.recv()).await {
                return;
            }
            // The directory may be a new one (removed and made again): watch it afresh.
            let _ = watcher.unwatch(&dir);
            if let Err(e) = watch_dir(&mut watcher, &dir) {
                tracing::debug!(error = %e, "file backend still disconnected");
                continue;
            }
        }
        // Coalesce: wait until the directory is quiet, or MAX_DELAY at most.
        let deadline = tokio::time::Instant::now() + MAX_DELAY;
        loop {
            let quiet = tokio::time::Instant::now() + QUIET;
            match tokio::time::timeout_at(quiet.min(deadline), events.recv()).await {
                Ok(Some(())) if tokio::time::Instant::now() < deadline => continue,
                Ok(None) => return,
                _ => break,
            }
        }
        let update = {
            let mut c = cache.lock().expect("cache lock");
            // Rescanned even when this rescan finds nothing new: `publish` rescans too, and may
            // have read a change first.
            match c.rescan(&dir) {
                Ok(_) => {
                    if !connected {
                        tracing::info!(dir = %dir.display(), "file backend reading again");
                    }
                    connected = true;
                    Some(c.update())
                }
                Err(e) => {
                    if connected {
                        tracing::warn!(error = %e, "file backend disconnected: cannot read the directory");
                    }
                    connected = false;
                    None
                }
            }
        };
        tx.send_if_modified(|last| match update {
            // A heartbeat-only rewrite (kilo.squat.ai/last-seen and kg's copy) costs no plan: only the
            // heartbeats change, under the same generation.
            Some(u)
                if u.errors == last.errors
                    && !super::snapshot_changed(&last.snapshot, &u.snapshot) =>
            {
                super::refresh(last, (*u.last_seen).clone(), true)
            }
            Some(u) => {
                tracing::debug!(
                    generation = u.generation,
                    nodes = u.snapshot.nodes.len(),
                    peers = u.snapshot.peers.len(),
                    "file backend update"
                );
                *last = u;
                true
            }
            None => super::refresh(last, (*last.last_seen).clone(), false),
        });
        if tx.is_closed() {
            return;
        }
    }
}

/// Rewrites (or creates) the node's file with the annotations applied; atomic by rename.
fn publish_file(
    dir: &Path,
    existing: Option<PathBuf>,
    node: &str,
    changes: &Annotations,
) -> Result<bool, BackendError> {
    let path = existing.unwrap_or_else(|| dir.join(format!("{node}.yaml")));
    let io = |source| BackendError::Io {
        path: path.display().to_string(),
        source,
    };
    let parse = |message: String| BackendError::Parse {
        path: path.display().to_string(),
        message,
    };
    let json = path.extension().and_then(|e| e.to_str()) == Some("json");
    let mut value: serde_json::Value = match std::fs::read_to_string(&path) {
        Ok(text) => serde_yaml::from_str(&text).map_err(|e| parse(e.to_string()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": { "name": node },
        }),
        Err(e) => return Err(io(e)),
    };
    let metadata = value
        .as_object_mut()
        .ok_or_else(|| parse("not a mapping".into()))?
        .entry("metadata")
        .or_insert_with(|| serde_json::json!({}));
    let metadata = metadata
        .as_object_mut()
        .ok_or_else(|| parse("field metadata: not a mapping".into()))?;
    let mut current: BTreeMap<String, String> = match metadata.get("annotations") {
        None | Some(serde_json::Value::Null) => BTreeMap::new(),
        Some(a) => serde_json::from_value(a.clone())
            .map_err(|e| parse(format!("field metadata.annotations: {e}")))?,
    };
    let created = !path.exists();
    if !apply_annotations(&mut current, changes) && !created {
        return Ok(false);
    }
    metadata.insert(
        "annotations".into(),
        serde_json::to_value(&current).expect("string map"),
    );
    let text = if json {
        serde_json::to_string_pretty(&value).expect("json value") + "\n"
    } else {
        serde_yaml::to_string(&value).map_err(|e| parse(e.to_string()))?
    };
    crate::files::replace(&path, text.as_bytes(), crate::files::Mode::Default, false)
        .map_err(io)?;
    Ok(true)
}

impl Backend for FileBackend {
    fn updates(&self) -> watch::Receiver<Update> {
        self.rx.clone()
    }

    fn publish<'a>(
        &'a self,
        node: &'a str,
        annotations: &'a Annotations,
    ) -> BoxFuture<'a, Result<bool, BackendError>> {
        async move {
            let existing = {
                let mut c = self.cache.lock().expect("cache lock");
                // Our own file may have changed since the last event was handled.
                let _ = c.rescan(&self.dir);
                c.node_file(node)
            };
            publish_file(&self.dir, existing, node, annotations)
        }
        .boxed()
    }
}

#[cfg(test)]
mod load_dir_tests {
    use super::*;

    #[test]
    fn load_dir_keeps_good_files() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("a.yaml"),
            "apiVersion: v1\nkind: Node\nmetadata: {name: a}\n",
        )
        .unwrap();
        std::fs::write(d.path().join("b.yaml"), "kind: Node\nmetadata: {name: a}\n").unwrap();
        std::fs::write(d.path().join("c.json"), "{").unwrap();
        std::fs::write(d.path().join("README.md"), "not an object").unwrap();
        let (s, errs) = load_dir(d.path());
        assert_eq!(s.nodes.len(), 1);
        assert_eq!(errs.len(), 2, "{errs:?}");
        let (_, errs) = load_dir(&d.path().join("missing"));
        assert_eq!(errs.len(), 1);
    }
}
