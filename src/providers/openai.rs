//! OpenAI-compatible chat completions, streaming (OpenAI, Ollama, vLLM,
//! llama.cpp server, LiteLLM, OpenRouter, …).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::{Content, ModelEvent, ModelRequest, ModelStream, Provider, ProviderError, Turn, http};
use crate::domain::MessageRole;

pub const DEFAULT_BASE_URL: &str = "https://api.openai.com";

pub struct OpenAi(pub http::Endpoint);

fn describe(body: &Value) -> Option<(String, String)> {
    let error = body.get("error")?;
    let message = error.get("message")?.as_str()?.to_owned();
    let code = error
        .get("type")
        .and_then(Value::as_str)
        .or_else(|| error.get("code").and_then(Value::as_str))
        .unwrap_or("api_error")
        .to_owned();
    Some((code, message))
}

/// `{base}/v1/chat/completions`; a base that already ends in `/v1` (as
/// `OPENAI_BASE_URL` conventionally does) is not given a second one.
pub fn endpoint(base: &str) -> String {
    let base = base.trim_end_matches('/');
    if base.ends_with("/v1") {
        format!("{base}/chat/completions")
    } else {
        format!("{base}/v1/chat/completions")
    }
}

/// One turn as chat messages. An assistant turn is one message, its tool
/// calls in `tool_calls` (arguments as JSON text, as the API wants). A user
/// turn's tool results become `tool` messages first, in order, since they
/// must directly follow the assistant message that called them; its text
/// follows as a user message. Reasoning is never sent: chat completions have
/// no field for it.
fn turn_messages(turn: &Turn, messages: &mut Vec<Value>) {
    let text = turn.plain_text();
    match turn.role {
        MessageRole::Assistant => {
            let calls: Vec<Value> = turn
                .content
                .iter()
                .filter_map(|content| match content {
                    Content::ToolUse { id, name, input } => Some(json!({
                        "id": id,
                        "type": "function",
                        "function": { "name": name, "arguments": input.to_string() },
                    })),
                    _ => None,
                })
                .collect();
            if calls.is_empty() {
                // A message with neither content nor tool calls is refused.
                if !text.is_empty() {
                    messages.push(json!({ "role": "assistant", "content": text }));
                }
                return;
            }
            let content = if text.is_empty() {
                Value::Null
            } else {
                json!(text)
            };
            messages.push(json!({ "role": "assistant", "content": content, "tool_calls": calls }));
        }
        MessageRole::User => {
            for content in &turn.content {
                if let Content::ToolResult {
                    tool_use_id,
                    output,
                    ..
                } = content
                {
                    messages.push(json!({
                        "role": "tool",
                        "tool_call_id": tool_use_id,
                        "content": output,
                    }));
                }
            }
            if !text.is_empty() || !turn.has_tool_results() {
                messages.push(json!({ "role": "user", "content": text }));
            }
        }
    }
}

/// OpenAI's own API takes `max_completion_tokens` (its reasoning models
/// refuse `max_tokens`); other servers keep the older, common name.
pub fn for_server(mut body: Value, base_url: &str) -> Value {
    let official = reqwest::Url::parse(base_url)
        .ok()
        .is_some_and(|url| url.host_str() == Some("api.openai.com"));
    if official
        && let Some(object) = body.as_object_mut()
        && let Some(tokens) = object.remove("max_tokens")
    {
        object.insert("max_completion_tokens".into(), tokens);
    }
    body
}

pub fn body(request: &ModelRequest) -> Value {
    let mut messages = Vec::new();
    if let Some(system) = &request.system {
        messages.push(json!({ "role": "system", "content": system }));
    }
    for turn in &request.turns {
        turn_messages(turn, &mut messages);
    }
    let mut body = json!({
        "model": request.model,
        "max_tokens": request.max_tokens,
        "stream": true,
        "stream_options": { "include_usage": true },
        "messages": messages,
    });
    if !request.tools.is_empty() {
        let tools: Vec<Value> = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    },
                })
            })
            .collect();
        body["tools"] = json!(tools);
    }
    body
}

/// A tool call being streamed: its fragments share an `index`.
#[derive(Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

type Item = Result<ModelEvent, ProviderError>;

/// Chat-completion chunks as model events.
#[derive(Default)]
struct Parser {
    stop_reason: Option<String>,
    calls: BTreeMap<u64, PartialCall>,
}

impl Parser {
    /// Where a tool-call fragment belongs. The API numbers calls with
    /// `index`; a server that leaves it out (some send each call whole) gets
    /// a new call for every new id, else the fragment extends the last call.
    fn slot(&self, fragment: &Value) -> u64 {
        if let Some(index) = fragment["index"].as_u64() {
            return index;
        }
        let last = self.calls.keys().next_back().copied();
        let id = fragment["id"].as_str().filter(|id| !id.is_empty());
        match (id, last) {
            (Some(id), Some(last)) if self.calls.values().all(|c| c.id != id) => last + 1,
            (_, Some(last)) => last,
            (_, None) => 0,
        }
    }

    fn fragment(&mut self, fragment: &Value) {
        let slot = self.slot(fragment);
        let call = self.calls.entry(slot).or_default();
        if let Some(id) = fragment["id"].as_str().filter(|id| !id.is_empty())
            && call.id.is_empty()
        {
            call.id = id.to_owned();
        }
        let function = &fragment["function"];
        if let Some(name) = function["name"].as_str().filter(|n| !n.is_empty())
            && call.name.is_empty()
        {
            call.name = name.to_owned();
        }
        match &function["arguments"] {
            Value::String(piece) => call.arguments.push_str(piece),
            // Some servers send the arguments as an object, whole.
            object @ Value::Object(_) => call.arguments.push_str(&object.to_string()),
            _ => {}
        }
    }

    /// The calls gathered so far, complete, in index order.
    fn flush(&mut self) -> Vec<Item> {
        std::mem::take(&mut self.calls)
            .into_values()
            .map(|call| {
                let PartialCall {
                    id,
                    name,
                    arguments,
                } = call;
                // A server that gives no id still needs one to pair the
                // result with the call in the history.
                let id = if id.is_empty() {
                    format!("call_{}", uuid::Uuid::now_v7().simple())
                } else {
                    id
                };
                let invalid = |why: String| ProviderError::Stream {
                    code: "invalid_tool_input".into(),
                    message: format!("the model's tool call {id} is not valid: {why}"),
                };
                if name.is_empty() {
                    return Err(invalid("it names no function".into()));
                }
                if arguments.trim().is_empty() {
                    return Ok(ModelEvent::ToolCall {
                        id,
                        name,
                        input: json!({}),
                    });
                }
                match serde_json::from_str::<Value>(&arguments) {
                    Ok(input) if input.is_object() => Ok(ModelEvent::ToolCall { id, name, input }),
                    Ok(other) => Err(invalid(format!(
                        "the arguments of `{name}` are not a JSON object: {other}"
                    ))),
                    Err(err) => Err(invalid(format!(
                        "the arguments of `{name}` are not JSON: {err}"
                    ))),
                }
            })
            .collect()
    }

    /// The model events of one `data:` line.
    fn feed(&mut self, raw: &str) -> Vec<Item> {
        if raw.trim() == "[DONE]" {
            return self.end(true);
        }
        // Some servers send an empty `data:` as a keep-alive.
        if raw.trim().is_empty() {
            return Vec::new();
        }
        let chunk = match serde_json::from_str::<Value>(raw) {
            Ok(chunk) => chunk,
            Err(err) => return vec![Err(ProviderError::invalid_event(err))],
        };
        if let Some((code, message)) = describe(&chunk) {
            return vec![Err(ProviderError::reported(&code, &message))];
        }
        let mut out = Vec::new();
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            out.push(Ok(ModelEvent::Usage {
                input_tokens: usage["prompt_tokens"].as_i64().unwrap_or(0),
                output_tokens: usage["completion_tokens"].as_i64().unwrap_or(0),
            }));
        }
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let delta = &choice["delta"];
            // Servers name it one way or the other; some send both.
            let reasoning = ["reasoning_content", "reasoning"]
                .iter()
                .find_map(|field| delta[*field].as_str().filter(|t| !t.is_empty()));
            if let Some(text) = reasoning {
                out.push(Ok(ModelEvent::Reasoning(text.to_owned())));
            }
            if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                out.push(Ok(ModelEvent::Text(text.to_owned())));
            }
            for fragment in delta["tool_calls"].as_array().into_iter().flatten() {
                self.fragment(fragment);
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                self.stop_reason = Some(reason.to_owned());
                // The calls are complete once their choice finishes, unless
                // the token limit cut one of them off.
                let calls = self.flush();
                if reason == "length" && calls.iter().any(Result::is_err) {
                    out.push(Err(ProviderError::cut_off_in_tool_call()));
                } else {
                    out.extend(calls);
                }
            }
        }
        out
    }

    /// The end of the stream: `[DONE]`, or the connection closing (some
    /// servers send no `[DONE]`; a finish reason is enough then).
    fn end(&mut self, done: bool) -> Vec<Item> {
        let mut out = self.flush();
        out.push(match self.stop_reason.take() {
            Some(stop_reason) => Ok(ModelEvent::Finished { stop_reason }),
            None if done => Ok(ModelEvent::Finished {
                stop_reason: String::new(),
            }),
            None => Err(ProviderError::Network(
                "the stream ended before it finished".into(),
            )),
        });
        out
    }
}

#[async_trait::async_trait]
impl Provider for OpenAi {
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let mut builder = http::client()?
            .post(endpoint(&self.0.base_url))
            .json(&for_server(body(&request), &self.0.base_url));
        if let Some(key) = &self.0.api_key {
            builder = builder.bearer_auth(key);
        }
        let response = http::send(builder, describe, self.0.idle_timeout).await?;
        Ok(http::model_events::<Parser>(http::events(
            response,
            self.0.idle_timeout,
        )))
    }
}

/// A chat-completions stream is done at `[DONE]`, or at its finish reason
/// when the connection closes.
impl http::EventParser for Parser {
    fn event(&mut self, event: &http::Event) -> Vec<Item> {
        self.feed(&event.data)
    }

    fn ended(&mut self) -> Vec<Item> {
        self.end(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::ToolSpec;

    fn request(turns: Vec<Turn>) -> ModelRequest {
        ModelRequest {
            model: "gpt-x".into(),
            system: Some("Be brief.".into()),
            turns,
            tools: Vec::new(),
            max_tokens: 50,
            thinking_budget: None,
            attempt: 1,
        }
    }

    #[test]
    fn openai_itself_gets_max_completion_tokens_and_other_servers_max_tokens() {
        let body = || json!({ "model": "m", "max_tokens": 50 });
        let official = for_server(body(), "https://api.openai.com/v1");
        assert_eq!(official["max_completion_tokens"], 50);
        assert!(official.get("max_tokens").is_none());
        let local = for_server(body(), "http://127.0.0.1:11434");
        assert_eq!(local["max_tokens"], 50);
    }

    #[test]
    fn reasoning_sent_under_both_names_comes_out_once() {
        let chunk = json!({ "choices": [{ "index": 0,
            "delta": { "reasoning_content": "Think.", "reasoning": "Think." },
            "finish_reason": null }] })
        .to_string();
        assert_eq!(
            Parser::default().feed(&chunk),
            [Ok(ModelEvent::Reasoning("Think.".into()))]
        );
    }

    #[test]
    fn the_endpoint_takes_bases_with_and_without_v1() {
        assert_eq!(endpoint("http://h:1"), "http://h:1/v1/chat/completions");
        assert_eq!(endpoint("http://h:1/v1/"), "http://h:1/v1/chat/completions");
    }

    #[test]
    fn the_body_streams_with_usage_and_the_system_prompt_first() {
        let body = body(&request(vec![Turn::text(MessageRole::User, "hi")]));
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["messages"][0]["role"], "system");
        assert_eq!(body["messages"][1]["content"], "hi");
        assert!(body.get("tools").is_none());
    }

    #[test]
    fn tool_calls_and_results_become_tool_calls_and_tool_messages() {
        let mut request = request(vec![
            Turn::text(MessageRole::User, "look up two things"),
            Turn {
                role: MessageRole::Assistant,
                content: vec![
                    Content::Reasoning {
                        text: "never sent".into(),
                        signature: Some("sig".into()),
                    },
                    Content::ToolUse {
                        id: "call_1".into(),
                        name: "lookup".into(),
                        input: json!({ "q": "é \"x\"" }),
                    },
                    Content::ToolUse {
                        id: "call_2".into(),
                        name: "lookup".into(),
                        input: json!({}),
                    },
                ],
            },
            Turn {
                role: MessageRole::User,
                content: vec![
                    Content::ToolResult {
                        tool_use_id: "call_1".into(),
                        output: "one".into(),
                        is_error: false,
                    },
                    Content::ToolResult {
                        tool_use_id: "call_2".into(),
                        output: "two failed".into(),
                        is_error: true,
                    },
                    Content::Text("thanks".into()),
                ],
            },
            Turn {
                role: MessageRole::Assistant,
                content: vec![
                    Content::Text("Both found. ".into()),
                    Content::Reasoning {
                        text: "unsigned".into(),
                        signature: None,
                    },
                    Content::Text("Done.".into()),
                ],
            },
        ]);
        request.tools = vec![ToolSpec {
            name: "lookup".into(),
            description: "Looks things up".into(),
            input_schema: json!({ "type": "object" }),
        }];
        let body = body(&request);
        assert_eq!(
            body["tools"],
            json!([{ "type": "function", "function": {
                "name": "lookup", "description": "Looks things up", "parameters": { "type": "object" } } }])
        );
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(
            messages[2],
            json!({ "role": "assistant", "content": null, "tool_calls": [
                { "id": "call_1", "type": "function",
                  "function": { "name": "lookup", "arguments": "{\"q\":\"é \\\"x\\\"\"}" } },
                { "id": "call_2", "type": "function",
                  "function": { "name": "lookup", "arguments": "{}" } },
            ] })
        );
        assert_eq!(
            messages[3],
            json!({ "role": "tool", "tool_call_id": "call_1", "content": "one" })
        );
        assert_eq!(
            messages[4],
            json!({ "role": "tool", "tool_call_id": "call_2", "content": "two failed" })
        );
        assert_eq!(messages[5], json!({ "role": "user", "content": "thanks" }));
        assert_eq!(
            messages[6],
            json!({ "role": "assistant", "content": "Both found. Done." })
        );
        assert_eq!(messages.len(), 7);
    }

    #[test]
    fn an_assistant_turn_with_nothing_to_send_is_left_out() {
        let body = body(&request(vec![
            Turn::text(MessageRole::User, "a"),
            Turn {
                role: MessageRole::Assistant,
                content: vec![Content::Reasoning {
                    text: "hmm".into(),
                    signature: None,
                }],
            },
            Turn::text(MessageRole::User, "b"),
        ]));
        let roles: Vec<&str> = body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "user"]);
    }

    fn chunk(delta: Value, finish: Value) -> String {
        json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] }).to_string()
    }

    #[test]
    fn tool_call_fragments_by_index_come_out_whole_when_the_choice_finishes() {
        let mut parser = Parser::default();
        let calls = |calls: Value| chunk(json!({ "tool_calls": calls }), Value::Null);
        let fragments = [
            calls(json!([{ "index": 0, "id": "call_a", "type": "function",
                           "function": { "name": "lookup", "arguments": "" } }])),
            calls(json!([{ "index": 1, "id": "call_b", "type": "function",
                           "function": { "name": "fetch", "arguments": "{\"u\":" } }])),
            calls(json!([{ "index": 0, "function": { "arguments": "{\"q\": \"\\u00" } }])),
            calls(json!([{ "index": 1, "function": { "arguments": "\"x\"}" } }])),
            calls(json!([{ "index": 0, "function": { "arguments": "e9\"}" } }])),
        ];
        for fragment in &fragments {
            assert!(parser.feed(fragment).is_empty());
        }
        let events = parser.feed(&chunk(json!({}), json!("tool_calls")));
        assert_eq!(
            events,
            [
                Ok(ModelEvent::ToolCall {
                    id: "call_a".into(),
                    name: "lookup".into(),
                    input: json!({ "q": "é" })
                }),
                Ok(ModelEvent::ToolCall {
                    id: "call_b".into(),
                    name: "fetch".into(),
                    input: json!({ "u": "x" })
                }),
            ]
        );
        assert_eq!(
            parser.feed("[DONE]"),
            [Ok(ModelEvent::Finished {
                stop_reason: "tool_calls".into()
            })]
        );
    }

    #[test]
    fn whole_calls_without_index_and_bad_arguments_are_handled() {
        let mut parser = Parser::default();
        let whole = |id: &str| {
            chunk(
                json!({ "tool_calls": [{ "id": id, "function": { "name": "f", "arguments": { "n": 1 } } }] }),
                Value::Null,
            )
        };
        parser.feed(&whole("c1"));
        parser.feed(&whole("c2"));
        let events = parser.end(false);
        let ids: Vec<String> = events
            .iter()
            .filter_map(|e| match e {
                Ok(ModelEvent::ToolCall { id, input, .. }) => {
                    assert_eq!(input, &json!({ "n": 1 }));
                    Some(id.clone())
                }
                _ => None,
            })
            .collect();
        assert_eq!(ids, ["c1", "c2"]);
        // No finish reason and no [DONE]: the stream was cut.
        assert!(matches!(
            events.last(),
            Some(Err(ProviderError::Network(_)))
        ));

        let mut parser = Parser::default();
        let bad = parser.feed(&chunk(
            json!({ "tool_calls": [{ "index": 0, "id": "c3", "function": { "name": "f", "arguments": "{\"n\": tru" } }] }),
            json!("tool_calls"),
        ));
        assert!(
            matches!(&bad[..], [Err(ProviderError::Stream { code, message })]
                if code == "invalid_tool_input" && message.contains("c3")),
            "{bad:?}"
        );
    }

    mod streams {
        use super::*;
        use crate::providers::http::tests::{
            check_broken, check_whole, model_events_of, pieces_of, with_broken_data,
        };
        use proptest::prelude::*;

        /// A chat-completions stream: reasoning, text in pieces, one tool
        /// call whose arguments stream three characters at a time, usage,
        /// `[DONE]`.
        fn sse(reasoning: &str, text: &[String], input: &Value) -> Vec<String> {
            let data = |chunk: Value| format!("data: {chunk}\n\n");
            let delta = |delta: Value, finish: Value| {
                data(
                    json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] }),
                )
            };
            let mut events = vec![delta(
                json!({ "reasoning_content": reasoning }),
                Value::Null,
            )];
            for piece in text {
                events.push(delta(json!({ "content": piece }), Value::Null));
            }
            events.push(delta(
                json!({ "tool_calls": [{ "index": 0, "id": "c1", "type": "function",
                                         "function": { "name": "f", "arguments": "" } }] }),
                Value::Null,
            ));
            for piece in pieces_of(input) {
                events.push(delta(
                    json!({ "tool_calls": [{ "index": 0, "function": { "arguments": piece } }] }),
                    Value::Null,
                ));
            }
            events.push(delta(json!({}), json!("tool_calls")));
            events.push(data(
                json!({ "choices": [], "usage": { "prompt_tokens": 3, "completion_tokens": 4 } }),
            ));
            events.push("data: [DONE]\n\n".into());
            events
        }

        proptest! {
            #[test]
            fn a_stream_cut_at_any_bytes_gives_the_same_events(
                reasoning in "\\PC{0,20}",
                text in prop::collection::vec("\\PC{0,12}", 0..5),
                value in "\\PC{0,30}",
                cuts in prop::collection::vec(any::<usize>(), 0..40),
            ) {
                let input = json!({ "q": value });
                let body = sse(&reasoning, &text, &input).concat();
                let call = ModelEvent::ToolCall { id: "c1".into(), name: "f".into(), input };
                let items = model_events_of(http::model_events::<Parser>, body.as_bytes(), &cuts);
                check_whole(items, &text, &reasoning, &call, "tool_calls")?;
            }

            #[test]
            fn a_chunk_with_broken_json_fails_the_stream_wherever_it_is(
                which in any::<prop::sample::Index>(),
                keep in any::<prop::sample::Index>(),
                cuts in prop::collection::vec(any::<usize>(), 0..40),
            ) {
                let mut events = sse("Hmm.", &["Hi ".into(), "there".into()], &json!({ "q": "é" }));
                // Not `[DONE]`, which is not JSON.
                let which = which.index(events.len() - 1);
                // An empty `data:` is a keep-alive, so at least one byte stays.
                events[which] = with_broken_data(&events[which], keep, 1);
                let items = model_events_of(http::model_events::<Parser>, events.concat().as_bytes(), &cuts);
                check_broken(&items)?;
            }

            #[test]
            fn arbitrary_bytes_never_panic(
                bytes in prop::collection::vec(any::<u8>(), 0..300),
                cuts in prop::collection::vec(any::<usize>(), 0..16),
            ) {
                let items = model_events_of(http::model_events::<Parser>, &bytes, &cuts);
                // Whatever came, the stream ends: with its end or an error.
                let ended = items.last().is_some_and(|i| matches!(i, Err(_) | Ok(ModelEvent::Finished { .. })));
                prop_assert!(ended, "{:?}", items);
            }
        }
    }
}
