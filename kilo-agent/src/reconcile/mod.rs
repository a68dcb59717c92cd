//! Reconcilers: observe kernel state, diff it against the plan, apply only the difference.
//! Each effect sits behind a small trait with a real implementation and an in-memory fake.
mod writes;

pub use writes::Writes;
