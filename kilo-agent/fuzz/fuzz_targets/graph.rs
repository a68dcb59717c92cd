//! The query string of kg's `/graph` (`format`, `layout`): any text answers 200 with the DOT
//! graph itself (`dot`, `gv`) or an SVG document, or 500 with a one-line reason; never a panic.
#![no_main]

use kilo_agent::telemetry::graph_response;
use libfuzzer_sys::fuzz_target;

const DOT: &str = "digraph kilo {\n  \"a\" -> \"b\";\n  \"b\" -> \"a\";\n}\n";

fuzz_target!(|data: &[u8]| {
    let Ok(query) = std::str::from_utf8(data) else {
        return;
    };
    let (status, content_type, body) = graph_response(Some(DOT), query);
    match status {
        200 if content_type.starts_with("text/plain") => assert_eq!(body, DOT),
        200 => {
            assert_eq!(content_type, "image/svg+xml");
            assert!(body.contains("<svg"), "{body}");
        }
        500 => assert!(body.ends_with('\n') && body.lines().count() == 1, "{body}"),
        other => panic!("status {other} for {query:?}"),
    }
    // Without a graph yet, every query gets the same 500.
    assert_eq!(graph_response(None, query).0, 500);
});
