//! Fake model providers: real HTTP servers speaking the providers' wire
//! formats (SSE event sequences, error bodies, `retry-after` headers), which
//! check requests the way the real APIs do and record them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

use crate::support::{PATIENCE, Server, ServerOptions};

pub const KEY: &str = "sk-test-key";

/// The variable that hands `KEY` to the agents of `model_config`.
pub fn key_env() -> (String, String) {
    ("TETHER_TEST_PROVIDER_KEY".into(), KEY.into())
}

/// The configuration of a server whose one agent `model` talks to a fake
/// at `base_url` over `provider`'s wire with the key of `key_env`:
/// `runtime` and `agent` are more keys of `[runtime]` and of the agent,
/// and `rest` follows the agent (its `[agents.*]` tables, `[[tools]]`).
pub fn model_config(
    provider: &str,
    base_url: &str,
    runtime: &str,
    agent: &str,
    rest: &str,
) -> String {
    format!(
        r#"
[runtime]
checkpoint_ms = 40
poll_ms = 100
{runtime}

[[agents]]
name = "model"
provider = "{provider}"
model = "fake-model"
base_url = "{base_url}"
api_key_env = "TETHER_TEST_PROVIDER_KEY"
{agent}
{rest}
"#
    )
}

/// A server with workers on `config`, with the key of `key_env`.
pub async fn server_with_key(config: String) -> Server {
    Server::start_with(ServerOptions {
        config,
        env: vec![key_env()],
        role: "all",
    })
    .await
}

/// What the fake answers to the next request.
pub enum Reply {
    /// An error status with the provider's error body and extra headers.
    Error {
        status: u16,
        kind: &'static str,
        message: &'static str,
        headers: Vec<(&'static str, &'static str)>,
    },
    /// A 200 streaming this SSE body, cut into chunks of `chunk_bytes`
    /// (splitting UTF-8 characters), `pause` apart.
    Stream {
        sse: String,
        chunk_bytes: usize,
        pause: Duration,
    },
    /// A 307 to another URL (as a proxy or a moved endpoint might answer).
    Redirect { location: String },
}

impl Reply {
    /// A 200 streaming `sse` in chunks of `chunk_bytes`, without pauses.
    pub fn sse(sse: String, chunk_bytes: usize) -> Reply {
        Reply::Stream {
            sse,
            chunk_bytes,
            pause: Duration::ZERO,
        }
    }

    /// A 200 streaming `sse` slowly (20 bytes every 40 ms): long enough
    /// for a test to act while the run streams.
    pub fn slow(sse: String) -> Reply {
        Reply::Stream {
            sse,
            chunk_bytes: 20,
            pause: Duration::from_millis(40),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Anthropic,
    OpenAi,
}

struct Shared {
    wire: Wire,
    script: Mutex<VecDeque<Reply>>,
    requests: Mutex<Vec<Value>>,
    /// The thinking, redacted thinking and tool_use blocks of each Messages
    /// API reply that called tools, in the order they were sent.
    issued: Mutex<Vec<Vec<Value>>>,
    /// When each request arrived, in the order of `requests`.
    arrivals: Mutex<Vec<std::time::Instant>>,
    /// Streams whose client went away before the stream's end.
    abandoned: AtomicUsize,
}

pub struct FakeProvider {
    pub base_url: String,
    shared: Arc<Shared>,
}

impl FakeProvider {
    pub async fn start(wire: Wire) -> FakeProvider {
        let shared = Arc::new(Shared {
            wire,
            script: Mutex::default(),
            requests: Mutex::default(),
            issued: Mutex::default(),
            arrivals: Mutex::default(),
            abandoned: AtomicUsize::new(0),
        });
        let app = Router::new()
            .route("/v1/messages", post(anthropic))
            .route("/v1/chat/completions", post(openai))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        FakeProvider {
            base_url: format!("http://{addr}"),
            shared,
        }
    }

    /// Queues replies; when the script is empty the fake streams a default
    /// reply.
    pub fn script(&self, replies: impl IntoIterator<Item = Reply>) {
        self.shared.script.lock().unwrap().extend(replies);
    }

    pub fn requests(&self) -> Vec<Value> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// Waits until the fake has received `count` requests.
    pub async fn wait_for_requests(&self, count: usize) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self.requests().len() < count {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the model never got request {count}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// When each of `requests` arrived.
    pub fn arrivals(&self) -> Vec<std::time::Instant> {
        self.shared.arrivals.lock().unwrap().clone()
    }

    /// The requests of a run that must have `ended` completed (they are
    /// shown if it did not).
    pub fn requests_of_completed(&self, ended: &Value) -> Vec<Value> {
        assert_eq!(
            ended["status"],
            "COMPLETED",
            "{ended} {:?}",
            self.requests()
        );
        self.requests()
    }

    pub fn abandoned_streams(&self) -> usize {
        self.shared.abandoned.load(Ordering::SeqCst)
    }
}

fn error_body(wire: Wire, kind: &str, message: &str, param: Option<&str>) -> Value {
    match wire {
        Wire::Anthropic => {
            json!({ "type": "error", "error": { "type": kind, "message": message } })
        }
        Wire::OpenAi => {
            json!({ "error": { "message": message, "type": kind, "param": param, "code": null } })
        }
    }
}

fn refuse(wire: Wire, status: StatusCode, kind: &str, message: &str) -> Response {
    (status, axum::Json(error_body(wire, kind, message, None))).into_response()
}

async fn anthropic(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let wire = Wire::Anthropic;
    if headers.get("x-api-key").and_then(|v| v.to_str().ok()) != Some(KEY) {
        return refuse(
            wire,
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid x-api-key",
        );
    }
    if headers.get("anthropic-version").is_none() {
        return refuse(
            wire,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "anthropic-version: header is required",
        );
    }
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return refuse(
            wire,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid JSON",
        );
    };
    let issued = shared.issued.lock().unwrap().clone();
    if let Err(message) =
        check_anthropic(&request).and_then(|()| check_unchanged(&request, &issued))
    {
        return refuse(
            wire,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &message,
        );
    }
    answer(&shared, request)
}

/// A signature the fake gives a thinking block, and checks when the block
/// comes back: as the real API, it refuses thinking that was changed or
/// signed by someone else. Deterministic (FNV-1a of the text) so tests can
/// expect it.
pub fn fake_signature(thinking: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in thinking.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("EqFAKE{hash:016x}")
}

/// The ids of an assistant message's `tool_use` blocks.
fn tool_use_ids(message: &Value) -> Vec<String> {
    message["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "tool_use")
        .filter_map(|b| b["id"].as_str().map(str::to_owned))
        .collect()
}

/// What the Messages API insists on, with its own messages.
fn check_anthropic(request: &Value) -> Result<(), String> {
    if !request["model"].is_string() {
        return Err("model: Field required".into());
    }
    let Some(max_tokens) = request["max_tokens"].as_u64() else {
        return Err("max_tokens: Field required".into());
    };
    let thinking = request["thinking"]["type"] == "enabled";
    if thinking {
        let budget = request["thinking"]["budget_tokens"].as_u64().unwrap_or(0);
        if budget < 1024 {
            return Err(
                "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
                    .into(),
            );
        }
        if max_tokens <= budget {
            return Err("`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation at https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size".into());
        }
    }
    let mut names = std::collections::HashSet::new();
    for (i, tool) in request["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let Some(name) = tool["name"].as_str() else {
            return Err(format!("tools.{i}.name: Field required"));
        };
        if !tool["input_schema"].is_object() {
            return Err(format!("tools.{i}.input_schema: Field required"));
        }
        if !names.insert(name) {
            return Err("tools: Tool names must be unique.".into());
        }
    }
    let messages = request["messages"]
        .as_array()
        .ok_or("messages: Field required")?;
    if messages.is_empty() || messages[0]["role"] != "user" {
        return Err("messages: first message must use the \"user\" role".into());
    }
    for pair in messages.windows(2) {
        if pair[0]["role"] == pair[1]["role"] {
            return Err("messages: roles must alternate between \"user\" and \"assistant\"".into());
        }
    }
    for (i, message) in messages.iter().enumerate() {
        let role = &message["role"];
        if role != "user" && role != "assistant" {
            return Err("messages: unexpected role".into());
        }
        let blocks = match &message["content"] {
            Value::String(_) => continue,
            Value::Array(blocks) => blocks,
            _ => return Err(format!("messages.{i}.content: Field required")),
        };
        if blocks.is_empty() {
            return Err(format!(
                "messages.{i}: all messages must have non-empty content except for the optional final assistant message"
            ));
        }
        for (j, block) in blocks.iter().enumerate() {
            let kind = block["type"].as_str().unwrap_or("");
            match (kind, role.as_str().unwrap_or("")) {
                ("text", _) => {
                    let text = block["text"].as_str().unwrap_or("");
                    if text.is_empty() {
                        return Err("messages: text content blocks must be non-empty".into());
                    }
                    if text.trim().is_empty() {
                        return Err(
                            "messages: text content blocks must contain non-whitespace text".into(),
                        );
                    }
                }
                ("thinking", "assistant") => {
                    let Some(signature) = block["signature"].as_str() else {
                        return Err(format!(
                            "messages.{i}.content.{j}.thinking.signature: Field required"
                        ));
                    };
                    let text = block["thinking"].as_str().unwrap_or("");
                    if signature != fake_signature(text) {
                        return Err(format!(
                            "messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
                        ));
                    }
                }
                ("redacted_thinking", "assistant") => {}
                ("tool_use", "assistant") => {
                    if !block["id"].is_string() || !block["name"].is_string() {
                        return Err(format!(
                            "messages.{i}.content.{j}.tool_use.id: Field required"
                        ));
                    }
                    if !block["input"].is_object() {
                        return Err(format!(
                            "messages.{i}.content.{j}.tool_use.input: Input should be a valid dictionary"
                        ));
                    }
                }
                ("tool_result", "user") => {
                    let id = block["tool_use_id"].as_str().unwrap_or("");
                    let called = i > 0 && tool_use_ids(&messages[i - 1]).iter().any(|c| c == id);
                    if !called {
                        return Err(format!(
                            "messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                        ));
                    }
                }
                (kind, role) => {
                    return Err(format!(
                        "messages.{i}.content.{j}: a `{role}` message cannot contain `{kind}` blocks"
                    ));
                }
            }
        }
        if role == "assistant" {
            if blocks.last().is_some_and(|b| b["type"] == "thinking") {
                return Err(format!(
                    "messages.{i}: The final block in an assistant message cannot be `thinking`."
                ));
            }
            // Every call answered by a `tool_result` at the very start of the
            // next message.
            let answered: Vec<&str> = messages
                .get(i + 1)
                .and_then(|next| next["content"].as_array())
                .into_iter()
                .flatten()
                .take_while(|b| b["type"] == "tool_result")
                .filter_map(|b| b["tool_use_id"].as_str())
                .collect();
            let dangling: Vec<String> = tool_use_ids(message)
                .into_iter()
                .filter(|id| !answered.contains(&id.as_str()))
                .collect();
            if !dangling.is_empty() {
                return Err(format!(
                    "messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: {}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                    dangling.join(", ")
                ));
            }
        }
    }
    // With thinking on, the assistant message whose tool calls are being
    // answered must open with the thinking that led to them.
    if thinking
        && let Some((i, last)) = messages
            .iter()
            .enumerate()
            .rev()
            .find(|(_, m)| m["role"] == "assistant")
        && !tool_use_ids(last).is_empty()
    {
        let first = last["content"][0]["type"].as_str().unwrap_or("text");
        if first != "thinking" && first != "redacted_thinking" {
            return Err(format!(
                "messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found `{first}`. When `thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). We recommend you include thinking blocks from previous turns. To avoid this requirement, disable `thinking`. Please consult our documentation at https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
            ));
        }
    }
    Ok(())
}

/// A block as `check_unchanged` compares it: thinking with its text and
/// signature, redacted thinking with its data, a tool call by its id.
fn kept_block(block: &Value) -> Option<Value> {
    match block["type"].as_str()? {
        "thinking" => Some(
            json!({ "type": "thinking", "thinking": block["thinking"], "signature": block["signature"] }),
        ),
        "redacted_thinking" => Some(json!({ "type": "redacted_thinking", "data": block["data"] })),
        "tool_use" => Some(json!({ "type": "tool_use", "id": block["id"] })),
        _ => None,
    }
}

/// As the real API: the latest assistant message that called tools must
/// carry the thinking and redacted thinking of the reply that made those
/// calls as they came, each block whole (not merged), in its place among
/// the calls, none left out.
fn check_unchanged(request: &Value, issued: &[Vec<Value>]) -> Result<(), String> {
    if request["thinking"]["type"] != "enabled" {
        return Ok(());
    }
    let messages = request["messages"].as_array().into_iter().flatten();
    let Some((i, latest)) = messages
        .enumerate()
        .filter(|(_, m)| m["role"] == "assistant" && !tool_use_ids(m).is_empty())
        .last()
    else {
        return Ok(());
    };
    let ids = tool_use_ids(latest);
    let Some(original) = issued.iter().find(|blocks| {
        blocks
            .iter()
            .any(|b| b["type"] == "tool_use" && b["id"] == ids[0].as_str())
    }) else {
        return Ok(());
    };
    let sent: Vec<Value> = latest["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(kept_block)
        .collect();
    if &sent != original {
        return Err(format!(
            "messages.{i}.content: `thinking` or `redacted_thinking` blocks in the latest assistant message cannot be modified. These blocks must remain as they were in the original response."
        ));
    }
    Ok(())
}

/// The kept blocks (`kept_block`) of a Messages API stream, rebuilt from
/// its events.
fn blocks_of_sse(sse: &str) -> Vec<Value> {
    let mut blocks: Vec<Value> = Vec::new();
    for event in sse.split("\n\n") {
        let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        let Ok(data) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        match data["type"].as_str() {
            Some("content_block_start") => blocks.push(data["content_block"].clone()),
            Some("content_block_delta") => {
                let (Some(block), delta) = (blocks.last_mut(), &data["delta"]) else {
                    continue;
                };
                match delta["type"].as_str() {
                    Some("thinking_delta") => {
                        let text = block["thinking"].as_str().unwrap_or("").to_owned()
                            + delta["thinking"].as_str().unwrap_or("");
                        block["thinking"] = json!(text);
                    }
                    Some("signature_delta") => block["signature"] = delta["signature"].clone(),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    blocks.iter().filter_map(kept_block).collect()
}

async fn openai(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let wire = Wire::OpenAi;
    let expected = format!("Bearer {KEY}");
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(expected.as_str()) {
        return refuse(
            wire,
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect API key provided",
        );
    }
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return refuse(
            wire,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid JSON",
        );
    };
    let messages = request["messages"].as_array().cloned().unwrap_or_default();
    if !request["model"].is_string() || messages.is_empty() {
        return refuse(
            wire,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "model and messages are required",
        );
    }
    if let Err((param, message)) = check_openai(&request) {
        let body = error_body(wire, "invalid_request_error", &message, Some(&param));
        return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
    }
    answer(&shared, request)
}

/// The ids of an assistant message's `tool_calls`.
fn tool_call_ids(message: &Value) -> Vec<String> {
    message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .collect()
}

/// What chat completions insist on about tools, as (`param`, message).
fn check_openai(request: &Value) -> Result<(), (String, String)> {
    for (i, tool) in request["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        if tool["type"] != "function" {
            return Err((
                format!("tools[{i}].type"),
                format!("Missing required parameter: 'tools[{i}].type'."),
            ));
        }
        if !tool["function"]["name"].is_string() {
            return Err((
                format!("tools[{i}].function.name"),
                format!("Missing required parameter: 'tools[{i}].function.name'."),
            ));
        }
    }
    let messages = request["messages"].as_array().cloned().unwrap_or_default();
    for (i, message) in messages.iter().enumerate() {
        match message["role"].as_str().unwrap_or("") {
            "system" | "developer" | "user" => {}
            "assistant" => {
                let calls = message["tool_calls"].as_array();
                if message["content"].is_null() && calls.is_none_or(|c| c.is_empty()) {
                    return Err((
                        format!("messages.[{i}].content"),
                        "Invalid value for 'content': expected a string, got null.".into(),
                    ));
                }
                for (k, call) in calls.into_iter().flatten().enumerate() {
                    if !call["id"].is_string() || call["type"] != "function" {
                        return Err((
                            format!("messages.[{i}].tool_calls.[{k}]"),
                            format!(
                                "Missing required parameter: 'messages[{i}].tool_calls[{k}].id'."
                            ),
                        ));
                    }
                    if !call["function"]["arguments"].is_string() {
                        return Err((
                            format!("messages.[{i}].tool_calls.[{k}].function.arguments"),
                            format!(
                                "Invalid type for 'messages[{i}].tool_calls[{k}].function.arguments': expected a string, but got an object instead."
                            ),
                        ));
                    }
                }
                // Each call answered by the `tool` messages right after.
                let answered: Vec<&str> = messages[i + 1..]
                    .iter()
                    .take_while(|m| m["role"] == "tool")
                    .filter_map(|m| m["tool_call_id"].as_str())
                    .collect();
                let unanswered: Vec<String> = tool_call_ids(message)
                    .into_iter()
                    .filter(|id| !answered.contains(&id.as_str()))
                    .collect();
                if !unanswered.is_empty() {
                    return Err((
                        format!("messages.[{i}].role"),
                        format!(
                            "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
                            unanswered.join(", ")
                        ),
                    ));
                }
            }
            "tool" => {
                let caller = messages[..i].iter().rev().find(|m| m["role"] != "tool");
                let calls = caller
                    .filter(|m| m["role"] == "assistant")
                    .map(tool_call_ids)
                    .unwrap_or_default();
                if calls.is_empty() {
                    return Err((
                        format!("messages.[{i}].role"),
                        "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.".into(),
                    ));
                }
                let id = message["tool_call_id"].as_str().unwrap_or("");
                if !calls.iter().any(|c| c == id) {
                    return Err((
                        format!("messages.[{i}].tool_call_id"),
                        format!(
                            "Invalid parameter: 'tool_call_id' of '{id}' not found in 'tool_calls' of previous message."
                        ),
                    ));
                }
            }
            other => {
                return Err((
                    format!("messages.[{i}].role"),
                    format!(
                        "Invalid value: '{other}'. Supported values are: 'system', 'assistant', 'user', 'function', 'tool', and 'developer'."
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn answer(shared: &Arc<Shared>, request: Value) -> Response {
    shared.requests.lock().unwrap().push(request);
    shared
        .arrivals
        .lock()
        .unwrap()
        .push(std::time::Instant::now());
    let reply = shared.script.lock().unwrap().pop_front();
    if let (Wire::Anthropic, Some(Reply::Stream { sse, .. })) = (shared.wire, &reply) {
        let blocks = blocks_of_sse(sse);
        if blocks.iter().any(|b| b["type"] == "tool_use") {
            shared.issued.lock().unwrap().push(blocks);
        }
    }
    let reply = reply.unwrap_or_else(|| Reply::Stream {
        sse: match shared.wire {
            Wire::Anthropic => anthropic_sse(&["Hello from the fake."], 10, 5),
            Wire::OpenAi => openai_sse(&["Hello from the fake."], 10, 5),
        },
        chunk_bytes: 64,
        pause: Duration::ZERO,
    });
    match reply {
        Reply::Error {
            status,
            kind,
            message,
            headers,
        } => {
            let mut response = refuse(
                shared.wire,
                StatusCode::from_u16(status).unwrap(),
                kind,
                message,
            );
            for (name, value) in headers {
                response.headers_mut().insert(name, value.parse().unwrap());
            }
            response
        }
        Reply::Redirect { location } => (
            StatusCode::TEMPORARY_REDIRECT,
            [("location", location)],
            "moved",
        )
            .into_response(),
        Reply::Stream {
            sse,
            chunk_bytes,
            pause,
        } => {
            let chunks: Vec<Bytes> = sse
                .as_bytes()
                .chunks(chunk_bytes.max(1))
                .map(Bytes::copy_from_slice)
                .collect();
            let watch = Watch {
                shared: shared.clone(),
                finished: false,
            };
            let body = async_stream::stream! {
                let mut watch = watch;
                for chunk in chunks {
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                    yield Ok::<Bytes, std::io::Error>(chunk);
                }
                watch.finished = true;
            };
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(body))
                .unwrap()
        }
    }
}

/// Counts a stream dropped before its end: the client closed the connection.
struct Watch {
    shared: Arc<Shared>,
    finished: bool,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.finished {
            self.shared.abandoned.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn sse_event(kind: &str, data: Value) -> String {
    format!("event: {kind}\ndata: {data}\n\n")
}

/// A tool call the fake model makes, for the SSE builders.
#[derive(Debug, Clone)]
pub struct FakeToolCall {
    pub id: String,
    pub name: String,
    /// The input exactly as the model streams it, as JSON text.
    pub input_json: String,
}

impl FakeToolCall {
    /// A call whose input streams as `input`'s JSON text.
    pub fn new(id: &str, name: &str, input: Value) -> FakeToolCall {
        FakeToolCall::raw(id, name, &input.to_string())
    }

    /// A call whose input streams as exactly this JSON text (with the
    /// escapes of your choosing: `\u00e9`, surrogate pairs, …).
    pub fn raw(id: &str, name: &str, input_json: &str) -> FakeToolCall {
        FakeToolCall {
            id: id.into(),
            name: name.into(),
            input_json: input_json.into(),
        }
    }

    /// The input a client should assemble from the fragments.
    pub fn input(&self) -> Value {
        serde_json::from_str(&self.input_json).unwrap()
    }
}

/// JSON text cut the way a streaming model cuts it, only more awkwardly: an
/// empty fragment first (as the Messages API sends), then pieces of 1, 2, 3,
/// 1, 2, 3… characters, so cuts fall inside strings, inside escapes (`\` |
/// `"`, `\u00` | `e9`) and right beside multi-byte characters (which the SSE
/// chunking of `Reply::Stream` then splits byte-wise).
pub fn awkward_fragments(json: &str) -> Vec<String> {
    let chars: Vec<char> = json.chars().collect();
    let mut fragments = vec![String::new()];
    let mut at = 0;
    for size in [1, 2, 3].into_iter().cycle() {
        if at >= chars.len() {
            break;
        }
        let end = (at + size).min(chars.len());
        fragments.push(chars[at..end].iter().collect());
        at = end;
    }
    fragments
}

/// One content block of a Messages API reply.
pub enum AnthropicBlock {
    /// Text in these pieces (`text_delta`s).
    Text(Vec<String>),
    /// Thinking in these pieces (`thinking_delta`s), closed by one
    /// `signature_delta` carrying `fake_signature` of the whole text.
    Thinking(Vec<String>),
    /// A tool call, its input in `awkward_fragments` (`input_json_delta`s).
    ToolUse(FakeToolCall),
    /// Encrypted thinking: this opaque data, whole at the block's start.
    Redacted(String),
}

impl AnthropicBlock {
    pub fn text(pieces: &[&str]) -> AnthropicBlock {
        AnthropicBlock::Text(pieces.iter().map(|p| p.to_string()).collect())
    }

    pub fn thinking(pieces: &[&str]) -> AnthropicBlock {
        AnthropicBlock::Thinking(pieces.iter().map(|p| p.to_string()).collect())
    }
}

/// A Messages API stream of these blocks, as the real API sends it:
/// `message_start`, each block's start, deltas and stop (a `ping` after the
/// first start), `message_delta` with `stop_reason` and usage,
/// `message_stop`.
pub fn anthropic_sse_blocks(
    blocks: &[AnthropicBlock],
    stop_reason: &str,
    input_tokens: i64,
    output_tokens: i64,
) -> String {
    let mut sse = sse_event(
        "message_start",
        json!({"type": "message_start", "message": {"id": "msg_fake", "type": "message", "role": "assistant",
               "content": [], "model": "claude-fake", "stop_reason": null, "stop_sequence": null,
               "usage": {"input_tokens": input_tokens, "output_tokens": 1}}}),
    );
    let delta = |index: usize, delta: Value| {
        sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        )
    };
    for (index, block) in blocks.iter().enumerate() {
        let (start, deltas): (Value, Vec<Value>) = match block {
            AnthropicBlock::Text(pieces) => (
                json!({"type": "text", "text": ""}),
                pieces
                    .iter()
                    .map(|p| json!({"type": "text_delta", "text": p}))
                    .collect(),
            ),
            AnthropicBlock::Thinking(pieces) => {
                let mut deltas: Vec<Value> = pieces
                    .iter()
                    .map(|p| json!({"type": "thinking_delta", "thinking": p}))
                    .collect();
                deltas.push(
                    json!({"type": "signature_delta", "signature": fake_signature(&pieces.concat())}),
                );
                (json!({"type": "thinking", "thinking": ""}), deltas)
            }
            AnthropicBlock::Redacted(data) => (
                json!({"type": "redacted_thinking", "data": data}),
                Vec::new(),
            ),
            AnthropicBlock::ToolUse(call) => (
                json!({"type": "tool_use", "id": call.id, "name": call.name, "input": {}}),
                awkward_fragments(&call.input_json)
                    .into_iter()
                    .map(|f| json!({"type": "input_json_delta", "partial_json": f}))
                    .collect(),
            ),
        };
        sse += &sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": start}),
        );
        if index == 0 {
            sse += &sse_event("ping", json!({"type": "ping"}));
        }
        for d in deltas {
            sse += &delta(index, d);
        }
        sse += &sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        );
    }
    sse += &sse_event(
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": output_tokens}}),
    );
    sse += &sse_event("message_stop", json!({"type": "message_stop"}));
    sse
}

/// A Messages API stream of text pieces, as the real API sends it.
pub fn anthropic_sse(pieces: &[&str], input_tokens: i64, output_tokens: i64) -> String {
    anthropic_sse_blocks(
        &[AnthropicBlock::text(pieces)],
        "end_turn",
        input_tokens,
        output_tokens,
    )
}

/// The start of a Messages API stream that then reports an error event.
pub fn anthropic_sse_failing(pieces: &[&str], kind: &str, message: &str) -> String {
    let full = anthropic_sse(pieces, 10, 5);
    let cut = full.find("event: content_block_stop").unwrap();
    full[..cut].to_owned()
        + &sse_event(
            "error",
            json!({"type": "error", "error": {"type": kind, "message": message}}),
        )
}

/// A Messages API stream with a thinking block (signed with
/// `fake_signature`) before the text.
pub fn anthropic_sse_thinking(thinking: &[&str], pieces: &[&str]) -> String {
    anthropic_sse_blocks(
        &[
            AnthropicBlock::thinking(thinking),
            AnthropicBlock::text(pieces),
        ],
        "end_turn",
        10,
        5,
    )
}

/// A Messages API stream of text pieces (no text block when there are
/// none) then tool calls, stop reason `tool_use`; usage 10 in, 5 out.
pub fn anthropic_sse_tool_calls(text: &[&str], calls: &[FakeToolCall]) -> String {
    anthropic_sse_thinking_tool_calls(&[], text, calls)
}

/// Like `anthropic_sse_tool_calls`, opening with a signed thinking block
/// (none when `thinking` is empty), as a model with extended thinking does.
pub fn anthropic_sse_thinking_tool_calls(
    thinking: &[&str],
    text: &[&str],
    calls: &[FakeToolCall],
) -> String {
    let mut blocks = Vec::new();
    if !thinking.is_empty() {
        blocks.push(AnthropicBlock::thinking(thinking));
    }
    if !text.is_empty() {
        blocks.push(AnthropicBlock::text(text));
    }
    blocks.extend(calls.iter().cloned().map(AnthropicBlock::ToolUse));
    anthropic_sse_blocks(&blocks, "tool_use", 10, 5)
}

/// One chat-completion chunk of one choice.
fn openai_chunk(delta: Value, finish: Value) -> String {
    format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "gpt-fake",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    )
}

/// The usage chunk (no choices) and `[DONE]` that end a stream.
fn openai_end(prompt_tokens: i64, completion_tokens: i64) -> String {
    format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "gpt-fake",
               "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}})
    ) + "data: [DONE]\n\n"
}

/// A chat-completions stream of text pieces, with the usage chunk and
/// `[DONE]`.
pub fn openai_sse(pieces: &[&str], prompt_tokens: i64, completion_tokens: i64) -> String {
    let mut sse = openai_chunk(json!({"role": "assistant", "content": ""}), Value::Null);
    for piece in pieces {
        sse += &openai_chunk(json!({"content": piece}), Value::Null);
    }
    sse += &openai_chunk(json!({}), json!("stop"));
    sse + &openai_end(prompt_tokens, completion_tokens)
}

/// A chat-completions stream of text pieces (maybe none) then tool calls:
/// per call a first fragment with `index`, `id`, `type` and `function.name`,
/// then `function.arguments` in `awkward_fragments`, the calls' fragments
/// interleaved (so only `index` tells them apart); finish reason
/// `tool_calls`, usage 10 in, 5 out, `[DONE]`.
pub fn openai_sse_tool_calls(text: &[&str], calls: &[FakeToolCall]) -> String {
    openai_sse_tool_calls_ending(text, calls, "tool_calls")
}

/// Like `openai_sse_tool_calls`, finishing with `finish_reason`.
pub fn openai_sse_tool_calls_ending(
    text: &[&str],
    calls: &[FakeToolCall],
    finish_reason: &str,
) -> String {
    let content = if text.is_empty() {
        Value::Null
    } else {
        json!("")
    };
    let mut sse = openai_chunk(
        json!({"role": "assistant", "content": content}),
        Value::Null,
    );
    for piece in text {
        sse += &openai_chunk(json!({"content": piece}), Value::Null);
    }
    let mut fragments: Vec<VecDeque<Value>> = calls
        .iter()
        .enumerate()
        .map(|(index, call)| {
            let mut fragments = VecDeque::from([json!({"index": index, "id": call.id, "type": "function",
                                                       "function": {"name": call.name, "arguments": ""}})]);
            fragments.extend(
                awkward_fragments(&call.input_json)
                    .into_iter()
                    .skip(1)
                    .map(|f| json!({"index": index, "function": {"arguments": f}})),
            );
            fragments
        })
        .collect();
    while fragments.iter().any(|f| !f.is_empty()) {
        for call in &mut fragments {
            if let Some(fragment) = call.pop_front() {
                sse += &openai_chunk(json!({"tool_calls": [fragment]}), Value::Null);
            }
        }
    }
    sse += &openai_chunk(json!({}), json!(finish_reason));
    sse + &openai_end(10, 5)
}
