//! A TCP proxy for fault injection: forwards 127.0.0.1:PORT to a target, and can stall
//! (stop forwarding, keep connections open), resume, or cut (close every connection and
//! refuse new ones until restored).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Forward,
    Stall,
    Cut,
}

pub struct Proxy {
    pub addr: SocketAddr,
    mode: Arc<watch::Sender<Mode>>,
}

impl Proxy {
    /// Starts a proxy to `target` (host:port) on a free local port.
    pub async fn start(target: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let (tx, _) = watch::channel(Mode::Forward);
        let mode = Arc::new(tx);
        let target = target.to_string();
        let m = mode.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if *m.borrow() == Mode::Cut {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, m.subscribe()));
                tokio::spawn(pipe(sr, cw, m.subscribe()));
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
        let (auth, tail) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let creds = auth.rfind('@').map(|i| &auth[..=i]).unwrap_or("");
        format!("{scheme}://{creds}{}{tail}", self.addr)
    }
}

/// Host and port of a URI, for the proxy's target.
pub fn host_port(uri: &str) -> String {
    let rest = uri.split_once("://").expect("scheme").1;
    let auth = rest.split(['/', '?']).next().unwrap();
    auth.rsplit('@').next().unwrap().to_string()
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
            _ = wait_for(&mut mode, Mode::Cut) => return,
        };
        // Hold the bytes while stalled; drop the connection if cut.
        loop {
            let now = *mode.borrow_and_update();
            match now {
                Mode::Forward => break,
                Mode::Cut => return,
                Mode::Stall => {
                    if mode.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn wait_for(mode: &mut watch::Receiver<Mode>, wanted: Mode) {
    loop {
        if *mode.borrow_and_update() == wanted {
            return;
        }
        if mode.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
