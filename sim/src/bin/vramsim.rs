//! The `vramsim` command line.
fn main() {}
