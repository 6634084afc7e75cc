//! RabbitMQ: the publisher the dispatch loop sends its waves through, and the seam under it.
//!
//! - [`publisher`]: one connection with a publisher-confirm channel to one node of
//!   `[rabbitmq] uri` at a time, failover between nodes, waves published pipelined with
//!   `mandatory`, returns matched by `MessageId`, and the suspect-link policy.
//! - [`link`]: the seam, RabbitMQ at the level of the AMQP link ([`link::Broker`],
//!   [`link::Link`]); [`lapinlink`] is the daemon's, through lapin; the simulation has a
//!   model of a cluster.

pub mod lapinlink;
pub mod link;
pub mod publisher;

/// What can go wrong connecting to RabbitMQ.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("RabbitMQ: {0}")]
    Link(#[from] link::LinkError),
    #[error("RabbitMQ: {0}")]
    Deadline(#[from] crate::deadline::Elapsed),
    /// Shutdown began before the connect finished: whether the broker answers is not known.
    #[error("shutdown began before the connection to RabbitMQ was open")]
    Stopped,
    #[error("no RabbitMQ node answered ({nodes}); the last said: {last}")]
    NoNode { nodes: String, last: String },
    #[error("cannot read TLS file {path}: {source}")]
    TlsFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}
