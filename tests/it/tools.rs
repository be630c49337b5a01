//! Tool calls end to end: the scripted model's `/tool` and `/loop`
//! directives, HTTP tools against a real downstream service, and what the
//! API shows of every call.

use serde_json::{Value, json};

use crate::downstream::Downstream;
use crate::support::{Server, of_type};

/// Every test tool: (name, recovery, downstream path, timeout in seconds).
pub const TOOLS: &[(&str, &str, &str, u64)] = &[
    ("effect", "idempotent", "effect", 30),
    ("once", "never_replay", "effect", 30),
    ("fail", "idempotent", "fail", 30),
    ("unavailable", "never_replay", "unavailable", 30),
    ("flaky", "idempotent", "flaky", 30),
    ("big", "idempotent", "big", 30),
    ("hang", "idempotent", "hang", 30),
    ("slow", "idempotent", "slow", 30),
    ("held", "idempotent", "held", 30),
    ("held_once", "never_replay", "held", 30),
    ("gated", "idempotent", "gated", 60),
    ("hang_briefly", "never_replay", "hang", 1),
];

/// Agents on the scripted model with every test tool; `extra` is added to
/// each agent (limits, stop conditions). `runtime` goes in `[runtime]`.
pub fn config(downstream: &Downstream, runtime: &str, agents: &[(&str, &str)]) -> String {
    let names: Vec<String> = TOOLS.iter().map(|(n, ..)| format!("{n:?}")).collect();
    let mut text = format!(
        "default_agent = {:?}\n\n[runtime]\nlease_secs = 3\nheartbeat_secs = 0.5\ncheckpoint_ms = 40\npoll_ms = 200\n{runtime}\n",
        agents[0].0
    );
    for (name, extra) in agents {
        text.push_str(&format!(
            "\n[[agents]]\nname = {name:?}\nprovider = \"scripted\"\nstream_delay_ms = 0\ntools = [{}]\n\n[agents.retry]\nmax_attempts = 3\ninitial_delay_ms = 10\nmax_delay_ms = 50\n{extra}\n",
            names.join(", ")
        ));
    }
    text.push_str(&tool_sections(downstream));
    text
}

/// The `[[tools]]` of every test tool, calling `downstream`.
pub fn tool_sections(downstream: &Downstream) -> String {
    let mut text = String::new();
    for (name, recovery, path, timeout) in TOOLS {
        text.push_str(&format!(
            "\n[[tools]]\nname = {name:?}\ndescription = \"A test tool\"\ninput_schema = {{ type = \"object\", properties = {{ text = {{ type = \"string\" }} }}, required = [\"text\"], additionalProperties = false }}\nrecovery = {recovery:?}\nhttp = {{ url = \"{}/{path}\", timeout_secs = {timeout} }}\n",
            downstream.base
        ));
    }
    text
}

pub async fn tool_calls(server: &Server, token: &str, run: &str) -> Vec<Value> {
    let data = server
        .gql(
            token,
            "query($r: ID!) { run(id: $r) { toolCalls(first: 500) { id runId step name input status outcome output outputTruncated fullOutput attempt idempotencyKey startedAt endedAt } } }",
            json!({ "r": run }),
        )
        .await;
    data["run"]["toolCalls"].as_array().unwrap().clone()
}

/// The text of the run's last TEXT part (the model's final reply).
pub async fn final_text(server: &Server, token: &str, conversation: &str, run: &str) -> String {
    server
        .reply_parts(token, conversation, run)
        .await
        .iter()
        .rev()
        .find(|p| p["kind"] == "TEXT" && p["text"].as_str().is_some_and(|t| !t.is_empty()))
        .and_then(|p| p["text"].as_str())
        .unwrap_or_default()
        .to_owned()
}

fn field<'a>(calls: &'a [Value], key: &str) -> Vec<&'a str> {
    calls
        .iter()
        .map(|c| c[key].as_str().unwrap_or(""))
        .collect()
}

/// `text` sent in a new conversation with `agent`, and the run waited on
/// until it ended: (conversation, run, the ended run).
pub async fn run_to_end(
    server: &Server,
    token: &str,
    agent: &str,
    text: &str,
) -> (String, String, Value) {
    let conversation = server.conversation_with(token, agent).await;
    let (_, run) = server.send(token, &conversation, text).await;
    let ended = server.wait_until_ended(token, &run).await;
    (conversation, run, ended)
}

#[tokio::test]
async fn a_batch_of_three_runs_in_parallel_and_the_model_reads_three_results_in_order() {
    let downstream = Downstream::start().await;
    // The slow call answers only once all three requests have arrived:
    // run one after another, the batch could never finish.
    downstream.slow_until(3);
    let server = Server::start_workers(&config(&downstream, "", &[("tools", "")])).await;
    let token = server.token("acme", "ada");
    let text = "/tool fail {\"text\": \"a\"}\n/tool slow {\"text\": \"b\"}\n/tool effect {\"text\": \"c\"}";
    let (conversation, run, ended) = run_to_end(&server, &token, "tools", text).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(ended["steps"], 2, "one step asked for tools, one answered");

    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(field(&calls, "name"), ["fail", "slow", "effect"]);
    assert_eq!(field(&calls, "status"), ["COMPLETED"; 3]);
    assert_eq!(
        field(&calls, "outcome"),
        ["FAILED", "SUCCEEDED", "SUCCEEDED"]
    );
    for call in &calls {
        assert_eq!(call["attempt"], 1, "{call}");
        assert_eq!(call["step"], 0, "{call}");
        assert!(call["startedAt"].is_string() && call["endedAt"].is_string());
    }
    assert_eq!(calls[2]["output"]["done"], json!({ "text": "c" }));
    assert_eq!(calls[0]["output"]["status"], 422);

    // Each request carried its call's own key and identities.
    let requests = downstream.requests();
    assert_eq!(requests.len(), 3);
    for call in &calls {
        let request = requests
            .iter()
            .find(|r| r.tool_call_id.as_deref() == call["id"].as_str())
            .unwrap_or_else(|| panic!("no request for {call}"));
        assert_eq!(request.key.as_deref(), call["idempotencyKey"].as_str());
        assert_eq!(request.run_id.as_deref(), Some(run.as_str()));
        assert_eq!(request.body, call["input"]);
    }

    // The next model request had the three results, in the order of the
    // calls (the scripted model quotes them in the order it read them).
    let reply = final_text(&server, &token, &conversation, &run).await;
    let at = |name: &str| {
        reply
            .find(&format!("{name} returned"))
            .unwrap_or_else(|| panic!("{name} missing: {reply}"))
    };
    assert!(
        at("fail") < at("slow") && at("slow") < at("effect"),
        "{reply}"
    );
    assert_eq!(reply.matches(" returned ").count(), 3, "{reply}");

    // The calls appear as TOOL_CALL parts, with their events.
    let shown: Vec<Value> = server
        .parts_of(&token, &conversation, "kind toolCall { id name }")
        .await
        .into_iter()
        .filter(|p| p["kind"] == "TOOL_CALL")
        .collect();
    assert_eq!(shown.len(), 3);
    for (part, call) in shown.iter().zip(&calls) {
        assert_eq!(part["toolCall"]["id"], call["id"]);
    }
    let events = server.all_events(&token, &conversation).await;
    assert_eq!(of_type(&events, "tool.started").len(), 3);
    assert_eq!(of_type(&events, "tool.completed").len(), 2);
    assert_eq!(of_type(&events, "tool.failed").len(), 1);
    assert_eq!(of_type(&events, "run.checkpointed").len(), 2);
}

#[tokio::test]
async fn input_the_schema_refuses_never_runs_and_the_model_reads_why() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream, "", &[("tools", "")])).await;
    let token = server.token("acme", "ada");
    let (conversation, run, ended) = run_to_end(
        &server,
        &token,
        "tools",
        "/tool effect {\"text\": 5, \"extra\": true}\n/tool nonexistent {\"text\": \"x\"}",
    )
    .await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert!(downstream.requests().is_empty(), "nothing was sent");
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(field(&calls, "outcome"), ["FAILED", "FAILED"]);
    assert_eq!(calls[0]["attempt"], 0, "never started");
    assert_eq!(calls[0]["input"], json!({ "text": 5, "extra": true }));
    let problem = calls[0]["output"]["error"].as_str().unwrap();
    assert!(
        problem.contains("/text") && problem.contains("extra"),
        "{problem}"
    );
    assert!(
        calls[1]["output"]["error"]
            .as_str()
            .unwrap()
            .contains("there is no tool \"nonexistent\""),
        "{}",
        calls[1]
    );
    let reply = final_text(&server, &token, &conversation, &run).await;
    assert!(reply.contains("invalid input for effect"), "{reply}");
}

#[tokio::test]
async fn transient_failures_and_timeouts_retry_idempotent_tools_with_the_same_key_and_never_replay_others()
 {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream, "", &[("tools", "")])).await;
    let token = server.token("acme", "ada");
    let (_, run, ended) = run_to_end(
        &server,
        &token,
        "tools",
        "/tool flaky {\"text\": \"a\"}\n/tool unavailable {\"text\": \"b\"}\n/tool hang_briefly {\"text\": \"c\"}",
    )
    .await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(
        field(&calls, "outcome"),
        ["SUCCEEDED", "UNKNOWN", "UNKNOWN"]
    );
    assert_eq!(
        field(&calls, "status"),
        ["COMPLETED", "INDETERMINATE", "INDETERMINATE"]
    );
    let flaky = downstream.requests_to("/flaky");
    assert_eq!(flaky.len(), 2, "one 503, then the retry");
    assert_eq!(flaky[0].key, flaky[1].key, "the retry kept its key");
    assert_eq!(
        downstream.requests_to("/unavailable").len(),
        1,
        "a never_replay tool is not sent twice"
    );
    let note = calls[1]["output"]["note"].as_str().unwrap();
    assert!(note.contains("check before repeating"), "{note}");
    // A call that outlives its timeout is abandoned (the service sees the
    // connection close) and, being never_replay, not sent again.
    let error = calls[2]["output"]["error"].as_str().unwrap();
    assert!(error.contains("network error"), "{error}");
    downstream
        .wait_for("the client giving up", |d| d.closed() == 1)
        .await;
    assert_eq!(downstream.requests_to("/hang").len(), 1);
}

#[tokio::test]
async fn large_outputs_are_cut_with_a_note_and_kept_whole() {
    let downstream = Downstream::start().await;
    let agent = "[agents.limits]\nmax_inline_tool_output_bytes = 256";
    let server = Server::start_workers(&config(&downstream, "", &[("tools", agent)])).await;
    let token = server.token("acme", "ada");
    let (conversation, run, ended) =
        run_to_end(&server, &token, "tools", "/tool big {\"text\": \"a\"}").await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outputTruncated"], true);
    let full = calls[0]["fullOutput"].as_str().unwrap();
    let whole: Value = serde_json::from_str(full).unwrap();
    assert_eq!(whole["text"].as_str().unwrap().len(), 2000);
    let inline = calls[0]["output"].as_str().unwrap();
    let note = format!(
        "[output truncated: {} of {} bytes cut]",
        full.len() - 256,
        full.len()
    );
    assert!(inline.ends_with(&note), "{inline}");
    assert!(inline.starts_with(&full[..256]), "{inline}");
    // The model read the cut output, note included.
    let reply = final_text(&server, &token, &conversation, &run).await;
    assert!(reply.contains("big returned {\"text\":\"xxx"), "{reply}");
}

#[tokio::test]
async fn limits_and_stop_conditions_end_runs_with_their_cause_and_reason() {
    let downstream = Downstream::start().await;
    let agents = [
        ("limited", "[agents.limits]\nmax_tool_calls = 2"),
        ("short", "[agents.limits]\nmax_steps = 2"),
        ("looping", "[agents.stop]\nrepeated_calls = 3"),
        ("erring", "[agents.stop]\nconsecutive_tool_errors = 2"),
        ("finishing", "[agents.stop]\non_tools = [\"effect\"]"),
        (
            "matching",
            "[agents.stop]\ncontent_match = \"scripted m.del\"",
        ),
    ];
    let server = Server::start_workers(&config(&downstream, "", &agents)).await;
    let token = server.token("acme", "ada");
    let cases = [
        (
            "limited",
            "/loop effect {\"text\": \"a\"}",
            "FAILED",
            "TOOL_CALL_LIMIT",
            "limit of 2 tool calls",
        ),
        (
            "short",
            "/loop effect {\"text\": \"b\"}",
            "FAILED",
            "STEP_LIMIT",
            "limit of 2 steps",
        ),
        (
            "looping",
            "/loop effect {\"text\": \"c\"}",
            "FAILED",
            "LOOP_DETECTED",
            "repeated_calls",
        ),
        (
            "erring",
            "/loop fail {\"text\": \"d\"}",
            "FAILED",
            "TOO_MANY_ERRORS",
            "consecutive_tool_errors",
        ),
        (
            "finishing",
            "/tool effect {\"text\": \"e\"}",
            "COMPLETED",
            "STOPPED",
            "on_tools: effect succeeded",
        ),
        ("matching", "hello", "COMPLETED", "STOPPED", "content_match"),
    ];
    for (agent, text, status, cause, reason) in cases {
        let (_, run, ended) = run_to_end(&server, &token, agent, text).await;
        assert_eq!(ended["status"], status, "{agent}: {ended}");
        assert_eq!(ended["endCause"], cause, "{agent}: {ended}");
        let data = server
            .gql(
                &token,
                "query($r: ID!) { run(id: $r) { endReason } }",
                json!({ "r": run }),
            )
            .await;
        let said = data["run"]["endReason"].as_str().unwrap_or_default();
        assert!(said.contains(reason), "{agent}: {said}");
        let calls = tool_calls(&server, &token, &run).await;
        match agent {
            "limited" => {
                // Two ran; the third, over the limit, never started.
                assert_eq!(
                    field(&calls, "outcome"),
                    ["SUCCEEDED", "SUCCEEDED", "NOT_STARTED"]
                );
            }
            "short" => assert_eq!(calls.len(), 2),
            "looping" => assert_eq!(calls.len(), 3),
            "erring" => assert_eq!(field(&calls, "outcome"), ["FAILED", "FAILED"]),
            "finishing" => assert_eq!(field(&calls, "outcome"), ["SUCCEEDED"]),
            _ => assert!(calls.is_empty()),
        }
        if status == "FAILED" {
            assert_eq!(ended["error"]["code"], cause, "{agent}: {ended}");
        }
    }
    // Only calls that ran reached the service: 2 + 2 + 3 + 2 + 1.
    assert_eq!(downstream.requests().len(), 10);
}

#[tokio::test]
async fn cancelling_during_a_slow_call_interrupts_it_and_the_unstarted_sibling_never_starts() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(
        &downstream,
        "tool_concurrency = 1",
        &[("tools", "")],
    ))
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.conversation_with(&token, "tools").await;
    let (_, run) = server
        .send(
            &token,
            &conversation,
            "/tool hang {\"text\": \"a\"}\n/tool effect {\"text\": \"b\"}",
        )
        .await;
    downstream
        .wait_for("the hanging request", |d| d.requests().len() == 1)
        .await;
    server.cancel(&token, &run).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "CANCELLED", "{ended}");
    downstream
        .wait_for("the client closing the connection", |d| d.closed() == 1)
        .await;
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(field(&calls, "outcome"), ["INTERRUPTED", "NOT_STARTED"]);
    assert_eq!(field(&calls, "status"), ["COMPLETED", "COMPLETED"]);
    assert_eq!(downstream.requests().len(), 1, "the sibling never started");

    // The next run's model reads both results (every call has one).
    let (_, next) = server.send(&token, &conversation, "and now?").await;
    let ended = server.wait_until_ended(&token, &next).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
}

#[tokio::test]
async fn cancelling_a_batch_while_its_calls_commit_ends_the_run_at_once() {
    let downstream = Downstream::start().await;
    let agent = "[agents.limits]\nmax_tool_calls = 200";
    let server = Server::start_workers(&config(
        &downstream,
        "tool_concurrency = 4",
        &[("tools", agent)],
    ))
    .await;
    let token = server.token("acme", "ada");
    for round in 0..3 {
        let conversation = server.conversation_with(&token, "tools").await;
        let text: Vec<String> = (0..150)
            .map(|i| format!("/tool effect {{\"text\": \"{round}-{i}\"}}"))
            .collect();
        let before = downstream.requests().len();
        let (_, run) = server.send(&token, &conversation, &text.join("\n")).await;
        downstream
            .wait_for("the batch under way", |d| d.requests().len() >= before + 8)
            .await;
        server.cancel(&token, &run).await;
        let ended = server.wait_until_ended(&token, &run).await;
        assert_eq!(ended["status"], "CANCELLED", "round {round}: {ended}");
        // Every call has its one result.
        let calls = tool_calls(&server, &token, &run).await;
        assert_eq!(calls.len(), 150);
        for call in &calls {
            assert!(
                matches!(
                    call["outcome"].as_str(),
                    Some("SUCCEEDED" | "INTERRUPTED" | "NOT_STARTED")
                ),
                "round {round}: {call}"
            );
        }
        // The process still writes: another conversation works at once.
        let other = server.conversation_with(&token, "tools").await;
        let (_, next) = server.send(&token, &other, "hello").await;
        assert_eq!(
            server.wait_until_ended(&token, &next).await["status"],
            "COMPLETED"
        );
    }
}

#[tokio::test]
async fn content_match_is_checked_on_steps_that_call_tools() {
    let downstream = Downstream::start().await;
    let agent = "[agents.stop]\ncontent_match = \"Calling effect\"\n[agents.limits]\nmax_steps = 3";
    let server = Server::start_workers(&config(&downstream, "", &[("matching", agent)])).await;
    let token = server.token("acme", "ada");
    let (_, run, ended) = run_to_end(
        &server,
        &token,
        "matching",
        "/loop effect {\"text\": \"a\"}",
    )
    .await;
    assert_eq!(ended["endCause"], "STOPPED", "{ended}");
    assert_eq!(ended["steps"], 1);
    assert_eq!(tool_calls(&server, &token, &run).await.len(), 1);
}
