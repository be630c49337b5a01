//! The history a model is sent, through a fake Anthropic that records
//! every request: replies stay with their questions when messages queue up,
//! a summary just made is used at once, and a failed attempt's tokens count.

use serde_json::json;

use crate::downstream::Downstream;
use crate::fakes::{
    FakeProvider, FakeToolCall, Reply, Wire, anthropic_sse, anthropic_sse_failing,
    anthropic_sse_tool_calls,
};
use crate::provider_tools;
use crate::support::{Server, events_with_retries, of_type};

/// An Anthropic agent with quick retries, on `provider_tools`'s server.
async fn server(fake: &FakeProvider, downstream: &Downstream, agent_extra: &str) -> Server {
    let keys = format!(
        "system = \"Be brief.\"\nmax_tokens = 321\n{agent_extra}\n\n[agents.retry]\nmax_attempts = 3\ninitial_delay_ms = 50\nmax_delay_ms = 100\n"
    );
    provider_tools::server(fake, "anthropic", downstream, &keys, "").await
}

/// A run streaming slowly (U0), for messages to queue behind it.
struct Streaming {
    fake: FakeProvider,
    server: Server,
    token: String,
    conversation: String,
    run0: String,
    _downstream: Downstream,
}

/// Starts the server, sends U0 and waits until its run is streaming.
async fn streaming_run0() -> Streaming {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([Reply::slow(anthropic_sse(
        &["slow ", "reply ", "zero"],
        10,
        5,
    ))]);
    let downstream = Downstream::start().await;
    let server = server(&fake, &downstream, "").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run0) = server.send(&token, &conversation, "U0").await;
    fake.wait_for_requests(1).await;
    Streaming {
        fake,
        server,
        token,
        conversation,
        run0,
        _downstream: downstream,
    }
}

/// Two messages queued while an earlier run streams: the second run's reply
/// (created when that run begins) sorts after the third user message, so the
/// third run's history ends with an assistant message (a prefill, which
/// Anthropic refuses with extended thinking and newer models refuse
/// always), and the reply to U1 is shown after U2.
#[tokio::test]
async fn queued_messages_keep_replies_in_order_and_history_ends_with_the_user() {
    let Streaming {
        fake,
        server,
        token,
        conversation,
        run0,
        _downstream,
    } = streaming_run0().await;
    let (_, _run1) = server.send(&token, &conversation, "U1").await;
    let (_, run2) = server.send(&token, &conversation, "U2").await;
    assert_eq!(
        server.wait_until_ended(&token, &run0).await["status"],
        "COMPLETED"
    );
    let ended = server.wait_until_ended(&token, &run2).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let requests = fake.requests();
    assert_eq!(requests.len(), 3);
    let messages = requests[2]["messages"].as_array().unwrap();
    assert_eq!(
        messages.last().unwrap()["role"],
        "user",
        "run 2's request ends with an assistant message: {}",
        serde_json::to_string_pretty(messages).unwrap()
    );
}

/// A run whose own reply has more turns than `keep_recent_messages`: the
/// cut walks back to the run's trigger message, the summary is stored
/// `through` the trigger, and `history::load` only uses summaries
/// `through < trigger`, so the summary just paid for is never used: the
/// request goes out over budget and every later step compacts again.
#[tokio::test]
async fn a_summary_through_the_runs_own_message_is_used() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let call = |id: &str| FakeToolCall::new(id, "effect", json!({ "text": "a" }));
    fake.script([
        Reply::sse(
            anthropic_sse_tool_calls(&["Calling."], &[call("toolu_1")]),
            64,
        ),
        // The summary.
        Reply::sse(anthropic_sse(&["Short summary."], 10, 5), 64),
        Reply::sse(
            anthropic_sse_tool_calls(&["Again."], &[call("toolu_2")]),
            64,
        ),
    ]);
    let downstream = Downstream::start().await;
    let server = server(
        &fake,
        &downstream,
        "[agents.context]\nbudget_tokens = 50\nkeep_recent_messages = 2",
    )
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let text = format!("please {}", "words ".repeat(60));
    let (_, run) = server.send(&token, &conversation, &text).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let requests = fake.requests();
    let events = events_with_retries(&server, &token, &conversation).await;
    let compacted = of_type(&events, "context.compacted").len();
    // Request 1: step 1; request 2: the summary; request 3: step 2.
    let first = requests[2]["messages"][0]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        first.starts_with("Summary of the earlier conversation:"),
        "step 2 went out without the summary just made ({} requests, {compacted} compactions); it starts: {first:.60}",
        requests.len()
    );
    assert_eq!(compacted, 1, "compacted once");
}

/// The provider reported usage for an attempt that then failed
/// (`message_start`: 10 input tokens, then an `error` event); the retry's
/// schedule drops it, so the run's usage, cost and ceilings only see the
/// attempt that succeeded.
#[tokio::test]
async fn a_failed_attempts_reported_usage_is_counted() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        Reply::sse(
            anthropic_sse_failing(&["half an ans"], "overloaded_error", "Overloaded"),
            16,
        ),
        Reply::sse(anthropic_sse(&["The whole answer."], 10, 4), 16),
    ]);
    let downstream = Downstream::start().await;
    let server = server(&fake, &downstream, "").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hi").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(ended["usage"]["inputTokens"], 20, "{ended}");
}

/// Three messages queued while a run streams: `Conversation.messages` (and
/// a page of it before a message) lists the conversation in the order the
/// model read it, each reply right after the message that started its run,
/// although each reply was made after all three were queued.
#[tokio::test]
async fn queued_messages_read_in_the_order_the_model_saw_them() {
    let Streaming {
        fake,
        server,
        token,
        conversation,
        run0,
        _downstream,
    } = streaming_run0().await;
    let mut runs = vec![run0];
    for text in ["U1", "U2", "U3"] {
        runs.push(server.send(&token, &conversation, text).await.1);
    }
    for run in &runs {
        let ended = server.wait_until_ended(&token, run).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
    }

    // What the last run's model read: U0 A0 U1 A1 U2 A2 U3.
    let requests = fake.requests();
    let seen: Vec<(String, String)> = requests.last().unwrap()["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let text = m["content"]
                .as_array()
                .and_then(|c| c.iter().find_map(|b| b["text"].as_str()))
                .or_else(|| m["content"].as_str())
                .unwrap_or_default();
            (m["role"].as_str().unwrap().to_uppercase(), text.to_owned())
        })
        .collect();
    const READ: &str = "query($c: ID!, $b: ID) { conversation(id: $c) { messages(before: $b) { id role runId parts { kind text } } } }";
    let read = |before: Option<String>| {
        let (server, token, conversation) = (&server, &token, &conversation);
        async move {
            let data = server
                .gql(token, READ, json!({ "c": conversation, "b": before }))
                .await;
            data["conversation"]["messages"].as_array().unwrap().clone()
        }
    };
    let listed = read(None).await;
    let shown: Vec<(String, String)> = listed
        .iter()
        .map(|m| {
            let text = m["parts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["kind"] == "TEXT")
                .filter_map(|p| p["text"].as_str())
                .collect::<String>();
            (m["role"].as_str().unwrap().to_owned(), text)
        })
        .collect();
    assert_eq!(shown.len(), 8, "{shown:?}");
    assert_eq!(&shown[..7], &seen[..], "people read what the model read");
    let roles: Vec<&str> = shown.iter().map(|(role, _)| role.as_str()).collect();
    assert_eq!(
        roles,
        [
            "USER",
            "ASSISTANT",
            "USER",
            "ASSISTANT",
            "USER",
            "ASSISTANT",
            "USER",
            "ASSISTANT"
        ]
    );
    for (i, run) in runs.iter().enumerate() {
        assert_eq!(listed[2 * i]["runId"], run.as_str(), "{listed:?}");
        assert_eq!(listed[2 * i + 1]["runId"], run.as_str(), "{listed:?}");
    }
    // A page before U2 is what comes before it in that order.
    let before_u2 = read(Some(listed[4]["id"].as_str().unwrap().to_owned())).await;
    assert_eq!(before_u2, listed[..4].to_vec());
}
