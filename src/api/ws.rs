//! GraphQL over WebSocket (`graphql-transport-ws` and the legacy
//! `graphql-ws`). async-graphql speaks the protocol; this loop adds what it
//! lacks: authentication closing with 4403 (also when the token expires on an
//! open connection), a `connection_init` timeout, and server keepalive pings.

use std::collections::HashSet;
use std::time::Duration;

use async_graphql::Data;
use async_graphql::http::{WebSocket as GraphqlSocket, WebSocketProtocols, WsMessage};
use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, sleep, timeout};
use tokio_stream::wrappers::ReceiverStream;

use super::AppState;
use super::auth::Viewer;

/// Client frames buffered towards the protocol engine.
const INBOUND_BUFFER: usize = 16;

const CLOSE_FORBIDDEN: u16 = 4403;
const CLOSE_INIT_TIMEOUT: u16 = 4408;
const CLOSE_TOO_LARGE: u16 = 1009;

pub async fn serve(socket: WebSocket, protocol: WebSocketProtocols, app: AppState) {
    let (mut sink, mut stream) = socket.split();
    let (inbound, inbound_rx) = mpsc::channel::<String>(INBOUND_BUFFER);
    let (auth_tx, mut auth_rx) = oneshot::channel::<Option<Viewer>>();
    let auth = app.auth.clone();
    let mut engine = GraphqlSocket::new(
        app.schema.clone(),
        ReceiverStream::new(inbound_rx),
        protocol,
    )
    .on_connection_init(move |payload| async move {
        let viewer = auth.verify_header(bearer_in(&payload)).await.ok();
        let _ = auth_tx.send(viewer.clone());
        match viewer {
            Some(viewer) => {
                let mut data = Data::default();
                data.insert(viewer);
                Ok(data)
            }
            None => Err(async_graphql::Error::new("forbidden")),
        }
    });

    let limits = &app.limits;
    let send_timeout = Duration::from_secs(limits.ws_send_timeout_secs);
    let init_deadline = sleep(Duration::from_secs(limits.ws_init_timeout_secs));
    tokio::pin!(init_deadline);
    // Until a token is accepted nothing expires; `sleep` saturates a
    // duration this long instead of overflowing.
    let expiry = sleep(Duration::MAX);
    tokio::pin!(expiry);
    let mut keepalive = tokio::time::interval(Duration::from_secs(limits.ws_keepalive_secs));
    keepalive.reset();
    let mut operations = Operations::new(limits.ws_max_operations);
    let mut authenticated = false;
    let mut auth_pending = true;

    let close: Option<(u16, String)> = loop {
        tokio::select! {
            // The socket is read only while the engine's buffer has room.
            // The engine drains that buffer when it is polled (the arm
            // below), so a flood of frames waits in the socket, and the
            // timers and outgoing frames of this loop keep being served.
            incoming = stream.next(), if inbound.capacity() > 0 => match incoming {
                Some(Ok(frame @ (Message::Text(_) | Message::Binary(_)))) => {
                    let text = match frame {
                        Message::Text(text) => text.to_string(),
                        other => match String::from_utf8(other.into_data().to_vec()) {
                            Ok(text) => text,
                            Err(_) => break Some((1007, "frames must be UTF-8 JSON".to_owned())),
                        },
                    };
                    if let Some(refusal) = operations.admit(protocol, &text) {
                        if !send(&mut sink, Message::Text(refusal.into()), send_timeout).await {
                            break None;
                        }
                    } else if inbound.try_send(text).is_err() {
                        break None;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Err(err)) => break too_large(err, limits.max_request_bytes),
                Some(Ok(Message::Close(_))) | None => break None,
            },
            outgoing = engine.next() => match outgoing {
                Some(WsMessage::Text(text)) => {
                    operations.ended(&text);
                    if !send(&mut sink, Message::Text(text.into()), send_timeout).await {
                        break None;
                    }
                }
                Some(WsMessage::Close(code, reason)) => {
                    break Some(refused_init(&mut auth_rx).unwrap_or((code, reason)));
                }
                None => break refused_init(&mut auth_rx),
            },
            result = &mut auth_rx, if auth_pending => {
                auth_pending = false;
                match result {
                    Ok(Some(viewer)) => {
                        authenticated = true;
                        expiry.as_mut().reset(deadline_after(viewer.expires_in()));
                    }
                    _ => break Some(forbidden("forbidden")),
                }
            },
            () = &mut init_deadline, if !authenticated && auth_pending => {
                break Some((CLOSE_INIT_TIMEOUT, "Connection initialisation timeout".to_owned()));
            },
            () = &mut expiry => break Some(forbidden("token expired")),
            _ = keepalive.tick(), if authenticated => {
                let ping = match protocol {
                    WebSocketProtocols::GraphQLWS => r#"{"type":"ping"}"#,
                    WebSocketProtocols::SubscriptionsTransportWS => r#"{"type":"ka"}"#,
                };
                if !send(&mut sink, Message::Text(ping.into()), send_timeout).await {
                    break None;
                }
            },
        }
    };
    if let Some((code, reason)) = close {
        let frame = CloseFrame {
            code,
            reason: reason.into(),
        };
        send(&mut sink, Message::Close(Some(frame)), send_timeout).await;
    }
}

/// `now + after`, or thirty years on where that does not fit.
fn deadline_after(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30))
}

/// Sends one frame, giving up on a client that does not take it in time.
/// Returns whether the frame went out.
async fn send(sink: &mut SplitSink<WebSocket, Message>, frame: Message, limit: Duration) -> bool {
    matches!(timeout(limit, sink.send(frame)).await, Ok(Ok(())))
}

/// The close for a read error: a frame over the size limit gets 1009 and a
/// reason; any other error ends the connection without one.
fn too_large(err: axum::Error, limit: usize) -> Option<(u16, String)> {
    let source = err.into_inner();
    match source.downcast_ref::<tungstenite::Error>() {
        Some(tungstenite::Error::Capacity(_)) => Some((
            CLOSE_TOO_LARGE,
            format!("message larger than {limit} bytes"),
        )),
        _ => None,
    }
}

/// The operations running on one socket, capped: each holds a subscription
/// and its buffer.
struct Operations {
    active: HashSet<String>,
    limit: usize,
}

impl Operations {
    fn new(limit: usize) -> Operations {
        Operations {
            active: HashSet::new(),
            limit,
        }
    }

    /// Notes a client frame; returns the refusal to send instead of passing
    /// it on when it starts an operation over the cap.
    fn admit(&mut self, protocol: WebSocketProtocols, text: &str) -> Option<String> {
        let frame: serde_json::Value = serde_json::from_str(text).ok()?;
        let id = frame["id"].as_str()?.to_owned();
        match frame["type"].as_str()? {
            "subscribe" | "start" if !self.active.contains(&id) => {
                if self.active.len() >= self.limit {
                    let error = serde_json::json!({
                        "message": format!("too many operations on this connection (at most {})", self.limit),
                        "extensions": { "code": "BAD_USER_INPUT" },
                    });
                    let payload = match protocol {
                        WebSocketProtocols::GraphQLWS => serde_json::json!([error]),
                        WebSocketProtocols::SubscriptionsTransportWS => error,
                    };
                    return Some(
                        serde_json::json!({ "id": id, "type": "error", "payload": payload })
                            .to_string(),
                    );
                }
                self.active.insert(id);
            }
            "complete" | "stop" => {
                self.active.remove(&id);
            }
            _ => {}
        }
        None
    }

    /// Notes a server frame that ends an operation.
    fn ended(&mut self, text: &str) {
        if !self.active.is_empty()
            && let Ok(frame) = serde_json::from_str::<serde_json::Value>(text)
            && matches!(frame["type"].as_str(), Some("complete" | "error"))
            && let Some(id) = frame["id"].as_str()
        {
            self.active.remove(id);
        }
    }
}

fn forbidden(reason: &str) -> (u16, String) {
    (CLOSE_FORBIDDEN, reason.to_owned())
}

/// When the engine closes after a refused `connection_init`, the close is
/// ours to give: 4403.
fn refused_init(auth_rx: &mut oneshot::Receiver<Option<Viewer>>) -> Option<(u16, String)> {
    match auth_rx.try_recv() {
        Ok(None) => Some(forbidden("forbidden")),
        _ => None,
    }
}

/// The `Authorization` value of a `connection_init` payload, its key in any
/// letter case.
fn bearer_in(payload: &serde_json::Value) -> Option<&str> {
    payload
        .as_object()?
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case("authorization"))
        .and_then(|(_, value)| value.as_str())
}
