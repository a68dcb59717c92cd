//! `kgctl`: inspect the mesh (graph, showconf).
fn main() -> anyhow::Result<()> {
    anyhow::bail!("kgctl: not implemented yet")
}
