//! Benchmarks of the prefix index and scoring (being written).
fn main() {}
