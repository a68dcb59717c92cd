//! The one reader of kg's Prometheus text exposition in tests and benchmarks: samples by name
//! and labels, one series' value, a family's sum.
//!
//! Hand-written rather than `prometheus-parse` (which splits label values on `=` and `,`, so it
//! drops the base64 `public_key` labels) or a strict OpenMetrics parser (tests read the metrics
//! out of mixed output too, such as the demo's, so lines that are not samples are skipped).
use std::collections::BTreeMap;

/// One sample line: `name{label="value",...} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The samples of an exposition (comments and other lines skipped).
pub fn samples(text: &str) -> Vec<Sample> {
    text.lines().filter_map(sample).collect()
}

/// `line` as a sample, if it is one.
fn sample(line: &str) -> Option<Sample> {
    let (name, labels, rest) = series(line.trim())?;
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Splits `name{labels} rest` (labels optional) into its parts.
fn series(s: &str) -> Option<(String, BTreeMap<String, String>, &str)> {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(s.len());
    let name = &s[..end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let mut labels = BTreeMap::new();
    let mut rest = &s[end..];
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            inner = inner.trim_start_matches([',', ' ']);
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = inner.split_once("=\"")?;
            let mut value = String::new();
            let mut chars = after.char_indices();
            let close = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.insert(key.trim().to_owned(), value);
            inner = &after[close + 1..];
        }
    }
    if !rest.is_empty() && !rest.starts_with(' ') {
        return None;
    }
    Some((name.to_owned(), labels, rest))
}

/// The value of the series `series` (a name and any labels, as in `name{a="b"}`: that label
/// set exactly, in any order) in `text`, when it is a non-negative integer.
pub fn metric(text: &str, series_: &str) -> Option<u64> {
    let (name, labels, _) = series(series_).unwrap_or_else(|| panic!("not a series: {series_}"));
    samples(text)
        .into_iter()
        .find(|s| s.name == name && s.labels == labels)
        .and_then(|s| integer(s.value))
}

/// The sum of every sample of the family `name` (all its label sets) in `text`.
pub fn metric_sum(text: &str, name: &str) -> u64 {
    samples(text)
        .iter()
        .filter(|s| s.name == name)
        .filter_map(|s| integer(s.value))
        .sum()
}

/// The samples of `name` by the value of their label `label`.
pub fn by_label(text: &str, name: &str, label: &str) -> BTreeMap<String, u64> {
    samples(text)
        .into_iter()
        .filter(|s| s.name == name)
        .filter_map(|s| Some((s.labels.get(label)?.clone(), integer(s.value)?)))
        .collect()
}

fn integer(v: f64) -> Option<u64> {
    (v >= 0.0 && v.fract() == 0.0 && v <= u64::MAX as f64).then_some(v as u64)
}
