//! GraphQL over WebSocket (`graphql-transport-ws` and the legacy
//! `graphql-ws`). This loop speaks the connection's part of the protocol:
//! `connection_init` (authentication, closing with 4403, also when the token
//! expires on an open connection; a timeout), pings both ways, and the
//! subscriptions to the event feeds, which `api::fanout` serves and whose
//! rendering it shares between subscribers. Any other operation goes to
//! async-graphql's protocol engine, started for the socket the first time
//! one comes: most sockets only ever follow feeds, and an idle one then
//! carries no engine.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_graphql::Data;
use async_graphql::http::{
    ClientMessage, WebSocket as GraphqlSocket, WebSocketProtocols, WsMessage,
};
use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::stream::{SplitSink, SplitStream, Stream};
use futures_util::{FutureExt, SinkExt, StreamExt};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep, timeout};
use tokio_stream::StreamMap;
use tokio_stream::wrappers::ReceiverStream;

use super::TetherSchema;
use super::admission::DocumentAdmission;
use super::auth::{Authenticator, Viewer};
use super::fanout::{self, Frame, Plan};
use super::quotas::{Quotas, Share};
use crate::config::ApiConfig;
use crate::store::Store;
use crate::telemetry;

/// Client frames buffered towards the protocol engine.
const INBOUND_BUFFER: usize = 16;

/// Frames of served operations written before one flush, at most.
const BATCH_FRAMES: usize = 64;

const CLOSE_FORBIDDEN: u16 = 4403;
const CLOSE_UNAUTHORIZED: u16 = 4401;
const CLOSE_INIT_TIMEOUT: u16 = 4408;
const CLOSE_TOO_MANY_INITS: u16 = 4429;
const CLOSE_BAD_FRAME: u16 = 1002;
const CLOSE_TOO_LARGE: u16 = 1009;
const CLOSE_NORMAL: u16 = 1000;
/// RFC 6455's "try again later": the principal or tenant holds as many
/// sockets as it may.
const CLOSE_TRY_AGAIN_LATER: u16 = 1013;

type Served = StreamMap<String, Pin<Box<dyn Stream<Item = Frame> + Send>>>;

/// Where the connection stands.
enum Init {
    /// No `connection_init` yet.
    Waiting,
    /// The `connection_init`'s token is being verified.
    Verifying(Pin<Box<dyn Future<Output = Option<Viewer>> + Send>>),
    /// Acknowledged: the viewer.
    Accepted(Viewer),
}

/// What every connection's loop uses of the app, shared by all of them.
pub struct Shared {
    pub(super) schema: TetherSchema,
    pub(super) store: Store,
    pub(super) auth: Arc<Authenticator>,
    pub(super) limits: Arc<ApiConfig>,
    pub(super) fanout: Arc<fanout::Fanout>,
    pub(super) admission: Arc<DocumentAdmission>,
    pub(super) quotas: Arc<Quotas>,
    /// One permit per WebSocket served (`api.max_websockets`), so that
    /// sockets leave connections for HTTP requests and the probes.
    pub(super) sockets: Arc<tokio::sync::Semaphore>,
}

/// The connection's loop, to be spawned as a task of its own.
///
/// Every idle socket carries this future, so it is kept small: an `async
/// fn` keeps its arguments' storage for as long as it runs, so the socket is
/// split before the loop starts; the app is one pointer; writes are boxed
/// (`send`, `write_ready`); and what a frame asks is decided before anything
/// is awaited (`step`).
pub fn serve(
    socket: WebSocket,
    protocol: WebSocketProtocols,
    shared: Arc<Shared>,
    slot: tokio::sync::OwnedSemaphorePermit,
) -> impl Future<Output = ()> + Send + 'static {
    let open = telemetry::websocket_opened();
    let (sink, stream) = socket.split();
    let conversation = converse(sink, stream, protocol, shared);
    async move {
        conversation.await;
        drop(open);
        drop(slot);
    }
}

async fn converse(
    mut sink: SplitSink<WebSocket, Message>,
    mut stream: SplitStream<WebSocket>,
    protocol: WebSocketProtocols,
    shared: Arc<Shared>,
) {
    let limits = &shared.limits;
    let send_timeout = Duration::from_secs(limits.ws_send_timeout_secs);
    // The init timeout until the connection is acknowledged, then the
    // token's expiry: one timer.
    let deadline = sleep(Duration::from_secs(limits.ws_init_timeout_secs));
    tokio::pin!(deadline);
    let keepalive_every = Duration::from_secs(limits.ws_keepalive_secs);
    let keepalive = sleep(keepalive_every);
    tokio::pin!(keepalive);
    let mut init = Init::Waiting;
    // Keepalive intervals in a row with no operation, and how many close
    // the socket.
    let mut idle_ticks: u64 = 0;
    let idle_limit = limits
        .ws_idle_timeout_secs
        .div_ceil(limits.ws_keepalive_secs.max(1))
        .max(1);
    // The principal's share of sockets, once acknowledged (boxed: every
    // idle socket's future carries this).
    let mut _share: Option<Box<Share>> = None;
    let mut operations = Operations::new(limits.ws_max_operations);
    let mut served: Served = StreamMap::new();
    let mut engine: Option<Box<Engine>> = None;
    let legacy = protocol == WebSocketProtocols::SubscriptionsTransportWS;
    // The client closed: tungstenite has queued its answer (the client's
    // code, echoed), which goes out when the socket is next flushed.
    let mut closed_by_client = false;

    let close: Option<(u16, String)> = loop {
        let accepted = matches!(init, Init::Accepted(_));
        let verifying = matches!(init, Init::Verifying(_));
        tokio::select! {
            // The socket is read only while the engine's buffer has room,
            // and not while a `connection_init` is verified (frames wait in
            // the socket, as they would for the engine). The engine drains
            // its buffer when it is polled (the arm below), so a flood of
            // frames waits in the socket, and the timers and outgoing frames
            // of this loop keep being served.
            incoming = stream.next(), if !verifying && engine.as_ref().is_none_or(|e| e.has_room()) => match incoming {
                Some(Ok(frame @ (Message::Text(_) | Message::Binary(_)))) => {
                    let text = match frame {
                        Message::Text(text) => text.to_string(),
                        other => match String::from_utf8(other.into_data().to_vec()) {
                            Ok(text) => text,
                            Err(_) => break Some((1007, "frames must be UTF-8 JSON".to_owned())),
                        },
                    };
                    let sent = match step(text, &init, &mut operations, &mut served, engine.is_some(), protocol, &shared.admission) {
                        Step::Nothing => true,
                        Step::Reply(reply) => send(&mut sink, Message::Text(reply.into()), send_timeout).await,
                        Step::Verify(payload) => {
                            let auth = shared.auth.clone();
                            init = Init::Verifying(Box::pin(async move {
                                auth.verify_header(bearer_in(&payload)).await.ok()
                            }));
                            true
                        }
                        Step::Serve(id, plan) => {
                            idle_ticks = 0;
                            let Init::Accepted(viewer) = &init else { unreachable!("served once acknowledged") };
                            let operation = fanout::operation(
                                shared.fanout.clone(),
                                shared.schema.clone(),
                                shared.store.clone(),
                                Arc::new(viewer_data(viewer)),
                                legacy,
                                &id,
                                *plan,
                            );
                            // Replacing one of the same id, as the engine does.
                            served.insert(id, operation);
                            true
                        }
                        Step::Pass(text) => {
                            idle_ticks = 0;
                            match (&mut engine, &init) {
                                (Some(engine), _) => engine.pass(text),
                                (None, Init::Accepted(viewer)) => engine.insert(Engine::start(&shared.schema, protocol, viewer)).pass(text),
                                (None, _) => true,
                            }
                        }
                        Step::End { last, close } => {
                            if let Some(last) = last {
                                send(&mut sink, Message::Text(last.into()), send_timeout).await;
                            }
                            break close;
                        }
                    };
                    if !sent {
                        break None;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Err(err)) => break too_large(err, limits.max_request_bytes),
                Some(Ok(Message::Close(_))) => {
                    closed_by_client = true;
                    break None;
                }
                None => break None,
            },
            verified = verification(&mut init) => match verified {
                Some(viewer) => {
                    match shared.quotas.socket(&viewer.tenant, &viewer.principal) {
                        Ok(share) => _share = Some(Box::new(share)),
                        Err(refused) => break Some((CLOSE_TRY_AGAIN_LATER, refused.message().to_owned())),
                    }
                    deadline.as_mut().reset(deadline_after(viewer.expires_in()));
                    init = Init::Accepted(viewer);
                    if !send(&mut sink, Message::Text(r#"{"type":"connection_ack"}"#.into()), send_timeout).await {
                        break None;
                    }
                }
                None => {
                    if legacy {
                        let error = serde_json::json!({ "type": "connection_error", "payload": { "message": "forbidden" } });
                        send(&mut sink, Message::Text(error.to_string().into()), send_timeout).await;
                    }
                    break Some(forbidden("forbidden"));
                }
            },
            Some(first) = served.next(), if !served.is_empty() => {
                let written = write_ready(&mut sink, first, &mut served, send_timeout);
                if !Box::pin(written).await {
                    break None;
                }
            },
            outgoing = engine_frame(&mut engine) => match outgoing {
                Some(WsMessage::Text(text)) => {
                    operations.ended(&text);
                    if !send(&mut sink, Message::Text(text.into()), send_timeout).await {
                        break None;
                    }
                }
                Some(WsMessage::Close(code, reason)) => break Some((code, reason)),
                None => break None,
            },
            () = &mut deadline => break Some(if accepted {
                forbidden("token expired")
            } else {
                (CLOSE_INIT_TIMEOUT, "Connection initialisation timeout".to_owned())
            }),
            () = &mut keepalive, if accepted => {
                keepalive.as_mut().reset(Instant::now() + keepalive_every);
                if served.is_empty() && operations.in_engine.is_empty() {
                    idle_ticks += 1;
                    if idle_ticks >= idle_limit {
                        break Some((CLOSE_NORMAL, format!("idle: no operation for {} s", limits.ws_idle_timeout_secs)));
                    }
                } else {
                    idle_ticks = 0;
                }
                let ping = if legacy { r#"{"type":"ka"}"# } else { r#"{"type":"ping"}"# };
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
    if closed_by_client {
        // Without this the client sees the connection drop (1006) instead
        // of its close acknowledged.
        let _ = timeout(send_timeout, sink.close()).await;
    }
}

/// What a client frame asks of the loop.
enum Step {
    Nothing,
    /// This frame to the client.
    Reply(String),
    /// Verify this `connection_init` payload.
    Verify(serde_json::Value),
    /// Serve this subscription here (`api::fanout`).
    Serve(String, Box<Plan>),
    /// Hand the frame to the engine, started if need be.
    Pass(String),
    /// Send `last`, if any, then close with `close` (or just hang up).
    End {
        last: Option<String>,
        close: Option<(u16, String)>,
    },
}

/// Where a client frame goes, decided before anything is awaited: the
/// frame's parsed form is large, and the loop's future does not carry it.
fn step(
    text: String,
    init: &Init,
    operations: &mut Operations,
    served: &mut Served,
    has_engine: bool,
    protocol: WebSocketProtocols,
    admission: &DocumentAdmission,
) -> Step {
    let legacy = protocol == WebSocketProtocols::SubscriptionsTransportWS;
    let message = match ClientMessage::from_bytes(&text) {
        Ok(message) => message,
        // As the engine closes on a frame it cannot read.
        Err(err) => {
            return Step::End {
                last: None,
                close: Some((CLOSE_BAD_FRAME, err.to_string())),
            };
        }
    };
    match message {
        ClientMessage::ConnectionInit { payload } => match init {
            Init::Waiting => Step::Verify(payload.unwrap_or_default()),
            _ => too_many_inits(legacy),
        },
        ClientMessage::Start { id, payload } => {
            if !matches!(init, Init::Accepted(_)) {
                return Step::End {
                    last: None,
                    close: Some(not_acknowledged(legacy)),
                };
            }
            match operations.admit(protocol, &id, served) {
                Err(refusal) => Step::Reply(refusal),
                Ok(can_serve) => match can_serve
                    .then(|| fanout::plan(payload, admission).ok())
                    .flatten()
                {
                    Some(plan) => Step::Serve(id, Box::new(plan)),
                    None => {
                        served.remove(&id);
                        operations.in_engine.insert(id);
                        Step::Pass(text)
                    }
                },
            }
        }
        ClientMessage::Stop { id } => {
            operations.in_engine.remove(&id);
            if served.remove(&id).is_some() {
                // As the engine answers a stop.
                Step::Reply(serde_json::json!({ "type": "complete", "id": id }).to_string())
            } else if has_engine {
                Step::Pass(text)
            } else {
                Step::Nothing
            }
        }
        ClientMessage::ConnectionTerminate => Step::End {
            last: None,
            close: None,
        },
        // A pong, as soon as possible, with no payload (as the engine
        // answers).
        ClientMessage::Ping { .. } => Step::Reply(r#"{"type":"pong"}"#.to_owned()),
        ClientMessage::Pong { .. } => Step::Nothing,
    }
}

/// The engine, for the operations not served here. It is given an init of
/// its own: the connection is acknowledged by then.
struct Engine {
    inbound: mpsc::Sender<String>,
    frames: Pin<Box<dyn Stream<Item = WsMessage> + Send>>,
    /// The engine's answer to its own init is still to come (and to drop).
    unacknowledged: bool,
}

impl Engine {
    fn start(schema: &TetherSchema, protocol: WebSocketProtocols, viewer: &Viewer) -> Box<Engine> {
        let (inbound, inbound_rx) = mpsc::channel::<String>(INBOUND_BUFFER);
        let viewer = viewer.clone();
        let frames = GraphqlSocket::new(schema.clone(), ReceiverStream::new(inbound_rx), protocol)
            .on_connection_init(move |_| async move { Ok(viewer_data(&viewer)) });
        let init = r#"{"type":"connection_init"}"#.to_owned();
        inbound.try_send(init).expect("a new channel has room");
        Box::new(Engine {
            inbound,
            frames: Box::pin(frames),
            unacknowledged: true,
        })
    }

    fn has_room(&self) -> bool {
        self.inbound.capacity() > 0
    }

    /// Hands a client frame to the engine; false if it has stopped.
    fn pass(&mut self, text: String) -> bool {
        self.inbound.try_send(text).is_ok()
    }
}

/// The engine's next frame for the client; never, while there is no engine.
async fn engine_frame(engine: &mut Option<Box<Engine>>) -> Option<WsMessage> {
    let Some(engine) = engine else {
        return std::future::pending().await;
    };
    loop {
        let frame = engine.frames.next().await;
        if engine.unacknowledged
            && let Some(WsMessage::Text(text)) = &frame
            && text.starts_with(r#"{"type":"connection_ack""#)
        {
            engine.unacknowledged = false;
            continue;
        }
        return frame;
    }
}

/// The verification of the `connection_init`'s token; never, while there is
/// none.
async fn verification(init: &mut Init) -> Option<Viewer> {
    match init {
        Init::Verifying(check) => check.await,
        _ => std::future::pending().await,
    }
}

/// The data an operation of this connection runs with.
pub(super) fn viewer_data(viewer: &Viewer) -> Data {
    let mut data = Data::default();
    data.insert(viewer.clone());
    data
}

/// A subscribe before the connection is acknowledged: `graphql-transport-ws`
/// closes with 4401; the legacy protocol as async-graphql does.
fn not_acknowledged(legacy: bool) -> (u16, String) {
    if legacy {
        (1011, "The handshake is not completed.".to_owned())
    } else {
        (CLOSE_UNAUTHORIZED, "Unauthorized".to_owned())
    }
}

/// A second `connection_init`: `graphql-transport-ws` closes with 4429; the
/// legacy protocol says so in a `connection_error` and hangs up.
fn too_many_inits(legacy: bool) -> Step {
    const REASON: &str = "Too many initialisation requests.";
    if legacy {
        let error =
            serde_json::json!({ "type": "connection_error", "payload": { "message": REASON } });
        Step::End {
            last: Some(error.to_string()),
            close: None,
        }
    } else {
        Step::End {
            last: None,
            close: Some((CLOSE_TOO_MANY_INITS, REASON.to_owned())),
        }
    }
}

/// `now + after`, or thirty years on where that does not fit.
fn deadline_after(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30))
}

/// Writes the frames of served operations ready now in one write (at most
/// `BATCH_FRAMES`): a catch-up's thousands of events, or the two of one
/// commit. Returns whether they went out.
async fn write_ready(
    sink: &mut SplitSink<WebSocket, Message>,
    first: (String, Frame),
    served: &mut Served,
    limit: Duration,
) -> bool {
    let mut ready = Some(first);
    let mut batched = 0;
    while let Some((id, frame)) = ready.take() {
        let text = match frame {
            Frame::Next(text) => text,
            Frame::Last(text) => {
                served.remove(&id);
                text
            }
        };
        if !matches!(
            timeout(limit, sink.feed(Message::Text(text.into()))).await,
            Ok(Ok(()))
        ) {
            return false;
        }
        batched += 1;
        if batched == BATCH_FRAMES {
            break;
        }
        // Whatever else is ready, without waiting: the loop's next turn
        // polls `served` again with the task's waker.
        ready = served.next().now_or_never().flatten();
    }
    matches!(timeout(limit, sink.flush()).await, Ok(Ok(())))
}

/// Sends one frame, giving up on a client that does not take it in time.
/// Returns whether the frame went out.
///
/// Boxed, as the writes of `write_ready` are: the loop's future, which every
/// idle socket carries, then holds a pointer where a write's state would be.
fn send(
    sink: &mut SplitSink<WebSocket, Message>,
    frame: Message,
    limit: Duration,
) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
    Box::pin(async move { matches!(timeout(limit, sink.send(frame)).await, Ok(Ok(()))) })
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
/// and its buffer. Those served here are the keys of `Served`; this keeps
/// the ids of those the engine runs.
struct Operations {
    in_engine: HashSet<String>,
    limit: usize,
}

impl Operations {
    fn new(limit: usize) -> Operations {
        Operations {
            in_engine: HashSet::new(),
            limit,
        }
    }

    /// A subscribe of `id`: the refusal of one over the cap, or whether it
    /// may be served here. An id the engine runs stays with the engine,
    /// which replaces it.
    fn admit<S>(
        &self,
        protocol: WebSocketProtocols,
        id: &str,
        served: &StreamMap<String, S>,
    ) -> Result<bool, String> {
        let in_engine = self.in_engine.contains(id);
        let known = in_engine || served.contains_key(id);
        if !known && self.in_engine.len() + served.len() >= self.limit {
            return Err(self.refusal(protocol, id));
        }
        Ok(!in_engine)
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
            self.in_engine.remove(id);
        }
    }
}

fn forbidden(reason: &str) -> (u16, String) {
    (CLOSE_FORBIDDEN, reason.to_owned())
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
