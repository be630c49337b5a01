//! The Anthropic and OpenAI-compatible providers against fakes that speak
//! their wire formats.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};
use tether::domain::MessageRole;
use tether::providers::anthropic::Anthropic;
use tether::providers::http::{Endpoint, install_tls};
use tether::providers::openai::OpenAi;
use tether::providers::{
    Content, ModelEvent, ModelRequest, Provider, ProviderError, ToolSpec, Turn,
};

use crate::fakes::{
    AnthropicBlock, FakeProvider, FakeToolCall, KEY, Reply, Wire, anthropic_sse,
    anthropic_sse_blocks, anthropic_sse_failing, anthropic_sse_thinking,
    anthropic_sse_thinking_tool_calls, anthropic_sse_tool_calls, fake_signature, model_config,
    openai_sse, openai_sse_tool_calls, server_with_key,
};
use crate::support::{Server, events_with_retries as events, of_type};

async fn server_for(fake: &FakeProvider, provider: &str) -> Server {
    server_with(fake, provider, "").await
}

/// A server whose one agent `model` talks to the fake, with `extra` TOML
/// appended to the agent (its `[agents.*]` tables).
pub async fn server_with(fake: &FakeProvider, provider: &str, extra: &str) -> Server {
    let agent = r#"system = "Be brief."
max_tokens = 321
idle_timeout_secs = 5
price = { input_per_mtok = 3.0, output_per_mtok = 15.0 }"#;
    let rest = format!(
        r#"
[agents.retry]
max_attempts = 3
initial_delay_ms = 100
max_delay_ms = 400

{extra}"#
    );
    server_with_key(model_config(provider, &fake.base_url, "", agent, &rest)).await
}

fn stream(sse: String, chunk_bytes: usize) -> Reply {
    Reply::Stream {
        sse,
        chunk_bytes,
        pause: Duration::ZERO,
    }
}

pub fn error(status: u16, kind: &'static str, headers: Vec<(&'static str, &'static str)>) -> Reply {
    Reply::Error {
        status,
        kind,
        message: "the fake says no",
        headers,
    }
}

#[tokio::test]
async fn anthropic_streams_text_split_anywhere_and_reports_usage_and_cost() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let pieces = ["Grüße, ", "世界 ", "🚀 and ", "{\"json\": true}"];
    // Three-byte chunks cut through multi-byte characters and JSON alike.
    fake.script([stream(anthropic_sse(&pieces, 1200, 340), 3)]);
    let server = server_for(&fake, "anthropic").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "Say hello").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(ended["usage"]["inputTokens"], 1200);
    assert_eq!(ended["usage"]["outputTokens"], 340);
    let cost = ended["usage"]["costUsd"].as_f64().unwrap();
    assert!(
        (cost - (1200.0 * 3.0 + 340.0 * 15.0) / 1e6).abs() < 1e-12,
        "{cost}"
    );
    let parts = server.reply_parts(&token, &conversation, &run).await;
    assert_eq!(parts[0]["text"], pieces.concat());

    let requests = fake.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0]["model"], "fake-model");
    assert_eq!(requests[0]["max_tokens"], 321);
    assert_eq!(requests[0]["system"], "Be brief.");
    assert_eq!(requests[0]["stream"], true);
    assert_eq!(
        requests[0]["messages"][0]["content"][0]["text"],
        "Say hello"
    );
    let events = events(&server, &token, &conversation).await;
    assert!(!of_type(&events, "usage.updated").is_empty());
}

#[tokio::test]
async fn anthropic_rate_limits_are_retried_no_sooner_than_retry_after() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        error(429, "rate_limit_error", vec![("retry-after", "1")]),
        error(429, "rate_limit_error", vec![("retry-after", "1")]),
    ]);
    let server = server_for(&fake, "anthropic").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hi").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let events = events(&server, &token, &conversation).await;
    let retries = of_type(&events, "run.retry-pending");
    let attempts: Vec<i64> = retries
        .iter()
        .map(|r| r["attempt"].as_i64().unwrap())
        .collect();
    assert_eq!(attempts, [1, 2]);
    for retry in &retries {
        assert!(retry["delayMs"].as_i64().unwrap() >= 1000, "{retry}");
        assert_eq!(retry["error"]["code"], "rate_limit_error");
        assert_eq!(retry["error"]["httpStatus"], 429);
    }
    let starts = of_type(&events, "run.started");
    assert_eq!(starts.len(), 3);
    for (retry, start) in retries.iter().zip(&starts[1..]) {
        assert!(start["at"].as_str().unwrap() >= retry["nextAttemptAt"].as_str().unwrap());
    }
    assert_eq!(fake.requests().len(), 3);
}

#[tokio::test]
async fn retry_after_ms_is_honoured_and_overloaded_is_retried() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([error(
        529,
        "overloaded_error",
        vec![("retry-after-ms", "1300")],
    )]);
    let server = server_for(&fake, "anthropic").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hi").await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let events = events(&server, &token, &conversation).await;
    let retry = of_type(&events, "run.retry-pending")[0];
    assert!(retry["delayMs"].as_i64().unwrap() >= 1300, "{retry}");
}

#[tokio::test]
async fn client_errors_are_not_retried_and_fail_with_the_providers_message() {
    for (status, kind) in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
    ] {
        let fake = FakeProvider::start(Wire::Anthropic).await;
        fake.script([error(status, kind, vec![])]);
        let server = server_for(&fake, "anthropic").await;
        let token = server.token("acme", "ada");
        let conversation = server.create_conversation(&token).await;
        let (_, run) = server.send(&token, &conversation, "hi").await;
        let ended = server.wait_until_ended(&token, &run).await;
        assert_eq!(ended["status"], "FAILED", "{status}");
        assert_eq!(ended["error"]["code"], kind);
        assert_eq!(ended["error"]["message"], "the fake says no");
        assert_eq!(fake.requests().len(), 1, "{status} is not retried");
        // The reply shows the failure, not an empty text.
        let parts = server.reply_parts(&token, &conversation, &run).await;
        assert_eq!(parts.len(), 1, "{status}: {parts:?}");
        assert_eq!(parts[0]["kind"], "ERROR", "{status}: {parts:?}");
        assert_eq!(parts[0]["state"], "DONE");
        assert_eq!(parts[0]["text"], "the fake says no");
    }
}

/// Sends "hi" to the server's agent and waits for the run to end: the run,
/// and its reply's parts as (kind, text).
async fn reply_to_hi(server: &Server) -> (Value, Vec<(String, String)>) {
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hi").await;
    let ended = server.wait_until_ended(&token, &run).await;
    let parts = server.reply_parts(&token, &conversation, &run).await;
    let shown = parts
        .iter()
        .map(|p| {
            let field = |name: &str| p[name].as_str().unwrap_or_default().to_owned();
            (field("kind"), field("text"))
        })
        .collect();
    (ended, shown)
}

#[tokio::test]
async fn a_run_that_fails_before_any_text_shows_the_reason_in_an_error_part() {
    // An Anthropic agent with no API key anywhere: the request is never made.
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let config = format!(
        "[[agents]]\nname = \"model\"\nprovider = \"anthropic\"\nmodel = \"fake-model\"\nbase_url = \"{}\"\n",
        fake.base_url
    );
    let server = Server::start_workers(&config).await;
    let (ended, shown) = reply_to_hi(&server).await;
    assert_eq!(ended["status"], "FAILED", "{ended}");
    assert!(fake.requests().is_empty());
    assert_eq!(shown.len(), 1, "{shown:?}");
    assert_eq!(shown[0].0, "ERROR", "{shown:?}");
    assert!(shown[0].1.contains("no Anthropic API key"), "{shown:?}");
    assert_eq!(shown[0].1, ended["error"]["message"], "the run's own error");

    // A provider that refuses the key: its message, and never the key.
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([Reply::Error {
        status: 401,
        kind: "authentication_error",
        message: "invalid x-api-key",
        headers: vec![],
    }]);
    let (ended, shown) = reply_to_hi(&server_for(&fake, "anthropic").await).await;
    assert_eq!(ended["status"], "FAILED", "{ended}");
    assert_eq!(shown.len(), 1, "{shown:?}");
    assert_eq!(shown[0].0, "ERROR", "{shown:?}");
    assert!(shown[0].1.contains("invalid x-api-key"), "{shown:?}");
    assert!(!shown[0].1.contains(KEY), "{shown:?}");
}

#[tokio::test]
async fn an_attempt_abandoned_before_its_first_token_leaves_no_empty_text_part() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        error(503, "api_error", vec![]),
        stream(anthropic_sse(&["The answer."], 10, 4), 16),
    ]);
    let (ended, shown) = reply_to_hi(&server_for(&fake, "anthropic").await).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    // The notice of the failed attempt, then the reply: no empty bubble.
    assert_eq!(shown.len(), 2, "{shown:?}");
    assert_eq!(shown[0].0, "NOTICE", "{shown:?}");
    assert!(shown[0].1.contains("attempt 2 of 3"), "{shown:?}");
    assert_eq!(shown[1], ("TEXT".to_owned(), "The answer.".to_owned()));
}

#[tokio::test]
async fn an_error_event_after_200_abandons_the_attempt_and_retries() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        stream(
            anthropic_sse_failing(&["half an ans"], "overloaded_error", "Overloaded"),
            16,
        ),
        stream(anthropic_sse(&["The whole answer."], 10, 4), 16),
    ]);
    let (ended, shown) = reply_to_hi(&server_for(&fake, "anthropic").await).await;
    assert_eq!(ended["status"], "COMPLETED");
    let text = |text: &str| ("TEXT".to_owned(), text.to_owned());
    assert_eq!(shown[0], text("half an ans"));
    assert_eq!(shown[1].0, "NOTICE");
    assert_eq!(shown[2], text("The whole answer."));
    // The abandoned text never went back to the model.
    let second = &fake.requests()[1];
    assert_eq!(second["messages"].as_array().unwrap().len(), 1, "{second}");
}

#[tokio::test]
async fn exhaustion_fails_the_run_with_the_last_error() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        error(503, "api_error", vec![]),
        error(503, "api_error", vec![]),
        error(500, "api_error", vec![]),
    ]);
    let server = server_for(&fake, "anthropic").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hi").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "FAILED");
    assert_eq!(ended["error"]["code"], "api_error");
    assert_eq!(fake.requests().len(), 3);
    let events = events(&server, &token, &conversation).await;
    assert_eq!(of_type(&events, "run.retry-pending").len(), 2);
}

#[tokio::test]
async fn cancelling_mid_stream_closes_the_connection_to_the_provider() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let pieces: Vec<String> = (0..200).map(|i| format!("word{i} ")).collect();
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    fake.script([Reply::Stream {
        sse: anthropic_sse(&pieces, 10, 200),
        chunk_bytes: 120,
        pause: Duration::from_millis(50),
    }]);
    let server = server_for(&fake, "anthropic").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "talk").await;
    loop {
        let parts = server.reply_parts(&token, &conversation, &run).await;
        if parts
            .first()
            .is_some_and(|p| !p["text"].as_str().unwrap().is_empty())
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.cancel(&token, &run).await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "CANCELLED"
    );
    let deadline = tokio::time::Instant::now() + crate::support::PATIENCE;
    while fake.abandoned_streams() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the provider never saw the connection close"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn openai_compatible_streams_with_usage_and_retries_rate_limits() {
    let fake = FakeProvider::start(Wire::OpenAi).await;
    fake.script([
        error(429, "requests", vec![("retry-after-ms", "1100")]),
        stream(openai_sse(&["Olá, ", "mundo ", "✓"], 77, 9), 5),
    ]);
    let server = server_for(&fake, "openai").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hi").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(ended["usage"]["inputTokens"], 77);
    assert_eq!(ended["usage"]["outputTokens"], 9);
    let parts = server.reply_parts(&token, &conversation, &run).await;
    assert_eq!(parts.last().unwrap()["text"], "Olá, mundo ✓");
    let events = events(&server, &token, &conversation).await;
    let retry = of_type(&events, "run.retry-pending")[0];
    assert!(retry["delayMs"].as_i64().unwrap() >= 1100);
    let request = &fake.requests()[1];
    assert_eq!(request["stream_options"]["include_usage"], true);
    assert_eq!(
        request["messages"][0],
        json!({ "role": "system", "content": "Be brief." })
    );
    assert_eq!(
        request["messages"][1],
        json!({ "role": "user", "content": "hi" })
    );
}

#[tokio::test]
async fn token_and_cost_ceilings_end_runs_with_their_cause() {
    for (limit, cause) in [
        ("max_input_tokens = 1000", "TOKEN_LIMIT"),
        ("max_output_tokens = 100", "TOKEN_LIMIT"),
        ("max_cost_usd = 0.001", "COST_LIMIT"),
    ] {
        let fake = FakeProvider::start(Wire::Anthropic).await;
        fake.script([stream(anthropic_sse(&["Long answer."], 1200, 340), 64)]);
        let server = server_with(&fake, "anthropic", &format!("[agents.limits]\n{limit}")).await;
        let token = server.token("acme", "ada");
        let conversation = server.create_conversation(&token).await;
        let (_, run) = server.send(&token, &conversation, "hi").await;
        let ended = server.wait_until_ended(&token, &run).await;
        assert_eq!(ended["status"], "FAILED", "{limit}");
        assert_eq!(ended["endCause"], cause, "{limit}");
        assert_eq!(ended["error"]["code"], cause, "{limit}");
        // What was produced is kept.
        let parts = server.reply_parts(&token, &conversation, &run).await;
        assert_eq!(parts[0]["text"], "Long answer.");
    }
}

#[tokio::test]
async fn thinking_streams_into_a_reasoning_part_before_the_text_and_goes_back_signed_and_unchanged()
{
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        stream(
            anthropic_sse_thinking(&["Let me ", "think."], &["The answer."]),
            7,
        ),
        stream(anthropic_sse(&["Second answer."], 10, 5), 64),
    ]);
    let server = server_for(&fake, "anthropic").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "Why?").await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let parts = server.reply_parts(&token, &conversation, &run).await;
    let shown: Vec<(&str, &str, &str)> = parts
        .iter()
        .map(|p| {
            (
                p["kind"].as_str().unwrap(),
                p["state"].as_str().unwrap(),
                p["text"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            ("REASONING", "DONE", "Let me think."),
            ("TEXT", "DONE", "The answer.")
        ]
    );
    // The next request carries the thinking block as it came, with its
    // signature (the fake checks it), before the reply.
    let (_, second) = server.send(&token, &conversation, "And?").await;
    assert_eq!(
        server.wait_until_ended(&token, &second).await["status"],
        "COMPLETED"
    );
    let request = &fake.requests()[1];
    let messages = request["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3, "{request}");
    assert_eq!(messages[0]["content"][0]["text"], "Why?");
    assert_eq!(
        messages[1]["content"],
        json!([
            { "type": "thinking", "thinking": "Let me think.", "signature": fake_signature("Let me think.") },
            { "type": "text", "text": "The answer." }
        ])
    );
    assert_eq!(messages[2]["content"][0]["text"], "And?");
}

#[tokio::test]
async fn a_long_history_is_compacted_once_and_the_next_request_fits_the_budget() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let server = server_with(
        &fake,
        "anthropic",
        "[agents.context]
budget_tokens = 60
keep_recent_messages = 2",
    )
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut runs = Vec::new();
    for i in 1..=3 {
        let text = format!("message {i}: {}", "words ".repeat(15));
        let (_, run) = server.send(&token, &conversation, &text).await;
        assert_eq!(
            server.wait_until_ended(&token, &run).await["status"],
            "COMPLETED"
        );
        runs.push(run);
    }

    let events = events(&server, &token, &conversation).await;
    let compacted: Vec<&Value> = of_type(&events, "context.compacted");
    assert_eq!(compacted.len(), 1, "compacted once");
    assert_eq!(compacted[0]["runId"], runs[2].as_str());
    assert_eq!(compacted[0]["messagesCompacted"], 3);

    // Requests: run 1, run 2, the summary, run 3.
    let requests = fake.requests();
    assert_eq!(requests.len(), 4);
    let summary_request = requests[2]["messages"].as_array().unwrap();
    // The instruction is the last block (the history's last user turn and
    // it are one message, their blocks merged).
    let last = summary_request.last().unwrap()["content"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()["text"]
        .as_str()
        .unwrap();
    assert!(last.contains("Summarize the conversation above"), "{last}");
    let main = requests[3]["messages"].as_array().unwrap();
    let first = main[0]["content"][0]["text"].as_str().unwrap();
    assert!(
        first.starts_with("Summary of the earlier conversation:"),
        "{first}"
    );
    let estimate: usize = main
        .iter()
        .flat_map(|m| m["content"].as_array().unwrap())
        .map(|block| block["text"].as_str().unwrap().chars().count().div_ceil(4))
        .sum();
    assert!(estimate <= 60, "the request fits the budget: {estimate}");

    // The original messages stay readable, and the summary's usage counts.
    let data = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { messages { role } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(
        data["conversation"]["messages"].as_array().unwrap().len(),
        6
    );
    let third = server.wait_until_ended(&token, &runs[2]).await;
    assert_eq!(
        third["usage"]["inputTokens"], 20,
        "summary and reply: {third}"
    );
}

// The provider clients driven directly against the fakes: tool calls and
// extended thinking, both ways.

fn endpoint(fake: &FakeProvider) -> Endpoint {
    install_tls();
    Endpoint {
        base_url: fake.base_url.clone(),
        api_key: Some(KEY.into()),
        idle_timeout: Duration::from_secs(5),
    }
}

fn lookup_tool() -> ToolSpec {
    ToolSpec {
        name: "lookup".into(),
        description: "Looks things up".into(),
        input_schema: json!({ "type": "object", "properties": { "query": { "type": "string" } } }),
    }
}

fn model_request(turns: Vec<Turn>, thinking_budget: Option<u32>) -> ModelRequest {
    ModelRequest {
        model: "fake-model".into(),
        system: Some("Be brief.".into()),
        turns,
        tools: vec![lookup_tool()],
        max_tokens: 321,
        thinking_budget,
        attempt: 1,
    }
}

/// Every event of one request, or the first error.
async fn run(
    provider: &dyn Provider,
    request: ModelRequest,
) -> Result<Vec<ModelEvent>, ProviderError> {
    let mut stream = provider.stream(request).await?;
    let mut events = Vec::new();
    while let Some(event) = stream.next().await {
        events.push(event?);
    }
    Ok(events)
}

fn text_of(events: &[ModelEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::Text(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

fn calls_of(events: &[ModelEvent]) -> Vec<(String, String, Value)> {
    events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ToolCall { id, name, input } => {
                Some((id.clone(), name.clone(), input.clone()))
            }
            _ => None,
        })
        .collect()
}

fn expected_calls(calls: &[FakeToolCall]) -> Vec<(String, String, Value)> {
    calls
        .iter()
        .map(|c| (c.id.clone(), c.name.clone(), c.input()))
        .collect()
}

/// Calls whose inputs are hard to reassemble: escapes, multi-byte
/// characters, a surrogate pair written as escapes, nesting, an empty input.
fn awkward_calls(prefix: &str) -> Vec<FakeToolCall> {
    vec![
        FakeToolCall::new(
            &format!("{prefix}1"),
            "lookup",
            json!({ "query": "Grüße \"zitiert\" \\ 世界 🚀", "limit": 3, "tags": ["a\nb", "ü"] }),
        ),
        FakeToolCall::raw(
            &format!("{prefix}2"),
            "lookup",
            r#"{"query":"caf\u00e9 \ud83d\ude80 \"q\" \\","nested":{"ok":true,"n":[1,2.5]}}"#,
        ),
        FakeToolCall::raw(&format!("{prefix}3"), "lookup", ""),
    ]
}

#[tokio::test]
async fn anthropic_tool_calls_split_across_chunks_come_out_whole() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let client = Anthropic(endpoint(&fake));
    let calls = awkward_calls("toolu_0");
    let mut expected = expected_calls(&calls[..2]);
    // An input streamed as nothing at all is an empty object.
    expected.push(("toolu_03".into(), "lookup".into(), json!({})));
    for chunk_bytes in [1, 2, 3, 5, 7, 64] {
        fake.script([Reply::sse(
            anthropic_sse_tool_calls(&["Let me ", "look… ✓"], &calls),
            chunk_bytes,
        )]);
        let turns = vec![Turn::text(MessageRole::User, "Look it up")];
        let events = run(&client, model_request(turns, None)).await.unwrap();
        assert_eq!(text_of(&events), "Let me look… ✓", "{chunk_bytes}");
        assert_eq!(calls_of(&events), expected, "{chunk_bytes}");
        assert_eq!(
            events.last(),
            Some(&ModelEvent::Finished {
                stop_reason: "tool_use".into()
            }),
            "{chunk_bytes}"
        );
        assert!(events.contains(&ModelEvent::Usage {
            input_tokens: 10,
            output_tokens: 5
        }));
    }
    let request = &fake.requests()[0];
    assert_eq!(
        request["tools"],
        json!([{ "name": "lookup", "description": "Looks things up",
                 "input_schema": lookup_tool().input_schema }])
    );
    assert!(request.get("thinking").is_none());
}

#[tokio::test]
async fn anthropic_invalid_tool_input_is_a_stream_error() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let client = Anthropic(endpoint(&fake));
    let broken = FakeToolCall::raw("toolu_bad", "lookup", r#"{"query": "unterminated"#);
    fake.script([Reply::sse(anthropic_sse_tool_calls(&[], &[broken]), 4)]);
    let turns = vec![Turn::text(MessageRole::User, "Look it up")];
    let error = run(&client, model_request(turns, None)).await.unwrap_err();
    match error {
        ProviderError::Stream { code, message } => {
            assert_eq!(code, "invalid_tool_input");
            assert!(message.contains("toolu_bad"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn anthropic_thinking_comes_out_with_its_signature_before_the_tool_call() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let client = Anthropic(endpoint(&fake));
    let call = FakeToolCall::new("toolu_t", "lookup", json!({ "query": "Zürich" }));
    let thinking = ["Ich über", "lege… 🤔 ", "\"genau\""];
    fake.script([Reply::sse(
        anthropic_sse_thinking_tool_calls(&thinking, &["Moment."], std::slice::from_ref(&call)),
        3,
    )]);
    let turns = vec![Turn::text(MessageRole::User, "Wetter?")];
    let events = run(&client, model_request(turns, Some(1024)))
        .await
        .unwrap();
    let shown: Vec<&ModelEvent> = events
        .iter()
        .filter(|e| !matches!(e, ModelEvent::Usage { .. }))
        .collect();
    let reasoning: String = shown
        .iter()
        .take_while(|e| matches!(e, ModelEvent::Reasoning(_)))
        .map(|e| match e {
            ModelEvent::Reasoning(t) => t.as_str(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(reasoning, thinking.concat());
    let rest: Vec<&ModelEvent> = shown
        .iter()
        .skip_while(|e| matches!(e, ModelEvent::Reasoning(_)))
        .copied()
        .collect();
    assert_eq!(
        rest,
        [
            &ModelEvent::ReasoningSignature(fake_signature(&thinking.concat())),
            &ModelEvent::Text("Moment.".into()),
            &ModelEvent::ToolCall {
                id: "toolu_t".into(),
                name: "lookup".into(),
                input: json!({ "query": "Zürich" })
            },
            &ModelEvent::Finished {
                stop_reason: "tool_use".into()
            },
        ]
    );
    let request = &fake.requests()[0];
    assert_eq!(
        request["thinking"],
        json!({ "type": "enabled", "budget_tokens": 1024 })
    );
    // The agent's max_tokens (321) is room for the answer beyond the budget.
    assert_eq!(request["max_tokens"], 1345);
}

fn signed(text: &str) -> Content {
    Content::Reasoning {
        text: text.into(),
        signature: Some(fake_signature(text)),
    }
}

fn tool_use(id: &str) -> Content {
    Content::ToolUse {
        id: id.into(),
        name: "lookup".into(),
        input: json!({ "query": id }),
    }
}

fn tool_result(id: &str, is_error: bool) -> Content {
    Content::ToolResult {
        tool_use_id: id.into(),
        output: format!("found {id}"),
        is_error,
    }
}

/// A history after a step that called two tools: `assistant` is the
/// calling turn, `results` the results turn, then the person's next words.
fn history(assistant: Vec<Content>, results: Vec<Content>) -> Vec<Turn> {
    vec![
        Turn::text(MessageRole::User, "Look two things up"),
        Turn {
            role: MessageRole::Assistant,
            content: assistant,
        },
        Turn {
            role: MessageRole::User,
            content: results,
        },
        Turn::text(MessageRole::User, "And be quick"),
    ]
}

fn refusal(result: Result<Vec<ModelEvent>, ProviderError>) -> String {
    match result {
        Err(ProviderError::Http {
            status: 400,
            code,
            message,
            ..
        }) => {
            assert_eq!(code, "invalid_request_error");
            message
        }
        other => panic!("expected a 400 from the fake: {other:?}"),
    }
}

#[tokio::test]
async fn anthropic_follow_ups_with_tool_results_are_accepted_and_broken_ones_refused() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let client = Anthropic(endpoint(&fake));
    let calling = || {
        vec![
            signed("Two lookups."),
            Content::Text("Looking.".into()),
            tool_use("toolu_a"),
            tool_use("toolu_b"),
        ]
    };
    let answered = || vec![tool_result("toolu_a", false), tool_result("toolu_b", true)];

    let events = run(
        &client,
        model_request(history(calling(), answered()), Some(1024)),
    )
    .await
    .unwrap();
    assert_eq!(text_of(&events), "Hello from the fake.");
    let requests = fake.requests();
    assert_eq!(requests.len(), 1);
    let messages = requests[0]["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(
        messages[1]["content"][0],
        json!({ "type": "thinking", "thinking": "Two lookups.", "signature": fake_signature("Two lookups.") })
    );
    assert_eq!(
        messages[2]["content"],
        json!([
            { "type": "tool_result", "tool_use_id": "toolu_a", "content": "found toolu_a", "is_error": false },
            { "type": "tool_result", "tool_use_id": "toolu_b", "content": "found toolu_b", "is_error": true },
            { "type": "text", "text": "And be quick" },
        ])
    );

    // A call left without its result.
    let message = refusal(
        run(
            &client,
            model_request(
                history(calling(), vec![tool_result("toolu_a", false)]),
                Some(1024),
            ),
        )
        .await,
    );
    assert_eq!(
        message,
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_b. Each `tool_use` block must have a corresponding `tool_result` block in the next message."
    );

    // A result for a call that was never made.
    let message = refusal(
        run(
            &client,
            model_request(
                history(
                    calling(),
                    vec![
                        tool_result("toolu_a", false),
                        tool_result("toolu_b", false),
                        tool_result("toolu_zz", false),
                    ],
                ),
                None,
            ),
        )
        .await,
    );
    assert!(
        message.starts_with(
            "messages.2.content.2: unexpected `tool_use_id` found in `tool_result` blocks: toolu_zz."
        ),
        "{message}"
    );

    // With thinking on, the calling turn must open with its thinking; an
    // unsigned one cannot be sent, so the request is refused.
    let unsigned = vec![
        Content::Reasoning {
            text: "Two lookups.".into(),
            signature: None,
        },
        tool_use("toolu_a"),
        tool_use("toolu_b"),
    ];
    let message = refusal(
        run(
            &client,
            model_request(history(unsigned, answered()), Some(1024)),
        )
        .await,
    );
    assert!(
        message.starts_with("messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `tool_use`."),
        "{message}"
    );

    // Thinking sent back changed.
    let mut tampered = calling();
    tampered[0] = Content::Reasoning {
        text: "Two lookups, edited.".into(),
        signature: Some(fake_signature("Two lookups.")),
    };
    let message = refusal(
        run(
            &client,
            model_request(history(tampered, answered()), Some(1024)),
        )
        .await,
    );
    assert_eq!(
        message,
        "messages.1.content.0: Invalid `signature` in `thinking` block"
    );
    assert_eq!(fake.requests().len(), 1, "refused requests get no reply");
}

#[tokio::test]
async fn anthropic_blocks_builder_streams_text_thinking_and_calls_in_any_order() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let client = Anthropic(endpoint(&fake));
    let call = FakeToolCall::new("toolu_x", "lookup", json!({ "query": "x" }));
    fake.script([Reply::sse(
        anthropic_sse_blocks(
            &[
                AnthropicBlock::thinking(&["a"]),
                AnthropicBlock::ToolUse(call.clone()),
                AnthropicBlock::thinking(&["b"]),
                AnthropicBlock::text(&["done"]),
            ],
            "end_turn",
            42,
            7,
        ),
        11,
    )]);
    let turns = vec![Turn::text(MessageRole::User, "go")];
    let events = run(&client, model_request(turns, Some(2048)))
        .await
        .unwrap();
    let shown: Vec<ModelEvent> = events
        .into_iter()
        .filter(|e| !matches!(e, ModelEvent::Usage { .. }))
        .collect();
    assert_eq!(
        shown,
        [
            ModelEvent::Reasoning("a".into()),
            ModelEvent::ReasoningSignature(fake_signature("a")),
            ModelEvent::ToolCall {
                id: "toolu_x".into(),
                name: "lookup".into(),
                input: call.input()
            },
            ModelEvent::Reasoning("b".into()),
            ModelEvent::ReasoningSignature(fake_signature("b")),
            ModelEvent::Text("done".into()),
            ModelEvent::Finished {
                stop_reason: "end_turn".into()
            },
        ]
    );
}

#[tokio::test]
async fn openai_tool_calls_split_across_chunks_come_out_whole() {
    let fake = FakeProvider::start(Wire::OpenAi).await;
    let client = OpenAi(endpoint(&fake));
    let calls = awkward_calls("call_");
    let mut expected = expected_calls(&calls[..2]);
    expected.push(("call_3".into(), "lookup".into(), json!({})));
    for chunk_bytes in [1, 2, 3, 5, 7, 64] {
        fake.script([Reply::sse(
            openai_sse_tool_calls(&["Prüfe ", "kurz… ✓"], &calls),
            chunk_bytes,
        )]);
        let turns = vec![Turn::text(MessageRole::User, "Look it up")];
        let events = run(&client, model_request(turns, None)).await.unwrap();
        assert_eq!(text_of(&events), "Prüfe kurz… ✓", "{chunk_bytes}");
        assert_eq!(calls_of(&events), expected, "{chunk_bytes}");
        assert_eq!(
            events.last(),
            Some(&ModelEvent::Finished {
                stop_reason: "tool_calls".into()
            })
        );
        assert!(events.contains(&ModelEvent::Usage {
            input_tokens: 10,
            output_tokens: 5
        }));
    }
    // Without text the stream still carries only the calls.
    fake.script([Reply::sse(openai_sse_tool_calls(&[], &calls[..1]), 3)]);
    let turns = vec![Turn::text(MessageRole::User, "Look it up")];
    let events = run(&client, model_request(turns, None)).await.unwrap();
    assert_eq!(text_of(&events), "");
    assert_eq!(calls_of(&events), expected[..1]);

    let request = &fake.requests()[0];
    assert_eq!(
        request["tools"],
        json!([{ "type": "function", "function": {
            "name": "lookup", "description": "Looks things up",
            "parameters": lookup_tool().input_schema } }])
    );
}

#[tokio::test]
async fn openai_follow_ups_with_tool_messages_are_accepted_and_broken_ones_refused() {
    let fake = FakeProvider::start(Wire::OpenAi).await;
    let client = OpenAi(endpoint(&fake));
    let calling = || {
        vec![
            Content::Reasoning {
                text: "never sent".into(),
                signature: None,
            },
            tool_use("call_a"),
            tool_use("call_b"),
        ]
    };
    let answered = || vec![tool_result("call_a", false), tool_result("call_b", true)];

    let events = run(&client, model_request(history(calling(), answered()), None))
        .await
        .unwrap();
    assert_eq!(text_of(&events), "Hello from the fake.");
    let requests = fake.requests();
    assert_eq!(requests.len(), 1);
    let messages = requests[0]["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool", "user"]
    );
    assert_eq!(messages[2]["content"], Value::Null);
    assert_eq!(
        messages[2]["tool_calls"][0],
        json!({ "id": "call_a", "type": "function",
                "function": { "name": "lookup", "arguments": "{\"query\":\"call_a\"}" } })
    );
    assert_eq!(
        messages[4],
        json!({ "role": "tool", "tool_call_id": "call_b", "content": "found call_b" })
    );

    // A call left without its answer.
    let message = refusal(
        run(
            &client,
            model_request(history(calling(), vec![tool_result("call_a", false)]), None),
        )
        .await,
    );
    assert_eq!(
        message,
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: call_b"
    );

    // An answer to a call that was never made.
    let message = refusal(
        run(
            &client,
            model_request(
                history(
                    calling(),
                    vec![
                        tool_result("call_a", false),
                        tool_result("call_b", false),
                        tool_result("call_zz", false),
                    ],
                ),
                None,
            ),
        )
        .await,
    );
    assert_eq!(
        message,
        "Invalid parameter: 'tool_call_id' of 'call_zz' not found in 'tool_calls' of previous message."
    );

    // An answer with no call before it at all.
    let turns = vec![
        Turn::text(MessageRole::User, "hi"),
        Turn {
            role: MessageRole::User,
            content: vec![tool_result("call_a", false)],
        },
    ];
    let message = refusal(run(&client, model_request(turns, None)).await);
    assert_eq!(
        message,
        "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'."
    );
    assert_eq!(fake.requests().len(), 1, "refused requests get no reply");
}

#[tokio::test]
async fn anthropic_refuses_thinking_blocks_merged_left_out_or_changed_when_the_calls_come_back() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let client = Anthropic(endpoint(&fake));
    let call = |id: &str| FakeToolCall::new(id, "lookup", json!({ "query": id }));
    fake.script([Reply::sse(
        anthropic_sse_blocks(
            &[
                AnthropicBlock::thinking(&["One."]),
                AnthropicBlock::Redacted("opaque-1".into()),
                AnthropicBlock::ToolUse(call("toolu_a")),
                AnthropicBlock::thinking(&["Two."]),
                AnthropicBlock::ToolUse(call("toolu_b")),
            ],
            "tool_use",
            10,
            5,
        ),
        13,
    )]);
    let events = run(
        &client,
        model_request(vec![Turn::text(MessageRole::User, "go")], Some(1024)),
    )
    .await
    .unwrap();
    assert!(events.contains(&ModelEvent::RedactedReasoning("opaque-1".into())));
    let redacted = |data: &str| Content::RedactedReasoning { data: data.into() };
    let answered = || vec![tool_result("toolu_a", false), tool_result("toolu_b", false)];
    let send = |said: Vec<Content>| {
        run(
            &client,
            model_request(history(said, answered()), Some(1024)),
        )
    };

    let faithful = vec![
        signed("One."),
        redacted("opaque-1"),
        tool_use("toolu_a"),
        signed("Two."),
        tool_use("toolu_b"),
    ];
    assert_eq!(
        text_of(&send(faithful).await.unwrap()),
        "Hello from the fake."
    );
    let sent = &fake.requests()[1]["messages"][1]["content"];
    assert_eq!(
        sent[1],
        json!({ "type": "redacted_thinking", "data": "opaque-1" })
    );

    let modified = "messages.1.content: `thinking` or `redacted_thinking` blocks in the latest assistant message cannot be modified. These blocks must remain as they were in the original response.";
    // Both thinking blocks as one, signed anew or with the last signature.
    let merged = vec![
        signed("One.Two."),
        redacted("opaque-1"),
        tool_use("toolu_a"),
        tool_use("toolu_b"),
    ];
    assert_eq!(refusal(send(merged).await), modified);
    let last_signature = vec![
        Content::Reasoning {
            text: "One.Two.".into(),
            signature: Some(fake_signature("Two.")),
        },
        redacted("opaque-1"),
        tool_use("toolu_a"),
        tool_use("toolu_b"),
    ];
    assert_eq!(
        refusal(send(last_signature).await),
        "messages.1.content.0: Invalid `signature` in `thinking` block"
    );
    // The redacted block left out, or changed.
    let dropped = vec![
        signed("One."),
        tool_use("toolu_a"),
        signed("Two."),
        tool_use("toolu_b"),
    ];
    assert_eq!(refusal(send(dropped).await), modified);
    let changed = vec![
        signed("One."),
        redacted("opaque-2"),
        tool_use("toolu_a"),
        signed("Two."),
        tool_use("toolu_b"),
    ];
    assert_eq!(refusal(send(changed).await), modified);
    // The second block moved before the first call.
    let moved = vec![
        signed("One."),
        redacted("opaque-1"),
        signed("Two."),
        tool_use("toolu_a"),
        tool_use("toolu_b"),
    ];
    assert_eq!(refusal(send(moved).await), modified);
    assert_eq!(fake.requests().len(), 2, "refused requests get no reply");
}

#[tokio::test]
async fn an_event_over_four_mebibytes_fails_the_run_without_retrying() {
    let fake = FakeProvider::start(Wire::OpenAi).await;
    // One `data:` line longer than the limit, and no line break after it.
    let endless = format!("data: {{\"pad\": \"{}", "x".repeat(4 * 1024 * 1024));
    fake.script([stream(endless, 64 * 1024)]);
    let server = server_for(&fake, "openai").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hi").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "FAILED", "{ended}");
    assert_eq!(ended["error"]["code"], "event_too_large", "{ended}");
    assert_eq!(fake.requests().len(), 1, "not retried");
}
