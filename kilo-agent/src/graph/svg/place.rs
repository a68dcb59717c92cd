//! Where everything goes: the boxes side by side, each node in its box's rows, and every edge's
//! path (a line, or an arc over what stands between its ends).
use super::{
    BOX_GAP, CHAR_W, CLEAR, Drawing, Edge, Frame, Graph, H_GAP, Kind, LABEL_H, LINE_H, Node, PAD,
    PEER_GAP, PEERS, Path, ROW_MAX, V_GAP,
};

impl Graph {
    /// Places every node; returns the boxes and edge paths to draw.
    pub(super) fn layout(&mut self) -> Drawing {
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

impl Path {
    /// The highest point of the line or curve (the least y).
    pub(super) fn top(&self) -> f64 {
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
