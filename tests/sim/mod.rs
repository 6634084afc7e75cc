//! The simulation's models of the servers timeoutd talks to, shared by test binaries
//! (`mod sim;`). Minimal until the simulation runner's own modules join it.
#![allow(dead_code)]

pub mod mongo;
