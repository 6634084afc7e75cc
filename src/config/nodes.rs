//! The RabbitMQ nodes of `[rabbitmq] uri`: one URI or a list of them (a TOML array, or
//! comma-separated in `TIMEOUTD_RABBITMQ__URI` and in `uri_file`), each a full `amqp://` or
//! `amqps://` URI with its own credentials and TLS; their validation; and the order in which
//! [`crate::rabbit::publisher::Publisher`] tries them.
//!
//! The order: an instance starts at a random node (so that a fleet spreads over the cluster)
//! and stays on the node that answers until its link fails (is lost, cut, or withholds
//! confirms); then it tries the next nodes of the list in turn, wrapping around, the failed
//! one last. A node that comes back is used again only when the node in use fails: no
//! flapping.

use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serializer};

use crate::redact::{redact_text, redact_uri};

/// The entries of `[rabbitmq] uri` as stored in the configuration (comma-separated), trimmed.
pub fn split(uri: &str) -> Vec<String> {
    uri.split([',', '\n'])
        .map(|s| s.trim().to_string())
        .collect()
}

/// The list with each entry's credentials hidden ([`redact_uri`]), comma-separated.
pub fn redact_list(uri: &str) -> String {
    split(uri)
        .iter()
        .map(|u| redact_uri(u))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What identifies a node in logs and in `timeoutd_rabbitmq_node{node}`: `host:port`, never
/// credentials.
pub fn label(uri: &str) -> String {
    match lapin::uri::AMQPUri::from_str(uri) {
        Ok(u) => format!("{}:{}", u.authority.host, u.authority.port),
        Err(_) => redact_uri(uri),
    }
}

/// An entry as an error may show it: [`redact_uri`], and for what is not even a URI only
/// what follows its last `@` (what precedes it may be a password).
fn shown(entry: &str) -> String {
    if entry.contains("://") {
        redact_uri(entry)
    } else {
        match entry.rsplit_once('@') {
            Some((_, host)) => format!("***@{host}"),
            None => entry.to_string(),
        }
    }
}

/// Every problem of the list, each naming its entry (redacted). Empty when the list is good.
pub fn problems(uri: &str) -> Vec<String> {
    let entries = split(uri);
    if uri.trim().is_empty() {
        return Vec::new(); // reported as "must not be empty"
    }
    let mut found = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let n = i + 1;
        if entry.is_empty() {
            found.push(format!("entry {n} of {} is empty", entries.len()));
            continue;
        }
        let shown = shown(entry);
        if !(entry.starts_with("amqp://") || entry.starts_with("amqps://")) {
            found.push(format!(
                "entry {n} (`{shown}`) must start with amqp:// or amqps://"
            ));
            continue;
        }
        if let Err(e) = lapin::uri::AMQPUri::from_str(entry) {
            found.push(format!(
                "entry {n} (`{shown}`) is not a valid AMQP URI: {}",
                redact_text(&e)
            ));
            continue;
        }
        if entries[..i].contains(entry) {
            found.push(format!("entry {n} (`{shown}`) is listed twice"));
        }
    }
    found
}

/// Reads `[rabbitmq] uri` as one string or a list of strings; a list is kept comma-separated.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged, expecting = "an AMQP URI or a list of them")]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(uri) => uri,
        OneOrMany::Many(all) => all.iter().map(|u| u.trim()).collect::<Vec<_>>().join(","),
    })
}

/// Writes one node as a string and several as a TOML array.
pub fn serialize<S: Serializer>(uri: &str, s: S) -> Result<S::Ok, S::Error> {
    let entries = split(uri);
    if entries.len() == 1 {
        s.serialize_str(uri)
    } else {
        s.collect_seq(entries)
    }
}

/// A node change: the link to `from` failed and `to` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failover {
    pub from: String,
    pub to: String,
}

/// The nodes and which one is in use.
#[derive(Debug, Clone)]
pub struct Nodes {
    uris: Vec<String>,
    /// The node in use, or the one to try first.
    current: usize,
    /// The node of the last open link, while it is still the node in use.
    in_use: Option<usize>,
    /// The link to `current` failed: the next connect starts at the node after it.
    failed: bool,
}

impl Nodes {
    /// The nodes of `uri`, starting at `start` (modulo their number).
    pub fn new(uri: &str, start: usize) -> Self {
        let uris: Vec<String> = split(uri).into_iter().filter(|u| !u.is_empty()).collect();
        let uris = if uris.is_empty() {
            vec![uri.to_string()]
        } else {
            uris
        };
        let current = start % uris.len();
        Self {
            uris,
            current,
            in_use: None,
            failed: false,
        }
    }

    /// The nodes of `uri`, starting at a random one.
    pub fn random_start(uri: &str) -> Self {
        let n = split(uri).len().max(1);
        Self::new(uri, crate::host::random_range(0..n as u64) as usize)
    }

    /// Whether there is only one node (no failover, and its own errors are the link's).
    pub fn single(&self) -> bool {
        self.uris.len() == 1
    }

    /// Every node's label, in the configured order.
    pub fn labels(&self) -> Vec<String> {
        self.uris.iter().map(|u| label(u)).collect()
    }

    /// Every node, credentials hidden ([`redact_list`]).
    pub fn redacted(&self) -> String {
        redact_list(&self.uris.join(","))
    }

    /// The label of node `i`.
    fn label_of(&self, i: usize) -> String {
        self.uris.get(i).map_or_else(String::new, |u| label(u))
    }

    /// The label of the node in use (or to be tried first).
    pub fn current_label(&self) -> String {
        self.label_of(self.current)
    }

    /// The indices to try, in order, with their URIs: from the node in use, or from the one
    /// after it when its link failed (the failed one then comes last).
    pub fn order(&self) -> Vec<(usize, String)> {
        let n = self.uris.len();
        let first = self.current + usize::from(self.failed);
        (0..n)
            .map(|k| (first + k) % n)
            .filter_map(|i| self.uris.get(i).map(|u| (i, u.clone())))
            .collect()
    }

    /// The link to the node in use failed (lost, cut, or withheld confirms).
    pub fn link_failed(&mut self) {
        self.failed = true;
    }

    /// A link to node `index` is open. Returns the failover when the node in use changed.
    pub fn connected(&mut self, index: usize) -> Option<Failover> {
        let before = self.in_use;
        self.current = index % self.uris.len().max(1);
        self.in_use = Some(self.current);
        self.failed = false;
        match before {
            Some(from) if from != self.current => Some(Failover {
                from: self.label_of(from),
                to: self.current_label(),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREE: &str = "amqp://u:p1@a:5672/%2f, amqp://u:p2@b:5673/%2f,amqps://u:p3@c/%2f";

    #[test]
    fn lists_split_label_and_redact() {
        assert_eq!(split(THREE).len(), 3);
        assert_eq!(label("amqp://u:p@a:5673/%2f"), "a:5673");
        assert_eq!(label("amqps://u:p@c/%2f"), "c:5671");
        let shown = redact_list(THREE);
        assert!(!shown.contains("p1") && !shown.contains("p2") && !shown.contains("p3"));
        assert!(shown.contains("@a:5672") && shown.contains("@b:5673") && shown.contains("@c/"));
    }

    #[test]
    fn problems_name_the_entry_without_its_password() {
        assert!(problems(THREE).is_empty());
        let bad = problems("amqp://u:s3cret@a/%2f,http://u:s3cret@b,,amqp://u:s3cret@a/%2f");
        assert_eq!(bad.len(), 3, "{bad:?}");
        assert!(bad[0].starts_with("entry 2 (`http://u:***@b`)"), "{bad:?}");
        assert!(bad[1].starts_with("entry 3 of 4 is empty"), "{bad:?}");
        assert!(
            bad[2].contains("entry 4") && bad[2].contains("twice"),
            "{bad:?}"
        );
        assert!(bad.iter().all(|p| !p.contains("s3cret")));
        let no_scheme = problems("amqp//u:s3cret@b");
        assert_eq!(
            no_scheme,
            ["entry 1 (`***@b`) must start with amqp:// or amqps://"]
        );
        let unparsable = problems("amqp://u:s3cret@a:notaport/%2f");
        assert_eq!(unparsable.len(), 1);
        assert!(!unparsable[0].contains("s3cret"), "{unparsable:?}");
    }

    #[test]
    fn the_configuration_takes_one_uri_or_a_list() {
        use crate::config::Config;
        let c = Config::from_toml(
            "[rabbitmq]\nuri = [\"amqp://u:nodepw-one@a/%2f\", \" amqp://u:nodepw-two@b:5673/%2f\"]",
        )
        .expect("a list");
        assert_eq!(
            split(&c.rabbitmq.uri),
            [
                "amqp://u:nodepw-one@a/%2f",
                "amqp://u:nodepw-two@b:5673/%2f"
            ]
        );
        let shown = c.to_redacted_toml();
        assert!(
            shown.contains("uri = [") && shown.contains("@b:5673"),
            "{shown}"
        );
        assert!(!shown.contains("nodepw"), "{shown}");
        let one = Config::from_toml("[rabbitmq]\nuri = \"amqp://a\"").expect("one");
        assert_eq!(one.rabbitmq.uri, "amqp://a");
        assert!(one.to_redacted_toml().contains("uri = \"amqp://a\""));
        let err = Config::from_toml("[rabbitmq]\nuri = 5")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rabbitmq.uri") && err.contains("list"),
            "{err}"
        );
    }

    #[test]
    fn failover_goes_to_the_next_node_and_does_not_flap_back() {
        let mut nodes = Nodes::new(THREE, 4);
        let order = |n: &Nodes| n.order().iter().map(|(i, _)| *i).collect::<Vec<_>>();
        assert_eq!(order(&nodes), [1, 2, 0], "starts at the given node");
        assert_eq!(nodes.connected(1), None, "the first link is no failover");
        assert_eq!(order(&nodes), [1, 2, 0], "stays on the node in use");
        nodes.link_failed();
        assert_eq!(order(&nodes), [2, 0, 1], "the failed node comes last");
        let f = nodes.connected(2).expect("a failover");
        assert_eq!((f.from.as_str(), f.to.as_str()), ("b:5673", "c:5671"));
        // b is back, but c answers: c stays in use.
        assert_eq!(order(&nodes), [2, 0, 1]);
        nodes.link_failed();
        assert_eq!(nodes.connected(2), None, "reconnecting to the same node");
    }

    #[test]
    fn one_node_never_fails_over() {
        let mut nodes = Nodes::new("amqp://a", 7);
        assert!(nodes.single());
        nodes.connected(0);
        nodes.link_failed();
        assert_eq!(nodes.order().len(), 1);
        assert_eq!(nodes.connected(0), None);
    }
}
