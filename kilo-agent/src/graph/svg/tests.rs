//! The SVG against the DOT it draws: boxes hold their nodes, nothing overlaps, the canvas fits.
use rstest::rstest;

use super::*;
use crate::{
    graph::render_dot,
    mesh::{self, Granularity, objects},
    topology::{self, Topology},
};

/// Seven nodes in three locations (3, 2 and 2 nodes) and three peers, as objects.
const LOCATIONS: [(&str, &[&str]); 3] = [
    ("eu-west", &["berlin-1", "berlin-2", "paris-1"]),
    ("us-east", &["nyc-1", "nyc-2"]),
    ("ap-south", &["mumbai-1", "mumbai-2"]),
];
const PEER_NAMES: [&str; 3] = ["laptop", "phone", "ci-runner"];

/// The mesh's DOT graph, seen from the last node (as `kgctl graph` sees it).
fn mesh_dot(granularity: Granularity) -> String {
    let key = |i: usize| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode([i as u8 + 1; 32])
    };
    let mut yaml = String::new();
    let mut i = 0;
    for (location, nodes) in LOCATIONS {
        for name in nodes {
            i += 1;
            yaml += &format!(
                "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  annotations:\n    \
                 kilo.squat.ai/endpoint: 203.0.113.{i}:51820\n    \
                 kilo.squat.ai/internal-ip: 10.0.{i}.1/24\n    \
                 kilo.squat.ai/location: {location}\n    kilo.squat.ai/key: {}\n\
                 spec:\n  podCIDR: 10.2.{i}.0/24\n",
                key(i)
            );
        }
    }
    for (j, name) in PEER_NAMES.iter().enumerate() {
        yaml += &format!(
            "---\napiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: {name}\n\
             spec:\n  allowedIPs: [10.5.0.{}/32]\n  publicKey: {}\n  \
             endpoint: {{dnsOrIP: {{ip: 198.51.100.{}}}, port: 51820}}\n",
            j + 1,
            key(100 + j),
            j + 1
        );
    }
    let snapshot = objects::parse_stream(&yaml, "mesh.yaml").unwrap();
    let parsed = mesh::parse_snapshot(&snapshot, mesh::DEFAULT_TOPOLOGY_LABEL);
    let options = topology::Options {
        granularity,
        hostname: parsed.nodes.keys().next_back().unwrap().clone(),
        port: 51820,
        subnet: "10.4.0.0/16".parse().unwrap(),
        service_cidrs: Vec::new(),
        persistent_keepalive: 0,
        kg_nodes: Default::default(),
    };
    render_dot(&Topology::new(&parsed.nodes, &parsed.peers, &options).unwrap())
}

/// The DOT's subgraphs and the nodes in each, read from `render_dot`'s lines.
fn subgraphs(dot: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for line in dot.lines() {
        if let Some(name) = line.strip_prefix("\tsubgraph \"") {
            out.push((name.trim_end_matches("\" {").into(), Vec::new()));
        } else if let (Some(last), Some(node)) = (out.last_mut(), line.strip_prefix("\t\"")) {
            last.1.push(node.split('"').next().unwrap().into());
        }
    }
    out
}

/// x0, y0, x1, y1
type Extent = [f64; 4];

fn num(n: roxmltree::Node, a: &str) -> f64 {
    n.attribute(a).unwrap().parse().unwrap()
}

fn title<'a>(n: roxmltree::Node<'a, '_>) -> &'a str {
    n.children()
        .find(|c| c.has_tag_name("title"))
        .and_then(|t| t.text())
        .unwrap_or("")
}

/// The extent of the shape of the group (node or cluster) titled `name`.
fn shape(doc: &roxmltree::Document, class: &str, name: &str) -> Extent {
    let g = doc
        .descendants()
        .find(|n| n.attribute("class") == Some(class) && title(*n) == name)
        .unwrap_or_else(|| panic!("no {class} {name}"));
    extent(
        g.children()
            .find(|c| c.is_element() && !c.has_tag_name("title"))
            .unwrap(),
    )
}

fn extent(n: roxmltree::Node) -> Extent {
    match n.tag_name().name() {
        "ellipse" => {
            let (x, y, rx, ry) = (num(n, "cx"), num(n, "cy"), num(n, "rx"), num(n, "ry"));
            [x - rx, y - ry, x + rx, y + ry]
        }
        "rect" => {
            let (x, y) = (num(n, "x"), num(n, "y"));
            [x, y, x + num(n, "width"), y + num(n, "height")]
        }
        // A line (M p L q) or a quadratic curve (M p Q c q), sampled.
        "path" => {
            let d = n.attribute("d").unwrap();
            let v: Vec<f64> = d
                .split(|c: char| c.is_ascii_alphabetic() || c == ' ' || c == ',')
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap())
                .collect();
            let (p, q) = ((v[0], v[1]), (v[v.len() - 2], v[v.len() - 1]));
            let c = if v.len() == 6 { (v[2], v[3]) } else { p };
            (0..=64)
                .map(|i| {
                    let t = f64::from(i) / 64.0;
                    let at = |a: f64, b: f64, c: f64| {
                        (1.0 - t) * (1.0 - t) * a + 2.0 * t * (1.0 - t) * b + t * t * c
                    };
                    (at(p.0, c.0, q.0), at(p.1, c.1, q.1))
                })
                .fold([f64::MAX, f64::MAX, f64::MIN, f64::MIN], |e, (x, y)| {
                    [e[0].min(x), e[1].min(y), e[2].max(x), e[3].max(y)]
                })
        }
        other => panic!("unexpected shape {other}"),
    }
}

fn inside(inner: Extent, outer: Extent) -> bool {
    inner[0] >= outer[0] && inner[1] >= outer[1] && inner[2] <= outer[2] && inner[3] <= outer[3]
}

fn overlap(a: Extent, b: Extent) -> bool {
    a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3]
}

/// Each location is a box holding its nodes, with its leader on top; the boxes do not overlap;
/// the peers are in their box, outside the locations' boxes, above them; the canvas is at most
/// 10% larger than the drawing. (In `full` and `cross`, Kilo's boxes are per segment.)
#[rstest]
#[case::location(Granularity::Location, 3)]
#[case::full(Granularity::Full, 7)]
#[case::cross(Granularity::Cross, 3)]
fn locations_are_boxes_around_their_nodes(
    #[case] granularity: Granularity,
    #[case] locations: usize,
) {
    let dot = mesh_dot(granularity);
    let svg = render_svg(&dot).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("{e}: {svg}"));
    let (peers, clusters): (Vec<_>, Vec<_>) = subgraphs(&dot)
        .into_iter()
        .partition(|(name, _)| name == PEERS);
    assert_eq!(clusters.len(), locations, "{dot}");
    assert_eq!(peers[0].1.len(), PEER_NAMES.len(), "{dot}");
    let mut boxes = Vec::new();
    for (name, nodes) in &clusters {
        let frame = shape(&doc, "cluster", name);
        let tops: Vec<(f64, &str)> = nodes
            .iter()
            .map(|n| {
                let e = shape(&doc, "node", n);
                assert!(inside(e, frame), "{n} {e:?} outside {name} {frame:?}");
                (e[1], n.as_str())
            })
            .collect();
        // The leader (the node whose label has its WireGuard IP) is the top node.
        let leader = doc.descendants().find(|n| {
            n.attribute("class") == Some("node")
                && nodes.iter().any(|m| m == title(*n))
                && n.descendants()
                    .any(|t| t.text().is_some_and(|t| t.starts_with("10.4.")))
        });
        let leader = shape(&doc, "node", title(leader.unwrap()));
        assert!(
            tops.iter().all(|&(top, _)| top >= leader[1]),
            "{name}: {tops:?}"
        );
        boxes.push(frame);
    }
    for (i, a) in boxes.iter().enumerate() {
        for b in &boxes[i + 1..] {
            assert!(!overlap(*a, *b), "{a:?} overlaps {b:?}");
        }
    }
    let peer_box = shape(&doc, "cluster", PEERS);
    for peer in PEER_NAMES {
        let p = shape(&doc, "node", peer);
        assert!(inside(p, peer_box), "{peer}");
        assert!(
            boxes.iter().all(|b| !overlap(p, *b) && p[3] < b[1]),
            "{peer}"
        );
    }
    // Everything drawn (nodes, boxes, edges), against the canvas.
    let drawn = doc
        .descendants()
        .filter(|n| matches!(n.attribute("class"), Some("node" | "cluster" | "edge")))
        .flat_map(|g| {
            g.children()
                .filter(|c| c.is_element() && !c.has_tag_name("title"))
        })
        .filter(|c| !c.has_tag_name("text"))
        .map(extent)
        .chain(
            doc.descendants()
                .filter(|n| n.attribute("class") == Some("graph-label"))
                .map(|t| {
                    let (x, y) = (num(t, "x"), num(t, "y"));
                    [x, y - num(t, "font-size"), x, y]
                }),
        )
        .fold([f64::MAX, f64::MAX, f64::MIN, f64::MIN], |a, b| {
            [
                a[0].min(b[0]),
                a[1].min(b[1]),
                a[2].max(b[2]),
                a[3].max(b[3]),
            ]
        });
    let root = doc.root_element();
    let (w, h) = (num(root, "width"), num(root, "height"));
    let view: Vec<f64> = root
        .attribute("viewBox")
        .unwrap()
        .split(' ')
        .map(|v| v.parse().unwrap())
        .collect();
    assert!(
        (view[2] - w).abs() < 1.0 && (view[3] - h).abs() < 1.0,
        "{view:?} {w} {h}"
    );
    assert!(
        inside(drawn, [0.0, 0.0, view[2], view[3]]),
        "{drawn:?} {view:?}"
    );
    let (dw, dh) = (drawn[2] - drawn[0], drawn[3] - drawn[1]);
    assert!(
        w <= 1.1 * dw && h <= 1.1 * dh,
        "canvas {w}x{h}, drawing {dw}x{dh}"
    );
}

#[test]
fn renders_labels_and_rejects_garbage() {
    let svg =
        render_svg("digraph kilo {\n\t\"a\" [ label=\"a\\n10.2.1.0/24\" ];\n\t\"a\"->\"b\";\n}\n")
            .unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let text: String = doc
        .descendants()
        .filter_map(|n| n.text())
        .collect::<Vec<_>>()
        .join(" ");
    assert!(text.contains("10.2.1.0/24") && text.contains('b'), "{text}");
    assert!(matches!(render_svg("graph {"), Err(SvgError::Parse(_))));
}
