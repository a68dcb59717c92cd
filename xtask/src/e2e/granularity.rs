//! The e2e scenario: full granularity and back.
use super::*;

impl Cluster {
    /// Kilo's e2e in full granularity: `--mesh-granularity=full` added to kg's args, every pod
    /// reaches every other; then the args as the overlay has them, and again.
    pub(super) fn full_granularity(&self) -> Result<String> {
        let (i, args) = self.kg_args()?;
        let mut full = args.as_array().cloned().unwrap_or_default();
        full.push(json!("--mesh-granularity=full"));
        self.set_kg_args(i, &Value::Array(full))?;
        // Every node leads a segment of its own in full granularity, one per location else.
        let locations = NODES.iter().map(|(_, l)| l).collect::<BTreeSet<_>>().len();
        let leading = |want: usize| {
            wait_for(Duration::from_secs(90), &format!("{want} leaders"), || {
                let leaders = self.leaders()?;
                if leaders.len() == want {
                    Ok(Some(()))
                } else {
                    bail!("leaders {leaders:?}")
                }
            })
        };
        leading(NODES.len())?;
        let in_full = self.adjacency(Duration::from_secs(90))?;
        self.set_kg_args(i, &args)?;
        leading(locations)?;
        let back = self.adjacency(Duration::from_secs(90))?;
        Ok(format!("full: {in_full}; location again: {back}"))
    }
}
