//! The Anthropic and OpenAI-compatible providers against fakes that speak
//! their wire formats.

use std::time::Duration;

use serde_json::{Value, json};

use crate::fakes::{
    FakeProvider, KEY, Reply, Wire, anthropic_sse, anthropic_sse_failing, anthropic_sse_thinking,
    openai_sse,
};
use crate::support::{Server, ServerOptions, events_with_retries as events, of_type};

async fn server_for(fake: &FakeProvider, provider: &str) -> Server {
    server_with(fake, provider, "").await
}

/// A server whose one agent `model` talks to the fake, with `extra` TOML
/// appended to the agent (its `[agents.*]` tables).
async fn server_with(fake: &FakeProvider, provider: &str, extra: &str) -> Server {
    let config = format!(
        r#"
[runtime]
checkpoint_ms = 40
poll_ms = 100

[[agents]]
name = "model"
provider = "{provider}"
model = "fake-model"
system = "Be brief."
base_url = "{base}"
api_key_env = "TETHER_TEST_PROVIDER_KEY"
max_tokens = 321
idle_timeout_secs = 5
price = {{ input_per_mtok = 3.0, output_per_mtok = 15.0 }}

[agents.retry]
max_attempts = 3
initial_delay_ms = 100
max_delay_ms = 400

{extra}
"#,
        base = fake.base_url
    );
    Server::start_with(ServerOptions {
        config,
        env: vec![("TETHER_TEST_PROVIDER_KEY".into(), KEY.into())],
        role: "all",
    })
    .await
}

fn stream(sse: String, chunk_bytes: usize) -> Reply {
    Reply::Stream {
        sse,
        chunk_bytes,
        pause: Duration::ZERO,
    }
}

fn error(status: u16, kind: &'static str, headers: Vec<(&'static str, &'static str)>) -> Reply {
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
    }
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
    let server = server_for(&fake, "anthropic").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hi").await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let parts = server.reply_parts(&token, &conversation, &run).await;
    let shown: Vec<(&str, &str)> = parts
        .iter()
        .map(|p| (p["kind"].as_str().unwrap(), p["text"].as_str().unwrap()))
        .collect();
    assert_eq!(shown[0], ("TEXT", "half an ans"));
    assert_eq!(shown[1].0, "NOTICE");
    assert_eq!(shown[2], ("TEXT", "The whole answer."));
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
    server
        .gql(
            &token,
            "mutation($r: ID!) { cancelRun(runId: $r) { status } }",
            json!({ "r": run }),
        )
        .await;
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
async fn thinking_streams_into_a_reasoning_part_before_the_text_and_stays_out_of_the_history() {
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
    // The next request carries the reply, not the reasoning.
    let (_, second) = server.send(&token, &conversation, "And?").await;
    assert_eq!(
        server.wait_until_ended(&token, &second).await["status"],
        "COMPLETED"
    );
    let request = &fake.requests()[1];
    let texts: Vec<&str> = request["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["Why?", "The answer.", "And?"]);
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
    let last = summary_request.last().unwrap()["content"][0]["text"]
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
        .map(|m| {
            m["content"][0]["text"]
                .as_str()
                .unwrap()
                .chars()
                .count()
                .div_ceil(4)
        })
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
