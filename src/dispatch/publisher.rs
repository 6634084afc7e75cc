//! The publisher: one RabbitMQ connection with a publisher-confirm channel, to one node of
//! `[rabbitmq] uri` at a time ([`crate::config::nodes`]: a failed link fails over to the next node).
//!
//! A batch is published pipelined (every `basic.publish` goes out before any confirm is
//! awaited), then the confirms are awaited together. Each message gets its own
//! [`SendOutcome`]; only [`SendOutcome::Confirmed`] may lead to deleting its record.

use futures::future::join_all;
use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::{Channel, Connection, ConnectionProperties, ConnectionStatus};

use crate::config::RabbitConfig;
use crate::config::nodes::Nodes;
use crate::metrics as m;
use tokio_util::sync::CancellationToken;

use crate::record::message::OutgoingMessage;

/// What can go wrong connecting to RabbitMQ.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("RabbitMQ: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("RabbitMQ: {0}")]
    Deadline(#[from] crate::deadline::Elapsed),
    #[error("no RabbitMQ node answered ({nodes}); the last said: {last}")]
    NoNode { nodes: String, last: String },
    #[error("cannot read TLS file {path}: {source}")]
    TlsFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// The fate of one published message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    /// The broker confirmed it and routed it to a queue.
    Confirmed,
    /// Returned by the broker: no queue matches the routing key (mandatory publish).
    Returned,
    /// The broker nacked it.
    Nacked,
    /// No confirm arrived before the publisher stopped waiting: the message may or may not
    /// have been delivered.
    TimedOut,
    /// The connection or channel failed after the message went out: it may or may not have
    /// been delivered.
    Connection(String),
    /// The connection was down before the message went out: it was not delivered.
    NotSent(String),
}

impl SendOutcome {
    /// A short label for logs and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            SendOutcome::Confirmed => "confirmed",
            SendOutcome::Returned => "returned",
            SendOutcome::Nacked => "nacked",
            SendOutcome::TimedOut => "timeout",
            SendOutcome::Connection(_) | SendOutcome::NotSent(_) => "connection",
        }
    }

    /// Whether the broker may have delivered the message although no confirm says so.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, SendOutcome::TimedOut | SendOutcome::Connection(_))
    }
}

/// Turns the confirmations of one batch into one outcome per message.
///
/// A `basic.return` precedes its message's ack, but lapin hands each return to whichever ack
/// it resolves next, which under pipelining and multiple-acks is often another message's.
/// So returns are matched to messages by `MessageId`, never by the ack they came with. A
/// return that names no message of the batch makes every acked message of the batch count
/// as returned: sent again rather than lost.
fn settle(
    message_ids: &[Option<String>],
    confirms: Vec<Result<Confirmation, SendOutcome>>,
) -> Vec<SendOutcome> {
    let mut returned: HashSet<String> = HashSet::new();
    let mut unattributed = false;
    for c in &confirms {
        if let Ok(Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r))) = c {
            match r.delivery.properties.message_id() {
                Some(id) if message_ids.iter().flatten().any(|m| m == id.as_str()) => {
                    returned.insert(id.to_string());
                }
                _ => unattributed = true,
            }
        }
    }
    confirms
        .into_iter()
        .zip(message_ids)
        .map(|(c, id)| {
            let was_returned = id.as_ref().is_some_and(|id| returned.contains(id));
            match c {
                Ok(Confirmation::Ack(_)) if was_returned || unattributed => SendOutcome::Returned,
                Ok(Confirmation::Ack(_)) => SendOutcome::Confirmed,
                Ok(Confirmation::Nack(_)) => SendOutcome::Nacked,
                Ok(Confirmation::NotRequested) => {
                    SendOutcome::Connection("channel is not in confirm mode".into())
                }
                Err(outcome) => outcome,
            }
        })
        .collect()
}

/// The state of the open link as the broker last set it, readable while a wave owns the
/// publisher: whether the broker blocked the connection (`connection.blocked`, a memory or
/// disk alarm) and has not unblocked it yet.
#[derive(Debug, Clone, Default)]
pub struct LinkWatch(Arc<Mutex<Option<ConnectionStatus>>>);

impl LinkWatch {
    /// Whether the open connection is blocked by the broker.
    pub fn blocked(&self) -> bool {
        let status = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        status
            .as_ref()
            .is_some_and(|s| s.connected() && s.blocked())
    }

    fn set(&self, status: Option<ConnectionStatus>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = status;
    }
}

/// A RabbitMQ publisher that reconnects on demand.
#[derive(Debug)]
pub struct Publisher {
    nodes: Nodes,
    watch: LinkWatch,
    name: String,
    tls: OwnedTLSConfig,
    link: Option<(Connection, Channel)>,
    connect_timeout: Duration,
}

impl Publisher {
    /// A publisher for `[rabbitmq]`; reads the TLS files now and connects on
    /// [`Publisher::connect`].
    pub fn new(config: &RabbitConfig) -> Result<Self, PublishError> {
        let read = |path: &std::path::Path| {
            std::fs::read(path).map_err(|source| PublishError::TlsFile {
                path: path.to_path_buf(),
                source,
            })
        };
        let cert_chain = match &config.tls_ca_file {
            Some(p) => Some(String::from_utf8_lossy(&read(p)?).into_owned()),
            None => None,
        };
        let identity = match (&config.tls_cert_file, &config.tls_key_file) {
            (Some(cert), Some(key)) => Some(OwnedIdentity::PKCS8 {
                pem: read(cert)?,
                key: read(key)?,
            }),
            _ => None,
        };
        Ok(Self {
            nodes: Nodes::random_start(&config.uri),
            watch: LinkWatch::default(),
            name: config.source_address.clone(),
            tls: OwnedTLSConfig {
                identity,
                cert_chain,
            },
            link: None,
            connect_timeout: config.connect_timeout,
        })
    }

    /// The largest frame the broker accepts on the open connection (its `frame_max`), or
    /// RabbitMQ's default before one is open. A message's content header must fit in it.
    pub fn frame_max(&self) -> u32 {
        match &self.link {
            Some((conn, _)) if conn.configuration().frame_max() > 0 => {
                conn.configuration().frame_max()
            }
            _ => crate::record::message::DEFAULT_FRAME_MAX,
        }
    }

    /// Whether the connection and channel are open.
    pub fn is_connected(&self) -> bool {
        self.link
            .as_ref()
            .is_some_and(|(c, ch)| c.status().connected() && ch.status().connected())
    }

    /// What the dispatch loop reads to learn whether the broker blocked the connection.
    pub fn watch(&self) -> LinkWatch {
        self.watch.clone()
    }

    /// The node in use (`host:port`), or the one tried first.
    pub fn node(&self) -> String {
        self.nodes.current_label()
    }

    /// Opens the connection and a confirm-mode channel unless already open: to the node in
    /// use, or when its link failed to the next node that answers, each within
    /// `[rabbitmq] connect_timeout`.
    pub async fn connect(&mut self) -> Result<(), PublishError> {
        if self.is_connected() {
            return Ok(());
        }
        if self.link.take().is_some() {
            self.nodes.link_failed();
        }
        self.watch.set(None);
        let mut last = None;
        let order: Vec<(usize, String)> = self
            .nodes
            .order()
            .into_iter()
            .map(|(i, u)| (i, u.to_string()))
            .collect();
        for (index, uri) in order {
            match self.open(&uri).await {
                Ok(link) => {
                    self.watch.set(Some(link.0.status().clone()));
                    self.link = Some(link);
                    let failover = self.nodes.connected(index);
                    if let Some(f) = &failover {
                        tracing::warn!(from = %f.from, to = %f.to, nodes = %crate::config::nodes::redact_list(&self.nodes_uri()), "RabbitMQ failover: the link to the node in use failed; another node answered");
                        m::rabbitmq_failover();
                    }
                    m::rabbitmq_node(&self.node(), &self.all_labels());
                    return Ok(());
                }
                Err(e) => {
                    if self.nodes.len() > 1 {
                        tracing::warn!(node = %crate::config::nodes::label(&uri), error = %e, "RabbitMQ node did not answer; trying the next");
                    }
                    last = Some(e);
                }
            }
        }
        match last {
            Some(e) if self.nodes.len() == 1 => Err(e),
            last => Err(PublishError::NoNode {
                nodes: crate::config::nodes::redact_list(&self.nodes_uri()),
                last: last.map_or_else(|| "no node is configured".into(), |e| e.to_string()),
            }),
        }
    }

    fn nodes_uri(&self) -> String {
        self.nodes.uris().join(",")
    }

    fn all_labels(&self) -> Vec<String> {
        self.nodes
            .uris()
            .iter()
            .map(|u| crate::config::nodes::label(u))
            .collect()
    }

    /// One node: the connection and a confirm-mode channel, within `connect_timeout`.
    async fn open(&self, uri: &str) -> Result<(Connection, Channel), PublishError> {
        let props = ConnectionProperties::default().with_connection_name(self.name.clone().into());
        let tls = self.tls.clone();
        crate::deadline::within(self.connect_timeout, "connecting to RabbitMQ", async {
            let runtime = lapin::runtime::default_runtime()?;
            let conn = Connection::connect_with_config(uri, props, tls, runtime).await?;
            let channel = conn.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, PublishError>((conn, channel))
        })
        .await
    }

    /// Closes the connection politely (at shutdown), within `[rabbitmq] connect_timeout`.
    pub async fn close(&mut self) {
        if let Some((conn, _)) = self.link.take() {
            let close = conn.close(200, "timeoutd shutting down".into());
            if tokio::time::timeout(self.connect_timeout, close)
                .await
                .is_err()
            {
                tracing::warn!(timeout = ?self.connect_timeout, "RabbitMQ did not answer the close in time; dropping the connection");
            }
        }
    }

    /// Publishes every message pipelined, then awaits the confirms until each arrives or
    /// `stop_waiting` is cancelled. Returns one outcome per message, in order. `answered` is
    /// cancelled at the first answer from the broker (proof that it reads and confirms).
    pub async fn publish_batch(
        &mut self,
        messages: &[OutgoingMessage],
        stop_waiting: &CancellationToken,
        answered: &CancellationToken,
    ) -> Vec<SendOutcome> {
        let Some((_, channel)) = self.link.as_ref().filter(|_| self.is_connected()) else {
            return vec![SendOutcome::NotSent("not connected".into()); messages.len()];
        };
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        // lapin resolves a publish once its frames reach the socket: a broker that stops
        // reading (a memory or disk alarm) blocks it, so the writes share the confirms'
        // deadline. A publish begun is of unknown outcome once given up on (its frames may
        // still go out); one never begun was not sent.
        let mut pending = Vec::with_capacity(messages.len());
        let mut broken: Option<SendOutcome> = None;
        for m in messages {
            if let Some(outcome) = &broken {
                let not_sent = match outcome {
                    SendOutcome::NotSent(e) | SendOutcome::Connection(e) => e.clone(),
                    _ => "an earlier publish of the wave did not finish in time".into(),
                };
                pending.push(Err(SendOutcome::NotSent(not_sent)));
                continue;
            }
            let publish = channel.basic_publish(
                "".into(),
                m.routing_key.as_str().into(),
                options,
                &m.body,
                m.properties.clone(),
            );
            tokio::select! {
                published = publish => match published {
                    Ok(confirm) => pending.push(Ok(confirm)),
                    Err(e) => {
                        let failed = SendOutcome::NotSent(e.to_string());
                        broken = Some(failed.clone());
                        pending.push(Err(failed));
                    }
                },
                _ = stop_waiting.cancelled() => {
                    broken = Some(SendOutcome::TimedOut);
                    pending.push(Err(SendOutcome::TimedOut));
                }
            }
        }
        let confirms = join_all(pending.into_iter().map(|p| async move {
            let confirm = match p {
                Ok(c) => c,
                Err(outcome) => return Err(outcome),
            };
            tokio::select! {
                c = confirm => {
                    if c.is_ok() {
                        answered.cancel();
                    }
                    c.map_err(|e| SendOutcome::Connection(e.to_string()))
                }
                _ = stop_waiting.cancelled() => Err(SendOutcome::TimedOut),
            }
        }))
        .await;
        let ids: Vec<Option<String>> = messages
            .iter()
            .map(|m| m.properties.message_id().as_ref().map(|id| id.to_string()))
            .collect();
        let outcomes = settle(&ids, confirms);
        // A link that lost or withheld a confirm is suspect: the next batch opens a new one,
        // to the next node. Not one the broker blocks (a memory or disk alarm, which a new
        // link would soon share): it is kept, so that the dispatch loop sees the block until
        // `connection.unblocked`, claiming nothing meanwhile.
        let blocked = self.watch.blocked();
        let suspect = !self.is_connected()
            || (!blocked
                && (broken.is_some() || outcomes.iter().any(SendOutcome::outcome_unknown)));
        if suspect && let Some((conn, _)) = self.link.take() {
            // The next connect starts at the next node: one that withholds confirms (a quorum
            // queue without its majority) must not get the next wave.
            self.nodes.link_failed();
            self.watch.set(None);
            crate::host::spawn(async move {
                let close = conn.close(320, "timeoutd: link lost or withheld confirms".into());
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), close).await;
            });
        }
        outcomes
    }
}
