//! The graph as SVG, drawn in-process (Kilo runs Graphviz's `dot`; kg may not exec). Reads the
//! DOT that [`super::render_dot`] writes and lays out its one shape: each location is a
//! dashed, rounded box (Graphviz's clusters) with its leaders in the top row and its other
//! nodes in rows below; the boxes stand side by side, so every leader is on one line, and an
//! edge between leaders that are not neighbours on it arcs over whatever stands between them.
//! The peers' box is above, joined to the leaders by dashed edges. The canvas is the drawing
//! plus a margin. Pure and deterministic. Reading the DOT is here; where everything goes is in
//! `place`, the SVG text in `draw`.
use std::collections::HashMap;

use layout::gv::{DotParser, parser::ast};

mod draw;
mod place;
#[cfg(test)]
mod tests;

/// Why a DOT graph could not be rendered.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SvgError {
    #[error("the graph is not DOT the renderer reads: {0}")]
    Parse(String),
}

/// The subgraph [`super::render_dot`] puts the peers in.
const PEERS: &str = "cluster_peers";

const FONT: f64 = 12.0;
/// The advance of one character of the monospace font at [`FONT`] (0.6 em).
const CHAR_W: f64 = 7.3;
const LINE_H: f64 = 15.0;
/// Inside a box: around its rows, and the height of its label.
const PAD: f64 = 14.0;
const LABEL_H: f64 = 20.0;
/// Between nodes of a row, between rows, between boxes.
const H_GAP: f64 = 24.0;
const V_GAP: f64 = 40.0;
const BOX_GAP: f64 = 36.0;
/// How far an arc passes over what it clears; between the peers and what is below them.
const CLEAR: f64 = 12.0;
const PEER_GAP: f64 = 64.0;
const MARGIN: f64 = 8.0;
/// At most this many nodes in a row of peers or of a location's non-leaders.
const ROW_MAX: usize = 5;

/// Renders DOT (as [`super::render_dot`] writes it) to an SVG document.
pub fn render_svg(dot: &str) -> Result<String, SvgError> {
    let ast = DotParser::new(dot).process().map_err(SvgError::Parse)?;
    let mut g = Graph::default();
    g.visit(&ast.list, None);
    let drawing = g.layout();
    Ok(drawing.svg(&g))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Leader,
    Node,
    Peer,
}

#[derive(Debug)]
struct Node {
    id: String,
    lines: Vec<String>,
    kind: Kind,
    cluster: Option<usize>,
    rx: f64,
    ry: f64,
    x: f64,
    y: f64,
}

#[derive(Debug, Default)]
struct Cluster {
    name: String,
    label: String,
}

#[derive(Debug, Default)]
struct Graph {
    label: String,
    nodes: Vec<Node>,
    index: HashMap<String, usize>,
    clusters: Vec<Cluster>,
    /// (from, to, dashed)
    edges: Vec<(usize, usize, bool)>,
}

fn attr<'a>(list: &'a ast::AttributeList, key: &str) -> Option<&'a str> {
    list.iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

impl Graph {
    /// Reads the statements of the graph or of the subgraph `cluster`.
    fn visit(&mut self, stmts: &ast::StmtList, cluster: Option<usize>) {
        for stmt in &stmts.list {
            match stmt {
                ast::Stmt::Attribute(a) if matches!(a.target, ast::AttrStmtTarget::Graph) => {
                    if let Some(label) = attr(&a.list, "label") {
                        match cluster {
                            Some(c) => self.clusters[c].label = label.into(),
                            None => self.label = label.into(),
                        }
                    }
                }
                ast::Stmt::Attribute(_) => {}
                ast::Stmt::Node(n) => {
                    let i = self.node(&n.id.name);
                    let node = &mut self.nodes[i];
                    if let Some(label) = attr(&n.list, "label") {
                        node.lines = label
                            .trim_end_matches('\n')
                            .lines()
                            .map(Into::into)
                            .collect();
                    }
                    if attr(&n.list, "rank").is_some() {
                        node.kind = Kind::Leader;
                    }
                    // A node in two subgraphs (a peer named as a node) is drawn in the first.
                    node.cluster = node.cluster.or(cluster);
                }
                ast::Stmt::Edge(e) => {
                    let dashed = attr(&e.list, "style").is_some_and(|s| s.contains("dashed"));
                    let mut from = self.node(&e.from.name);
                    for (to, _) in &e.to {
                        let to = self.node(&to.name);
                        if to != from {
                            self.edges.push((from, to, dashed));
                        }
                        from = to;
                    }
                }
                ast::Stmt::SubGraph(s) => {
                    self.clusters.push(Cluster {
                        name: s.name.clone(),
                        label: String::new(),
                    });
                    self.visit(&s.list, Some(self.clusters.len() - 1));
                }
            }
        }
    }

    /// The index of node `id`, added unplaced when new.
    fn node(&mut self, id: &str) -> usize {
        if let Some(&i) = self.index.get(id) {
            return i;
        }
        self.nodes.push(Node {
            id: id.into(),
            lines: vec![id.into()],
            kind: Kind::Node,
            cluster: None,
            rx: 0.0,
            ry: 0.0,
            x: 0.0,
            y: 0.0,
        });
        self.index.insert(id.into(), self.nodes.len() - 1);
        self.nodes.len() - 1
    }
}

/// A drawn box: a location, or the peers.
struct Frame {
    x0: f64,
    y0: f64,
    x1: f64,
    y1: f64,
    /// `None`: loose nodes, not boxed.
    label: Option<String>,
    title: String,
}

struct Path {
    from: (f64, f64),
    control: Option<(f64, f64)>,
    to: (f64, f64),
}

struct Edge {
    path: Path,
    dashed: bool,
    kind: Kind,
}

struct Drawing {
    boxes: Vec<Frame>,
    edges: Vec<Edge>,
}
