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

pub const KEY: &str = "sk-test-key";

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

    pub fn abandoned_streams(&self) -> usize {
        self.shared.abandoned.load(Ordering::SeqCst)
    }
}

fn error_body(wire: Wire, kind: &str, message: &str) -> Value {
    match wire {
        Wire::Anthropic => {
            json!({ "type": "error", "error": { "type": kind, "message": message } })
        }
        Wire::OpenAi => {
            json!({ "error": { "message": message, "type": kind, "param": null, "code": null } })
        }
    }
}

fn refuse(wire: Wire, status: StatusCode, kind: &str, message: &str) -> Response {
    (status, axum::Json(error_body(wire, kind, message))).into_response()
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
    if let Err(message) = check_anthropic(&request) {
        return refuse(
            wire,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &message,
        );
    }
    answer(&shared, request)
}

/// What the Messages API insists on.
fn check_anthropic(request: &Value) -> Result<(), String> {
    if !request["model"].is_string() {
        return Err("model: Field required".into());
    }
    if !request["max_tokens"].is_u64() {
        return Err("max_tokens: Field required".into());
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
    for message in messages {
        if message["role"] != "user" && message["role"] != "assistant" {
            return Err("messages: unexpected role".into());
        }
    }
    Ok(())
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
    answer(&shared, request)
}

fn answer(shared: &Arc<Shared>, request: Value) -> Response {
    shared.requests.lock().unwrap().push(request);
    let reply = shared.script.lock().unwrap().pop_front();
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

/// A Messages API stream of text pieces, as the real API sends it.
pub fn anthropic_sse(pieces: &[&str], input_tokens: i64, output_tokens: i64) -> String {
    let mut sse = sse_event(
        "message_start",
        json!({"type": "message_start", "message": {"id": "msg_fake", "type": "message", "role": "assistant",
               "content": [], "model": "claude-fake", "stop_reason": null, "stop_sequence": null,
               "usage": {"input_tokens": input_tokens, "output_tokens": 1}}}),
    );
    sse += &sse_event(
        "content_block_start",
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    );
    sse += &sse_event("ping", json!({"type": "ping"}));
    for piece in pieces {
        sse += &sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}),
        );
    }
    sse += &sse_event(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    );
    sse += &sse_event(
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": output_tokens}}),
    );
    sse += &sse_event("message_stop", json!({"type": "message_stop"}));
    sse
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

/// A chat-completions stream of text pieces, with the usage chunk and
/// `[DONE]`.
pub fn openai_sse(pieces: &[&str], prompt_tokens: i64, completion_tokens: i64) -> String {
    let chunk = |delta: Value, finish: Value| {
        format!(
            "data: {}\n\n",
            json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "gpt-fake",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        )
    };
    let mut sse = chunk(json!({"role": "assistant", "content": ""}), Value::Null);
    for piece in pieces {
        sse += &chunk(json!({"content": piece}), Value::Null);
    }
    sse += &chunk(json!({}), json!("stop"));
    sse += &format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "gpt-fake",
               "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}})
    );
    sse + "data: [DONE]\n\n"
}

/// A Messages API stream with a thinking block (with its signature) before
/// the text.
pub fn anthropic_sse_thinking(thinking: &[&str], pieces: &[&str]) -> String {
    let text_only = anthropic_sse(pieces, 10, 5);
    let start = text_only.find("event: content_block_start").unwrap();
    let mut thinking_block = sse_event(
        "content_block_start",
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
    );
    for piece in thinking {
        thinking_block += &sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": piece}}),
        );
    }
    thinking_block += &sse_event(
        "content_block_delta",
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "c2lnbmF0dXJl"}}),
    );
    thinking_block += &sse_event(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    );
    // The text block becomes index 1.
    let rest = text_only[start..].replace("\"index\":0", "\"index\":1");
    text_only[..start].to_owned() + &thinking_block + &rest
}
