//! The placed drawing written as an SVG document.
use std::fmt::Write as _;

use super::{CHAR_W, Drawing, FONT, Graph, Kind, LABEL_H, LINE_H, MARGIN, PAD};

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
    pub(super) fn svg(&self, g: &Graph) -> String {
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
