//! Anthropic's Messages API, streaming.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::{Content, ModelEvent, ModelRequest, ModelStream, Provider, ProviderError, Turn, http};
use crate::domain::MessageRole;

pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
const VERSION: &str = "2023-06-01";

pub struct Anthropic(pub http::Endpoint);

/// The provider's error type and message from an error body.
fn describe(body: &Value) -> Option<(String, String)> {
    let error = body.get("error")?;
    Some((
        error.get("type")?.as_str()?.to_owned(),
        error.get("message")?.as_str()?.to_owned(),
    ))
}

fn role_name(role: MessageRole) -> &'static str {
    match role {
        MessageRole::User => "user",
        MessageRole::Assistant => "assistant",
    }
}

/// One content block as the Messages API takes it; `None` for what is never
/// sent.
fn block(content: &Content) -> Option<Value> {
    match content {
        // The API refuses empty and whitespace-only text blocks.
        Content::Text(text) if text.trim().is_empty() => None,
        Content::Text(text) => Some(json!({ "type": "text", "text": text })),
        // Signed thinking goes back unchanged (the API checks the signature);
        // reasoning without one (another provider's, or a thinking block cut
        // short) cannot be verified, so it is for people only.
        Content::Reasoning {
            text,
            signature: Some(signature),
        } => Some(json!({ "type": "thinking", "thinking": text, "signature": signature })),
        Content::Reasoning {
            signature: None, ..
        } => None,
        Content::RedactedReasoning { data } => {
            Some(json!({ "type": "redacted_thinking", "data": data }))
        }
        Content::ToolUse { id, name, input } => {
            Some(json!({ "type": "tool_use", "id": id, "name": name, "input": input }))
        }
        Content::ToolResult {
            tool_use_id,
            output,
            is_error,
        } => Some(json!({
            "type": "tool_result",
            "tool_use_id": tool_use_id,
            "content": output,
            "is_error": is_error,
        })),
    }
}

/// Appends messages, merging consecutive ones of one role (the API wants
/// roles to alternate) and dropping empty ones (the API refuses them).
fn merge(
    messages: impl IntoIterator<Item = (MessageRole, Vec<Value>)>,
) -> Vec<(MessageRole, Vec<Value>)> {
    let mut merged: Vec<(MessageRole, Vec<Value>)> = Vec::new();
    for (role, blocks) in messages {
        if blocks.is_empty() {
            continue;
        }
        match merged.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => merged.push((role, blocks)),
        }
    }
    merged
}

fn is_thinking(block: &Value) -> bool {
    block["type"] == "thinking" || block["type"] == "redacted_thinking"
}

/// Turns as Messages API messages. Consecutive turns of one role are merged
/// by joining their content blocks in order: the engine puts a step's tool
/// results before any text of that turn, which is where the API wants
/// `tool_result` blocks (first in the user message after the `tool_use`).
fn messages(turns: &[Turn]) -> Vec<Value> {
    let blocks = turns
        .iter()
        .map(|turn| (turn.role, turn.content.iter().filter_map(block).collect()));
    let mut merged = merge(blocks);
    // The API refuses an assistant message whose last block is thinking;
    // such thinking led to nothing that was kept, so it is left out.
    for (role, content) in &mut merged {
        if *role == MessageRole::Assistant {
            while content.last().is_some_and(is_thinking) {
                content.pop();
            }
        }
    }
    merge(merged)
        .into_iter()
        .map(|(role, content)| json!({ "role": role_name(role), "content": content }))
        .collect()
}

/// The `max_tokens` sent. With extended thinking the API counts the thinking
/// inside `max_tokens` and refuses a `max_tokens` not above the budget; an
/// agent's `max_tokens` at or below its budget is then taken as the room for
/// the answer after the thinking, and the budget is added to it.
pub fn max_tokens(request: &ModelRequest) -> u32 {
    match request.thinking_budget {
        Some(budget) if request.max_tokens <= budget => budget.saturating_add(request.max_tokens),
        _ => request.max_tokens,
    }
}

pub fn body(request: &ModelRequest) -> Value {
    let mut body = json!({
        "model": request.model,
        "max_tokens": max_tokens(request),
        "stream": true,
        "messages": messages(&request.turns),
    });
    if let Some(system) = &request.system {
        body["system"] = json!(system);
    }
    if !request.tools.is_empty() {
        let tools: Vec<Value> = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "name": tool.name,
                    "description": tool.description,
                    "input_schema": tool.input_schema,
                })
            })
            .collect();
        body["tools"] = json!(tools);
    }
    if let Some(budget) = request.thinking_budget {
        body["thinking"] = json!({ "type": "enabled", "budget_tokens": budget });
    }
    body
}

/// A content block being streamed, by its index.
enum Open {
    /// A tool call: its input arrives as JSON text in fragments.
    ToolUse {
        id: String,
        name: String,
        json: String,
        /// The input given at the block's start; the real API gives `{}`
        /// there and the whole input in fragments, but a proxy that does not
        /// stream may give it whole.
        initial: Value,
    },
    /// Thinking: its signature arrives at the end, maybe in pieces.
    Thinking { signature: String },
}

type Item = Result<ModelEvent, ProviderError>;

/// The Messages API's event sequence as model events.
#[derive(Default)]
struct Parser {
    input_tokens: i64,
    output_tokens: i64,
    stop_reason: String,
    open: HashMap<u64, Open>,
    /// A tool call whose input did not parse, held until the stop reason
    /// says whether the token limit cut it off.
    broken: Option<ProviderError>,
}

/// A tool call's input from its streamed JSON text.
fn tool_input(id: &str, name: &str, json: &str, initial: Value) -> Result<Value, ProviderError> {
    if json.trim().is_empty() {
        return Ok(if initial.is_object() {
            initial
        } else {
            json!({})
        });
    }
    let invalid = |why: String| ProviderError::Stream {
        code: "invalid_tool_input".into(),
        message: format!("the model's input for tool `{name}` ({id}) is not a JSON object: {why}"),
    };
    match serde_json::from_str::<Value>(json) {
        Ok(input) if input.is_object() => Ok(input),
        Ok(other) => Err(invalid(format!("got {other}"))),
        Err(err) => Err(invalid(err.to_string())),
    }
}

impl Parser {
    /// The model events of one server-sent event (`name` is its `event:`
    /// field, `raw` its data).
    fn feed(&mut self, name: &str, raw: &str) -> Vec<Item> {
        let data = match serde_json::from_str::<Value>(raw) {
            Ok(data) => data,
            Err(err) => return vec![Err(ProviderError::invalid_event(err))],
        };
        let kind = data["type"].as_str().unwrap_or(name);
        let index = data["index"].as_u64().unwrap_or(0);
        let mut out = Vec::new();
        match kind {
            "message_start" => {
                let usage = &data["message"]["usage"];
                self.input_tokens = [
                    "input_tokens",
                    "cache_creation_input_tokens",
                    "cache_read_input_tokens",
                ]
                .iter()
                .filter_map(|k| usage[k].as_i64())
                .sum();
                self.output_tokens = usage["output_tokens"].as_i64().unwrap_or(0);
                out.push(Ok(self.usage()));
            }
            "content_block_start" => {
                let block = &data["content_block"];
                match block["type"].as_str() {
                    Some("tool_use") => {
                        self.open.insert(
                            index,
                            Open::ToolUse {
                                id: block["id"].as_str().unwrap_or_default().to_owned(),
                                name: block["name"].as_str().unwrap_or_default().to_owned(),
                                json: String::new(),
                                initial: block["input"].clone(),
                            },
                        );
                    }
                    Some("redacted_thinking") => {
                        let data = block["data"].as_str().unwrap_or_default();
                        out.push(Ok(ModelEvent::RedactedReasoning(data.to_owned())));
                    }
                    Some("thinking") => {
                        if let Some(text) = block["thinking"].as_str().filter(|t| !t.is_empty()) {
                            out.push(Ok(ModelEvent::Reasoning(text.to_owned())));
                        }
                        let signature = block["signature"].as_str().unwrap_or_default();
                        self.open.insert(
                            index,
                            Open::Thinking {
                                signature: signature.to_owned(),
                            },
                        );
                    }
                    Some("text") => {
                        if let Some(text) = block["text"].as_str().filter(|t| !t.is_empty()) {
                            out.push(Ok(ModelEvent::Text(text.to_owned())));
                        }
                    }
                    _ => {}
                }
            }
            "content_block_delta" => {
                let delta = &data["delta"];
                match (delta["type"].as_str(), self.open.get_mut(&index)) {
                    (Some("text_delta"), _) => {
                        if let Some(text) = delta["text"].as_str() {
                            out.push(Ok(ModelEvent::Text(text.to_owned())));
                        }
                    }
                    (Some("thinking_delta"), _) => {
                        if let Some(text) = delta["thinking"].as_str() {
                            out.push(Ok(ModelEvent::Reasoning(text.to_owned())));
                        }
                    }
                    (Some("signature_delta"), Some(Open::Thinking { signature })) => {
                        signature.push_str(delta["signature"].as_str().unwrap_or_default());
                    }
                    (Some("input_json_delta"), Some(Open::ToolUse { json, .. })) => {
                        json.push_str(delta["partial_json"].as_str().unwrap_or_default());
                    }
                    _ => {}
                }
            }
            "content_block_stop" => match self.open.remove(&index) {
                Some(Open::ToolUse {
                    id,
                    name,
                    json,
                    initial,
                }) => match tool_input(&id, &name, &json, initial) {
                    Ok(input) => out.push(Ok(ModelEvent::ToolCall { id, name, input })),
                    Err(err) => {
                        self.broken.get_or_insert(err);
                    }
                },
                // The signature closes its block: emitted once, whole.
                Some(Open::Thinking { signature }) if !signature.is_empty() => {
                    out.push(Ok(ModelEvent::ReasoningSignature(signature)));
                }
                _ => {}
            },
            "message_delta" => {
                if let Some(reason) = data["delta"]["stop_reason"].as_str() {
                    self.stop_reason = reason.to_owned();
                    let in_call = self.broken.is_some()
                        || self
                            .open
                            .values()
                            .any(|o| matches!(o, Open::ToolUse { .. }));
                    if reason == "max_tokens" && in_call {
                        self.broken = Some(ProviderError::cut_off_in_tool_call());
                    }
                }
                if let Some(err) = self.broken.take() {
                    out.push(Err(err));
                    return out;
                }
                if let Some(tokens) = data["usage"]["output_tokens"].as_i64() {
                    self.output_tokens = tokens;
                    out.push(Ok(self.usage()));
                }
            }
            "message_stop" => out.push(match self.broken.take() {
                Some(err) => Err(err),
                None => Ok(ModelEvent::Finished {
                    stop_reason: std::mem::take(&mut self.stop_reason),
                }),
            }),
            "error" => {
                let (code, message) =
                    describe(&data).unwrap_or_else(|| ("api_error".into(), raw.to_owned()));
                out.push(Err(ProviderError::reported(&code, &message)));
            }
            _ => {}
        }
        out
    }

    fn usage(&self) -> ModelEvent {
        ModelEvent::Usage {
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
        }
    }
}

#[async_trait::async_trait]
impl Provider for Anthropic {
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let key = self.0.api_key.clone().ok_or_else(|| {
            ProviderError::Unavailable(
                "no Anthropic API key: set ANTHROPIC_API_KEY or the agent's api_key_env".into(),
            )
        })?;
        let url = format!("{}/v1/messages", self.0.base_url.trim_end_matches('/'));
        let builder = http::client()?
            .post(url)
            .header("x-api-key", key)
            .header("anthropic-version", VERSION)
            .json(&body(&request));
        let response = http::send(builder, describe, self.0.idle_timeout).await?;
        Ok(http::model_events::<Parser>(http::events(
            response,
            self.0.idle_timeout,
        )))
    }
}

/// A Messages API stream ends at `message_stop`.
impl http::EventParser for Parser {
    fn event(&mut self, event: &http::Event) -> Vec<Item> {
        self.feed(&event.event, &event.data)
    }

    fn ended(&mut self) -> Vec<Item> {
        vec![Err(ProviderError::Network(
            "the stream ended before message_stop".into(),
        ))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::ToolSpec;

    fn request(turns: Vec<Turn>) -> ModelRequest {
        ModelRequest {
            model: "claude-x".into(),
            system: Some("Be brief.".into()),
            turns,
            tools: Vec::new(),
            max_tokens: 99,
            thinking_budget: None,
            attempt: 1,
        }
    }

    fn turn(role: MessageRole, content: Vec<Content>) -> Turn {
        Turn { role, content }
    }

    fn tool_use(id: &str) -> Content {
        Content::ToolUse {
            id: id.into(),
            name: "lookup".into(),
            input: json!({ "q": id }),
        }
    }

    fn tool_result(id: &str, is_error: bool) -> Content {
        Content::ToolResult {
            tool_use_id: id.into(),
            output: format!("result of {id}"),
            is_error,
        }
    }

    fn signed(text: &str) -> Content {
        Content::Reasoning {
            text: text.into(),
            signature: Some(format!("sig-{text}")),
        }
    }

    fn unsigned(text: &str) -> Content {
        Content::Reasoning {
            text: text.into(),
            signature: None,
        }
    }

    #[test]
    fn turns_of_one_role_merge_their_blocks_and_the_system_prompt_is_separate() {
        let body = body(&request(vec![
            Turn::text(MessageRole::User, "a"),
            Turn::text(MessageRole::User, "b"),
            Turn::text(MessageRole::Assistant, "c"),
        ]));
        assert_eq!(body["system"], "Be brief.");
        assert_eq!(body["max_tokens"], 99);
        assert_eq!(body["stream"], true);
        assert!(body.get("tools").is_none());
        assert!(body.get("thinking").is_none());
        assert_eq!(
            body["messages"],
            json!([
                { "role": "user", "content": [
                    { "type": "text", "text": "a" },
                    { "type": "text", "text": "b" },
                ] },
                { "role": "assistant", "content": [{ "type": "text", "text": "c" }] },
            ])
        );
    }

    #[test]
    fn tool_calls_and_results_keep_their_order_with_results_first_in_the_user_message() {
        let mut request = request(vec![
            Turn::text(MessageRole::User, "look up two things"),
            turn(
                MessageRole::Assistant,
                vec![
                    Content::Text("Looking.".into()),
                    tool_use("t1"),
                    tool_use("t2"),
                ],
            ),
            turn(
                MessageRole::User,
                vec![tool_result("t1", false), tool_result("t2", true)],
            ),
            Turn::text(MessageRole::User, "and hurry"),
        ]);
        request.tools = vec![ToolSpec {
            name: "lookup".into(),
            description: "Looks things up".into(),
            input_schema: json!({ "type": "object" }),
        }];
        let body = body(&request);
        assert_eq!(
            body["tools"],
            json!([{ "name": "lookup", "description": "Looks things up", "input_schema": { "type": "object" } }])
        );
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 3);
        assert_eq!(
            messages[1]["content"],
            json!([
                { "type": "text", "text": "Looking." },
                { "type": "tool_use", "id": "t1", "name": "lookup", "input": { "q": "t1" } },
                { "type": "tool_use", "id": "t2", "name": "lookup", "input": { "q": "t2" } },
            ])
        );
        assert_eq!(messages[2]["role"], "user");
        assert_eq!(
            messages[2]["content"],
            json!([
                { "type": "tool_result", "tool_use_id": "t1", "content": "result of t1", "is_error": false },
                { "type": "tool_result", "tool_use_id": "t2", "content": "result of t2", "is_error": true },
                { "type": "text", "text": "and hurry" },
            ])
        );
    }

    #[test]
    fn signed_thinking_goes_back_first_and_unsigned_reasoning_never_does() {
        let mut request = request(vec![
            Turn::text(MessageRole::User, "q1"),
            turn(
                MessageRole::Assistant,
                vec![unsigned("from another model"), Content::Text("a1".into())],
            ),
            Turn::text(MessageRole::User, "q2"),
            turn(MessageRole::Assistant, vec![signed("plan"), tool_use("t1")]),
            turn(MessageRole::User, vec![tool_result("t1", false)]),
        ]);
        request.thinking_budget = Some(2048);
        let body = body(&request);
        assert_eq!(
            body["thinking"],
            json!({ "type": "enabled", "budget_tokens": 2048 })
        );
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(
            messages[1]["content"],
            json!([{ "type": "text", "text": "a1" }])
        );
        assert_eq!(
            messages[3]["content"][0],
            json!({ "type": "thinking", "thinking": "plan", "signature": "sig-plan" })
        );
        assert_eq!(messages[3]["content"][1]["type"], "tool_use");
    }

    #[test]
    fn turns_with_nothing_to_send_are_dropped_and_their_neighbours_merge() {
        let body = body(&request(vec![
            Turn::text(MessageRole::User, "a"),
            // Only unsigned reasoning, or a blank text: nothing to send.
            turn(MessageRole::Assistant, vec![unsigned("hmm")]),
            turn(MessageRole::User, vec![Content::Text(" \n".into())]),
            Turn::text(MessageRole::User, "b"),
            // Signed thinking that led to nothing may not end a message.
            turn(MessageRole::Assistant, vec![signed("idle")]),
            Turn::text(MessageRole::User, "c"),
            turn(
                MessageRole::Assistant,
                vec![signed("x"), Content::Text("d".into()), signed("y")],
            ),
        ]));
        assert_eq!(
            body["messages"],
            json!([
                { "role": "user", "content": [
                    { "type": "text", "text": "a" },
                    { "type": "text", "text": "b" },
                    { "type": "text", "text": "c" },
                ] },
                { "role": "assistant", "content": [
                    { "type": "thinking", "thinking": "x", "signature": "sig-x" },
                    { "type": "text", "text": "d" },
                ] },
            ])
        );
    }

    #[test]
    fn max_tokens_stays_above_the_thinking_budget() {
        let mut request = request(vec![Turn::text(MessageRole::User, "a")]);
        request.max_tokens = 321;
        assert_eq!(max_tokens(&request), 321);
        request.thinking_budget = Some(1024);
        assert_eq!(max_tokens(&request), 1345);
        request.max_tokens = 1024;
        assert_eq!(max_tokens(&request), 2048);
        request.max_tokens = 4096;
        assert_eq!(max_tokens(&request), 4096);
        assert_eq!(body(&request)["max_tokens"], 4096);
    }

    fn feed(parser: &mut Parser, data: Value) -> Vec<Item> {
        parser.feed("", &data.to_string())
    }

    #[test]
    fn tool_input_fragments_are_assembled_per_block_and_emitted_at_its_stop() {
        let mut parser = Parser::default();
        let start = |index: u64, id: &str| {
            json!({ "type": "content_block_start", "index": index,
                    "content_block": { "type": "tool_use", "id": id, "name": "lookup", "input": {} } })
        };
        let part = |index: u64, json: &str| {
            json!({ "type": "content_block_delta", "index": index,
                    "delta": { "type": "input_json_delta", "partial_json": json } })
        };
        let stop = |index: u64| json!({ "type": "content_block_stop", "index": index });
        assert!(feed(&mut parser, start(1, "t1")).is_empty());
        assert!(feed(&mut parser, start(2, "t2")).is_empty());
        for (index, piece) in [(1, "{\"q\": \"a\\"), (2, ""), (1, "\"b\"}"), (2, "  ")] {
            assert!(feed(&mut parser, part(index, piece)).is_empty());
        }
        assert_eq!(
            feed(&mut parser, stop(2)),
            [Ok(ModelEvent::ToolCall {
                id: "t2".into(),
                name: "lookup".into(),
                input: json!({})
            })]
        );
        assert_eq!(
            feed(&mut parser, stop(1)),
            [Ok(ModelEvent::ToolCall {
                id: "t1".into(),
                name: "lookup".into(),
                input: json!({ "q": "a\"b" })
            })]
        );
        // Input that does not parse fails the stream once the stop reason
        // says whether the token limit cut it off.
        let stop_reason = |reason: &str| {
            json!({ "type": "message_delta", "delta": { "stop_reason": reason },
                    "usage": { "output_tokens": 9 } })
        };
        for (reason, expected) in [
            ("tool_use", "invalid_tool_input"),
            ("max_tokens", "max_tokens"),
        ] {
            let mut parser = Parser::default();
            feed(&mut parser, start(3, "t3"));
            feed(&mut parser, part(3, "{\"q\": "));
            assert!(feed(&mut parser, stop(3)).is_empty());
            let bad = feed(&mut parser, stop_reason(reason));
            match &bad[..] {
                [Err(err @ ProviderError::Stream { code, message })] => {
                    assert_eq!(code, expected);
                    assert!(message.contains("t3"), "{message}");
                    assert!(err.is_transient());
                }
                [Err(err @ ProviderError::Unusable { code, .. })] => {
                    assert_eq!(code, expected);
                    assert!(!err.is_transient());
                }
                other => panic!("{other:?}"),
            }
        }
        // A call still open when the limit hits is cut off too.
        let mut parser = Parser::default();
        feed(&mut parser, start(4, "t4"));
        let cut = feed(&mut parser, stop_reason("max_tokens"));
        assert_eq!(cut, [Err(ProviderError::cut_off_in_tool_call())]);
        // Text cut off by the limit is an ordinary end.
        let mut parser = Parser::default();
        assert_eq!(
            feed(&mut parser, stop_reason("max_tokens")),
            [Ok(ModelEvent::Usage {
                input_tokens: 0,
                output_tokens: 9
            })]
        );
    }

    #[test]
    fn thinking_streams_as_reasoning_and_its_signature_closes_the_block() {
        let mut parser = Parser::default();
        feed(
            &mut parser,
            json!({ "type": "content_block_start", "index": 0,
                    "content_block": { "type": "thinking", "thinking": "" } }),
        );
        let delta =
            |delta: Value| json!({ "type": "content_block_delta", "index": 0, "delta": delta });
        assert_eq!(
            feed(
                &mut parser,
                delta(json!({ "type": "thinking_delta", "thinking": "Hmm." }))
            ),
            [Ok(ModelEvent::Reasoning("Hmm.".into()))]
        );
        for piece in ["EqQ", "Bsig"] {
            let events = feed(
                &mut parser,
                delta(json!({ "type": "signature_delta", "signature": piece })),
            );
            assert!(events.is_empty());
        }
        assert_eq!(
            feed(
                &mut parser,
                json!({ "type": "content_block_stop", "index": 0 })
            ),
            [Ok(ModelEvent::ReasoningSignature("EqQBsig".into()))]
        );
    }

    mod streams {
        use super::*;
        use crate::providers::http::tests::{
            check_broken, check_whole, model_events_of, pieces_of, with_broken_data,
        };
        use proptest::prelude::*;

        fn event(data: Value) -> String {
            format!(
                "event: {}\ndata: {data}\n\n",
                data["type"].as_str().unwrap()
            )
        }

        /// A Messages API stream: signed thinking, text in pieces, one tool
        /// call whose input streams three characters at a time.
        fn sse(thinking: &str, text: &[String], input: &Value) -> Vec<String> {
            let mut events = vec![event(json!({ "type": "message_start",
                "message": { "usage": { "input_tokens": 7, "output_tokens": 1 } } }))];
            let delta = |index: u64, delta: Value| {
                event(json!({ "type": "content_block_delta", "index": index, "delta": delta }))
            };
            let start = |index: u64, block: Value| {
                event(
                    json!({ "type": "content_block_start", "index": index, "content_block": block }),
                )
            };
            let stop = |index: u64| event(json!({ "type": "content_block_stop", "index": index }));
            events.push(start(0, json!({ "type": "thinking", "thinking": "" })));
            events.push(delta(
                0,
                json!({ "type": "thinking_delta", "thinking": thinking }),
            ));
            events.push(delta(
                0,
                json!({ "type": "signature_delta", "signature": "sig" }),
            ));
            events.push(stop(0));
            events.push(start(1, json!({ "type": "text", "text": "" })));
            events.push(event(json!({ "type": "ping" })));
            for piece in text {
                events.push(delta(1, json!({ "type": "text_delta", "text": piece })));
            }
            events.push(stop(1));
            events.push(start(
                2,
                json!({ "type": "tool_use", "id": "t1", "name": "f", "input": {} }),
            ));
            for piece in pieces_of(input) {
                events.push(delta(
                    2,
                    json!({ "type": "input_json_delta", "partial_json": piece }),
                ));
            }
            events.push(stop(2));
            events.push(event(json!({ "type": "message_delta",
                "delta": { "stop_reason": "tool_use" }, "usage": { "output_tokens": 9 } })));
            events.push(event(json!({ "type": "message_stop" })));
            events
        }

        proptest! {
            #[test]
            fn a_stream_cut_at_any_bytes_gives_the_same_events(
                thinking in "\\PC{0,20}",
                text in prop::collection::vec("\\PC{0,12}", 0..5),
                value in "\\PC{0,30}",
                cuts in prop::collection::vec(any::<usize>(), 0..40),
            ) {
                let input = json!({ "q": value });
                let body = sse(&thinking, &text, &input).concat();
                let call = ModelEvent::ToolCall { id: "t1".into(), name: "f".into(), input };
                let items = model_events_of(http::model_events::<Parser>, body.as_bytes(), &cuts);
                let events = check_whole(items, &text, &thinking, &call, "tool_use")?;
                prop_assert!(events.contains(&ModelEvent::ReasoningSignature("sig".into())));
            }

            #[test]
            fn an_event_with_broken_json_fails_the_stream_wherever_it_is(
                which in any::<prop::sample::Index>(),
                keep in any::<prop::sample::Index>(),
                cuts in prop::collection::vec(any::<usize>(), 0..40),
            ) {
                let mut events = sse("Hmm.", &["Hi ".into(), "there".into()], &json!({ "q": "é" }));
                let which = which.index(events.len());
                events[which] = with_broken_data(&events[which], keep, 0);
                let items = model_events_of(http::model_events::<Parser>, events.concat().as_bytes(), &cuts);
                check_broken(&items)?;
            }

            #[test]
            fn arbitrary_bytes_never_panic_and_end_the_stream_with_an_error(
                bytes in prop::collection::vec(any::<u8>(), 0..300),
                cuts in prop::collection::vec(any::<usize>(), 0..16),
            ) {
                let items = model_events_of(http::model_events::<Parser>, &bytes, &cuts);
                prop_assert!(items.last().is_some_and(Result::is_err), "{:?}", items);
            }
        }
    }
}
