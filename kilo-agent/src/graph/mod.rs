//! The topology drawn, for `kgctl graph` and kg's `/graph`: Kilo's DOT ([`render_dot`], the
//! text gographviz writes for Kilo's `Topology.Dot()`, byte for byte except that names
//! containing `"` are escaped) and an SVG of it drawn in-process ([`render_svg`]). Pure.
mod svg;

pub use svg::{SvgError, render_svg};

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use crate::{
    mesh::{Endpoint, Granularity},
    topology::{self, Topology},
};

fn esc(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\\\""))
}

/// A minimal model of the gographviz graph Kilo builds, written the way gographviz writes it.
#[derive(Default)]
struct Dot {
    attrs: BTreeMap<String, String>,
    /// subgraph id → (attrs, children)
    subgraphs: BTreeMap<String, (BTreeMap<String, String>, BTreeSet<String>)>,
    /// node id → attrs (one global table, as in gographviz: a later add extends the attrs)
    nodes: BTreeMap<String, BTreeMap<String, String>>,
    edges: Vec<(String, String, bool)>,
}

impl Dot {
    fn subgraph(&mut self, id: &str, label: &str) {
        let sg = self.subgraphs.entry(id.into()).or_default();
        sg.0.insert("label".into(), esc(label));
        sg.0.insert("style".into(), "\"dashed,rounded\"".into());
    }
    fn node(&mut self, sg: &str, id: &str, attrs: &[(&str, String)]) {
        let a = self.nodes.entry(id.into()).or_default();
        a.insert("shape".into(), "ellipse".into());
        for (k, v) in attrs {
            a.insert((*k).into(), v.clone());
        }
        self.subgraphs
            .entry(sg.into())
            .or_default()
            .1
            .insert(id.into());
    }
    fn render(&self) -> String {
        fn attrs(a: &BTreeMap<String, String>) -> String {
            a.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
        let mut o = String::from("digraph kilo {\n");
        for (k, v) in &self.attrs {
            let _ = writeln!(o, "\t{k}={v};");
        }
        for (s, d, dashed) in &self.edges {
            let style = if *dashed { ", style=dashed" } else { "" };
            let _ = writeln!(o, "\t{s}->{d}[ dir=both{style} ];");
        }
        for (id, (a, children)) in &self.subgraphs {
            let _ = writeln!(o, "\tsubgraph {id} {{");
            for (k, v) in a {
                let _ = writeln!(o, "\t{k}={v};");
            }
            for c in children {
                let _ = writeln!(o, "\t{c} [ {} ];", attrs(&self.nodes[c]));
            }
            o.push_str("\n}\n;\n");
        }
        o.push_str("\n}\n");
        o
    }
}

fn node_label(
    location: &str,
    n: &topology::SegmentNode,
    wg: Option<std::net::IpAddr>,
    ep: Option<&Endpoint>,
) -> String {
    let mut parts = vec![location.to_string(), n.name.clone()];
    if n.pod_cidrs.is_empty() {
        parts.push("<nil>".into());
    }
    parts.extend(n.pod_cidrs.iter().map(ToString::to_string));
    parts.extend(n.internal_ips.iter().map(|i| i.addr().to_string()));
    if let Some(w) = wg {
        parts.push(w.to_string());
    }
    if let Some(e) = ep {
        parts.push(e.to_string());
    }
    esc(&parts.join("\\n"))
}

/// Kilo's `Topology.Dot()`: a cluster per location, edges between leaders (within a location
/// from its leader to each node), dashed edges from every leader to every peer. In `cross`, a
/// cluster per location whose nodes all lead their own segment, edges between nodes of
/// different locations only.
pub fn render_dot(t: &Topology) -> String {
    let mut g = Dot::default();
    g.attrs
        .insert("label".into(), esc(&t.wireguard_cidr.trunc().to_string()));
    g.attrs.insert("labelloc".into(), "t".into());
    g.attrs.insert("outputorder".into(), "nodesfirst".into());
    g.attrs.insert("overlap".into(), "false".into());
    let mut leaders: Vec<(String, &str)> = Vec::new();
    let cross = t.granularity == Granularity::Cross;
    for s in &t.segments {
        let cluster_label = if cross { &s.group } else { &s.location };
        let sg = esc(&format!("cluster_location_{cluster_label}"));
        g.subgraph(&sg, cluster_label);
        let mut ids = Vec::new();
        for (j, n) in s.nodes.iter().enumerate() {
            let id = esc(&n.name);
            let lead = j == s.leader;
            let label = node_label(
                &s.location,
                n,
                lead.then_some(s.wireguard_ip),
                if lead { s.endpoint.as_ref() } else { None },
            );
            let mut a = vec![("label", label)];
            if lead {
                a.push(("rank", "1".into()));
            }
            g.node(&sg, &id, &a);
            ids.push(id);
        }
        // meshSubGraph: the segment's leader to each other node (names are sorted, as gographviz's).
        for (i, id) in ids.iter().enumerate() {
            if i != s.leader {
                g.edges.push((ids[s.leader].clone(), id.clone(), false));
            }
        }
        leaders.push((ids[s.leader].clone(), s.group.as_str()));
    }
    for i in 0..leaders.len() {
        for j in i + 1..leaders.len() {
            if !cross || leaders[i].1 != leaders[j].1 {
                g.edges
                    .push((leaders[i].0.clone(), leaders[j].0.clone(), false));
            }
        }
    }
    let psg = esc("cluster_peers");
    g.subgraph(&psg, "peers");
    let mut peer_ids = BTreeSet::new();
    for p in &t.peers {
        let id = esc(&p.name);
        let ep = p
            .endpoint
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        g.node(
            &psg,
            &id,
            &[("label", esc(&format!("{}\\n{ep}\n", p.name)))],
        );
        peer_ids.insert(id);
    }
    for (l, _) in &leaders {
        for p in &peer_ids {
            g.edges.push((l.clone(), p.clone(), true));
        }
    }
    g.render()
}
