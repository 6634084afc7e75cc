//! What operators do to records and destinations. The queries behind `list`, `cancel`,
//! `reschedule`, pauses, ramps and the audit are the store's ([`crate::store::listing`],
//! [`crate::store::edit`], [`crate::store::control`]); here is what the instance's tasks share
//! of them: [`control::ControlState`], the pauses in force.

pub mod control;
