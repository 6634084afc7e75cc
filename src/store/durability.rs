//! What the MongoDB deployment must give for the lease to mean what it says, checked at start.
//!
//! On a replica set a claim or a guarded delete acknowledged by the primary alone can be rolled
//! back by a failover: a claimed record becomes claimable again while this instance sends it
//! (a duplicate), a delete comes back (a duplicate at the next poll). `w: "majority"` makes an
//! acknowledged lease write survive a failover. Reads from secondaries may miss a claim just
//! made or a delete just done. timeoutd warns at start about each such setting; it does not
//! refuse them (`w=0` alone is refused, in [`crate::store`]).

use bson::Document;
use mongodb::options::{Acknowledgment, ReadPreference, SelectionCriteria, WriteConcern};

/// The settings that weaken the lease on the deployment a `hello` reply describes, each as a
/// sentence for the log. Empty on a standalone server (no failover) and with safe settings.
pub fn risks(
    hello: &Document,
    write_concern: Option<&WriteConcern>,
    selection: Option<&SelectionCriteria>,
) -> Vec<String> {
    let replicated = hello.contains_key("setName") || hello.get_str("msg") == Ok("isdbgrid");
    if !replicated {
        return Vec::new();
    }
    let mut risks = Vec::new();
    match write_concern.and_then(|wc| wc.w.as_ref()) {
        None => {}
        Some(Acknowledgment::Majority) => {}
        Some(w) => risks.push(format!(
            "the write concern is w={w:?}, not majority: a failover can roll back an acknowledged claim or delete, and the timeouts it covered are sent twice; use w=majority"
        )),
    }
    if write_concern.and_then(|wc| wc.journal) == Some(false) {
        risks.push(
            "the write concern has journal=false: an acknowledged lease write can be lost with the primary; remove journal=false".into(),
        );
    }
    match selection {
        None | Some(SelectionCriteria::ReadPreference(ReadPreference::Primary)) => {}
        Some(other) => risks.push(format!(
            "reads go to {other:?}, not the primary: a claim reads candidates and reads back what it took, and a secondary may not have the latest lease writes yet; use readPreference=primary"
        )),
    }
    risks
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

    fn wc(w: Acknowledgment) -> WriteConcern {
        WriteConcern::builder().w(w).build()
    }

    #[test]
    fn a_standalone_server_has_no_failover_to_fear() {
        let hello = doc! { "isWritablePrimary": true };
        assert!(risks(&hello, Some(&wc(Acknowledgment::Nodes(1))), None).is_empty());
    }

    #[test]
    fn w1_journal_off_and_secondary_reads_are_risks_on_a_replica_set() {
        let rs = doc! { "setName": "rs0" };
        assert!(
            risks(&rs, None, None).is_empty(),
            "the server's default applies"
        );
        assert!(risks(&rs, Some(&wc(Acknowledgment::Majority)), None).is_empty());
        let w1 = risks(&rs, Some(&wc(Acknowledgment::Nodes(1))), None);
        assert_eq!(w1.len(), 1);
        assert!(w1[0].contains("not majority"), "{w1:?}");
        let no_journal = WriteConcern::builder().journal(false).build();
        assert!(risks(&rs, Some(&no_journal), None)[0].contains("journal=false"));
        let secondary =
            SelectionCriteria::ReadPreference(ReadPreference::Secondary { options: None });
        assert!(risks(&rs, None, Some(&secondary))[0].contains("not the primary"));
        let mongos = doc! { "msg": "isdbgrid" };
        assert_eq!(
            risks(&mongos, Some(&wc(Acknowledgment::Nodes(1))), None).len(),
            1
        );
    }
}
