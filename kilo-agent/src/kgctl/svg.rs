//! The graph as SVG, laid out in-process with `layout-rs` (Kilo runs Graphviz's `dot`; kg may
//! not exec). One layered layout; Graphviz's clusters are not drawn. Pure.
use layout::{
    backends::svg::SVGWriter,
    gv::{DotParser, GraphBuilder},
};

/// Why a DOT graph could not be rendered.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SvgError {
    #[error("the graph is not DOT the renderer reads: {0}")]
    Parse(String),
    #[error("the layout failed")]
    Layout,
}

/// Renders DOT (as [`super::render_dot`] writes it) to an SVG document.
pub fn render_svg(dot: &str) -> Result<String, SvgError> {
    let graph = DotParser::new(dot).process().map_err(SvgError::Parse)?;
    // The layout asserts on inputs it cannot place; a request must not take the agent down.
    std::panic::catch_unwind(|| {
        let mut builder = GraphBuilder::new();
        builder.visit_graph(&graph);
        let mut visual = builder.get();
        let mut svg = SVGWriter::new();
        visual.do_it(false, false, false, &mut svg);
        svg.finalize()
    })
    .map_err(|_| SvgError::Layout)
}

#[cfg(test)]
mod tests {
    use super::*;

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
