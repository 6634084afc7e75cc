//! A TCP proxy for fault injection: forwards 127.0.0.1:PORT to a service and can hold back
//! replies (a request reaches the service, the client hears nothing), stall both directions,
//! or cut every connection and refuse new ones until restored.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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
    /// Every connection is closed (held bytes dropped) and new ones are refused.
    Cut,
}

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
                tokio::spawn(pipe(cr, sw, f.subscribe(), false));
                tokio::spawn(pipe(sr, cw, f.subscribe(), true));
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

/// Copies one direction. `replies`: this is the server-to-client direction.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    replies: bool,
) {
    let held = |f: Mode| match f {
        Mode::Forward => false,
        Mode::HoldReplies => replies,
        Mode::Stall | Mode::Cut => true,
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
            _ = cut(&mut mode) => return,
        };
        loop {
            let now = *mode.borrow_and_update();
            if now == Mode::Cut {
                return;
            }
            if !held(now) {
                break;
            }
            if mode.changed().await.is_err() {
                return;
            }
        }
        tokio::select! {
            r = to.write_all(&buf[..n]) => if r.is_err() { return },
            _ = cut(&mut mode) => return,
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
