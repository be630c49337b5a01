//! The HTTP listener: accepts TCP connections and serves HTTP/1.1 on them,
//! WebSocket upgrades included, with the limits `axum::serve` does not
//! offer: a header-read timeout, an idle keep-alive timeout and a cap on
//! the connections served at once. Event streams are written by
//! `streaming`, outside hyper.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper::service::{Service, service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ApiConfig;

mod streaming;

/// The address the listener that accepted a connection is bound to (say
/// `0.0.0.0:9000`, where the connection's own address would be one
/// interface's), for handlers whose access depends on who can reach the
/// listener (`/metrics`).
#[derive(Debug, Clone, Copy)]
pub struct LocalAddr(pub std::net::SocketAddr);

/// What bounds one server's connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    /// How long a new connection may take to send its first byte.
    pub first_byte_timeout: Duration,
    pub keepalive_idle: Duration,
    pub max_connections: usize,
}

impl ConnectionLimits {
    pub fn of(api: &ApiConfig) -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(api.header_read_timeout_secs),
            first_byte_timeout: Duration::from_millis(api.first_byte_timeout_ms),
            keepalive_idle: Duration::from_secs(api.keepalive_idle_secs),
            max_connections: api.max_connections,
        }
    }
}

/// Serves `app` on `listener` until `stopping` is cancelled, then lets open
/// connections finish their requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stopping: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let bound = listener.local_addr().ok().map(LocalAddr);
    let connections = TaskTracker::new();
    loop {
        // A connection over the cap waits in the kernel's backlog until a
        // served one ends.
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = stopping.cancelled() => break,
        };
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(err) => {
                    // Out of descriptors, or a connection reset before it
                    // was accepted: wait a little rather than spin.
                    tracing::debug!(error = %err, "accept failed");
                    sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = stopping.cancelled() => break,
        };
        // Events are small frames: without TCP_NODELAY, Nagle's algorithm
        // and a client's delayed ACK hold them back by tens of milliseconds.
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
        connections.spawn(serve_connection(
            tcp,
            bound,
            permit,
            app.clone(),
            limits,
            stopping.clone(),
        ));
    }
    connections.close();
    connections.wait().await;
}

async fn serve_connection(
    tcp: TcpStream,
    local: Option<LocalAddr>,
    permit: OwnedSemaphorePermit,
    app: Router,
    limits: ConnectionLimits,
    stopping: CancellationToken,
) {
    // A connection that sends nothing holds its slot this long, not the
    // whole header timeout: nothing is read, only waited for.
    let mut first = [0u8; 1];
    match tokio::time::timeout(limits.first_byte_timeout, tcp.peek(&mut first)).await {
        Ok(Ok(n)) if n > 0 => {}
        _ => return,
    }
    // An event stream keeps its connection for its whole life: served
    // where hyper's buffers do not stay with it.
    if first[0] == b'G'
        && let Some(stream) = streaming::peek(&tcp).await
    {
        return streaming::serve(tcp, stream, local, permit, app, stopping).await;
    }
    let activity = Activity::new();
    let router = TowerToHyperService::new(app);
    // Handlers that serve loopback callers only (`/metrics`) read it.
    let peer = tcp.peer_addr().ok().map(ConnectInfo);
    let service = {
        let activity = activity.clone();
        service_fn(move |mut request: hyper::Request<Incoming>| {
            if let Some(peer) = peer {
                request.extensions_mut().insert(peer);
            }
            if let Some(local) = local {
                request.extensions_mut().insert(local);
            }
            let guard = activity.begin();
            let response = router.call(request);
            async move {
                let response = response.await;
                drop(guard);
                response
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    // The permit travels with the socket, so an upgraded WebSocket keeps
    // its slot until it closes.
    let io = TokioIo::new(Counted {
        tcp,
        _permit: permit,
    });
    let connection = builder.serve_connection(io, service).with_upgrades();
    tokio::pin!(connection);
    let mut closing = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(err) = result {
                    tracing::debug!(error = %err, "connection ended with an error");
                }
                break;
            }
            () = activity.idle_for(limits.keepalive_idle), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
            () = stopping.cancelled(), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Requests in flight on one connection and when the last one ended.
#[derive(Clone)]
struct Activity(Arc<watch::Sender<(usize, Instant)>>);

/// Marks a request in flight until dropped.
struct InFlight(Activity);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .0
            .send_modify(|(busy, last)| (*busy, *last) = (busy.saturating_sub(1), Instant::now()));
    }
}

impl Activity {
    fn new() -> Activity {
        Activity(Arc::new(watch::Sender::new((0, Instant::now()))))
    }

    fn begin(&self) -> InFlight {
        self.0.send_modify(|(busy, _)| *busy += 1);
        InFlight(self.clone())
    }

    /// Resolves once no request has been in flight for `limit`.
    async fn idle_for(&self, limit: Duration) {
        let mut changes = self.0.subscribe();
        loop {
            let (busy, last) = *changes.borrow_and_update();
            if busy == 0 {
                let due = last.checked_add(limit).unwrap_or(last);
                tokio::select! {
                    () = sleep_until(due) => return,
                    _ = changes.changed() => {}
                }
            } else if changes.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// A connection's socket, holding its slot under the connection cap.
struct Counted {
    tcp: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}
