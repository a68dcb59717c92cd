//! The graph as SVG, drawn in-process (Kilo runs Graphviz's `dot`; kg may not exec). Reads the
//! DOT that [`super::render_dot`] writes and lays out its one shape: each location is a
//! dashed, rounded box (Graphviz's clusters) with its leaders in the top row and its other
//! nodes in rows below; the boxes stand side by side, so every leader is on one line, and an
//! edge between leaders that are not neighbours on it arcs over whatever stands between them.
//! The peers' box is above, joined to the leaders by dashed edges. The canvas is the drawing
//! plus a margin. Pure and deterministic.
use std::{collections::HashMap, fmt::Write as _};

use layout::gv::{DotParser, parser::ast};

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

    /// Places every node; returns the boxes and edge paths to draw.
    fn layout(&mut self) -> Drawing {
        for n in &mut self.nodes {
            if n.cluster.is_some_and(|c| self.clusters[c].name == PEERS) {
                n.kind = Kind::Peer;
            }
            // The smallest ellipse of the text block's proportions around it, plus a margin.
            let chars = n.lines.iter().map(|l| l.chars().count()).max().unwrap_or(0);
            n.rx = (chars as f64 * CHAR_W / 2.0 + 6.0) * std::f64::consts::SQRT_2;
            n.ry = (n.lines.len() as f64 * LINE_H / 2.0 + 4.0) * std::f64::consts::SQRT_2;
        }
        let members = |c: Option<usize>| -> Vec<usize> {
            (0..self.nodes.len())
                .filter(|&i| self.nodes[i].cluster == c)
                .collect()
        };
        // Below, a box per location, leaders on top; above, the peers and any node in no box.
        let mut below: Vec<Group> = Vec::new();
        let mut above: Vec<Group> = Vec::new();
        for (c, cluster) in self.clusters.iter().enumerate() {
            let ids = members(Some(c));
            if ids.is_empty() {
                continue;
            }
            let group = Group {
                label: Some(cluster.label.clone()),
                title: cluster.name.clone(),
                rows: Vec::new(),
            };
            if cluster.name == PEERS {
                above.push(group.rows(ids.chunks(ROW_MAX).map(<[_]>::to_vec).collect()));
            } else {
                let (leaders, rest): (Vec<usize>, Vec<usize>) = ids
                    .into_iter()
                    .partition(|&i| self.nodes[i].kind == Kind::Leader);
                let mut rows = vec![leaders];
                rows.extend(rest.chunks(ROW_MAX).map(<[_]>::to_vec));
                rows.retain(|r| !r.is_empty());
                below.push(group.rows(rows));
            }
        }
        let loose = members(None);
        if !loose.is_empty() {
            above.push(Group {
                label: None,
                title: String::new(),
                rows: loose.chunks(ROW_MAX).map(<[_]>::to_vec).collect(),
            });
        }
        // The locations from y = 0 down, then the peers above their highest arc (the peers,
        // still all at the origin, make no arc).
        let mut boxes = self.place_row(&below, 0.0);
        let arc_top = self
            .paths(&boxes)
            .iter()
            .filter(|p| p.control.is_some())
            .map(Path::top)
            .fold(0.0, f64::min);
        let (_, height) = self.row_metrics(&above);
        let top = if below.is_empty() {
            0.0
        } else {
            arc_top - PEER_GAP - height
        };
        boxes.extend(self.place_row(&above, top));
        let edges = self
            .edges
            .iter()
            .zip(self.paths(&boxes))
            .map(|(&(from, to, dashed), path)| {
                let (a, b) = (&self.nodes[from], &self.nodes[to]);
                let kind = if dashed {
                    Kind::Peer
                } else if a.kind == Kind::Leader && b.kind == Kind::Leader {
                    Kind::Leader
                } else {
                    Kind::Node
                };
                Edge { path, dashed, kind }
            })
            .collect();
        Drawing { boxes, edges }
    }

    /// Each edge's path: a straight line between the ellipses, or for an arc (see
    /// [`Graph::arcs`]) a quadratic curve whose control point is twice as far above the line
    /// as the apex. The arcs leaving one side of a node leave it at angles spread from 20° to
    /// 75° above the horizontal, the shortest lowest, so that they do not meet at one point.
    fn paths(&self, boxes: &[Frame]) -> Vec<Path> {
        let arcs = self.arcs(boxes);
        let mut paths: Vec<Path> = self
            .edges
            .iter()
            .zip(&arcs)
            .map(|(&(a, b, _), arc)| {
                let (a, b) = (&self.nodes[a], &self.nodes[b]);
                match *arc {
                    Some((mid, apex)) => {
                        let c = (mid, 2.0 * apex - a.y);
                        Path {
                            from: a.boundary(c),
                            control: Some(c),
                            to: b.boundary(c),
                        }
                    }
                    None => Path {
                        from: a.boundary((b.x, b.y)),
                        control: None,
                        to: b.boundary((a.x, a.y)),
                    },
                }
            })
            .collect();
        // Each end of an arc: (node, on its right, span, edge, the edge's first end).
        let mut ends: Vec<(usize, bool, f64, usize, bool)> = Vec::new();
        for (e, (&(a, b, _), arc)) in self.edges.iter().zip(&arcs).enumerate() {
            let Some((mid, _)) = *arc else { continue };
            for (n, first) in [(a, true), (b, false)] {
                let x = self.nodes[n].x;
                ends.push((n, mid > x, (mid - x).abs(), e, first));
            }
        }
        ends.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)).then(a.2.total_cmp(&b.2)));
        for side in ends.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)) {
            if side.len() < 2 {
                continue;
            }
            let last = (side.len() - 1) as f64;
            for (i, &(n, right, _, e, first)) in side.iter().enumerate() {
                let node = &self.nodes[n];
                let angle = (20.0 + 55.0 * i as f64 / last).to_radians();
                let dx = if right { node.rx } else { -node.rx };
                let at = (node.x + dx * angle.cos(), node.y - node.ry * angle.sin());
                if first {
                    paths[e].from = at;
                } else {
                    paths[e].to = at;
                }
            }
        }
        paths
    }

    /// Of `groups` placed in one row: the half height of their first rows' line, and the
    /// height of their boxes.
    fn row_metrics(&self, groups: &[Group]) -> (f64, f64) {
        let first_half = groups
            .iter()
            .map(|g| g.first_half(&self.nodes))
            .fold(0.0, f64::max);
        let height = groups
            .iter()
            .map(|g| g.height(&self.nodes, first_half))
            .fold(0.0, f64::max);
        (first_half, height)
    }

    /// Places `groups` side by side from `top`, centred on x = 0, their first rows on one line
    /// and their boxes of one height. Returns the boxes (`None` label: not drawn).
    fn place_row(&mut self, groups: &[Group], top: f64) -> Vec<Frame> {
        let (first_half, height) = self.row_metrics(groups);
        let widths: Vec<f64> = groups.iter().map(|g| g.width(&self.nodes)).collect();
        let total = widths.iter().sum::<f64>() + BOX_GAP * widths.len().saturating_sub(1) as f64;
        let mut x = -total / 2.0;
        let mut boxes = Vec::new();
        for (g, w) in groups.iter().zip(widths) {
            let mut y = top + LABEL_H + PAD;
            let mut half = first_half;
            for row in &g.rows {
                let row_w = row_width(&self.nodes, row);
                let mut nx = x + (w - row_w) / 2.0;
                let row_half = half.max(row_half(&self.nodes, row));
                for &i in row {
                    let n = &mut self.nodes[i];
                    n.x = nx + n.rx;
                    n.y = y + row_half;
                    nx += 2.0 * n.rx + H_GAP;
                }
                y += 2.0 * row_half + V_GAP;
                half = 0.0;
            }
            boxes.push(Frame {
                x0: x,
                y0: top,
                x1: x + w,
                y1: top + height,
                label: g.label.clone(),
                title: g.title.clone(),
            });
            x += w + BOX_GAP;
        }
        boxes
    }

    /// For each edge, `Some((mid x, apex y))` when it joins two nodes on one line with
    /// something between them: the height clears every node between them on that line and
    /// every box between their boxes.
    fn arcs(&self, boxes: &[Frame]) -> Vec<Option<(f64, f64)>> {
        self.edges
            .iter()
            .map(|&(a, b, _)| {
                let (a, b) = (&self.nodes[a], &self.nodes[b]);
                if (a.y - b.y).abs() > 0.5 {
                    return None;
                }
                let (x0, x1) = (a.x.min(b.x), a.x.max(b.x));
                let y = a.y;
                let nodes = self
                    .nodes
                    .iter()
                    .filter(|n| (n.y - y).abs() < 0.5 && n.x > x0 + 0.5 && n.x < x1 - 0.5);
                let obstacles = nodes.map(|n| (n.x - n.rx, n.x + n.rx, n.ry + CLEAR)).chain(
                    boxes
                        .iter()
                        .filter(|b| b.x0 > x0 && b.x1 < x1 && b.y0 < y && b.y1 > y)
                        .map(|b| (b.x0, b.x1, y - b.y0 + CLEAR)),
                );
                // The curve's height at x is 4 h s (1 - s), s = (x - x0) / (x1 - x0): lowest
                // over an obstacle at one of its ends.
                let lift = |x: f64| {
                    let s = ((x - x0) / (x1 - x0)).clamp(0.02, 0.98);
                    4.0 * s * (1.0 - s)
                };
                let h = obstacles
                    .map(|(l, r, h)| h / lift(l).min(lift(r)))
                    .fold(None, |m: Option<f64>, h| Some(m.map_or(h, |m| m.max(h))))?;
                Some(((x0 + x1) / 2.0, y - h))
            })
            .collect()
    }
}

/// A box's or a row's nodes before placement.
struct Group {
    label: Option<String>,
    title: String,
    rows: Vec<Vec<usize>>,
}

impl Group {
    fn rows(self, rows: Vec<Vec<usize>>) -> Self {
        Group { rows, ..self }
    }

    fn first_half(&self, nodes: &[Node]) -> f64 {
        self.rows.first().map_or(0.0, |r| row_half(nodes, r))
    }

    fn width(&self, nodes: &[Node]) -> f64 {
        let label = self
            .label
            .as_ref()
            .map_or(0.0, |l| l.chars().count() as f64 * CHAR_W);
        self.rows
            .iter()
            .map(|r| row_width(nodes, r))
            .fold(label, f64::max)
            + 2.0 * PAD
    }

    /// The height with the first row `first_half` high on either side of its line.
    fn height(&self, nodes: &[Node], first_half: f64) -> f64 {
        let rows: f64 = self
            .rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let half = row_half(nodes, r);
                2.0 * if i == 0 { half.max(first_half) } else { half }
            })
            .sum();
        LABEL_H + PAD + rows + V_GAP * self.rows.len().saturating_sub(1) as f64 + PAD
    }
}

fn row_width(nodes: &[Node], row: &[usize]) -> f64 {
    row.iter().map(|&i| 2.0 * nodes[i].rx).sum::<f64>() + H_GAP * row.len().saturating_sub(1) as f64
}

fn row_half(nodes: &[Node], row: &[usize]) -> f64 {
    row.iter().map(|&i| nodes[i].ry).fold(0.0, f64::max)
}

impl Node {
    /// Where the segment from the centre towards `p` leaves the ellipse.
    fn boundary(&self, p: (f64, f64)) -> (f64, f64) {
        let (dx, dy) = (p.0 - self.x, p.1 - self.y);
        let d = ((dx / self.rx).powi(2) + (dy / self.ry).powi(2)).sqrt();
        if d == 0.0 {
            return (self.x, self.y);
        }
        (self.x + dx / d, self.y + dy / d)
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

impl Path {
    /// The highest point of the line or curve (the least y).
    fn top(&self) -> f64 {
        let (a, b) = (self.from.1, self.to.1);
        let Some((_, c)) = self.control else {
            return a.min(b);
        };
        // y(t) = (1-t)² a + 2t(1-t) c + t² b is extreme where its derivative is zero.
        let t = (a - c) / (a - 2.0 * c + b);
        let y = if (0.0..=1.0).contains(&t) {
            (1.0 - t).powi(2) * a + 2.0 * t * (1.0 - t) * c + t * t * b
        } else {
            f64::MAX
        };
        y.min(a).min(b)
    }
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

/// Stroke (and fill of nodes) per kind: leaders blue, other nodes grey, peers amber.
fn colours(k: Kind) -> (&'static str, &'static str) {
    match k {
        Kind::Leader => ("#2f5fb3", "#e6eefc"),
        Kind::Node => ("#555555", "#ffffff"),
        Kind::Peer => ("#b86e00", "#fdf1de"),
    }
}

fn marker(k: Kind) -> &'static str {
    match k {
        Kind::Leader => "leader",
        Kind::Node => "node",
        Kind::Peer => "peer",
    }
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Drawing {
    fn svg(&self, g: &Graph) -> String {
        // The extent of everything drawn, then the title above it.
        let (mut x0, mut y0, mut x1, mut y1) = (f64::MAX, f64::MAX, f64::MIN, f64::MIN);
        let mut extend = |a: f64, b: f64, c: f64, d: f64| {
            (x0, y0, x1, y1) = (x0.min(a), y0.min(b), x1.max(c), y1.max(d));
        };
        for n in &g.nodes {
            extend(n.x - n.rx, n.y - n.ry, n.x + n.rx, n.y + n.ry);
        }
        for b in self.boxes.iter().filter(|b| b.label.is_some()) {
            extend(b.x0, b.y0, b.x1, b.y1);
        }
        for e in &self.edges {
            let (from, to) = (e.path.from, e.path.to);
            extend(
                from.0.min(to.0),
                e.path.top(),
                from.0.max(to.0),
                from.1.max(to.1),
            );
        }
        let title_w = g.label.chars().count() as f64 * CHAR_W * 16.0 / FONT;
        let title_y = if g.label.is_empty() { y0 } else { y0 - 12.0 };
        if x0 > x1 {
            (x0, y0, x1, y1) = (0.0, 0.0, 0.0, 0.0);
        }
        let mid = (x0 + x1) / 2.0;
        if !g.label.is_empty() {
            let (a, b) = (mid - title_w / 2.0, title_y - 16.0);
            (x0, y0, x1) = (x0.min(a), y0.min(b), x1.max(mid + title_w / 2.0));
        }
        let (dx, dy) = (MARGIN - x0, MARGIN - y0);
        let (w, h) = (x1 - x0 + 2.0 * MARGIN, y1 - y0 + 2.0 * MARGIN);
        let p = |x: f64, y: f64| format!("{:.1},{:.1}", x + dx, y + dy);

        let mut o = String::new();
        let _ = writeln!(
            o,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" \
             viewBox=\"0 0 {w:.1} {h:.1}\" font-family=\"DejaVu Sans Mono, Menlo, Consolas, \
             monospace\" font-size=\"{FONT}\">\n<title>kilo</title>\n<defs>"
        );
        for k in [Kind::Leader, Kind::Node, Kind::Peer] {
            let _ = writeln!(
                o,
                "<marker id=\"{}\" viewBox=\"0 0 10 10\" refX=\"10\" refY=\"5\" \
                 markerWidth=\"7\" markerHeight=\"7\" orient=\"auto-start-reverse\">\
                 <path d=\"M0,0 L10,5 L0,10 z\" fill=\"{}\"/></marker>",
                marker(k),
                colours(k).0
            );
        }
        let _ = writeln!(
            o,
            "</defs>\n<rect class=\"background\" x=\"0\" y=\"0\" width=\"{w:.1}\" \
             height=\"{h:.1}\" fill=\"#ffffff\"/>"
        );
        if !g.label.is_empty() {
            let _ = writeln!(
                o,
                "<text class=\"graph-label\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" \
                 font-size=\"16\" font-weight=\"bold\" fill=\"#222222\">{}</text>",
                mid + dx,
                title_y + dy,
                xml(&g.label)
            );
        }
        for (e, &(from, to, _)) in self.edges.iter().zip(&g.edges) {
            let (a, b) = (p(e.path.from.0, e.path.from.1), p(e.path.to.0, e.path.to.1));
            let path = match e.path.control {
                Some(c) => format!("M{a} Q{} {b}", p(c.0, c.1)),
                None => format!("M{a} L{b}"),
            };
            let dash = if e.dashed {
                " stroke-dasharray=\"6,4\" stroke-opacity=\"0.8\""
            } else {
                ""
            };
            let _ = writeln!(
                o,
                "<g class=\"edge\"><title>{}&#45;&gt;{}</title><path d=\"{path}\" fill=\"none\" \
                 stroke=\"{}\" stroke-width=\"1.3\"{dash} marker-start=\"url(#{m})\" \
                 marker-end=\"url(#{m})\"/></g>",
                xml(&g.nodes[from].id),
                xml(&g.nodes[to].id),
                colours(e.kind).0,
                m = marker(e.kind),
            );
        }
        for b in &self.boxes {
            let Some(label) = &b.label else { continue };
            let _ = writeln!(
                o,
                "<g class=\"cluster\"><title>{}</title><rect x=\"{:.1}\" y=\"{:.1}\" \
                 width=\"{:.1}\" height=\"{:.1}\" rx=\"10\" fill=\"none\" stroke=\"#888888\" \
                 stroke-width=\"1.2\" stroke-dasharray=\"6,4\"/><text x=\"{:.1}\" y=\"{:.1}\" \
                 font-weight=\"bold\" fill=\"#444444\" stroke=\"#ffffff\" stroke-width=\"4\" \
                 paint-order=\"stroke\">{}</text></g>",
                xml(&b.title),
                b.x0 + dx,
                b.y0 + dy,
                b.x1 - b.x0,
                b.y1 - b.y0,
                b.x0 + PAD + dx,
                b.y0 + LABEL_H + dy - 4.0,
                xml(label)
            );
        }
        for n in &g.nodes {
            let (stroke, fill) = colours(n.kind);
            let _ = write!(
                o,
                "<g class=\"node\"><title>{}</title><ellipse cx=\"{:.1}\" cy=\"{:.1}\" \
                 rx=\"{:.1}\" ry=\"{:.1}\" fill=\"{fill}\" stroke=\"{stroke}\" \
                 stroke-width=\"1.4\"/><text text-anchor=\"middle\" fill=\"#222222\">",
                xml(&n.id),
                n.x + dx,
                n.y + dy,
                n.rx,
                n.ry
            );
            let first = n.y - (n.lines.len() as f64 - 1.0) * LINE_H / 2.0 + FONT * 0.35;
            for (i, line) in n.lines.iter().enumerate() {
                let bold = if *line == n.id {
                    " font-weight=\"bold\""
                } else {
                    ""
                };
                let _ = write!(
                    o,
                    "<tspan x=\"{:.1}\" y=\"{:.1}\"{bold}>{}</tspan>",
                    n.x + dx,
                    first + i as f64 * LINE_H + dy,
                    xml(line)
                );
            }
            o.push_str("</text></g>\n");
        }
        o.push_str("</svg>");
        o
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;
    use crate::{
        kgctl::{GranularityArg, Options, cluster, graph},
        mesh::{Granularity, objects},
    };

    /// Seven nodes in three locations (3, 2 and 2 nodes) and three peers, as objects.
    const LOCATIONS: [(&str, &[&str]); 3] = [
        ("eu-west", &["berlin-1", "berlin-2", "paris-1"]),
        ("us-east", &["nyc-1", "nyc-2"]),
        ("ap-south", &["mumbai-1", "mumbai-2"]),
    ];
    const PEER_NAMES: [&str; 3] = ["laptop", "phone", "ci-runner"];

    /// The mesh's DOT graph.
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
        let options = Options {
            granularity: GranularityArg::Fixed(granularity),
            ..Options::default()
        };
        graph(&cluster(&snapshot, &options).unwrap()).unwrap()
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
        let svg = render_svg(
            "digraph kilo {\n\t\"a\" [ label=\"a\\n10.2.1.0/24\" ];\n\t\"a\"->\"b\";\n}\n",
        )
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
}
