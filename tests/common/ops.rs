//! The operator commands run as the binary, for tests/suite/control.rs, tests/suite/cancel.rs and
//! tests/suite/pause.rs.

use std::process::Output;

use bson::{DateTime, Document};
use serde_json::Value;
use uuid::Uuid;

use super::fleet::BIN;
use super::uuid;

/// Runs `timeoutd ARGS` with the environment `vars`.
pub async fn cli(args: &[&str], vars: &[(String, String)]) -> Output {
    tokio::process::Command::new(BIN)
        .args(args)
        .envs(vars.iter().cloned())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run timeoutd")
}

pub fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Stdout as a JSON array.
pub fn json(o: &Output) -> Vec<Value> {
    serde_json::from_str::<Vec<Value>>(out(o).trim())
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", out(o), err(o)))
}

/// A record some instance holds under a live lease until `until`.
pub fn leased(mut d: Document, owner: Uuid, until: DateTime) -> Document {
    d.insert("Locked", true);
    d.insert("LockedBy", uuid(owner));
    d.insert("LockExpiresAt", until);
    d
}

pub fn rfc3339(t: DateTime) -> String {
    t.try_to_rfc3339_string().unwrap()
}
