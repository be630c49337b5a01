//! GraphQL over WebSocket (`graphql-transport-ws` and the legacy
//! `graphql-ws`). async-graphql speaks the protocol; this loop adds what it
//! lacks: authentication closing with 4403 (also when the token expires on an
//! open connection), a `connection_init` timeout, and server keepalive pings.

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
use crate::domain::time::now_millis;

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
        let viewer = bearer_in(&payload).and_then(|value| auth.verify_header(Some(value)).ok());
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
    let mut authenticated = false;
    let mut auth_pending = true;

    let close: Option<(u16, String)> = loop {
        tokio::select! {
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Text(text))) => {
                    if inbound.send(text.to_string()).await.is_err() {
                        break None;
                    }
                }
                Some(Ok(Message::Binary(bytes))) => {
                    let Ok(text) = String::from_utf8(bytes.to_vec()) else {
                        break Some((1007, "frames must be UTF-8 JSON".to_owned()));
                    };
                    if inbound.send(text).await.is_err() {
                        break None;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break None,
            },
            outgoing = engine.next() => match outgoing {
                Some(WsMessage::Text(text)) => {
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
                        let left_ms = (viewer.expires_at * 1000 - now_millis()).max(0) as u64;
                        expiry.as_mut().reset(Instant::now() + Duration::from_millis(left_ms));
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
