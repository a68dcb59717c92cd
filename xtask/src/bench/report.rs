//! What the benchmarks recorded, rendered: the tables and targets of BENCHMARKS.md, its SVG
//! plots and the README's summary.
use super::*;

/// A table as its records describe it.
#[derive(Default)]
pub(super) struct Table {
    pub(super) title: String,
    pub(super) unit: String,
    pub(super) rows: Vec<String>,
    pub(super) cols: Vec<String>,
    pub(super) cells: BTreeMap<(String, String), Cell>,
    pub(super) notes: Vec<String>,
    pub(super) plot: Option<Value>,
}

pub(super) enum Cell {
    Values(Vec<f64>),
    Text(String),
}

pub(super) fn str_of<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or_default()
}

pub(super) fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_owned());
    }
}

/// A benchmark's tables in order, its facts (key, value) and its target records.
pub(super) type Parsed = (Vec<(String, Table)>, Vec<(String, String)>, Vec<Value>);

/// The tables of one benchmark, in order, with its facts and targets.
pub(super) fn tables(records: &[Value]) -> Parsed {
    let mut tables: Vec<(String, Table)> = Vec::new();
    let mut meta = Vec::new();
    let mut targets = Vec::new();
    let get = |tables: &mut Vec<(String, Table)>, id: &str| -> usize {
        match tables.iter().position(|(t, _)| t == id) {
            Some(i) => i,
            None => {
                tables.push((
                    id.to_owned(),
                    Table {
                        title: id.to_owned(),
                        ..Table::default()
                    },
                ));
                tables.len() - 1
            }
        }
    };
    for r in records {
        match str_of(r, "type") {
            "table" => {
                let i = get(&mut tables, str_of(r, "table"));
                tables[i].1.title = str_of(r, "title").to_owned();
                tables[i].1.unit = str_of(r, "unit").to_owned();
            }
            "cell" => {
                let i = get(&mut tables, str_of(r, "table"));
                let t = &mut tables[i].1;
                let (row, col) = (str_of(r, "row"), str_of(r, "col"));
                push_unique(&mut t.rows, row);
                push_unique(&mut t.cols, col);
                let cell = match r["values"].as_array() {
                    Some(v) => Cell::Values(v.iter().filter_map(Value::as_f64).collect()),
                    None => Cell::Text(str_of(r, "text").to_owned()),
                };
                t.cells.insert((row.to_owned(), col.to_owned()), cell);
            }
            "note" => {
                let i = get(&mut tables, str_of(r, "table"));
                tables[i].1.notes.push(str_of(r, "text").to_owned());
            }
            "plot" => {
                let i = get(&mut tables, str_of(r, "table"));
                tables[i].1.plot = Some(r.clone());
            }
            "meta" => meta.push((str_of(r, "key").to_owned(), str_of(r, "value").to_owned())),
            "target" => targets.push(r.clone()),
            _ => {}
        }
    }
    (tables, meta, targets)
}

pub(super) fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// A number with as many digits as it deserves.
pub fn num(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        "–".into()
    } else if a >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// An axis label: whole numbers without decimals.
pub(super) fn axis(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        num(v)
    }
}

pub(super) fn cell_text(c: Option<&Cell>) -> String {
    match c {
        None => String::new(),
        Some(Cell::Text(t)) => t.clone(),
        Some(Cell::Values(v)) if v.len() > 1 => {
            let s = sorted(v);
            format!("{} ({}–{})", num(median(v)), num(s[0]), num(s[s.len() - 1]))
        }
        Some(Cell::Values(v)) => v.first().map_or(String::new(), |x| num(*x)),
    }
}

/// The first paragraph of an example's `//!` doc (for the e2e figures, the `--bench` paragraph
/// of `xtask/src/e2e/mod.rs`).
pub(super) fn intro(what: &str) -> String {
    let path = match what {
        E2E => root_dir().join("xtask/src/e2e/mod.rs"),
        _ => {
            let file = root_dir().join(format!("kilo-agent/examples/bench_{what}.rs"));
            if file.exists() {
                file
            } else {
                root_dir().join(format!("kilo-agent/examples/bench_{what}/main.rs"))
            }
        }
    };
    let src = read(&path.to_string_lossy());
    let src = match what {
        E2E => src
            .lines()
            .skip_while(|l| !l.starts_with("//! `--bench FILE`"))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => src,
    };
    src.lines()
        .map_while(|l| l.strip_prefix("//!"))
        .map(str::trim)
        .take_while(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

pub(super) fn render(
    out: &Path,
    start: &Start,
    quick: bool,
    no_run: bool,
    ran: &[Ran],
) -> Result<String> {
    let mut md = String::new();
    let mode = match (quick, no_run) {
        (true, _) => {
            "quick (`cargo xtask bench --quick`: small sizes, few repetitions; a check that the \
             machinery works, not figures to quote)"
        }
        (false, false) => "full (`cargo xtask bench`)",
        (false, true) => {
            "full, rendered again with `--no-run` from each benchmark's last run (`cargo xtask \
             bench WHAT` runs one); the date and load averages are the rendering's"
        }
    };
    let _ = writeln!(md, "# Benchmarks\n");
    let _ = writeln!(
        md,
        "Written by `cargo xtask bench`. Every figure of kg and of the tools beside it \
         (iptables, ipset, nftables, the empty program, the lookups alone) was measured in \
         this one run, on the machine described below; figures labelled Kilo's reference \
         figures were not: they are constants from earlier measurements of Kilo 0.7.0 (its \
         execs per change from running its iptables controller; its agent's memory, CPU and \
         burst from a live run of three Kilo agents; the latency of one change), each named \
         where it appears, with their sources and methods in \
         [docs/kilo-reference.md](docs/kilo-reference.md). Every comparison is also given as a \
         ratio. Cells are the median of the repetitions, with their range (min–max) in \
         parentheses. A target reads yes only when its figures were measured and meet it; \
         otherwise **no**, not measured (a figure could not be read) or not judged (the run did \
         not reach the size the target names, or the interval is too wide to decide). No \
         figure here is asserted by a test: the test suite only checks that `--quick` runs and \
         writes this report.\n"
    );
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(md, "| date | {} |", start.date);
    let _ = writeln!(md, "| mode | {mode} |");
    let _ = writeln!(md, "| machine | {} |", machine());
    let _ = writeln!(
        md,
        "| kernel | {} |",
        read("/proc/sys/kernel/osrelease").trim()
    );
    let _ = writeln!(md, "| versions | {} |", versions());
    let _ = writeln!(md, "| load average at the start | {} |", start.load);
    let _ = writeln!(
        md,
        "| load average at the end | {} |",
        read("/proc/loadavg")
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let _ = writeln!(
        md,
        "| run time | {} |\n",
        ran.iter()
            .map(|r| format!("{} {:.0} s", r.what, r.seconds))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let parsed: Vec<_> = ran.iter().map(|r| tables(&r.records)).collect();
    let _ = writeln!(md, "## Targets\n");
    let _ = writeln!(md, "{}", targets_table(&parsed, true, quick));
    let plots = out.join("docs/bench");
    for (r, (tables, meta, _)) in ran.iter().zip(&parsed) {
        let source = match r.what.as_str() {
            E2E => "cargo xtask e2e --bench".to_owned(),
            what => format!("bench_{what}"),
        };
        let _ = writeln!(md, "## {} (`{source}`, {:.0} s)\n", r.what, r.seconds);
        let _ = writeln!(md, "{}\n", intro(&r.what));
        if !r.ok {
            let _ = writeln!(
                md,
                "**This benchmark failed**; what it wrote before is below.\n"
            );
        }
        if r.records.is_empty() {
            let _ = writeln!(
                md,
                "No results (it needs root, or it failed before measuring).\n"
            );
        }
        for (k, v) in meta {
            let _ = writeln!(md, "- {k}: {v}");
        }
        if !meta.is_empty() {
            md.push('\n');
        }
        for (id, t) in tables {
            let unit = if t.unit.is_empty() {
                String::new()
            } else {
                format!(" ({})", t.unit)
            };
            let _ = writeln!(md, "### {}{unit}\n", t.title);
            let _ = writeln!(md, "| | {} |", t.cols.join(" | "));
            let _ = writeln!(md, "|---|{}", "---:|".repeat(t.cols.len()));
            for row in &t.rows {
                let cells: Vec<String> = t
                    .cols
                    .iter()
                    .map(|c| cell_text(t.cells.get(&(row.clone(), c.clone()))))
                    .collect();
                let _ = writeln!(md, "| {row} | {} |", cells.join(" | "));
            }
            md.push('\n');
            for n in &t.notes {
                let _ = writeln!(md, "{n}\n");
            }
            if let Some(p) = &t.plot {
                std::fs::create_dir_all(&plots)?;
                let name = format!("{}-{}.svg", r.what, slug(id));
                match plot(&plots.join(&name), t, p) {
                    Ok(()) => {
                        let _ = writeln!(md, "![{}](docs/bench/{name})\n", t.title);
                    }
                    Err(e) => {
                        let _ = writeln!(md, "(no plot: {e})\n");
                    }
                }
            }
        }
    }
    Ok(md)
}

/// How a target's state reads in a table: only `met` is a pass.
pub(super) fn verdict(target: &Value, quick: bool) -> &'static str {
    match str_of(target, "state") {
        "met" => "yes",
        "not met" => "**no**",
        "not judged" if quick => "not judged (quick)",
        "not judged" => "not judged",
        _ => "not measured",
    }
}

/// The targets and where each stands; with `figures`, what was measured too (the README's
/// summary leaves the figures to BENCHMARKS.md).
pub(super) fn targets_table(parsed: &[Parsed], figures: bool, quick: bool) -> String {
    let mut md = String::from(if figures {
        "| target | measured | met |\n|---|---|---|\n"
    } else {
        "| target | met |\n|---|---|\n"
    });
    for (_, _, targets) in parsed {
        for t in targets {
            let figure = if figures {
                format!(" {} |", str_of(t, "figure"))
            } else {
                String::new()
            };
            let _ = writeln!(
                md,
                "| {} |{figure} {} |",
                str_of(t, "target"),
                verdict(t, quick)
            );
        }
    }
    md
}

/// Replaces the table between `<!-- bench-summary -->` and `<!-- /bench-summary -->` in
/// `out/README.md`, if both are there.
pub(super) fn update_readme(out: &Path, start: &Start, quick: bool, ran: &[Ran]) -> Result<()> {
    let path = out.join("README.md");
    let Ok(readme) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let (begin, end) = ("<!-- bench-summary -->", "<!-- /bench-summary -->");
    let (Some(a), Some(b)) = (readme.find(begin), readme.find(end)) else {
        return Ok(());
    };
    let parsed: Vec<_> = ran.iter().map(|r| tables(&r.records)).collect();
    let mode = if quick {
        "quick run (small sizes: not figures to quote)"
    } else {
        "run"
    };
    let text = format!(
        "{}{begin}\nThe targets, from the {mode} of {} (figures in [BENCHMARKS.md](BENCHMARKS.md)):\n\n{}{}",
        &readme[..a],
        start.date,
        targets_table(&parsed, false, quick),
        &readme[b..]
    );
    std::fs::write(&path, text)?;
    Ok(())
}

/// A column as a number: `1,000`, `N=1000`.
pub(super) fn parse_x(s: &str) -> Option<f64> {
    let s = s.rsplit('=').next().unwrap_or(s);
    s.replace([',', '_'], "").trim().parse().ok()
}

/// An SVG line plot of `t`: a series per row, the columns as x.
pub(super) fn plot(path: &Path, t: &Table, spec: &Value) -> Result<()> {
    use plotters::prelude::*;
    let xs: Vec<(String, f64)> = t
        .cols
        .iter()
        .filter_map(|c| Some((c.clone(), parse_x(c)?)))
        .collect();
    let series: Vec<(String, Vec<(f64, f64)>)> = t
        .rows
        .iter()
        .map(|row| {
            let pts = xs
                .iter()
                .filter_map(|(c, x)| match t.cells.get(&(row.clone(), c.clone())) {
                    Some(Cell::Values(v)) if !v.is_empty() => Some((*x, median(v))),
                    _ => None,
                })
                .collect();
            (row.clone(), pts)
        })
        .filter(|(_, p): &(String, Vec<(f64, f64)>)| !p.is_empty())
        .collect();
    let all = || series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all() {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if series.is_empty() {
        bail!("nothing numeric to plot");
    }
    let (log_x, log_y) = (
        spec["log_x"].as_bool() == Some(true),
        spec["log_y"].as_bool() == Some(true),
    );
    let pad = |lo: f64, hi: f64, log: bool| {
        if log {
            (lo.max(1e-9) / 1.5, hi.max(1e-9) * 1.5)
        } else {
            let d = (hi - lo).max(hi.abs() * 0.1).max(1e-9);
            ((lo - d * 0.05).min(0.0_f64.max(lo - d)), hi + d * 0.1)
        }
    };
    let (x0, x1) = pad(x0, x1, log_x);
    let (y0, y1) = pad(y0, y1, log_y);
    let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    // The chart on the left, its legend beside it (never over a line).
    let (chart, legend) = root.split_horizontally(620);
    let color = |i: usize| Palette99::pick(i).to_rgba();
    for (i, (name, _)) in series.iter().enumerate() {
        let y = 40 + 22 * i as i32;
        legend.draw(&PathElement::new(
            vec![(4, y), (28, y)],
            color(i).stroke_width(3),
        ))?;
        legend.draw(&Text::new(
            name.clone(),
            (34, y - 7),
            ("sans-serif", 13).into_font(),
        ))?;
    }
    let mut b = ChartBuilder::on(&chart);
    b.caption(&t.title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64);
    let y_desc = format!("{} ({})", str_of(spec, "y"), t.unit);
    // One chart per combination of axis kinds (plotters types them apart).
    macro_rules! draw {
        ($x:expr, $y:expr) => {{
            let mut c = b.build_cartesian_2d($x, $y)?;
            c.configure_mesh()
                .x_desc(str_of(spec, "x"))
                .y_desc(y_desc.as_str())
                .x_labels(6)
                .x_label_formatter(&|v| axis(*v))
                .y_label_formatter(&|v| axis(*v))
                .draw()?;
            for (i, (_, pts)) in series.iter().enumerate() {
                c.draw_series(LineSeries::new(
                    pts.iter().copied(),
                    color(i).stroke_width(2),
                ))?;
                c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color(i).filled())))?;
            }
        }};
    }
    match (log_x, log_y) {
        (true, true) => draw!((x0..x1).log_scale(), (y0..y1).log_scale()),
        (true, false) => draw!((x0..x1).log_scale(), y0..y1),
        (false, true) => draw!(x0..x1, (y0..y1).log_scale()),
        (false, false) => draw!(x0..x1, y0..y1),
    }
    root.present()?;
    Ok(())
}
