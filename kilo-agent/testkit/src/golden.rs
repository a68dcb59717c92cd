//! Kilo's fixture and golden outputs (`kilo-agent/tests/data/kilo/`), read the way the golden
//! tests compare them: the fixture's objects, the goldens' settings, a golden's sections, and
//! Go's quoting as Kilo's tables print it.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use ipnet::IpNet;
use kilo_agent::{
    mesh::{self, Granularity, objects},
    plan::{self, KeepaliveSource, Settings},
    topology::Topology,
};

/// The fixture's `last-seen` (unix seconds) and the planners' clock.
pub const NOW: i64 = 1_700_000_000;

/// A private key for the plans (never printed by Kilo's goldens).
pub const PRIV: &str = "cHJpdgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// The fixture's nodes, and the granularities of Kilo's goldens.
pub const HOSTS: [&str; 4] = ["a", "b", "c", "d"];

pub const GRANULARITIES: [Granularity; 2] = [Granularity::Location, Granularity::Full];

/// A file of `tests/data/kilo/` (Kilo's fixture and its outputs).
pub fn data(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/kilo")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The fixture's objects, with `last-seen: NOW` set to [`NOW`].
pub fn fixture() -> mesh::Snapshot {
    let text = data("fixture.yaml").replace("\"NOW\"", &format!("\"{NOW}\""));
    let snap = objects::parse_stream(&text, "fixture.yaml").unwrap();
    assert_eq!((snap.nodes.len(), snap.peers.len()), (4, 2));
    snap
}

/// The goldens' settings: Kilo's test service CIDR, no keepalive, the clock at [`NOW`].
pub fn settings(g: Granularity, host: &str) -> Settings {
    Settings {
        hostname: host.into(),
        granularity: g,
        service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
        persistent_keepalive: KeepaliveSource::Fixed(0),
        now: Some(NOW),
        ..Settings::default()
    }
}

/// The golden file of a granularity and host.
pub fn golden_name(g: Granularity, host: &str) -> String {
    format!("{g}-from-{host}.txt")
}

/// The lines after the header starting with `header`, up to the next `## ` header, with one
/// trailing newline.
pub fn section(text: &str, header: &str) -> String {
    let start = text
        .find(&format!("\n{header}"))
        .unwrap_or_else(|| panic!("no section {header:?}"))
        + 1;
    let body_start = start + text[start..].find('\n').unwrap() + 1;
    let end = text[body_start..]
        .find("\n## ")
        .map_or(text.len(), |e| body_start + e + 1);
    let mut s = text[body_start..end].trim_end_matches('\n').to_string();
    s.push('\n');
    s
}

/// The first line starting with `header`.
pub fn header_line(text: &str, header: &str) -> String {
    text.lines()
        .find(|l| l.starts_with(header))
        .unwrap()
        .to_string()
}

/// Every golden file: granularity, host and the file's text.
pub fn each_golden() -> impl Iterator<Item = (Granularity, &'static str, String)> {
    GRANULARITIES.into_iter().flat_map(|g| {
        HOSTS
            .into_iter()
            .map(move |h| (g, h, data(&golden_name(g, h))))
    })
}

/// Every golden file with our topology for its granularity and host.
pub fn each_case() -> impl Iterator<Item = (Granularity, &'static str, String, Topology)> {
    let snap = fixture();
    each_golden().map(move |(g, h, text)| {
        let planned = plan::plan_for(&snap, &settings(g, h));
        assert!(planned.errors.is_empty(), "{:?}", planned.errors);
        let t = planned.topology.expect("local node is ready");
        (g, h, text, t)
    })
}

/// The plan for `s`, which must have one.
pub fn plan_of(snap: &mesh::Snapshot, s: &Settings) -> plan::Plan {
    plan::plan_for(snap, s).plan.expect("local node is ready")
}

/// The CIDRs of a map.
pub fn keys<V>(m: &BTreeMap<IpNet, V>) -> BTreeSet<IpNet> {
    m.keys().copied().collect()
}

/// A Go `%q` string at the start of `s` (after optional spaces): its value and the rest.
pub fn go_unquote(s: &str) -> (String, &str) {
    let s = s.trim_start();
    let mut chars = s.char_indices();
    assert_eq!(chars.next(), Some((0, '"')), "not a quoted string: {s}");
    let mut out = String::new();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return (out, &s[i + 1..]),
            '\\' => match chars.next().unwrap().1 {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                e @ ('"' | '\\') => out.push(e),
                e => panic!("escape \\{e} in {s}"),
            },
            c => out.push(c),
        }
    }
    panic!("unterminated: {s}")
}

/// Go's `%q`, for the strings of the table.
pub fn go_quote(s: &str) -> String {
    format!("{s:?}")
}

/// Sets (or, with `None`, removes) an annotation of a fixture node.
pub fn set_annotation(snap: &mut mesh::Snapshot, node: &str, key: &str, value: Option<&str>) {
    let ann = snap
        .nodes
        .get_mut(node)
        .unwrap()
        .metadata
        .annotations
        .as_mut()
        .unwrap();
    match value {
        Some(v) => ann.insert(key.into(), v.into()),
        None => ann.remove(key),
    };
}

/// Go's `time.Duration` text for whole seconds.
pub fn go_duration(secs: u64) -> String {
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}
