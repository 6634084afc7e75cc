//! The seam under [`crate::rabbit::publisher::Publisher`]: RabbitMQ at the level of the AMQP
//! link.
//!
//! A [`Broker`] opens a [`Link`] to one node: a connection with one confirm-mode channel.
//! A link tells its status (open, blocked by `connection.blocked`), its negotiated
//! `frame_max`, publishes (the future resolves once the frames are written; the [`Confirm`]
//! it yields resolves with the broker's answer), and closes. lapin is one implementation
//! (the daemon); an in-memory model of a RabbitMQ cluster is the other (`sim/`). Failover
//! between nodes, waves, returns matched by `MessageId` and the suspect-link policy live above
//! this seam, so they run as real code under the simulation.

use std::fmt;

use futures::future::BoxFuture;
use lapin::BasicProperties;

/// A link failed: the connection or channel is closed, or an I/O error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LinkError(pub String);

/// A link's state as the broker last set it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStatus {
    /// The connection and its channel are open.
    pub connected: bool,
    /// The broker blocked the connection (`connection.blocked`: a memory or disk alarm) and
    /// has not unblocked it yet.
    pub blocked: bool,
}

/// A `basic.return`: the broker could not route a mandatory message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Returned {
    /// The returned message's `MessageId` property.
    pub message_id: Option<String>,
    pub reply_code: u16,
}

/// The broker's answer to one publish. As with lapin, a return may come with the ack of
/// *another* message of the same channel (whichever the client resolves next), so the caller
/// matches returns by `MessageId`, never by the ack that carried them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Ack(Option<Returned>),
    Nack(Option<Returned>),
    /// The channel is not in confirm mode.
    NotRequested,
}

/// The broker's answer to one publish, to be awaited after the publish was written.
pub type Confirm = BoxFuture<'static, Result<Answer, LinkError>>;

/// Opens links to RabbitMQ nodes.
pub trait Broker: Send + Sync + fmt::Debug + 'static {
    /// Connects to the node at `uri` and opens one confirm-mode channel. `name` is the
    /// connection name the broker shows. No deadline of its own: the caller bounds it.
    fn open(&self, uri: &str, name: &str) -> BoxFuture<'static, Result<Box<dyn Link>, LinkError>>;
}

/// One open connection with its confirm-mode channel.
pub trait Link: Send + Sync + fmt::Debug {
    /// Whether it is open, and whether the broker blocks it.
    fn status(&self) -> LinkStatus;

    /// The largest frame the broker accepts on this connection (0 when none was negotiated).
    fn frame_max(&self) -> u32;

    /// The broker's product version from the handshake, when it said.
    fn server_version(&self) -> Option<String>;

    /// Publishes one message to the default exchange with `routing_key`. Resolves once its
    /// frames are written (a broker that stops reading blocks it); then the [`Confirm`]
    /// resolves with the broker's answer.
    fn publish(
        &self,
        routing_key: &str,
        body: Vec<u8>,
        properties: BasicProperties,
        mandatory: bool,
    ) -> BoxFuture<'static, Result<Confirm, LinkError>>;

    /// Closes the connection with `code` and `reason`. No deadline of its own.
    fn close(&self, code: u16, reason: &str) -> BoxFuture<'static, Result<(), LinkError>>;
}
