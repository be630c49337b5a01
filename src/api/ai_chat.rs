//! The AI SDK's UI message stream (`x-vercel-ai-ui-message-stream: v1`),
//! for `useChat` (AI SDK 5 and later; approvals need 6):
//! - `POST /ai/chat` takes `useChat`'s body. Its `id` is a conversation of
//!   the caller's; only the last message is read, the server holding the
//!   history. A user message is sent (`sendMessage`, its `id` the
//!   `clientMessageId`) and its run streamed; an assistant message whose
//!   tool parts carry approval responses decides them (approved
//!   `ALLOW_ONCE`, denied `DENY`) and continues that message's stream with
//!   what is new.
//! - `GET /ai/chat/{conversationId}/stream` replays the active run's
//!   message from `start` and follows it live (`useChat({ resume: true })`);
//!   204 when nothing is active.
//!
//! An adapter like the others: the run's events come from its feed as the
//! fan-out serves them (`sse::follow`), the message's state from the
//! schema (the `SNAPSHOT` query, with the viewer's access), and `chunks`
//! turns them into stream parts. The stream ends (`finish`, then `[DONE]`)
//! when the run ends or parks on a pause. A client that goes away only
//! disconnects: nothing here cancels a run (`cancelRun` does).

mod chunks;

use std::collections::{HashMap, HashSet};

use async_graphql::Variables;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use self::chunks::{Projector, Standing};
use super::AppState;
use super::auth::Viewer;
use super::fanout::Frame;
use super::http::{posted, refusal, unauthenticated};
use super::sse::{self, Feed, Held};
use crate::domain::cursor::Cursor;

/// Rendered events read from the feed before the message is read again.
const BATCH: usize = 256;

/// The events that end a run.
const FINAL: [&str; 3] = ["run.completed", "run.failed", "run.cancelled"];

/// The message's state and the run's, as `chunks` reads them.
const SNAPSHOT: &str = "query Snapshot($m: ID!, $r: ID!) { \
    message(id: $m) { parts(first: 500) { id kind state text interactionId \
      toolCall { id name input outcome output } \
      question { status questions { key prompt multiple allowOther options { value label description } } answers { key values other } } \
      connection { provider gap status } } } \
    run(id: $r) { status error { message } } \
    pendingApprovals(runId: $r) { interactionId toolCallId } \
    pendingConnection(runId: $r) { interactionId loginUrl } }";

/// `useChat`'s request body, what of it is read.
#[derive(Deserialize)]
struct ChatRequest {
    /// The conversation.
    id: String,
    messages: Vec<UiMessage>,
    #[serde(default)]
    trigger: Option<String>,
}

#[derive(Deserialize)]
struct UiMessage {
    id: String,
    role: String,
    #[serde(default)]
    parts: Vec<Value>,
}

#[derive(Deserialize)]
pub struct Params {
    access_token: Option<String>,
}

/// `POST /ai/chat`.
pub async fn chat(State(app): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let viewer = sse::caller(&app, &parts.headers, None);
    let what = "useChat's request: {\"id\": the conversation, \"messages\": [...]}";
    let (viewer, chat): (_, ChatRequest) =
        match posted(&app, &parts.headers, body, viewer, what).await {
            Ok(posted) => posted,
            Err(refused) => return refused,
        };
    if chat.trigger.as_deref() == Some("regenerate-message") {
        return refusal(
            StatusCode::BAD_REQUEST,
            "regenerating a message is not supported yet",
        );
    }
    let Some(last) = chat.messages.last() else {
        return refusal(
            StatusCode::BAD_REQUEST,
            "messages must end with the new message",
        );
    };
    // The stream's slot and share first: a request refused for want of
    // them changes nothing.
    let held = match sse::hold(&app, &viewer) {
        Ok(held) => held,
        Err(body) => return sse::refused(&body),
    };
    match last.role.as_str() {
        "user" => send(&app, viewer, held, &chat.id, last).await,
        "assistant" => decide(&app, viewer, held, &chat.id, last).await,
        _ => refusal(
            StatusCode::BAD_REQUEST,
            "the last message must be the user's new message, or the assistant's with approval responses",
        ),
    }
}

/// `GET /ai/chat/{conversationId}/stream`.
pub async fn resume(
    State(app): State<AppState>,
    Path(conversation): Path<String>,
    params: Result<Query<Params>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let Query(params) = match params {
        Ok(params) => params,
        Err(rejected) => return sse::malformed(&rejected),
    };
    let viewer = match sse::caller(&app, &headers, params.access_token.as_deref()).await {
        Ok(viewer) => viewer,
        Err(refused) => return unauthenticated(&refused),
    };
    let held = match sse::hold(&app, &viewer) {
        Ok(held) => held,
        Err(body) => return sse::refused(&body),
    };
    let active = execute(
        &app,
        &viewer,
        "query($c: ID!) { conversation(id: $c) { activeRun { id } } }",
        json!({ "c": conversation }),
    )
    .await;
    let data = match active {
        Ok(data) => data,
        Err(body) => return sse::refused(&body),
    };
    if data["conversation"].is_null() {
        return sse::not_found("conversation not found");
    }
    match data["conversation"]["activeRun"]["id"].as_str() {
        None => StatusCode::NO_CONTENT.into_response(),
        Some(run) => from_start(&app, viewer, held, run).await,
    }
}

/// A user message: sent, and its run streamed.
async fn send(
    app: &AppState,
    viewer: Viewer,
    held: Held,
    conversation: &str,
    message: &UiMessage,
) -> Response {
    let text: Vec<&str> = message
        .parts
        .iter()
        .filter(|part| part["type"] == "text")
        .filter_map(|part| part["text"].as_str())
        .collect();
    let sent = execute(
        app,
        &viewer,
        "mutation($c: ID!, $t: String!, $k: String) { \
         sendMessage(input: { conversationId: $c, text: $t, clientMessageId: $k }) { run { id } } }",
        json!({ "c": conversation, "t": text.join("\n"), "k": message.id }),
    )
    .await;
    let data = match sent {
        Ok(data) => data,
        Err(body) => return sse::refused(&body),
    };
    let Some(run) = data["sendMessage"]["run"]["id"].as_str() else {
        return sse::refused(&sse::errors("internal error", "INTERNAL"));
    };
    from_start(app, viewer, held, run).await
}

/// An assistant message with approval responses: each decided, and the
/// message's stream continued from where the client has it.
async fn decide(
    app: &AppState,
    viewer: Viewer,
    held: Held,
    conversation: &str,
    message: &UiMessage,
) -> Response {
    let decisions: Vec<(&str, &str)> = message
        .parts
        .iter()
        .filter(|part| part["state"] == "approval-responded")
        .filter_map(|part| {
            let approval = &part["approval"];
            let decision = if approval["approved"].as_bool()? {
                "ALLOW_ONCE"
            } else {
                "DENY"
            };
            Some((approval["id"].as_str()?, decision))
        })
        .collect();
    if decisions.is_empty() {
        return refusal(
            StatusCode::BAD_REQUEST,
            "the assistant message carries no approval response",
        );
    }
    let found = execute(
        app,
        &viewer,
        "query($m: ID!, $c: ID!) { message(id: $m) { conversationId runId } \
         conversation(id: $c) { lastCursor } }",
        json!({ "m": message.id, "c": conversation }),
    )
    .await;
    let data = match found {
        Ok(data) => data,
        Err(body) => return sse::refused(&body),
    };
    let (Some(run), Some(after)) = (
        data["message"]["runId"].as_str(),
        data["conversation"]["lastCursor"].as_str(),
    ) else {
        return sse::not_found("message not found");
    };
    if data["message"]["conversationId"] != conversation {
        return sse::not_found("message not found");
    }
    // What the client has: the message as it stands before the decisions
    // (the run is parked), read after the cursor the stream follows from,
    // so that nothing after it is missed and nothing before it sent again.
    let before = match snapshot(app, &viewer, &message.id, run).await {
        Ok(before) => before,
        Err(body) => return sse::refused(&body),
    };
    // Each approval must be one of this message's: pending, to decide, or
    // decided already (a repeated request), to leave as it is. Nothing is
    // decided unless every one is.
    let pending: HashMap<&str, &str> = before["pendingApprovals"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["interactionId"].as_str()?, p["toolCallId"].as_str()?)))
        .collect();
    let shown: HashSet<&str> = before["message"]["parts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|part| part["kind"] == "APPROVAL")
        .filter_map(|part| part["interactionId"].as_str())
        .collect();
    if let Some((unknown, _)) = decisions
        .iter()
        .find(|(id, _)| !pending.contains_key(id) && !shown.contains(id))
    {
        return sse::not_found(&format!("approval {unknown} not found in this message"));
    }
    let mut projector = Projector::new(run);
    projector.sync(&before, &mut Vec::new());
    let mut awaiting = Vec::new();
    for (interaction, decision) in decisions {
        let Some(call) = pending.get(interaction) else {
            continue;
        };
        let decided = execute(
            app,
            &viewer,
            "mutation($i: ID!, $d: ApprovalDecision!) { \
             decideApproval(input: { interactionId: $i, decision: $d }) { resumed } }",
            json!({ "i": interaction, "d": decision }),
        )
        .await;
        if let Err(body) = decided {
            return sse::refused(&body);
        }
        awaiting.push((*call).to_owned());
    }
    projector.await_outcomes(awaiting);
    let message_id = message.id.clone();
    stream(app, viewer, held, run, after, projector, Some(message_id)).await
}

/// The run's message from its `start`, as a client that has none of it
/// reads it.
async fn from_start(app: &AppState, viewer: Viewer, held: Held, run: &str) -> Response {
    let after = Cursor::START.to_string();
    stream(app, viewer, held, run, &after, Projector::new(run), None).await
}

/// The run's message as the UI message stream, from its feed after
/// `after`, until the run ends or parks; `message`, when the client has
/// it already.
async fn stream(
    app: &AppState,
    viewer: Viewer,
    held: Held,
    run: &str,
    after: &str,
    mut projector: Projector,
    mut message: Option<String>,
) -> Response {
    let frames = match sse::follow(app, &viewer, Feed::Run, run, after).await {
        Ok(frames) => frames,
        Err(body) => return sse::refused(&body),
    };
    let (app_, viewer_, run) = (app.clone(), viewer.clone(), run.to_owned());
    let chunks = async_stream::stream! {
        let (app, viewer) = (app_, viewer_);
        let mut out = Vec::new();
        if let Some(message) = &message {
            projector.start(message, &mut out);
        }
        let mut frames = frames.ready_chunks(BATCH);
        let mut ended = false;
        while let Some(batch) = frames.next().await {
            let mut changed = false;
            for frame in batch {
                let Frame::Next(payload) = frame else { continue };
                let event = match event_of(&payload) {
                    Ok(event) => event,
                    Err(error) => {
                        out.push(json!({ "type": "error", "errorText": error }));
                        ended = true;
                        break;
                    }
                };
                let kind = event["type"].as_str().unwrap_or_default();
                if kind == "message.created" && event["role"] == "ASSISTANT" && message.is_none() {
                    let id = event["messageId"].as_str().unwrap_or_default().to_owned();
                    projector.start(&id, &mut out);
                    message = Some(id);
                    changed = true;
                } else if kind == "part.delta" {
                    // Deltas of this message only: a later reply of the run
                    // (after a steered message) shows in the history.
                    let (Some(id), Some(part)) = (&message, event["partId"].as_str()) else {
                        continue;
                    };
                    if event["messageId"] != id.as_str() {
                        continue;
                    }
                    // A delta of a part not sent yet: the part first.
                    if !projector.knows(part) {
                        match snapshot(&app, &viewer, id, &run).await {
                            Ok(now) => {
                                if projector.sync(&now, &mut out) != Standing::Going {
                                    changed = true;
                                }
                            }
                            Err(errors) => {
                                out.push(json!({ "type": "error", "errorText": error_text(&errors) }));
                                ended = true;
                                break;
                            }
                        }
                    }
                    let offset = event["offset"].as_u64().unwrap_or_default() as usize;
                    let text = event["text"].as_str().unwrap_or_default();
                    projector.delta(part, offset, text, &mut out);
                } else if message.is_none() && FINAL.contains(&kind) {
                    // Ended before it had a message: cancelled while queued.
                    let status = event["status"].as_str().unwrap_or_default();
                    projector.ended_without_message(status, &mut out);
                    ended = true;
                    break;
                } else {
                    changed = true;
                }
            }
            if !ended && changed && let Some(id) = &message {
                match snapshot(&app, &viewer, id, &run).await {
                    Ok(now) => {
                        if projector.sync(&now, &mut out) != Standing::Going {
                            projector.finish(&now, &mut out);
                            ended = true;
                        }
                    }
                    Err(errors) => {
                        out.push(json!({ "type": "error", "errorText": error_text(&errors) }));
                        ended = true;
                    }
                }
            }
            for chunk in out.drain(..) {
                yield Event::default().data(chunk.to_string());
            }
            if ended {
                break;
            }
        }
        yield Event::default().data("[DONE]");
    };
    let mut response = sse::stream(app, &viewer, chunks.boxed(), held);
    response.headers_mut().insert(
        "x-vercel-ai-ui-message-stream",
        HeaderValue::from_static("v1"),
    );
    response
}

/// What a failure's error body says, for the stream's `error` part.
fn error_text(body: &Value) -> String {
    body["errors"][0]["message"]
        .as_str()
        .unwrap_or("the run's message could not be read")
        .to_owned()
}

/// The message's and the run's state now.
async fn snapshot(
    app: &AppState,
    viewer: &Viewer,
    message: &str,
    run: &str,
) -> Result<Value, Value> {
    execute(app, viewer, SNAPSHOT, json!({ "m": message, "r": run })).await
}

/// An event of the feed, or the errors that ended it.
fn event_of(payload: &str) -> Result<Value, String> {
    let mut payload: Value = serde_json::from_str(payload).map_err(|err| err.to_string())?;
    let event = payload["data"]["events"].take();
    if event["type"].is_string() {
        Ok(event)
    } else {
        Err(payload["errors"][0]["message"]
            .as_str()
            .unwrap_or("the run's events could not be read")
            .to_owned())
    }
}

/// Runs a document through the schema as the viewer: its data, or the
/// body of its errors.
async fn execute(
    app: &AppState,
    viewer: &Viewer,
    query: &str,
    variables: Value,
) -> Result<Value, Value> {
    let request = async_graphql::Request::new(query)
        .variables(Variables::from_json(variables))
        .data(viewer.clone());
    let response = app.schema.execute(request).await;
    if response.is_err() {
        let mut body = serde_json::to_value(&response).unwrap_or(Value::Null);
        sse::without_locations(&mut body);
        return Err(body);
    }
    Ok(response.data.into_json().unwrap_or(Value::Null))
}
