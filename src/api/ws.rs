//! GraphQL over WebSocket (`graphql-transport-ws` and the legacy
//! `graphql-ws`). async-graphql speaks the protocol; this loop adds what it
//! lacks: authentication closing with 4403 (also when the token expires on an
//! open connection), a `connection_init` timeout, and server keepalive pings.

use std::collections::HashSet;
use std::time::Duration;

use async_graphql::Data;
use async_graphql::http::{WebSocket as GraphqlSocket, WebSocketProtocols, WsMessage};
use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, sleep, sleep_until};
use tokio_stream::wrappers::ReceiverStream;

use super::AppState;
use super::auth::Viewer;

/// Client frames buffered towards the protocol engine.
const INBOUND_BUFFER: usize = 16;

const CLOSE_FORBIDDEN: u16 = 4403;
const CLOSE_INIT_TIMEOUT: u16 = 4408;

pub async fn serve(mut socket: WebSocket, protocol: WebSocketProtocols, app: AppState) {
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

    let init_deadline = sleep(Duration::from_secs(app.limits.ws_init_timeout_secs));
    tokio::pin!(init_deadline);
    let far_future = Instant::now() + Duration::from_secs(86_400 * 365);
    let expiry = sleep_until(far_future);
    tokio::pin!(expiry);
    let mut keepalive = tokio::time::interval(Duration::from_secs(app.limits.ws_keepalive_secs));
    keepalive.reset();
    let mut operations = Operations::new(app.limits.ws_max_operations);
    let mut authenticated = false;
    let mut auth_pending = true;

    let close: Option<(u16, String)> = loop {
        tokio::select! {
            incoming = socket.recv() => match incoming {
                Some(Ok(frame @ (Message::Text(_) | Message::Binary(_)))) => {
                    let text = match frame {
                        Message::Text(text) => text.to_string(),
                        other => match String::from_utf8(other.into_data().to_vec()) {
                            Ok(text) => text,
                            Err(_) => break Some((1007, "frames must be UTF-8 JSON".to_owned())),
                        },
                    };
                    if let Some(refusal) = operations.admit(protocol, &text) {
                        if socket.send(Message::Text(refusal.into())).await.is_err() {
                            break None;
                        }
                    } else if inbound.send(text).await.is_err() {
                        break None;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break None,
            },
            outgoing = engine.next() => match outgoing {
                Some(WsMessage::Text(text)) => {
                    operations.ended(&text);
                    if socket.send(Message::Text(text.into())).await.is_err() {
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
                        expiry.as_mut().reset(Instant::now() + viewer.expires_in());
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
                if socket.send(Message::Text(ping.into())).await.is_err() {
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
        let _ = socket.send(Message::Close(Some(frame))).await;
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
