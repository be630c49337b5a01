//! GraphQL over Server-Sent Events, the `graphql-sse` protocol, on
//! `/graphql/stream`, in both of its modes:
//! - **Distinct connections.** A `POST` (or `GET`) with
//!   `Accept: text/event-stream` and no stream token is one operation: its
//!   results stream back as `event: next` (`data:` the execution result),
//!   then `event: complete`, and the stream ends.
//! - **Single connection.** A `PUT` reserves a stream and answers `201` with
//!   its token; a `GET` (or `POST`) with `Accept: text/event-stream` and the
//!   token (header `x-graphql-event-stream-token`, or `?token=`) opens it;
//!   each `POST` with the token and `extensions.operationId` starts an
//!   operation (`202`) whose results come on the stream as
//!   `{"id", "payload"}`, then `{"id"}` with `event: complete`; a `DELETE`
//!   with `?operationId=` stops one.
//!
//! An adapter like `api::sse`: a subscription to the event feeds is served
//! by `api::fanout` (admission through the schema, the feed, the shared
//! rendering), anything else by async-graphql's executor, both in this
//! module's framing. Every request carries the caller's bearer token (a
//! stream's `GET`, which `EventSource` makes, may carry a short-lived one
//! in `?access_token=`, as plain SSE); a reservation is its principal's
//! alone, and another's token is a stream not found. A reservation holds a
//! socket share of its principal's from the `PUT`; its stream, once open,
//! also holds a slot of `api.max_websockets`. Reservations live in the
//! process that made them: behind a load balancer, single-connection mode
//! needs the stream and its operations routed to one instance.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_graphql::parser::types::OperationType;
use axum::body::Body;
use axum::extract::{Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_stream::StreamMap;
use tokio_util::sync::CancellationToken;

use super::AppState;
use super::admission::operation_type;
use super::auth::Viewer;
use super::fanout::{self, Frame, Framing};
use super::http::{GRAPHQL_REQUEST, json_response, posted, queried, refusal, unauthenticated};
use super::quotas::Share;
use super::sse;
use super::ws::viewer_data;

/// The refusal of a stream token that is not the caller's reservation.
const STREAM_NOT_FOUND: &str = "stream not found";

/// Where a client of single-connection mode sends its stream's token.
pub const TOKEN_HEADER: &str = "x-graphql-event-stream-token";

/// The reservations of single-connection mode made in this process.
#[derive(Default)]
pub struct Reservations {
    by_token: Mutex<HashMap<String, Arc<Reservation>>>,
}

/// An operation started on a stream: its id and its frames.
type Started = (String, BoxStream<'static, Frame>);

/// A stream reserved by a `PUT`, open or still to be opened.
struct Reservation {
    tenant: String,
    principal: String,
    /// Operations started, for the stream to serve: at most as many as the
    /// stream may hold (`operations` counts them), so there is always room.
    starts: mpsc::Sender<Started>,
    /// Taken by the stream that opens the reservation: there is one.
    inbox: Mutex<Option<mpsc::Receiver<Started>>>,
    /// The principal's socket share, held from the `PUT`, then by the open
    /// stream.
    share: Mutex<Option<Share>>,
    /// The operations not yet complete, each with what stops it.
    operations: Mutex<HashMap<String, CancellationToken>>,
}

/// What the URL may carry.
#[derive(Deserialize)]
pub struct Params {
    token: Option<String>,
    #[serde(rename = "operationId")]
    operation_id: Option<String>,
    access_token: Option<String>,
}

/// `/graphql/stream`, every method.
pub async fn graphql_stream(State(app): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(Query(params)) = Query::<Params>::try_from_uri(&parts.uri) else {
        return bad_request("malformed query string");
    };
    let token = parts
        .headers
        .get(TOKEN_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
        .or(params.token.clone());
    let wants_stream = parts
        .headers
        .get(header::ACCEPT)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|accept| accept.contains("text/event-stream"));
    match (&parts.method, token, wants_stream) {
        (&Method::PUT, _, _) => reserve(&app, &parts.headers).await,
        (&Method::DELETE, Some(token), _) => stop(&app, &parts.headers, &token, params).await,
        (&Method::GET | &Method::POST, Some(token), true) => {
            open(&app, &parts.headers, &token, params).await
        }
        (&Method::GET | &Method::POST, None, true) => distinct(&app, &parts, body, params).await,
        (&Method::POST, Some(token), false) => start(&app, &parts.headers, &token, body).await,
        (&Method::DELETE, None, _) | (&Method::POST, None, false) => bad_request(
            "without Accept: text/event-stream, a request needs the token of a reserved stream",
        ),
        (&Method::GET, _, false) => json_response(
            StatusCode::NOT_ACCEPTABLE,
            "application/json",
            &sse::errors(
                "a GET of /graphql/stream must accept text/event-stream",
                "BAD_USER_INPUT",
            ),
        ),
        _ => {
            let mut response = StatusCode::METHOD_NOT_ALLOWED.into_response();
            response.headers_mut().insert(
                header::ALLOW,
                HeaderValue::from_static("GET, POST, PUT, DELETE"),
            );
            response
        }
    }
}

/// Distinct-connections mode: one operation, its results, `complete`.
async fn distinct(app: &AppState, parts: &Parts, body: Body, params: Params) -> Response {
    let request = if parts.method == Method::POST {
        let viewer = sse::caller(app, &parts.headers, None);
        posted(app, &parts.headers, body, viewer, GRAPHQL_REQUEST).await
    } else {
        match sse::caller(app, &parts.headers, params.access_token.as_deref()).await {
            Err(refused) => Err(unauthenticated(&refused)),
            Ok(viewer) => {
                let query = parts.uri.query().unwrap_or_default();
                queried(app, &viewer, query, &parts.headers)
                    .await
                    .map(|request| (viewer, request))
            }
        }
    };
    let (viewer, request) = match request {
        Ok(posted) => posted,
        Err(refused) => return refused,
    };
    let held = match sse::hold(app, &viewer) {
        Ok(held) => held,
        Err(body) => return sse::refused(&body),
    };
    // Distinct-connections mode's data: the execution result; nothing with
    // `complete`.
    let frames = operation(app, &viewer, sse::Unframed, request);
    sse::stream(app, &viewer, frames.map(event).boxed(), held)
}

/// A `PUT`: a reservation of the caller's, `201` with its token.
async fn reserve(app: &AppState, headers: &HeaderMap) -> Response {
    let viewer = match sse::caller(app, headers, None).await {
        Ok(viewer) => viewer,
        Err(refused) => return unauthenticated(&refused),
    };
    let share = match sse::share(app, &viewer) {
        Ok(share) => share,
        Err(body) => return sse::refused(&body),
    };
    let mut bytes = [0u8; 32];
    if getrandom::fill(&mut bytes).is_err() {
        return sse::refused(&sse::errors("internal error", "INTERNAL"));
    }
    let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    // Started operations wait here until the stream serves them.
    let (starts, inbox) = mpsc::channel(app.limits.ws_max_operations.max(1));
    let reservation = Arc::new(Reservation {
        tenant: viewer.tenant.clone(),
        principal: viewer.principal.clone(),
        starts,
        inbox: Mutex::new(Some(inbox)),
        share: Mutex::new(Some(share)),
        operations: Mutex::default(),
    });
    app.graphql_sse.insert(token.clone(), reservation);
    // A reservation no stream opens in time is let go, and its share with
    // it.
    let reservations = app.graphql_sse.clone();
    let expiring = token.clone();
    let within = Duration::from_secs(app.limits.ws_init_timeout_secs);
    tokio::spawn(async move {
        tokio::time::sleep(within).await;
        reservations.remove_unopened(&expiring);
    });
    let mut response = (StatusCode::CREATED, token).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// A stream's `GET`: the reservation opened, its operations' results as
/// they come, for as long as the client stays or its token is valid.
async fn open(app: &AppState, headers: &HeaderMap, token: &str, params: Params) -> Response {
    let viewer = match sse::caller(app, headers, params.access_token.as_deref()).await {
        Ok(viewer) => viewer,
        Err(refused) => return unauthenticated(&refused),
    };
    let slot = match sse::slot(app) {
        Ok(slot) => slot,
        Err(body) => return sse::refused(&body),
    };
    let (reservation, inbox) = match app.graphql_sse.open(token, &viewer) {
        Opening::Opened(reservation, inbox) => (reservation, inbox),
        Opening::NotFound => return sse::not_found(STREAM_NOT_FOUND),
        Opening::AlreadyOpen => {
            return sse::refused(&sse::errors("the stream is already open", "CONFLICT"));
        }
    };
    let share = reservation
        .share
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    let opened = Opened {
        reservations: app.graphql_sse.clone(),
        token: token.to_owned(),
    };
    let events = serve_reservation(reservation, inbox, opened);
    sse::stream(app, &viewer, events, (slot, share))
}

/// The open stream's events: each operation's frames as they come.
fn serve_reservation(
    reservation: Arc<Reservation>,
    mut inbox: mpsc::Receiver<Started>,
    opened: Opened,
) -> BoxStream<'static, Event> {
    async_stream::stream! {
        let _opened = opened;
        let mut served: StreamMap<String, BoxStream<'static, Frame>> = StreamMap::new();
        loop {
            tokio::select! {
                start = inbox.recv() => match start {
                    Some((id, frames)) => {
                        served.insert(id, frames);
                    }
                    // The reservation keeps a sender while the stream is
                    // served: never.
                    None => break,
                },
                Some((id, frame)) = served.next(), if !served.is_empty() => {
                    if matches!(frame, Frame::Last(_)) {
                        reservation.operations().remove(&id);
                    }
                    yield event(frame);
                }
            }
        }
    }
    .boxed()
}

/// A `POST` with a stream's token: an operation started on the stream,
/// `202`; its results come on the stream.
async fn start(app: &AppState, headers: &HeaderMap, token: &str, body: Body) -> Response {
    let viewer = sse::caller(app, headers, None);
    let (viewer, request): (_, async_graphql::Request) =
        match posted(app, headers, body, viewer, GRAPHQL_REQUEST).await {
            Ok(posted) => posted,
            Err(refused) => return refused,
        };
    let Some(reservation) = app.graphql_sse.of(token, &viewer) else {
        return sse::not_found(STREAM_NOT_FOUND);
    };
    let id = match request.extensions.get("operationId") {
        Some(async_graphql::Value::String(id)) if !id.is_empty() => id.clone(),
        _ => return bad_request("extensions.operationId must name the operation"),
    };
    let stop = CancellationToken::new();
    {
        let mut operations = reservation.operations();
        if operations.contains_key(&id) {
            return sse::refused(&sse::errors(
                "an operation with this operationId is running",
                "CONFLICT",
            ));
        }
        let most = app.limits.ws_max_operations;
        if operations.len() >= most {
            return bad_request(&format!(
                "too many operations on this stream (at most {most})"
            ));
        }
        operations.insert(id.clone(), stop.clone());
    }
    let framing = Single::new(&id);
    let complete = framing.complete();
    let mut request = request;
    // A mutation takes effect now, whether or not a stream ever reads its
    // result; the rest runs as the stream reads it.
    let frames = if is_mutation(app, &viewer, &mut request).await {
        let done: Vec<Frame> = operation(app, &viewer, framing, request).collect().await;
        futures_util::stream::iter(done).boxed()
    } else {
        operation(app, &viewer, framing, request)
    };
    // An operation ends when it is stopped, or when the token that started
    // it expires, as a WebSocket's operations end with its token.
    let frames = until(frames, stop, viewer.expires_in(), complete);
    // There is room: the stream holds at most as many operations.
    if reservation.starts.try_send((id.clone(), frames)).is_err() {
        reservation.operations().remove(&id);
        return sse::not_found(STREAM_NOT_FOUND);
    }
    StatusCode::ACCEPTED.into_response()
}

/// Whether the request is a mutation, read once admission has let its
/// document through (a refused one is not: the schema refuses it again
/// where the stream reads it).
async fn is_mutation(
    app: &AppState,
    viewer: &Viewer,
    request: &mut async_graphql::Request,
) -> bool {
    app.admission.admit(request, Some(viewer)).await.is_ok()
        && operation_type(request) == Some(OperationType::Mutation)
}

/// `frames`, ended with `complete` when `stop` is cancelled or `within`
/// has passed.
fn until(
    frames: BoxStream<'static, Frame>,
    stop: CancellationToken,
    within: Duration,
    complete: String,
) -> BoxStream<'static, Frame> {
    async_stream::stream! {
        let mut frames = frames;
        let expired = tokio::time::sleep(within);
        tokio::pin!(expired);
        loop {
            tokio::select! {
                frame = frames.next() => match frame {
                    Some(frame) => {
                        let last = matches!(frame, Frame::Last(_));
                        yield frame;
                        if last {
                            break;
                        }
                    }
                    None => break,
                },
                () = stop.cancelled() => break,
                () = &mut expired => {
                    yield Frame::Last(complete);
                    break;
                }
            }
        }
    }
    .boxed()
}

/// A `DELETE` with a stream's token and `?operationId=`: the operation
/// stopped, `200`.
async fn stop(app: &AppState, headers: &HeaderMap, token: &str, params: Params) -> Response {
    let viewer = match sse::caller(app, headers, None).await {
        Ok(viewer) => viewer,
        Err(refused) => return unauthenticated(&refused),
    };
    let Some(reservation) = app.graphql_sse.of(token, &viewer) else {
        return sse::not_found(STREAM_NOT_FOUND);
    };
    let Some(id) = params.operation_id.filter(|id| !id.is_empty()) else {
        return bad_request("?operationId= must name the operation to stop");
    };
    // An operation complete already, or never started, has nothing to stop.
    if let Some(stop) = reservation.operations().remove(&id) {
        stop.cancel();
    }
    StatusCode::OK.into_response()
}

/// One operation's frames: a subscription to the event feeds served by the
/// fan-out, anything else by the executor.
fn operation(
    app: &AppState,
    viewer: &Viewer,
    framing: impl Framing,
    request: async_graphql::Request,
) -> BoxStream<'static, Frame> {
    let session = Arc::new(viewer_data(viewer));
    match fanout::plan(request, &app.admission) {
        Ok(plan) => fanout::serve(
            app.fanout.clone(),
            app.schema.clone(),
            app.services.store.clone(),
            session,
            framing,
            plan,
        ),
        Err(request) => fanout::execute(&app.schema, session, framing, *request),
    }
}

/// A frame as the protocol's event: `next`, or `complete` for the last.
fn event(frame: Frame) -> Event {
    match frame {
        Frame::Next(data) => Event::default().event("next").data(data),
        Frame::Last(data) => Event::default().event("complete").data(data),
    }
}

/// Single-connection mode's data: the result with its operation's id.
struct Single {
    /// The id, as a JSON string.
    id: String,
}

impl Single {
    fn new(id: &str) -> Single {
        Single {
            id: serde_json::Value::from(id).to_string(),
        }
    }
}

impl Framing for Single {
    fn next(&self, payload: &str) -> String {
        format!(r#"{{"id":{},"payload":{payload}}}"#, self.id)
    }

    fn complete(&self) -> String {
        format!(r#"{{"id":{}}}"#, self.id)
    }
}

impl Reservations {
    fn insert(&self, token: String, reservation: Arc<Reservation>) {
        self.tokens().insert(token, reservation);
    }

    /// The reservation of `token`, if it is `viewer`'s.
    fn of(&self, token: &str, viewer: &Viewer) -> Option<Arc<Reservation>> {
        self.tokens()
            .get(token)
            .filter(|r| r.tenant == viewer.tenant && r.principal == viewer.principal)
            .cloned()
    }

    /// The reservation of `token`, if it is `viewer`'s, opened: its inbox
    /// taken under the map's lock, so that it cannot lapse meanwhile.
    fn open(&self, token: &str, viewer: &Viewer) -> Opening {
        let tokens = self.tokens();
        let Some(reservation) = tokens
            .get(token)
            .filter(|r| r.tenant == viewer.tenant && r.principal == viewer.principal)
        else {
            return Opening::NotFound;
        };
        let inbox = reservation
            .inbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match inbox {
            Some(inbox) => Opening::Opened(reservation.clone(), inbox),
            None => Opening::AlreadyOpen,
        }
    }

    /// Lets a reservation go if no stream has opened it.
    fn remove_unopened(&self, token: &str) {
        let mut tokens = self.tokens();
        let unopened = tokens.get(token).is_some_and(|reservation| {
            reservation
                .inbox
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some()
        });
        if unopened {
            tokens.remove(token);
        }
    }

    fn tokens(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Reservation>>> {
        self.by_token.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What opening a reservation came to.
enum Opening {
    Opened(Arc<Reservation>, mpsc::Receiver<Started>),
    NotFound,
    AlreadyOpen,
}

impl Reservation {
    fn operations(&self) -> std::sync::MutexGuard<'_, HashMap<String, CancellationToken>> {
        self.operations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// An open stream's hold on its reservation: the reservation ends with the
/// stream.
struct Opened {
    reservations: Arc<Reservations>,
    token: String,
}

impl Drop for Opened {
    fn drop(&mut self) {
        self.reservations.tokens().remove(&self.token);
    }
}

fn bad_request(message: &str) -> Response {
    refusal(StatusCode::BAD_REQUEST, message)
}
