//! `kg`: the kilo-rs agent.
fn main() -> anyhow::Result<()> {
    anyhow::bail!("kg: not implemented yet")
}
