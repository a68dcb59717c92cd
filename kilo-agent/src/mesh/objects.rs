//! Kubernetes-shaped objects as files hold them: one Node or Peer per file, YAML or JSON, or a
//! stream of them. Pure: the file backend reads the files.
use super::{KubeNode, ObjectError, ObjectKind, Peer, Snapshot};

/// One parsed object.
#[derive(Debug, Clone)]
pub enum Object {
    Node(Box<KubeNode>),
    Peer(Box<Peer>),
}

impl Object {
    pub fn name(&self) -> Option<&str> {
        match self {
            Object::Node(n) => n.metadata.name.as_deref(),
            Object::Peer(p) => p.metadata.name.as_deref(),
        }
    }
}

/// An error about the file at `path` (unreadable, unparsable, not a Node or Peer).
pub fn file_err(path: &str, field: &str, problem: impl Into<String>) -> ObjectError {
    ObjectError::new(ObjectKind::File, path, field, problem)
}

/// The largest object file read: 1 MiB (etcd refuses objects above 1.5 MiB; a Peer with
/// 10,000 allowed IPs takes about 200 KB).
pub const MAX_OBJECT_BYTES: u64 = 1 << 20;

/// The error for a file of `size` bytes above [`MAX_OBJECT_BYTES`].
pub fn too_large(path: &str, size: u64) -> ObjectError {
    file_err(
        path,
        "size",
        format!("{size} bytes, more than the {MAX_OBJECT_BYTES} an object file may hold; not read"),
    )
}

/// Parses one object (YAML or JSON; JSON is YAML) of kind `Node` or `Peer`.
pub fn parse_object(bytes: &[u8], path: &str) -> Result<Object, ObjectError> {
    if bytes.len() as u64 > MAX_OBJECT_BYTES {
        return Err(too_large(path, bytes.len() as u64));
    }
    let value: serde_yaml::Value = serde_yaml::from_slice(bytes).map_err(|e| not_yaml(path, e))?;
    object(value, path)
}

fn not_yaml(path: &str, e: serde_yaml::Error) -> ObjectError {
    file_err(path, "content", format!("not YAML or JSON: {e}"))
}

/// The object a parsed document describes.
fn object(value: serde_yaml::Value, path: &str) -> Result<Object, ObjectError> {
    let kind = value
        .get("kind")
        .and_then(|k| k.as_str())
        .ok_or_else(|| file_err(path, "kind", "missing"))?
        .to_string();
    let api = value
        .get("apiVersion")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    let obj = match kind.as_str() {
        "Node" => {
            if !api.is_empty() && api != "v1" {
                return Err(file_err(path, "apiVersion", format!("{api:?} is not v1")));
            }
            Object::Node(Box::new(serde_yaml::from_value(value).map_err(|e| {
                file_err(path, "content", format!("not a Node: {e}"))
            })?))
        }
        "Peer" => {
            if !api.is_empty() && api != "kilo.squat.ai/v1alpha1" {
                return Err(file_err(
                    path,
                    "apiVersion",
                    format!("{api:?} is not kilo.squat.ai/v1alpha1"),
                ));
            }
            Object::Peer(Box::new(serde_yaml::from_value(value).map_err(|e| {
                file_err(path, "content", format!("not a Peer: {e}"))
            })?))
        }
        other => {
            return Err(file_err(
                path,
                "kind",
                format!("{other:?} is neither Node nor Peer"),
            ));
        }
    };
    match obj.name() {
        Some(n) if !n.is_empty() => Ok(obj),
        _ => Err(file_err(path, "metadata.name", "missing")),
    }
}

/// Adds a parsed object to a snapshot; a second object with the same kind and name is an error.
pub fn insert(snapshot: &mut Snapshot, obj: Object, path: &str) -> Result<(), ObjectError> {
    let name = obj.name().unwrap_or_default().to_string();
    let dup = match obj {
        Object::Node(n) => snapshot.nodes.insert(name.clone(), *n).is_some(),
        Object::Peer(p) => snapshot.peers.insert(name.clone(), *p).is_some(),
    };
    if dup {
        return Err(file_err(
            path,
            "metadata.name",
            format!("{name:?} is defined twice; this file wins"),
        ));
    }
    Ok(())
}

/// Parses a YAML stream of several objects (documents separated by `---` lines, as `kubectl get
/// -o yaml` lists or Kilo's test fixture write them); documents without a `kind` (comments only)
/// are skipped. An error names the document by its index in the stream: `ORIGIN#N`.
pub fn parse_stream(text: &str, origin: &str) -> Result<Snapshot, ObjectError> {
    use serde::Deserialize as _;
    let mut snapshot = Snapshot::default();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let path = format!("{origin}#{i}");
        let value = serde_yaml::Value::deserialize(doc).map_err(|e| not_yaml(&path, e))?;
        if value.get("kind").is_some() {
            insert(&mut snapshot, object(value, &path)?, &path)?;
        }
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json() {
        let y = b"apiVersion: v1\nkind: Node\nmetadata:\n  name: a\n  annotations:\n    kilo.squat.ai/location: \"1\"\nspec:\n  podCIDR: 10.2.1.0/24\n";
        assert!(matches!(
            parse_object(y, "a.yaml").unwrap(),
            Object::Node(_)
        ));
        let j = br#"{"apiVersion":"kilo.squat.ai/v1alpha1","kind":"Peer","metadata":{"name":"p"},"spec":{"allowedIPs":["10.5.0.1/32"],"publicKey":"x"}}"#;
        assert!(matches!(
            parse_object(j, "p.json").unwrap(),
            Object::Peer(_)
        ));
    }

    #[test]
    fn bad_files_are_errors() {
        for (b, field) in [
            (&b"{"[..], "content"),
            (b"kind: Pod\nmetadata: {name: x}\n", "kind"),
            (
                b"apiVersion: v1\nkind: Node\nmetadata: {}\n",
                "metadata.name",
            ),
            (
                b"apiVersion: v2\nkind: Node\nmetadata: {name: a}\n",
                "apiVersion",
            ),
            (b"metadata: {name: a}\n", "kind"),
        ] {
            let e = parse_object(b, "f.yaml").unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().starts_with("file \"f.yaml\": "));
        }
    }

    #[test]
    fn a_stream_is_read_document_by_document() {
        let node = |name: &str| format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {name}}}\n");
        let peer =
            "kind: Peer\nmetadata: {name: p}\nspec: {allowedIPs: [10.5.0.1/32], publicKey: x}\n";
        // A leading `---`, a comment-only document, a separator inside a block scalar.
        let text = format!(
            "---\n{}---\n# nothing\n---\n{peer}---\napiVersion: v1\nkind: Node\nmetadata:\n  \
             name: b\n  annotations:\n    text: |\n      a\n      ---\n      b\n",
            node("a"),
        );
        let s = parse_stream(&text, "s.yaml").unwrap();
        assert_eq!(s.nodes.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(s.peers.len(), 1);
        let note = &s.nodes["b"].metadata.annotations.as_ref().unwrap()["text"];
        assert_eq!(note, "a\n---\nb\n");
        // Errors name the document and the field.
        for (text, path, field) in [
            (
                format!("{}---\nkind: Pod\nmetadata: {{name: x}}\n", node("a")),
                "s.yaml#1",
                "kind",
            ),
            (
                format!("{}---\n{}", node("a"), node("a")),
                "s.yaml#1",
                "metadata.name",
            ),
            (
                format!("{}---\nkind: Node\nmetadata: {{}}\n", node("a")),
                "s.yaml#1",
                "metadata.name",
            ),
            (
                format!("{}---\n{peer}---\nkind: [\n", node("a")),
                "s.yaml#2",
                "content",
            ),
        ] {
            let e = parse_stream(&text, "s.yaml").unwrap_err();
            assert_eq!(e.field, field, "{e}");
            let named = format!("file \"{path}\": ");
            assert!(e.to_string().starts_with(&named), "{e}");
        }
    }
}
