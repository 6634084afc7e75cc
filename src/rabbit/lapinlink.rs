//! The daemon's [`Broker`]: RabbitMQ through lapin. One [`LapinLink`] is one lapin
//! [`Connection`] with one confirm-mode [`Channel`].
//!
//! Nothing here waits without a bound of its caller: [`Broker::open`] and [`Link::close`] are
//! bounded by the publisher (`[rabbitmq] connect_timeout`), a publish and its confirm by the
//! wave's deadline.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::PublishError;
use crate::config::RabbitConfig;
use crate::rabbit::link::{Answer, Broker, Confirm, Link, LinkError, LinkStatus, Returned};
use crate::redact::redact_text;

/// The most a broker's Connection.Start frame may hold here (RabbitMQ's is about 500 bytes).
const MAX_START_FRAME: usize = 64 * 1024;

fn link_error(e: lapin::Error) -> LinkError {
    LinkError(e.to_string())
}

/// Opens lapin connections with the TLS files of `[rabbitmq]`, read once when it is built.
#[derive(Clone)]
pub struct LapinBroker {
    tls: OwnedTLSConfig,
    read_version: bool,
}

impl std::fmt::Debug for LapinBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The TLS identity holds a private key: never printed.
        f.debug_struct("LapinBroker")
            .field("tls_ca", &self.tls.cert_chain.is_some())
            .field("tls_identity", &self.tls.identity.is_some())
            .field("read_version", &self.read_version)
            .finish()
    }
}

impl LapinBroker {
    /// A broker for `[rabbitmq]`: reads its TLS files now.
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
            tls: OwnedTLSConfig {
                identity,
                cert_chain,
            },
            read_version: false,
        })
    }

    /// Also reads the broker's product and version before each connect (`check-config
    /// --connect`): lapin does not keep the server properties of the handshake, so they are
    /// read from a Connection.Start of their own (plain `amqp://` only). Not for the daemon:
    /// the broker may log each such handshake as unfinished.
    pub fn reading_version(mut self) -> Self {
        self.read_version = true;
        self
    }
}

impl Broker for LapinBroker {
    fn open(&self, uri: &str, name: &str) -> BoxFuture<'static, Result<Box<dyn Link>, LinkError>> {
        let props = ConnectionProperties::default().with_connection_name(name.to_string().into());
        let tls = self.tls.clone();
        let read_version = self.read_version;
        let uri = uri.to_string();
        async move {
            let version = if read_version {
                Some(
                    broker_version(&uri)
                        .await
                        .unwrap_or_else(|e| format!("unknown ({e})")),
                )
            } else {
                None
            };
            let runtime = lapin::runtime::default_runtime().map_err(link_error)?;
            let conn = Connection::connect_with_config(&uri, props, tls, runtime)
                .await
                .map_err(link_error)?;
            let channel = conn.create_channel().await.map_err(link_error)?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(link_error)?;
            Ok(Box::new(LapinLink {
                conn: Arc::new(conn),
                channel,
                version,
            }) as Box<dyn Link>)
        }
        .boxed()
    }
}

/// One lapin connection with its confirm-mode channel.
pub struct LapinLink {
    conn: Arc<Connection>,
    channel: Channel,
    version: Option<String>,
}

impl std::fmt::Debug for LapinLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LapinLink")
            .field("status", &self.status())
            .field("frame_max", &self.frame_max())
            .finish()
    }
}

/// The broker's answer as the seam names it; the return, if any, by its `MessageId`.
fn answer(confirmation: Confirmation) -> Answer {
    let returned = |r: lapin::message::BasicReturnMessage| Returned {
        message_id: r
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string()),
        reply_code: r.reply_code,
    };
    match confirmation {
        Confirmation::Ack(r) => Answer::Ack(r.map(returned)),
        Confirmation::Nack(r) => Answer::Nack(r.map(returned)),
        Confirmation::NotRequested => Answer::NotRequested,
    }
}

impl Link for LapinLink {
    fn status(&self) -> LinkStatus {
        let conn = self.conn.status();
        LinkStatus {
            connected: conn.connected() && self.channel.status().connected(),
            blocked: conn.blocked(),
        }
    }

    fn frame_max(&self) -> u32 {
        self.conn.configuration().frame_max()
    }

    fn server_version(&self) -> Option<String> {
        self.version.clone()
    }

    fn publish(
        &self,
        routing_key: &str,
        body: Vec<u8>,
        properties: BasicProperties,
        mandatory: bool,
    ) -> BoxFuture<'static, Result<Confirm, LinkError>> {
        let channel = self.channel.clone();
        let routing_key = routing_key.to_string();
        let options = BasicPublishOptions {
            mandatory,
            ..BasicPublishOptions::default()
        };
        async move {
            let confirm = channel
                .basic_publish("".into(), routing_key.into(), options, &body, properties)
                .await
                .map_err(link_error)?;
            Ok(async move { confirm.await.map(answer).map_err(link_error) }.boxed())
        }
        .boxed()
    }

    fn close(&self, code: u16, reason: &str) -> BoxFuture<'static, Result<(), LinkError>> {
        let conn = Arc::clone(&self.conn);
        let reason = reason.to_string();
        async move { conn.close(code, reason.into()).await.map_err(link_error) }.boxed()
    }
}

/// The broker's product and version, from the Connection.Start it sends a client that opens
/// an AMQP 0-9-1 connection (plain `amqp://` only; lapin does not keep them). The socket is
/// closed right after: the broker may log a handshake that was not finished. No deadline of
/// its own: the caller bounds it.
pub async fn broker_version(uri: &str) -> Result<String, String> {
    let parsed: lapin::uri::AMQPUri = uri.parse().map_err(|e: String| redact_text(&e))?;
    if parsed.scheme != lapin::uri::AMQPScheme::AMQP {
        return Err("not read over amqps://".into());
    }
    let io = |e: std::io::Error| e.to_string();
    let host = parsed.authority.host.clone();
    let mut socket = tokio::net::TcpStream::connect((host.as_str(), parsed.authority.port))
        .await
        .map_err(io)?;
    socket
        .write_all(b"AMQP\x00\x00\x09\x01")
        .await
        .map_err(io)?;
    let mut head = [0u8; 7];
    socket.read_exact(&mut head).await.map_err(io)?;
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    if head[0] != 1 || size > MAX_START_FRAME {
        return Err("the broker sent no Connection.Start".into());
    }
    let mut payload = vec![0u8; size];
    socket.read_exact(&mut payload).await.map_err(io)?;
    // class 10 (connection), method 10 (start), version-major, version-minor, properties.
    if payload.get(..4) != Some(&[0, 10, 0, 10][..]) {
        return Err("the broker sent no Connection.Start".into());
    }
    let table = payload.get(6..).unwrap_or_default();
    let (_, properties) = lapin::types::parsing::parse_field_table(table)
        .map_err(|_| "unreadable server properties".to_string())?;
    let text = |key: &str| match properties.inner().get(key) {
        Some(lapin::types::AMQPValue::LongString(s)) => Some(s.to_string()),
        _ => None,
    };
    match (text("product"), text("version")) {
        (Some(product), Some(version)) => Ok(format!("{product} {version}")),
        (None, Some(version)) => Ok(version),
        _ => Err("the broker did not say".into()),
    }
}
