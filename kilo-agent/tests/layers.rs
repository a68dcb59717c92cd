//! Pure tier: the crate's module files import one another in one direction. No two files import
//! each other, directly or around a circle (a module's own `mod.rs` declaring and re-exporting
//! its children does not count), and the pure core flows one way: `mesh` imports neither
//! `topology` nor `plan`, `topology` does not import `plan`, and none of the three imports the
//! reconcilers, the datapath or the agent. Test modules are left out: a test may reach across.
//! The test files show which tests need root: those that call `require_root` are the
//! `*_privileged.rs` ones, and every one of those does.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// A test that needs root is in a `tests/*_privileged.rs` file, and such a file has no other.
#[test]
fn root_only_tests_live_in_privileged_files() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut misplaced = Vec::new();
    for entry in std::fs::read_dir(&tests).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with(".rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let tests = text.matches("#[test]").count() + text.matches("#[tokio::test]").count();
        // Spelt in two so that this file does not count as a caller.
        let root = text
            .matches(["require", "_root("].concat().as_str())
            .count();
        let privileged = name.ends_with("_privileged.rs");
        if privileged != (root > 0) || (privileged && root < tests) {
            misplaced.push(format!("{name}: {root} of {tests} tests need root"));
        }
    }
    assert!(misplaced.is_empty(), "{misplaced:#?}");
}

/// A module by its path under `src/` (`["datapath", "load"]`); the crate root is empty.
type Module = Vec<String>;

#[test]
fn module_files_import_in_one_direction() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = module_files(&src);
    let edges: BTreeMap<Module, BTreeSet<Module>> = files
        .iter()
        .map(|(module, path)| {
            let text = std::fs::read_to_string(path).unwrap();
            (
                module.clone(),
                imports(module, &without_tests(&text), &files),
            )
        })
        .collect();
    let circles = circles(&edges);
    assert!(
        circles.is_empty(),
        "module files importing each other: {circles:#?}"
    );
    // The pure core's order.
    let forbidden = [
        ("mesh", &["topology", "plan"][..]),
        ("topology", &["plan"][..]),
        ("mesh", &["reconcile", "datapath", "agent", "backend"][..]),
        (
            "topology",
            &["reconcile", "datapath", "agent", "backend"][..],
        ),
        ("plan", &["reconcile", "datapath", "agent", "backend"][..]),
    ];
    let mut wrong = Vec::new();
    for (from, to) in &edges {
        for target in to {
            for (layer, not) in &forbidden {
                if from.first().map(String::as_str) == Some(layer)
                    && target.first().is_some_and(|t| not.contains(&t.as_str()))
                {
                    wrong.push(format!("{} -> {}", from.join("/"), target.join("/")));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the data flow: {wrong:#?}"
    );
    // The check sees imports at all (a parser that found none would pass everything).
    assert!(edges[&module(&["datapath", "load"])].contains(&module(&["datapath", "attach"])));
}

fn module(parts: &[&str]) -> Module {
    parts.iter().map(ToString::to_string).collect()
}

/// Every module file under `src` but the binaries and test modules, by module path.
fn module_files(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Module = rel.iter().map(|p| p.to_string_lossy().into()).collect();
            let last = parts.last().cloned().unwrap_or_default();
            if parts[0] == "bin"
                || path.extension().is_none_or(|e| e != "rs")
                || last == "tests"
                || last.ends_with("_tests")
                || parts.iter().any(|p| p == "tests")
            {
                continue;
            }
            if last == "mod" || last == "lib" {
                parts.pop();
            }
            out.insert(parts, path);
        }
    }
    out
}

/// `text` without its `#[cfg(test)]` items (a test module inline, or its declaration).
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        // The item ends at `;` (a declaration) or at its block's closing brace.
        let (semi, brace) = (after.find(';'), after.find('{'));
        let end = match (semi, brace) {
            (Some(s), Some(b)) if s < b => s + 1,
            (_, Some(b)) => {
                let mut depth = 0;
                let mut end = after.len();
                for (i, c) in after[b..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = b + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (Some(s), None) => s + 1,
            (None, None) => after.len(),
        };
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The module files `module` imports: every `crate::`, `super::` and child path in its `use`
/// trees and its code, resolved to the deepest module file it names. Edges to the module's own
/// ancestors and descendants are left out.
fn imports(module: &Module, text: &str, files: &BTreeMap<Module, PathBuf>) -> BTreeSet<Module> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut paths = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 4..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let end = rest.find(';').unwrap_or(rest.len());
        use_tree(&rest[..end], Vec::new(), &mut paths);
    }
    for word in ["crate::", "super::"] {
        for (at, _) in code.match_indices(word) {
            let path: String = code[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            paths.push(path.split("::").map(String::from).collect());
        }
    }
    paths
        .iter()
        .filter_map(|p| resolve(module, p, files))
        .filter(|t| !t.starts_with(module) && !module.starts_with(t))
        .collect()
}

/// Flattens a `use` tree (`a::{b, c::d}`) into its paths.
fn use_tree(tree: &str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let mut base = prefix;
        base.extend(
            tree[..open]
                .split("::")
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
        );
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    use_tree(&inner[start..i], base.clone(), out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        use_tree(&inner[start..], base, out);
    } else if !tree.is_empty() {
        let mut path = prefix;
        let tree = tree.split(" as ").next().unwrap_or(tree);
        path.extend(tree.split("::").map(|s| s.trim().to_string()));
        out.push(path);
    }
}

/// The deepest module file `path` (as written in `module`) names, if it is one of ours.
fn resolve(module: &Module, path: &[String], files: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    let (mut at, rest): (Module, &[String]) = match path.first().map(String::as_str) {
        Some("crate") => (Vec::new(), &path[1..]),
        Some("super") => {
            let mut at = module.clone();
            at.pop();
            let mut rest = &path[1..];
            while rest.first().map(String::as_str) == Some("super") {
                at.pop();
                rest = &rest[1..];
            }
            (at, rest)
        }
        Some("self") => (module.clone(), &path[1..]),
        Some(first) => {
            let mut child = module.clone();
            child.push(first.to_string());
            if !files.contains_key(&child) {
                return None;
            }
            (module.clone(), path)
        }
        None => return None,
    };
    let mut found = files.contains_key(&at).then(|| at.clone());
    for part in rest {
        at.push(part.clone());
        if files.contains_key(&at) {
            found = Some(at.clone());
        } else {
            break;
        }
    }
    found
}

/// The circles among the edges (Tarjan's strongly connected components of more than one file).
fn circles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on_stack: BTreeSet<&'a Module>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a Module) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.edges.get(v).into_iter().flatten() {
            let Some((w, _)) = s.edges.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.join("/"));
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}
