//! The simulation's models and runner (`tests/simulate.rs`).

pub mod rabbit;
