//! kgctl's renderings: `graph` (Graphviz DOT) and `showconf` (WireGuard, JSON, YAML), in Kilo's formats.
