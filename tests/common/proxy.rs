//! A TCP proxy for fault injection: forwards 127.0.0.1:PORT to a service and can hold back
//! replies (a request reaches the service, the client hears nothing), stall both directions,
//! delay every chunk by a set time (a slow link: nothing is lost or reordered, and nothing is
//! closed), or cut every connection and refuse new ones until restored.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// What a [`Proxy`] does to the bytes of its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Both directions flow.
    Forward,
    /// Client to server flows; server to client is held back. The service acts on every
    /// request (a publish is routed) and the client hears nothing (no confirm).
    HoldReplies,
    /// Nothing flows; connections stay open and bytes are held.
    Stall,
    /// A slow link: every chunk read from the server is delivered to the client `replies`
    /// after it was read, every chunk from the client to the server `requests` after; in
    /// order, nothing dropped, nothing closed. A round trip takes `requests + replies` more.
    /// Chunks still waiting when the mode changes go at once (or are held, or dropped, as
    /// the new mode says).
    Delay {
        requests: Duration,
        replies: Duration,
    },
    /// Every connection is closed (held bytes dropped) and new ones are refused.
    Cut,
}

impl Mode {
    /// Replies (server to client) delayed by `d`; requests flow.
    pub fn slow_replies(d: Duration) -> Self {
        Mode::Delay {
            requests: Duration::ZERO,
            replies: d,
        }
    }
}

/// Chunks read but not yet written, per direction. Enough that a delay adds latency without
/// limiting throughput; bounded, so that a held direction pushes back on its sender.
const IN_FLIGHT_CHUNKS: usize = 1_024;

/// A TCP proxy on 127.0.0.1 for one instance's link to a service.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: Arc<watch::Sender<Mode>>,
}

impl Proxy {
    /// Proxies to `target` (host:port), forwarding.
    pub async fn start(target: &str) -> Self {
        Self::start_in(target, Mode::Forward).await
    }

    /// Proxies to `target` (host:port), starting in `initial`.
    pub async fn start_in(target: &str, initial: Mode) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(watch::channel(initial).0);
        let f = mode.clone();
        let target = target.to_string();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if *f.borrow() == Mode::Cut {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                pipe(cr, sw, &f, false);
                pipe(sr, cw, &f, true);
            }
        });
        Self { addr, mode }
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// `scheme://user:pass@host:port/rest` with host:port replaced by the proxy.
    pub fn rewrite(&self, uri: &str) -> String {
        let (scheme, rest) = uri.split_once("://").expect("uri with scheme");
        let (auth, tail) = match rest.find(['/', '?']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let creds = auth.rfind('@').map(|i| &auth[..=i]).unwrap_or("");
        format!("{scheme}://{creds}{}{tail}", self.addr)
    }
}

/// Whether `mode` holds the bytes of a direction (`replies`: server to client).
fn held(mode: Mode, replies: bool) -> bool {
    match mode {
        Mode::Forward | Mode::Delay { .. } => false,
        Mode::HoldReplies => replies,
        Mode::Stall | Mode::Cut => true,
    }
}

/// How long `mode` delays a chunk of a direction.
fn delay(mode: Mode, replies: bool) -> Duration {
    match mode {
        Mode::Delay {
            requests,
            replies: r,
        } => {
            if replies {
                r
            } else {
                requests
            }
        }
        _ => Duration::ZERO,
    }
}

/// Copies one direction: a reader that stamps each chunk with the instant it may go, and a
/// writer that sends them in order once due. `replies`: the server-to-client direction.
fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: &watch::Sender<Mode>,
    replies: bool,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(IN_FLIGHT_CHUNKS);
    let mut reading = mode.subscribe();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = tokio::select! {
                r = from.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
                _ = cut(&mut reading) => return,
            };
            // A held direction reads no further, so the sender's buffers fill as they would.
            if !wait_unheld(&mut reading, replies).await {
                return;
            }
            let due = Instant::now() + delay(*reading.borrow(), replies);
            tokio::select! {
                r = tx.send((due, buf[..n].to_vec())) => if r.is_err() { return },
                _ = cut(&mut reading) => return,
            }
        }
    });
    let mut writing = mode.subscribe();
    tokio::spawn(async move {
        while let Some((due, chunk)) = tokio::select! {
            c = rx.recv() => c,
            _ = cut(&mut writing) => None,
        } {
            // Due, or the delay was lifted (the link is fast again): then it goes now.
            loop {
                if !wait_unheld(&mut writing, replies).await {
                    return;
                }
                if !matches!(*writing.borrow(), Mode::Delay { .. }) {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(due) => break,
                    changed = writing.changed() => if changed.is_err() { break },
                }
            }
            tokio::select! {
                r = to.write_all(&chunk) => if r.is_err() { return },
                _ = cut(&mut writing) => return,
            }
        }
    });
}

/// Waits while the mode holds this direction; false once the proxy is cut.
async fn wait_unheld(mode: &mut watch::Receiver<Mode>, replies: bool) -> bool {
    loop {
        let now = *mode.borrow_and_update();
        if now == Mode::Cut {
            return false;
        }
        if !held(now, replies) {
            return true;
        }
        if mode.changed().await.is_err() {
            return false;
        }
    }
}

/// Resolves when the proxy is cut (never, if the proxy is gone).
async fn cut(mode: &mut watch::Receiver<Mode>) {
    loop {
        if *mode.borrow_and_update() == Mode::Cut {
            return;
        }
        if mode.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Host and port of a URI, for the proxy's target.
pub fn host_port(uri: &str) -> String {
    let rest = uri.split_once("://").expect("scheme").1;
    let auth = rest.split(['/', '?']).next().unwrap();
    auth.rsplit('@').next().unwrap().to_string()
}
