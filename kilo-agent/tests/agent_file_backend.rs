//! The file backend: inotify-driven snapshots, bad files reported and skipped, atomic publishing
//! that preserves the rest of the node's file, several agents sharing one directory.
use std::{
    collections::BTreeMap,
    io::Write,
    os::unix::fs::MetadataExt,
    sync::{Arc, Mutex},
    time::Duration,
};

use kilo_agent::backend::{Annotations, Backend, Update, file::FileBackend};
use tokio::sync::watch;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Waits (bounded, for liveness only) until an update satisfies `pred`.
async fn until(
    rx: &mut watch::Receiver<Update>,
    what: &str,
    pred: impl Fn(&Update) -> bool,
) -> Update {
    let wait = async {
        loop {
            {
                let u = rx.borrow_and_update();
                if pred(&u) {
                    return u.clone();
                }
            }
            rx.changed().await.expect("backend stopped");
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .unwrap_or_else(|_| panic!("no update where {what}: last {:?}", rx.borrow().snapshot))
}

fn node(name: &str, annotations: &[(&str, &str)]) -> String {
    let mut s = format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels:\n    topology.kubernetes.io/region: eu\n"
    );
    if !annotations.is_empty() {
        s.push_str("  annotations:\n");
        for (k, v) in annotations {
            s.push_str(&format!("    {k}: \"{v}\"\n"));
        }
    }
    s.push_str("spec:\n  podCIDR: 10.2.1.0/24\n");
    s
}

const PEER: &str = r#"{"apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer", "metadata": {"name": "laptop"},
 "spec": {"allowedIPs": ["10.5.0.1/32"], "publicKey": "a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "persistentKeepalive": 10}}"#;

fn write(path: &std::path::Path, text: &str) {
    // Written in two steps, like an editor would: the backend must coalesce.
    let mut f = std::fs::File::create(path).unwrap();
    let (a, b) = text.split_at(text.len() / 2);
    f.write_all(a.as_bytes()).unwrap();
    f.flush().unwrap();
    f.write_all(b.as_bytes()).unwrap();
}

#[test]
fn files_added_edited_and_removed_update_the_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.yaml"), &node("a", &[]));
    rt().block_on(async {
        let backend = FileBackend::start(dir.path()).unwrap();
        let mut rx = backend.updates();
        let first = rx.borrow_and_update().clone();
        assert_eq!(first.snapshot.nodes.keys().collect::<Vec<_>>(), ["a"]);
        assert!(first.errors.is_empty());

        write(&dir.path().join("laptop.json"), PEER);
        write(&dir.path().join("b.yml"), &node("b", &[]));
        let u = until(&mut rx, "peer and node b appear", |u| {
            u.snapshot.peers.contains_key("laptop") && u.snapshot.nodes.contains_key("b")
        })
        .await;
        assert_eq!(u.snapshot.peers["laptop"].spec.allowed_ips, ["10.5.0.1/32"]);
        assert_eq!(
            u.snapshot.peers["laptop"].spec.persistent_keepalive,
            Some(10)
        );

        write(
            &dir.path().join("a.yaml"),
            &node("a", &[("kilo.squat.ai/location", "berlin")]),
        );
        until(&mut rx, "a's annotation is seen", |u| {
            u.snapshot.nodes["a"]
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("kilo.squat.ai/location"))
                .map(String::as_str)
                == Some("berlin")
        })
        .await;

        std::fs::remove_file(dir.path().join("b.yml")).unwrap();
        let u = until(&mut rx, "b is gone", |u| {
            !u.snapshot.nodes.contains_key("b")
        })
        .await;
        assert!(u.snapshot.nodes.contains_key("a") && u.snapshot.peers.contains_key("laptop"));
        // Files that are not objects are ignored.
        std::fs::write(dir.path().join("README"), "not an object").unwrap();
        std::fs::write(dir.path().join(".hidden.yaml"), "kind: [").unwrap();
        write(&dir.path().join("c.yaml"), &node("c", &[]));
        let u = until(&mut rx, "c appears", |u| u.snapshot.nodes.contains_key("c")).await;
        assert!(u.errors.is_empty(), "{:?}", u.errors);
    });
}

/// Collects formatted log lines.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_bad_file_is_reported_and_the_others_delivered() {
    let logs = Logs::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.yaml"), &node("a", &[]));
    rt().block_on(async {
        let backend = FileBackend::start(dir.path()).unwrap();
        let mut rx = backend.updates();
        std::fs::write(
            dir.path().join("broken.yaml"),
            "kind: Node\nmetadata: [oops",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("badpeer.json"),
            r#"{"kind": "Peer", "metadata": {"name": "x"}, "spec": {"publicKey": 7}}"#,
        )
        .unwrap();
        write(&dir.path().join("laptop.json"), PEER);
        let u = until(&mut rx, "the good peer arrives", |u| {
            u.snapshot.peers.contains_key("laptop") && u.errors.len() == 2
        })
        .await;
        assert!(u.snapshot.nodes.contains_key("a"));
        assert!(!u.snapshot.peers.contains_key("x"));
        assert!(
            u.errors.iter().any(|e| e.contains("broken.yaml")),
            "{:?}",
            u.errors
        );
        assert!(
            u.errors
                .iter()
                .any(|e| e.contains("badpeer.json") && e.contains("Peer")),
            "{:?}",
            u.errors
        );
    });
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("WARN") && text.contains("broken.yaml") && text.contains("badpeer.json"),
        "{text}"
    );
}

fn annotations(pairs: &[(&str, Option<&str>)]) -> Annotations {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
        .collect()
}

#[test]
fn publishing_is_atomic_and_preserves_the_rest_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mine.yaml");
    write(
        &path,
        &node(
            "me",
            &[
                ("kilo.squat.ai/leader", "true"),
                ("kilo.squat.ai/last-seen", "1"),
            ],
        ),
    );
    rt().block_on(async {
        let backend = FileBackend::start(dir.path()).unwrap();
        let mut rx = backend.updates();
        let ino = std::fs::metadata(&path).unwrap().ino();
        let changes = annotations(&[
            (
                "kilo.squat.ai/key",
                Some("a2V5NAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="),
            ),
            ("kilo.squat.ai/endpoint", Some("10.0.0.1:51820")),
            ("kilo.squat.ai/last-seen", None),
        ]);
        assert!(backend.publish("me", &changes).await.unwrap());
        // Rewritten by rename: a new inode, no temporary left behind.
        let meta = std::fs::metadata(&path).unwrap();
        assert_ne!(meta.ino(), ino);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["mine.yaml"]);

        let u = until(&mut rx, "our annotations are seen", |u| {
            u.snapshot.nodes["me"]
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key("kilo.squat.ai/key"))
        })
        .await;
        let n = &u.snapshot.nodes["me"];
        let a = n.metadata.annotations.as_ref().unwrap();
        assert_eq!(a["kilo.squat.ai/endpoint"], "10.0.0.1:51820");
        assert_eq!(a["kilo.squat.ai/leader"], "true");
        assert!(!a.contains_key("kilo.squat.ai/last-seen"));
        assert_eq!(
            n.metadata.labels.as_ref().unwrap()["topology.kubernetes.io/region"],
            "eu"
        );
        assert_eq!(
            n.spec.as_ref().unwrap().pod_cidr.as_deref(),
            Some("10.2.1.0/24")
        );

        // Publishing what is already there writes nothing.
        assert!(!backend.publish("me", &changes).await.unwrap());
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), meta.ino());
    });
}

#[test]
fn agents_sharing_a_directory_each_write_their_own_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("laptop.json"), PEER).unwrap();
    rt().block_on(async {
        let a = FileBackend::start(dir.path()).unwrap();
        let b = FileBackend::start(dir.path()).unwrap();
        let key = |k: &str| annotations(&[("kilo.squat.ai/key", Some(k))]);
        assert!(a.publish("node-a", &key("A")).await.unwrap());
        assert!(b.publish("node-b", &key("B")).await.unwrap());
        for backend in [&a, &b] {
            let mut rx = backend.updates();
            let u = until(&mut rx, "both nodes are seen", |u| {
                u.snapshot.nodes.len() == 2 && u.snapshot.peers.len() == 1
            })
            .await;
            let keys: BTreeMap<&str, &str> = u
                .snapshot
                .nodes
                .iter()
                .map(|(n, o)| {
                    (
                        n.as_str(),
                        o.metadata.annotations.as_ref().unwrap()["kilo.squat.ai/key"].as_str(),
                    )
                })
                .collect();
            assert_eq!(keys, BTreeMap::from([("node-a", "A"), ("node-b", "B")]));
        }
        assert!(dir.path().join("node-a.yaml").exists() && dir.path().join("node-b.yaml").exists());
    });
}

#[test]
fn heartbeat_only_rewrites_update_the_heartbeats_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.yaml");
    write(&path, &node("a", &[("kilo.squat.ai/last-seen", "100")]));
    rt().block_on(async {
        let backend = FileBackend::start(dir.path()).unwrap();
        let mut rx = backend.updates();
        let first = rx.borrow_and_update().clone();
        assert_eq!(first.last_seen.get("a"), Some(&100));
        assert!(first.connected);
        write(&path, &node("a", &[("kilo.squat.ai/last-seen", "130")]));
        let hb = until(&mut rx, "the heartbeat arrives", |u| {
            u.last_seen.get("a") == Some(&130)
        })
        .await;
        assert_eq!(
            hb.generation, first.generation,
            "a heartbeat is no new snapshot"
        );
        assert!(Arc::ptr_eq(&hb.snapshot, &first.snapshot));
        write(&dir.path().join("b.yaml"), &node("b", &[]));
        let u = until(&mut rx, "b is seen", |u| u.snapshot.nodes.contains_key("b")).await;
        assert!(u.generation > first.generation);
        // The stored view has the fresh heartbeat all the same.
        assert_eq!(
            u.snapshot.nodes["a"].metadata.annotations.as_ref().unwrap()["kilo.squat.ai/last-seen"],
            "130"
        );
    });
}

#[test]
fn an_unreadable_directory_is_reported_disconnected_until_it_is_back() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("objects");
    let away = parent.path().join("away");
    std::fs::create_dir(&dir).unwrap();
    write(
        &dir.join("a.yaml"),
        &node("a", &[("kilo.squat.ai/last-seen", "100")]),
    );
    rt().block_on(async {
        let backend = FileBackend::start(&dir).unwrap();
        let mut rx = backend.updates();
        let first = rx.borrow_and_update().clone();
        std::fs::rename(&dir, &away).unwrap();
        let lost = until(&mut rx, "disconnected", |u| !u.connected).await;
        assert_eq!(lost.generation, first.generation);
        assert_eq!(lost.snapshot.nodes.len(), 1, "the view is kept");
        // Removed and made again (a new inode): watched afresh, read again.
        std::fs::remove_dir_all(&away).unwrap();
        std::fs::create_dir(&dir).unwrap();
        write(
            &dir.join("a.yaml"),
            &node("a", &[("kilo.squat.ai/last-seen", "160")]),
        );
        let back = until(&mut rx, "connected again", |u| u.connected).await;
        assert_eq!(back.last_seen.get("a"), Some(&160));
        write(&dir.join("b.yaml"), &node("b", &[]));
        until(&mut rx, "b is seen through the new watch", |u| {
            u.snapshot.nodes.contains_key("b")
        })
        .await;
    });
}
