//! The simulation's models of the servers timeoutd talks to, shared by test binaries
//! (`mod sim;`).
#![allow(dead_code)]

pub mod mongo;
pub mod rabbit;
