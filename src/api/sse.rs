//! Plain Server-Sent Events of one conversation's or one run's events
//! (`GET /conversations/{id}/events`, `GET /runs/{id}/events`).
//!
//! An adapter over the subscription a WebSocket client would make, not a
//! copy of it: the request is a fixed `conversationEvents` or `runEvents`
//! document that `api::fanout` admits through the schema (the viewer's
//! access, the cursor, the subscription shares) and serves from the feed
//! (`api::feed::follow`) with the shared rendering. Only the framing is
//! this module's: `event:` the event's `type`, `id:` its cursor (none for a
//! live `part.delta`, which is not persisted), `data:` the event as the
//! contract shapes it.
//!
//! The token is the `Authorization` header's, or, for `EventSource`, which
//! cannot send headers, a short-lived one in `?access_token=`. Without
//! `Last-Event-ID` or `?after=`, a stream starts at the first persisted
//! event. A run's stream ends after the run's final event. The
//! stream ends when the token expires; the client reconnects with a new
//! one and `Last-Event-ID`, as `EventSource` does.

use std::sync::Arc;
use std::time::Duration;

use async_graphql::{Request, Variables};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;

use super::AppState;
use super::auth::{AuthError, Refusal, Viewer};
use super::fanout::{self, Admitted, Frame, Framing};
use super::http::{authorization, json_response, refusal, unauthenticated};
use super::quotas::Share;
use super::types::parse_id;
use super::ws::viewer_data;
use crate::domain::cursor::Cursor;
use crate::domain::run::RunStatus;
use crate::store::reads;

/// Every field of every event type, as the contract lists them.
const EVENT: &str = "fragment Event on TransportEvent { __typename cursor type conversationId runId at \
    ... on RunEvent { status } \
    ... on RunRetryPending { attempt maxAttempts delayMs nextAttemptAt error { code httpStatus message retryable } } \
    ... on MessageEvent { messageId role } \
    ... on PartEvent { messageId partId kind textLength } \
    ... on PartDelta { messageId partId offset text } \
    ... on ToolEvent { toolCallId toolName } \
    ... on InteractionEvent { interactionId } \
    ... on UsageUpdated { usage { inputTokens outputTokens costUsd } } \
    ... on ContextCompacted { messagesCompacted } }";

/// Whose events a stream follows.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Feed {
    Conversation,
    Run,
}

impl Feed {
    /// The subscription a WebSocket client would send for it.
    fn document(self) -> String {
        let field = match self {
            Feed::Conversation => "conversationEvents(conversationId: $id, after: $after)",
            Feed::Run => "runEvents(runId: $id, after: $after)",
        };
        format!(
            "subscription Events($id: ID!, $after: String) {{ events: {field} {{ ...Event }} }} {EVENT}"
        )
    }
}

/// What the URL may carry, for a client that cannot send headers
/// (`EventSource`): `?after=CURSOR` for `Last-Event-ID`, and
/// `?access_token=JWT` for `Authorization`.
#[derive(Deserialize)]
pub struct Params {
    after: Option<String>,
    access_token: Option<String>,
}

pub async fn conversation_events(
    State(app): State<AppState>,
    Path(id): Path<String>,
    params: Result<Query<Params>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    events(&app, Feed::Conversation, id, params, &headers).await
}

pub async fn run_events(
    State(app): State<AppState>,
    Path(id): Path<String>,
    params: Result<Query<Params>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    events(&app, Feed::Run, id, params, &headers).await
}

/// A query string the endpoint cannot read, refused as GraphQL refuses
/// bad input.
pub(super) fn malformed(rejected: &QueryRejection) -> Response {
    refusal(
        StatusCode::BAD_REQUEST,
        &format!("malformed query string: {}", rejected.body_text()),
    )
}

async fn events(
    app: &AppState,
    feed: Feed,
    id: String,
    params: Result<Query<Params>, QueryRejection>,
    headers: &HeaderMap,
) -> Response {
    let Query(params) = match params {
        Ok(params) => params,
        Err(rejected) => return malformed(&rejected),
    };
    let viewer = match caller(app, headers, params.access_token.as_deref()).await {
        Ok(viewer) => viewer,
        Err(refused) => return unauthenticated(&refused),
    };
    let held = match hold(app, &viewer) {
        Ok(held) => held,
        Err(body) => return refused(&body),
    };
    // `Last-Event-ID` is what `EventSource` sends when it reconnects; an
    // empty one, or an empty `?after=`, is none.
    let after = headers
        .get("last-event-id")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
        .or(params.after)
        .filter(|after| !after.is_empty())
        .unwrap_or_else(|| Cursor::START.to_string());
    let mut frames = match follow(app, &viewer, feed, &id, &after).await {
        Ok(frames) => frames,
        Err(body) => return refused(&body),
    };
    // A run that has ended has a stream that ends: one with nothing after
    // the cursor answers 204, which stops `EventSource` reconnecting to it
    // for ever with its last event's id.
    if feed == Feed::Run && run_has_ended(app, &viewer, &id).await {
        match frames.next().await {
            None | Some(Frame::Last(_)) => return StatusCode::NO_CONTENT.into_response(),
            Some(first) => {
                frames = futures_util::stream::once(async { first })
                    .chain(frames)
                    .boxed()
            }
        }
    }
    let events = frames.filter_map(|frame| std::future::ready(sse_event(frame)));
    stream(app, &viewer, events.boxed(), held)
}

/// The events of a conversation's or a run's feed after `after`, each
/// rendered with every field its type has (`{"data":{"events":…}}`), as
/// the subscription a WebSocket client would make: admitted through the
/// schema (the viewer's access, the cursor, the subscription shares) and
/// served by the fan-out. A refusal is its error body.
pub(super) async fn follow(
    app: &AppState,
    viewer: &Viewer,
    feed: Feed,
    id: &str,
    after: &str,
) -> Result<BoxStream<'static, Frame>, Value> {
    let request = Request::new(feed.document())
        .variables(Variables::from_json(json!({ "id": id, "after": after })));
    let Ok(plan) = fanout::plan(request, &app.admission) else {
        // Only limits set below what the fixed document needs refuse it.
        tracing::error!("the events document is not admitted under the configured limits");
        return Err(errors("internal error", "INTERNAL"));
    };
    let admitted = fanout::admit(
        app.fanout.clone(),
        app.schema.clone(),
        app.services.store.clone(),
        Arc::new(viewer_data(viewer)),
        plan,
    )
    .await;
    if let Admitted::Refused(responses) = &admitted {
        let mut body = responses
            .first()
            .and_then(|response| serde_json::to_value(response).ok())
            .unwrap_or(Value::Null);
        without_locations(&mut body);
        return Err(body);
    }
    Ok(fanout::frames(Unframed, admitted))
}

/// The errors of `body` without where in the document they are: no help
/// to a client that never sent it.
pub(super) fn without_locations(body: &mut Value) {
    for err in body["errors"].as_array_mut().into_iter().flatten() {
        if let Some(err) = err.as_object_mut() {
            err.remove("locations");
            err.remove("path");
        }
    }
}

/// What a stream holds while it is served: a slot and a share (`slot`,
/// `share`).
pub(super) type Held = (OwnedSemaphorePermit, Share);

/// The slot and share a stream holds, or the refusal's body.
pub(super) fn hold(app: &AppState, viewer: &Viewer) -> Result<Held, Value> {
    slot(app).and_then(|slot| Ok((slot, share(app, viewer)?)))
}

/// A `NOT_FOUND` refusal, as GraphQL gives it for what the caller cannot
/// see.
pub(super) fn not_found(message: &str) -> Response {
    refused(&errors(message, "NOT_FOUND"))
}

/// A slot of those kept from HTTP requests and the probes
/// (`api.max_websockets`): a stream holds its connection, as a WebSocket
/// does. 503 when there is none.
pub(super) fn slot(app: &AppState) -> Result<OwnedSemaphorePermit, Value> {
    app.ws.sockets.clone().try_acquire_owned().map_err(|_| {
        errors(
            "the server is serving as many streams as it may; try again later",
            "UNAVAILABLE",
        )
    })
}

/// The viewer's principal's and tenant's share of streams and sockets: 429
/// with `Retry-After` past it.
pub(super) fn share(app: &AppState, viewer: &Viewer) -> Result<Share, Value> {
    app.services
        .quotas
        .socket(&viewer.tenant, &viewer.principal)
        .map_err(|limited| json!({ "errors": [async_graphql::Error::from(limited)] }))
}

/// Whether the run (already found the caller's) has ended.
async fn run_has_ended(app: &AppState, viewer: &Viewer, id: &str) -> bool {
    let Some(run_id) = parse_id(&async_graphql::ID::from(id)) else {
        return false;
    };
    matches!(
        reads::run(app.services.store.api_reads(), &viewer.tenant, run_id).await,
        Ok(Some(run)) if run.status.parse::<RunStatus>().is_ok_and(RunStatus::is_ended)
    )
}

/// A JSON error body with one error.
pub(super) fn errors(message: &str, code: &str) -> Value {
    json!({ "errors": [{ "message": message, "extensions": { "code": code } }] })
}

/// Who calls: the `Authorization` header's bearer token, or, without the
/// header, a token in the URL that expires within
/// `api.sse_url_token_max_secs`. A URL is kept where a header is not (proxy
/// logs, the browser's history), so only a short-lived token may travel in
/// one; the server itself logs no URL.
pub(super) async fn caller(
    app: &AppState,
    headers: &HeaderMap,
    url_token: Option<&str>,
) -> Result<Viewer, AuthError> {
    let (Some(token), None) = (url_token, authorization(headers)) else {
        return app.auth.verify_header(authorization(headers)).await;
    };
    let most = app.limits.sse_url_token_max_secs;
    if most == 0 {
        return Err(AuthError::Missing);
    }
    let viewer = app.auth.verify(token).await?;
    if viewer.expires_in() > Duration::from_secs(most) {
        return Err(Refusal::LongLivedInUrl(most).into());
    }
    Ok(viewer)
}

/// `events` as an SSE response, until they end or the token expires, with
/// heartbeat comments; `held` (the stream's slot and share) is given back
/// when it ends or the client goes.
pub(super) fn stream<H: Send + 'static>(
    app: &AppState,
    viewer: &Viewer,
    events: BoxStream<'static, Event>,
    held: H,
) -> Response {
    let expired = tokio::time::sleep(viewer.expires_in());
    let events = events
        .map(move |event| {
            let _held = &held;
            Ok::<_, std::convert::Infallible>(event)
        })
        .take_until(expired)
        .boxed();
    let every = Duration::from_secs(app.limits.sse_keepalive_secs);
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(every))
        .into_response();
    // A proxy must pass each event on as it comes.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// The payloads as the fan-out renders them: the transport's framing is
/// `sse_event`'s, which reads the event's type and cursor from it.
pub(super) struct Unframed;

impl Framing for Unframed {
    fn next(&self, payload: &str) -> String {
        payload.to_owned()
    }

    fn complete(&self) -> String {
        String::new()
    }
}

/// One rendered payload as an SSE event: `event:` its type, `id:` its
/// cursor unless it is a live delta, `data:` the event. An error (the feed
/// failed) goes out as `event: errors` with the GraphQL errors (not
/// `error`, which `EventSource` fires for its own connection failures),
/// and the stream ends after it.
fn sse_event(frame: Frame) -> Option<Event> {
    let Frame::Next(payload) = frame else {
        return None;
    };
    let mut payload: Value = serde_json::from_str(&payload).ok()?;
    let event = payload["data"]["events"].take();
    let Some(kind) = event["type"].as_str() else {
        return Some(
            Event::default()
                .event("errors")
                .data(payload["errors"].to_string()),
        );
    };
    let sse = Event::default().event(kind);
    let sse = match event["cursor"].as_str() {
        Some(cursor) if kind != "part.delta" => sse.id(cursor),
        _ => sse,
    };
    Some(sse.data(event.to_string()))
}

/// A refusal before the stream starts, with the status its code means over
/// HTTP and the same body a GraphQL request would get.
pub(super) fn refused(body: &Value) -> Response {
    let code = body["errors"][0]["extensions"]["code"].as_str();
    let status = match code {
        Some("NOT_FOUND") => StatusCode::NOT_FOUND,
        Some("BAD_USER_INPUT") => StatusCode::BAD_REQUEST,
        Some("RATE_LIMITED") => StatusCode::TOO_MANY_REQUESTS,
        Some("UNAVAILABLE") => StatusCode::SERVICE_UNAVAILABLE,
        Some("FORBIDDEN") => StatusCode::FORBIDDEN,
        Some("CONFLICT") => StatusCode::CONFLICT,
        Some("TIMEOUT") => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let mut response = json_response(status, "application/json", body);
    if let Some(secs) = body["errors"][0]["extensions"]["retryAfter"].as_u64()
        && let Ok(value) = HeaderValue::from_str(&secs.to_string())
    {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}
