//! Tool calls through the real provider wires: the fakes stream tool calls
//! the way Anthropic and OpenAI do, and refuse a follow-up whose history
//! pairs calls and results wrongly, so a completed run proves the history
//! Tether rebuilt from committed facts was valid.

use serde_json::{Value, json};

use crate::downstream::Downstream;
use crate::fakes::{
    AnthropicBlock, FakeProvider, FakeToolCall, Reply, Wire, anthropic_sse, anthropic_sse_blocks,
    anthropic_sse_thinking_tool_calls, fake_signature, model_config, openai_sse,
    openai_sse_tool_calls, openai_sse_tool_calls_ending, server_with_key,
};
use crate::support::Server;
use crate::tools::{run_to_end, tool_calls, tool_sections};

/// A server whose agent `model` talks to the fake and offers `tools`.
pub async fn server(
    fake: &FakeProvider,
    provider: &str,
    downstream: &Downstream,
    agent_keys: &str,
    runtime: &str,
) -> Server {
    let agent = format!(
        "idle_timeout_secs = 5\ntools = [\"fail\", \"slow\", \"effect\", \"hang\"]\n{agent_keys}"
    );
    let tools = tool_sections(downstream);
    server_with_key(model_config(
        provider,
        &fake.base_url,
        runtime,
        &agent,
        &tools,
    ))
    .await
}

fn three_calls() -> Vec<FakeToolCall> {
    vec![
        FakeToolCall::new("call_1", "fail", json!({ "text": "a" })),
        FakeToolCall::new("call_2", "slow", json!({ "text": "b" })),
        FakeToolCall::new("call_3", "effect", json!({ "text": "ç" })),
    ]
}

#[tokio::test]
async fn anthropic_gets_signed_thinking_then_the_calls_then_exactly_three_results_in_order() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        Reply::sse(
            anthropic_sse_thinking_tool_calls(&["Three ", "tools."], &["Calling."], &three_calls()),
            5,
        ),
        Reply::sse(anthropic_sse(&["All done."], 10, 5), 64),
    ]);
    let downstream = Downstream::start().await;
    downstream.slow_until(3);
    let keys = "thinking_budget_tokens = 1024\nmax_tokens = 2048";
    let server = server(&fake, "anthropic", &downstream, keys, "").await;
    let token = server.token("acme", "ada");
    let (_, run, ended) = run_to_end(&server, &token, "model", "Go.").await;
    let requests = fake.requests_of_completed(&ended);
    assert_eq!(requests.len(), 2);
    let offered: Vec<&str> = requests[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(offered, ["fail", "slow", "effect", "hang"]);
    assert_eq!(requests[0]["thinking"]["budget_tokens"], 1024);

    let messages = requests[1]["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3, "{messages:?}");
    let said = messages[1]["content"].as_array().unwrap();
    assert_eq!(
        said[0],
        json!({ "type": "thinking", "thinking": "Three tools.", "signature": fake_signature("Three tools.") })
    );
    assert_eq!(said[1], json!({ "type": "text", "text": "Calling." }));
    let used: Vec<(&str, &Value)> = said[2..]
        .iter()
        .map(|b| (b["id"].as_str().unwrap(), &b["input"]))
        .collect();
    assert_eq!(
        used,
        [
            ("call_1", &json!({ "text": "a" })),
            ("call_2", &json!({ "text": "b" })),
            ("call_3", &json!({ "text": "ç" }))
        ]
    );
    let results = messages[2]["content"].as_array().unwrap();
    let answered: Vec<(&str, bool)> = results
        .iter()
        .map(|b| {
            assert_eq!(b["type"], "tool_result");
            (
                b["tool_use_id"].as_str().unwrap(),
                b["is_error"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        answered,
        [("call_1", true), ("call_2", false), ("call_3", false)]
    );
    let effect: Value = serde_json::from_str(results[2]["content"].as_str().unwrap()).unwrap();
    assert_eq!(effect["done"], json!({ "text": "ç" }));

    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls.len(), 3);
}

#[tokio::test]
async fn openai_gets_the_calls_then_one_tool_message_per_call_in_order() {
    let fake = FakeProvider::start(Wire::OpenAi).await;
    fake.script([
        Reply::sse(openai_sse_tool_calls(&[], &three_calls()), 3),
        Reply::sse(openai_sse(&["All done."], 10, 5), 64),
    ]);
    let downstream = Downstream::start().await;
    downstream.slow_until(3);
    let server = server(&fake, "openai", &downstream, "", "").await;
    let token = server.token("acme", "ada");
    let (_, _, ended) = run_to_end(&server, &token, "model", "Go.").await;
    let requests = fake.requests_of_completed(&ended);
    assert_eq!(requests[0]["tools"][2]["function"]["name"], "effect");
    let messages = requests[1]["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "tool", "tool"]);
    let ids: Vec<&str> = messages[1]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["call_1", "call_2", "call_3"]);
    let answered: Vec<&str> = messages[2..]
        .iter()
        .map(|m| m["tool_call_id"].as_str().unwrap())
        .collect();
    assert_eq!(answered, ["call_1", "call_2", "call_3"]);
}

#[tokio::test]
async fn calls_cut_off_by_a_cancel_still_have_their_results_in_the_next_runs_history() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        Reply::sse(
            anthropic_sse_thinking_tool_calls(
                &[],
                &["Calling."],
                &[
                    FakeToolCall::new("call_h", "hang", json!({ "text": "a" })),
                    FakeToolCall::new("call_e", "effect", json!({ "text": "b" })),
                ],
            ),
            64,
        ),
        Reply::sse(anthropic_sse(&["Sorry about that."], 10, 5), 64),
    ]);
    let downstream = Downstream::start().await;
    let server = server(&fake, "anthropic", &downstream, "", "tool_concurrency = 1").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "Go.").await;
    downstream
        .wait_for("the hanging request", |d| d.requests().len() == 1)
        .await;
    server.cancel(&token, &run).await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "CANCELLED"
    );
    let (_, next) = server.send(&token, &conversation, "What happened?").await;
    let ended = server.wait_until_ended(&token, &next).await;
    let messages = fake.requests_of_completed(&ended)[1]["messages"]
        .as_array()
        .unwrap()
        .clone();
    // user, assistant (text + 2 tool_use), user (2 results + the new text).
    assert_eq!(messages.len(), 3, "{messages:?}");
    let answer = messages[2]["content"].as_array().unwrap();
    let results: Vec<(&str, bool)> = answer[..2]
        .iter()
        .map(|b| {
            (
                b["tool_use_id"].as_str().unwrap(),
                b["is_error"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(results, [("call_h", true), ("call_e", true)]);
    assert!(
        answer[0]["content"]
            .as_str()
            .unwrap()
            .contains("interrupted")
    );
    assert!(
        answer[1]["content"]
            .as_str()
            .unwrap()
            .contains("not started")
    );
    assert_eq!(answer[2]["text"], "What happened?");
}

#[tokio::test]
async fn interleaved_and_redacted_thinking_go_back_block_by_block_in_their_places() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let first = FakeToolCall::new("call_1", "effect", json!({ "text": "a" }));
    let second = FakeToolCall::new("call_2", "effect", json!({ "text": "b" }));
    let blocks = [
        AnthropicBlock::thinking(&["First ", "lookup."]),
        AnthropicBlock::ToolUse(first),
        AnthropicBlock::thinking(&["Then the ", "second."]),
        AnthropicBlock::Redacted("EncRyPtEd/opaque+data==".into()),
        AnthropicBlock::text(&["Both."]),
        AnthropicBlock::ToolUse(second),
    ];
    fake.script([
        Reply::sse(anthropic_sse_blocks(&blocks, "tool_use", 10, 5), 7),
        Reply::sse(anthropic_sse(&["All done."], 10, 5), 64),
    ]);
    let downstream = Downstream::start().await;
    let keys = "thinking_budget_tokens = 1024\nmax_tokens = 2048";
    let server = server(&fake, "anthropic", &downstream, keys, "").await;
    let token = server.token("acme", "ada");
    let (conversation, _, ended) = run_to_end(&server, &token, "model", "Go.").await;
    // The fake refuses merged, re-signed, reordered or missing blocks.
    let requests = fake.requests_of_completed(&ended);
    assert_eq!(requests.len(), 2);
    let said = &requests[1]["messages"][1]["content"];
    let thinking = |text: &str| json!({ "type": "thinking", "thinking": text, "signature": fake_signature(text) });
    let call = |id: &str, text: &str| json!({ "type": "tool_use", "id": id, "name": "effect", "input": { "text": text } });
    assert_eq!(
        said,
        &json!([
            thinking("First lookup."),
            call("call_1", "a"),
            thinking("Then the second."),
            { "type": "redacted_thinking", "data": "EncRyPtEd/opaque+data==" },
            { "type": "text", "text": "Both." },
            call("call_2", "b"),
        ])
    );

    // One reasoning part per block; the redacted one has no text for people
    // and keeps its data.
    let parts = server
        .parts_of(&token, &conversation, "kind text data")
        .await;
    let reasoning: Vec<(&str, &Value)> = parts
        .iter()
        .filter(|p| p["kind"] == "REASONING")
        .map(|p| (p["text"].as_str().unwrap(), &p["data"]))
        .collect();
    assert_eq!(reasoning.len(), 3, "{parts:?}");
    assert_eq!(reasoning[0].0, "First lookup.");
    assert_eq!(reasoning[0].1["signature"], fake_signature("First lookup."));
    assert_eq!(reasoning[1].0, "Then the second.");
    assert_eq!(reasoning[1].1["afterCalls"], 1);
    assert_eq!(reasoning[2].0, "");
    assert_eq!(reasoning[2].1["redactedData"], "EncRyPtEd/opaque+data==");
}

/// A run whose one reply ends with the token limit inside a tool call's
/// input: it fails at once with `max_tokens`, asking the model only once.
async fn cut_off_in_a_call(wire: Wire, provider: &str, sse: String) {
    let fake = FakeProvider::start(wire).await;
    fake.script([Reply::sse(sse, 9)]);
    let downstream = Downstream::start().await;
    let server = server(&fake, provider, &downstream, "", "").await;
    let token = server.token("acme", "ada");
    let (_, _, ended) = run_to_end(&server, &token, "model", "Go.").await;
    assert_eq!(ended["status"], "FAILED", "{ended}");
    assert_eq!(ended["error"]["code"], "max_tokens", "{ended}");
    let message = ended["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("token limit") && message.contains("tool call"),
        "{message}"
    );
    assert_eq!(fake.requests().len(), 1, "retried: {:?}", fake.requests());
    assert!(downstream.requests().is_empty());
}

#[tokio::test]
async fn anthropic_cut_off_by_max_tokens_inside_a_tool_call_fails_without_retrying() {
    let cut = FakeToolCall::raw("call_1", "effect", "{\"text\": \"an unfinish");
    let blocks = [
        AnthropicBlock::text(&["Calling."]),
        AnthropicBlock::ToolUse(cut),
    ];
    let sse = anthropic_sse_blocks(&blocks, "max_tokens", 10, 321);
    cut_off_in_a_call(Wire::Anthropic, "anthropic", sse).await;
}

#[tokio::test]
async fn openai_cut_off_by_length_inside_a_tool_call_fails_without_retrying() {
    let cut = FakeToolCall::raw("call_1", "effect", "{\"text\": \"an unfinish");
    let sse = openai_sse_tool_calls_ending(&[], &[cut], "length");
    cut_off_in_a_call(Wire::OpenAi, "openai", sse).await;
}
