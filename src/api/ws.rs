//! GraphQL over WebSocket (`graphql-transport-ws` and the legacy
//! `graphql-ws`). async-graphql speaks the protocol; this loop adds what it
//! lacks: authentication closing with 4403 (also when the token expires on an
//! open connection), a `connection_init` timeout, and server keepalive pings.
//! Subscriptions to the event feeds are served by `api::fanout` beside the
//! protocol engine, which shares their rendering between subscribers.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_graphql::Data;
use async_graphql::http::{WebSocket as GraphqlSocket, WebSocketProtocols, WsMessage};
use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::stream::{SplitSink, Stream};
use futures_util::{FutureExt, SinkExt, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, sleep, timeout};
use tokio_stream::StreamMap;
use tokio_stream::wrappers::ReceiverStream;

use super::AppState;
use super::auth::Viewer;
use super::fanout::{self, Frame, Plan};

/// Client frames buffered towards the protocol engine.
const INBOUND_BUFFER: usize = 16;

/// Frames of served operations written before one flush, at most.
const BATCH_FRAMES: usize = 64;

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
    // The viewer's data for the operations served beside the engine, from
    // the moment the engine acknowledges the connection.
    // (The engine may acknowledge before or after this loop hears of the
    // viewer.)
    let mut viewer: Option<Viewer> = None;
    let mut acknowledged = false;
    let mut session: Option<Arc<Data>> = None;
    let mut served: StreamMap<String, Pin<Box<dyn Stream<Item = Frame> + Send>>> = StreamMap::new();

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
                    let routed = match operations.admit(protocol, &text, session.is_some(), &served) {
                        Route::Engine => inbound.try_send(text).is_ok(),
                        Route::Reply(reply) => send(&mut sink, Message::Text(reply.into()), send_timeout).await,
                        Route::Serve(id, plan) => {
                            let Some(session) = &session else { unreachable!("served only once acknowledged") };
                            let operation = fanout::operation(
                                app.fanout.clone(),
                                app.schema.clone(),
                                app.services.store.clone(),
                                session.clone(),
                                protocol == WebSocketProtocols::SubscriptionsTransportWS,
                                &id,
                                *plan,
                            );
                            served.insert(id, operation);
                            true
                        }
                        Route::Stop(id) => {
                            served.remove(&id);
                            // As the engine answers a stop.
                            let complete = serde_json::json!({ "type": "complete", "id": id }).to_string();
                            send(&mut sink, Message::Text(complete.into()), send_timeout).await
                        }
                    };
                    if !routed {
                        break None;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Err(err)) => break too_large(err, limits.max_request_bytes),
                Some(Ok(Message::Close(_))) | None => break None,
            },
            Some(first) = served.next(), if !served.is_empty() => {
                // The frames ready now go out in one write: a catch-up's
                // thousands of events, or the two of one commit.
                let mut ready = Some(first);
                let mut batched = 0;
                let mut sent = true;
                while let Some((id, frame)) = ready.take() {
                    let text = match frame {
                        Frame::Next(text) => text,
                        Frame::Last(text) => {
                            operations.active.remove(&id);
                            served.remove(&id);
                            text
                        }
                    };
                    sent = matches!(timeout(send_timeout, sink.feed(Message::Text(text.into()))).await, Ok(Ok(())));
                    batched += 1;
                    if !sent || batched == BATCH_FRAMES {
                        break;
                    }
                    // Whatever else is ready, without waiting: the next turn
                    // of the loop polls `served` again with this task's waker.
                    ready = served.next().now_or_never().flatten();
                }
                if !sent || !matches!(timeout(send_timeout, sink.flush()).await, Ok(Ok(()))) {
                    break None;
                }
            },
            outgoing = engine.next() => match outgoing {
                Some(WsMessage::Text(text)) => {
                    operations.ended(&text);
                    if text.starts_with(r#"{"type":"connection_ack""#) {
                        acknowledged = true;
                        session = session.or_else(|| serving(acknowledged, &mut viewer));
                    }
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
                    Ok(Some(accepted)) => {
                        authenticated = true;
                        expiry.as_mut().reset(deadline_after(accepted.expires_in()));
                        viewer = Some(accepted);
                        session = session.or_else(|| serving(acknowledged, &mut viewer));
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

/// The data of the operations served beside the engine, once the engine has
/// acknowledged the connection and the viewer is known.
fn serving(acknowledged: bool, viewer: &mut Option<Viewer>) -> Option<Arc<Data>> {
    if !acknowledged {
        return None;
    }
    let mut data = Data::default();
    data.insert(viewer.take()?);
    Some(Arc::new(data))
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

/// Where a client frame goes.
enum Route {
    /// To async-graphql's protocol engine, as it is.
    Engine,
    /// Nowhere: this is the answer.
    Reply(String),
    /// A subscription served beside the engine (`api::fanout`).
    Serve(String, Box<Plan>),
    /// The end of a subscription served beside the engine.
    Stop(String),
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

    /// Notes a client frame and says where it goes. An operation over the
    /// cap is refused; a subscription to an event feed is served beside the
    /// engine once the connection is acknowledged (`can_serve`), unless the
    /// engine already runs an operation of that id (it replaces it).
    fn admit<S>(
        &mut self,
        protocol: WebSocketProtocols,
        text: &str,
        can_serve: bool,
        served: &StreamMap<String, S>,
    ) -> Route {
        let Ok(frame) = serde_json::from_str::<serde_json::Value>(text) else {
            return Route::Engine;
        };
        let Some(id) = frame["id"].as_str() else {
            return Route::Engine;
        };
        let id = id.to_owned();
        match frame["type"].as_str() {
            Some("subscribe" | "start") => {
                let known = self.active.contains(&id);
                if !known && self.active.len() >= self.limit {
                    return Route::Reply(self.refusal(protocol, &id));
                }
                let in_engine = known && !served.contains_key(&id);
                let plan = match (can_serve && !in_engine, frame.get("payload")) {
                    (true, Some(payload)) => fanout::plan(payload),
                    _ => None,
                };
                self.active.insert(id.clone());
                match plan {
                    Some(plan) => Route::Serve(id, Box::new(plan)),
                    None => Route::Engine,
                }
            }
            Some("complete" | "stop") => {
                self.active.remove(&id);
                if served.contains_key(&id) {
                    Route::Stop(id)
                } else {
                    Route::Engine
                }
            }
            _ => Route::Engine,
        }
    }

    fn refusal(&self, protocol: WebSocketProtocols, id: &str) -> String {
        let error = serde_json::json!({
            "message": format!("too many operations on this connection (at most {})", self.limit),
            "extensions": { "code": "BAD_USER_INPUT" },
        });
        let payload = match protocol {
            WebSocketProtocols::GraphQLWS => serde_json::json!([error]),
            WebSocketProtocols::SubscriptionsTransportWS => error,
        };
        serde_json::json!({ "id": id, "type": "error", "payload": payload }).to_string()
    }

    /// Notes a frame of the engine's that ends an operation. The engine
    /// writes `type` first, so only frames that may end one are parsed.
    fn ended(&mut self, text: &str) {
        let ends =
            text.starts_with(r#"{"type":"complete""#) || text.starts_with(r#"{"type":"error""#);
        if ends
            && let Ok(frame) = serde_json::from_str::<serde_json::Value>(text)
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
