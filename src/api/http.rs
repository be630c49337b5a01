//! GraphQL over HTTP and the health probes.

use std::future::Future;

use async_graphql::http::WebSocketProtocols;
use async_graphql_axum::GraphQLResponse;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Request, State, WebSocketUpgrade};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

use async_graphql::parser::types::OperationType;

use super::admission::operation_type;
use super::auth::{AuthError, Viewer};
use super::error::bad_request;
use super::{AppState, ws};

const GRAPHQL_RESPONSE: &str = "application/graphql-response+json";

/// What the body of a GraphQL POST must be.
pub(super) const GRAPHQL_REQUEST: &str = "a JSON GraphQL request";

/// A WebSocket's read buffer, allocated up front (it grows for a larger
/// frame; most of a client's frames are small: pings, `complete`s).
const WS_READ_BUFFER_BYTES: usize = 512;

/// What a WebSocket's writes gather before they go to the socket. It is
/// allocated as frames are written, and tungstenite keeps the capacity of
/// the largest batch a socket was sent.
const WS_WRITE_BUFFER_BYTES: usize = 16 * 1024;

pub async fn graphql_post(State(app): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let viewer = app.auth.verify_header(authorization(&parts.headers));
    match posted(&app, &parts.headers, body, viewer, GRAPHQL_REQUEST).await {
        Ok((viewer, request)) => execute(&app, viewer, request, &parts.headers).await,
        Err(refused) => refused,
    }
}

/// The caller (`viewer`, being verified) and the JSON body of a POST,
/// `what` it must be (a GraphQL request, say), or the answer that refuses
/// them.
pub(super) async fn posted<T: serde::de::DeserializeOwned>(
    app: &AppState,
    headers: &HeaderMap,
    body: Body,
    viewer: impl Future<Output = Result<Viewer, AuthError>>,
    what: &str,
) -> Result<(Viewer, T), Response> {
    let limit = app.limits.max_request_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // A body too large even to drain is refused before a byte of it is read.
    if declared.is_some_and(|length| length > drain_bound(limit) as u64) {
        return Err(closing(too_large(limit)));
    }
    let viewer = viewer.await;
    // The body is read, or drained, whatever the answer: a client still
    // sending when the server closes gets a reset instead of that answer.
    // A body trickled in slowly holds its connection no longer than a query
    // may run.
    let reading = tokio::time::timeout(app.limits.request_timeout(), read_limited(body, limit));
    let bytes = match (viewer.as_ref(), reading.await) {
        (Ok(_), Ok(Ok(bytes))) => bytes,
        (Err(refused), Ok(Ok(_))) => return Err(unauthenticated(refused)),
        (Err(refused), _) => return Err(closing(unauthenticated(refused))),
        (Ok(_), Ok(Err(response))) => return Err(response),
        (Ok(_), Err(_)) => {
            return Err(closing(refusal(
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive within request_timeout_secs",
            )));
        }
    };
    let viewer = viewer.map_err(|refused| unauthenticated(&refused))?;
    match serde_json::from_slice(&bytes) {
        Ok(request) => Ok((viewer, request)),
        Err(err) => Err(refusal(
            StatusCode::BAD_REQUEST,
            &format!("the body must be {what}: {err}"),
        )),
    }
}

/// Queries over GET, or the WebSocket upgrade for subscriptions.
pub async fn graphql_get(State(app): State<AppState>, request: Request) -> Response {
    let (mut parts, _) = request.into_parts();
    let wants_socket = parts
        .headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if wants_socket {
        let upgrade = match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
            Ok(upgrade) => upgrade,
            Err(rejection) => return rejection.into_response(),
        };
        let Some(protocol) = negotiate_protocol(&parts.headers) else {
            return refusal(
                StatusCode::BAD_REQUEST,
                "supported subprotocols: graphql-transport-ws, graphql-ws",
            );
        };
        let Ok(slot) = app.ws.sockets.clone().try_acquire_owned() else {
            return refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is serving as many WebSockets as it may; try again later",
            );
        };
        let max_frame = app.limits.max_request_bytes;
        let shared = app.ws.clone();
        return upgrade
            .protocols([protocol.sec_websocket_protocol()])
            .max_message_size(max_frame)
            .max_frame_size(max_frame)
            // tungstenite reserves 128 KiB to read per socket by default,
            // and gathers 128 KiB of writes before it sends them.
            .read_buffer_size(WS_READ_BUFFER_BYTES)
            .write_buffer_size(WS_WRITE_BUFFER_BYTES)
            .on_upgrade(move |socket| {
                // The connection's loop gets a task of its own: axum's task
                // around this callback would keep the socket's and the
                // callback's storage for as long as the loop runs.
                tokio::spawn(ws::serve(socket, protocol, shared, slot));
                std::future::ready(())
            });
    }
    let viewer = match app.auth.verify_header(authorization(&parts.headers)).await {
        Ok(viewer) => viewer,
        Err(refused) => return unauthenticated(&refused),
    };
    let query = parts.uri.query().unwrap_or_default();
    match queried(&app, &viewer, query, &parts.headers).await {
        Ok(request) => execute(&app, viewer, request, &parts.headers).await,
        Err(refused) => refused,
    }
}

/// The GraphQL request of a GET's query string, admitted, or the answer
/// that refuses it: a mutation must be sent with POST.
pub(super) async fn queried(
    app: &AppState,
    viewer: &Viewer,
    query: &str,
    headers: &HeaderMap,
) -> Result<async_graphql::Request, Response> {
    if query.len() > app.limits.max_request_bytes {
        return Err(refusal(
            StatusCode::URI_TOO_LONG,
            "the query string is too long",
        ));
    }
    let mut request = async_graphql::http::parse_query_string(query)
        .map_err(|_| refusal(StatusCode::BAD_REQUEST, "malformed GraphQL query string"))?;
    // Admitted before its operation's type is read from it.
    if let Err(refused) = app.admission.admit(&mut request, Some(viewer)).await {
        let response = async_graphql::Response::from_errors(vec![refused.into()]);
        return Err(answer(response, headers));
    }
    if operation_type(&mut request) == Some(OperationType::Mutation) {
        return Err(refusal(
            StatusCode::METHOD_NOT_ALLOWED,
            "mutations must be sent with POST",
        ));
    }
    Ok(request)
}

async fn execute(
    app: &AppState,
    viewer: Viewer,
    request: async_graphql::Request,
    headers: &HeaderMap,
) -> Response {
    let request = request.data(viewer);
    answer(app.schema.execute(request).await, headers)
}

/// The HTTP answer for a GraphQL response.
fn answer(response: async_graphql::Response, headers: &HeaderMap) -> Response {
    let modern = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains(GRAPHQL_RESPONSE));
    let refused = response.data == async_graphql::Value::Null && response.is_err();
    let retry_after = retry_after(&response).filter(|_| refused);
    // async-graphql-axum's response: the body, its media type, and the
    // headers and cache control resolvers set.
    let mut answer = GraphQLResponse::from(response).into_response();
    if !modern {
        // A client that did not ask for the GraphQL-over-HTTP media type
        // gets plain JSON, always with 200.
        answer.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    } else if refused {
        // With it, a request refused before execution (no data at all) is
        // a 400.
        *answer.status_mut() = StatusCode::BAD_REQUEST;
    }
    // A request refused whole by a rate limit is 429 with `Retry-After`,
    // for any client: proxies and HTTP libraries back off on it.
    if let Some(secs) = retry_after {
        *answer.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        if let Ok(value) = HeaderValue::from_str(&secs.to_string()) {
            answer.headers_mut().insert(header::RETRY_AFTER, value);
        }
    }
    answer
}

/// The `retryAfter` of a `RATE_LIMITED` error, when the response has one.
fn retry_after(response: &async_graphql::Response) -> Option<u64> {
    response.errors.iter().find_map(|err| {
        let extensions = err.extensions.as_ref()?;
        let limited = matches!(extensions.get("code"), Some(async_graphql::Value::String(code)) if code == "RATE_LIMITED");
        match extensions.get("retryAfter")? {
            async_graphql::Value::Number(secs) if limited => secs.as_u64(),
            _ => None,
        }
    })
}

pub(super) fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

fn negotiate_protocol(headers: &HeaderMap) -> Option<WebSocketProtocols> {
    match headers.get(header::SEC_WEBSOCKET_PROTOCOL) {
        None => Some(WebSocketProtocols::GraphQLWS),
        Some(value) => value
            .to_str()
            .ok()?
            .split(',')
            .find_map(|p| p.trim().parse().ok()),
    }
}

/// How much of an oversized body is read and thrown away so that the client,
/// still sending, receives the 413 instead of a reset connection: 16 MiB, or
/// the limit itself where that is larger.
fn drain_bound(limit: usize) -> usize {
    limit.max(16 * 1024 * 1024)
}

/// The body, if it fits in `limit` bytes; a larger one is drained up to
/// `drain_bound` and refused (413, closing the connection).
async fn read_limited(mut body: Body, limit: usize) -> Result<Bytes, Response> {
    let mut bytes = Vec::new();
    let mut seen: usize = 0;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Err(closing(refusal(
                StatusCode::BAD_REQUEST,
                "the request body could not be read",
            )));
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen <= limit {
            bytes.extend_from_slice(&data);
        } else if seen > drain_bound(limit) {
            break;
        }
    }
    if seen > limit {
        return Err(closing(too_large(limit)));
    }
    Ok(bytes.into())
}

fn too_large(limit: usize) -> Response {
    refusal(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("the request body is larger than {limit} bytes"),
    )
}

/// The connection closes after this answer: the rest of the request may
/// still be on its way.
fn closing(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

pub(super) fn json_response(
    status: StatusCode,
    content_type: &str,
    body: &impl serde::Serialize,
) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => {
            let mut response = (status, bytes).into_response();
            if let Ok(value) = HeaderValue::from_str(content_type) {
                response.headers_mut().insert(header::CONTENT_TYPE, value);
            }
            response
        }
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn errors_body(message: &str, code: &str) -> serde_json::Value {
    serde_json::json!({ "errors": [{ "message": message, "extensions": { "code": code } }] })
}

/// A request refused before it reached the schema, as a GraphQL error.
pub(super) fn refusal(status: StatusCode, message: &str) -> Response {
    let err = bad_request(message);
    json_response(
        status,
        "application/json",
        &async_graphql::Response::from_errors(vec![err]),
    )
}

/// 401, with why in `extensions.reason` (`expired`, `bad signature`,
/// `missing claim tenant`…) beside the stable message and code.
pub(super) fn unauthenticated(refused: &AuthError) -> Response {
    let mut body = errors_body("unauthenticated", "UNAUTHENTICATED");
    body["errors"][0]["extensions"]["reason"] = refused.reason().into();
    let mut response = json_response(StatusCode::UNAUTHORIZED, "application/json", &body);
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

pub async fn healthz() -> &'static str {
    "ok"
}
