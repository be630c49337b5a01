//! The operators' view, across tenants: `tether runs --stuck` and `tether
//! tool-calls --unknown` against a database holding a stuck run and a call
//! of unknown outcome; `resolveToolCall`, `requeueRun` and `cancelRun` for
//! an operator's token, refused for everyone else.

use std::time::Duration;

use sea_orm::{ColumnTrait, EntityTrait, QueryFilter};
use serde_json::{Value, json};

use crate::downstream::Downstream;
use crate::fakes::{
    FakeProvider, FakeToolCall, Reply, Wire, anthropic_sse, anthropic_sse_tool_calls, key_env,
    model_config,
};
use crate::support::{OPERATOR_CLAIM, PATIENCE, Server, ServerOptions};
use crate::tools::{TOOLS, tool_calls, tool_sections};

const RESOLVE: &str = "mutation($i: ResolveToolCallInput!) { resolveToolCall(input: $i) { id status outcome output } }";
const UNKNOWN: &str =
    "{ unknownToolCalls { tenant idempotencyKey target toolCall { id name status outcome } } }";
const REQUEUE: &str =
    "mutation($r: ID!, $n: String!) { requeueRun(input: {runId: $r, note: $n}) { id status } }";
const CANCEL: &str = "mutation($r: ID!) { cancelRun(runId: $r) { id } }";
const STUCK: &str = "query($s: Int!) { stuckRuns(queuedLongerThanSecs: $s) { tenant reason since run { id status } } }";

fn operators() -> String {
    format!("\n[auth]\noperator_claim = \"{OPERATOR_CLAIM}\"\n")
}

/// The JSON lines a command printed; it must have succeeded.
fn json_lines(output: &std::process::Output) -> Vec<Value> {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone())
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object a line"))
        .collect()
}

/// Waits until `tether runs --stuck --json` lists `run`; returns its line.
async fn listed_as_stuck(server: &Server, run: &str) -> Value {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let listed = json_lines(&server.command(&["runs", "--stuck", "--json"]).await);
        if let Some(found) = listed.into_iter().find(|r| r["runId"] == run) {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the run was never listed as stuck"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn an_operator_lists_a_stuck_run_and_resolves_a_call_of_unknown_outcome() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([
        Reply::sse(
            anthropic_sse_tool_calls(
                &["Publishing."],
                &[FakeToolCall::new(
                    "call_1",
                    "held_once",
                    json!({ "text": "launch" }),
                )],
            ),
            64,
        ),
        Reply::sse(
            anthropic_sse(&["It may or may not have gone out."], 10, 5),
            64,
        ),
        Reply::sse(anthropic_sse(&["Good, it went out."], 10, 5), 64),
    ]);
    let downstream = Downstream::start().await;
    assert!(
        TOOLS
            .iter()
            .any(|(name, recovery, ..)| *name == "held_once" && *recovery == "never_replay")
    );
    let config = model_config(
        "anthropic",
        &fake.base_url,
        "lease_secs = 1\nheartbeat_secs = 0.3",
        "tools = [\"held_once\"]",
        // The tool's URL carries a secret in its query, as webhooks do.
        &format!("{}{}", tool_sections(&downstream), operators())
            .replace("/held\"", "/held?hook_token=s3cr3t-hook\""),
    );
    let mut server = Server::start_with(ServerOptions {
        config,
        env: vec![key_env()],
        role: "all",
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server
        .send(&token, &conversation, "Announce the launch")
        .await;
    downstream
        .wait_for("the call's request", |d| d.requests().len() == 1)
        .await;
    server.kill().await;

    // Nobody holds the run now: once its lease runs out it is stuck.
    let stuck = listed_as_stuck(&server, &run).await;
    assert_eq!(stuck["reason"], "LEASE_EXPIRED", "{stuck}");
    assert_eq!(stuck["tenant"], "acme");
    assert_eq!(stuck["status"], "RUNNING");
    let table = server.command(&["runs", "--stuck"]).await;
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(table.starts_with("RUN "), "{table}");
    assert!(
        table.contains(&run) && table.contains("LEASE_EXPIRED"),
        "{table}"
    );

    // Recovered, the call that must not be replayed ends UNKNOWN and the
    // run goes on without it.
    server.restart(&[]).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    let call_id = calls[0]["id"].as_str().unwrap().to_owned();
    assert_eq!(calls[0]["outcome"], "UNKNOWN");

    let listed = json_lines(&server.command(&["tool-calls", "--unknown", "--json"]).await);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["toolCallId"], call_id.as_str());
    assert_eq!(listed[0]["tenant"], "acme");
    assert_eq!(listed[0]["idempotencyKey"], calls[0]["idempotencyKey"]);
    assert_eq!(
        listed[0]["target"],
        format!("POST {}/held?hook_token=[redacted]", downstream.base).as_str()
    );

    // A tenant's token, even of the same tenant, is no operator's.
    let resolution = json!({
        "toolCallId": call_id,
        "outcome": "COMPLETED",
        "output": { "published": true, "id": "post-7" },
        "note": "the blog shows post-7, published at 12:00",
    });
    for query in [UNKNOWN, STUCK] {
        let refused = server.gql_error(&token, query, json!({ "s": 0 })).await;
        assert_eq!(refused["extensions"]["code"], "FORBIDDEN", "{refused}");
    }
    let refused = server
        .gql_error(&token, RESOLVE, json!({ "i": resolution }))
        .await;
    assert_eq!(refused["extensions"]["code"], "FORBIDDEN", "{refused}");

    let operator = server.operator_token("ops", "olga");
    let unknown = server.gql(&operator, UNKNOWN, json!({})).await;
    let unknown = unknown["unknownToolCalls"].as_array().unwrap().clone();
    assert_eq!(unknown.len(), 1, "{unknown:?}");
    assert_eq!(unknown[0]["toolCall"]["id"], call_id.as_str());
    assert_eq!(unknown[0]["tenant"], "acme");
    assert_eq!(
        unknown[0]["target"],
        format!("POST {}/held?hook_token=[redacted]", downstream.base).as_str()
    );
    let empty_note = server
        .gql_error(
            &operator,
            RESOLVE,
            json!({ "i": { "toolCallId": call_id, "outcome": "FAILED", "output": {}, "note": " " } }),
        )
        .await;
    assert_eq!(
        empty_note["extensions"]["code"], "BAD_USER_INPUT",
        "{empty_note}"
    );

    let resolved = server
        .gql(&operator, RESOLVE, json!({ "i": resolution }))
        .await;
    let resolved = &resolved["resolveToolCall"];
    assert_eq!(resolved["status"], "COMPLETED", "{resolved}");
    assert_eq!(resolved["outcome"], "SUCCEEDED", "{resolved}");
    assert_eq!(resolved["output"]["output"]["id"], "post-7");
    // Resolved once: it is no longer of unknown outcome.
    let again = server
        .gql_error(&operator, RESOLVE, json!({ "i": resolution }))
        .await;
    assert_eq!(again["extensions"]["code"], "CONFLICT", "{again}");
    assert!(
        again["message"].as_str().unwrap().contains("UNKNOWN"),
        "{again}"
    );
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["status"], "COMPLETED");
    assert_eq!(calls[0]["outcome"], "SUCCEEDED");
    let listed = json_lines(&server.command(&["tool-calls", "--unknown", "--json"]).await);
    assert!(listed.is_empty(), "{listed:?}");

    // Audited, with the operator, the note and what changed.
    let store = tether::store::Store::connect(server.database_url(), Default::default())
        .await
        .unwrap();
    use tether::store::entities::operator_action;
    let audit = operator_action::Entity::find()
        .filter(operator_action::Column::ToolCallId.eq(uuid::Uuid::parse_str(&call_id).unwrap()))
        .all(store.db())
        .await
        .unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].operator, "olga");
    assert_eq!(audit[0].action, "resolveToolCall");
    assert_eq!(audit[0].tenant, "acme");
    assert_eq!(audit[0].note, "the blog shows post-7, published at 12:00");
    assert_eq!(audit[0].detail["before"]["outcome"], "UNKNOWN");

    // The next run's model reads the outcome as a fact, and nothing is
    // called again.
    let (_, next) = server.send(&token, &conversation, "Did it go out?").await;
    assert_eq!(
        server.wait_until_ended(&token, &next).await["status"],
        "COMPLETED"
    );
    let requests = fake.requests();
    let last = requests.last().unwrap();
    let results: Vec<Value> = last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["type"] == "tool_result")
        .collect();
    assert_eq!(results.len(), 1, "{last}");
    assert_eq!(results[0]["is_error"], false, "{last}");
    let content = results[0]["content"].to_string();
    assert!(
        content.contains("post-7") && content.contains("Do not repeat"),
        "{content}"
    );
    assert_eq!(
        downstream.requests().len(),
        1,
        "the call was never sent again"
    );
}

/// A run waiting for an approval past its expiry, with no process left to
/// expire it, is listed as stuck: `INTERACTION_EXPIRED`, since the expiry.
#[tokio::test]
async fn an_approval_past_its_expiry_that_nobody_expired_is_listed_as_stuck() {
    let downstream = Downstream::start().await;
    let config = format!(
        "{}{}",
        crate::interactions::config(&downstream),
        operators()
    );
    let mut server = Server::start_workers(&config).await;
    // Tenant `hasty` has one-second approvals.
    let token = server.token("hasty", "ada");
    let conversation = server.create_conversation(&token).await;
    let (run, _) = crate::interactions::gated(
        &server,
        &token,
        &conversation,
        "/tool demo_publish {\"text\": \"x\"}",
    )
    .await;
    server.kill().await;

    let stuck = listed_as_stuck(&server, &run).await;
    assert_eq!(stuck["reason"], "INTERACTION_EXPIRED", "{stuck}");
    assert_eq!(stuck["tenant"], "hasty");
    assert_eq!(stuck["status"], "WAITING_FOR_APPROVAL");
}

#[tokio::test]
async fn an_operator_requeues_a_run_whose_recoveries_ran_out_and_cancels_across_tenants() {
    let config = format!(
        r#"
default_agent = "demo"

[runtime]
lease_secs = 1
heartbeat_secs = 0.3
checkpoint_ms = 40
poll_ms = 200
crash_retry_budget = 0

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = 5
{}"#,
        operators()
    );
    let mut server = Server::start_workers(&config).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/hold 2").await;
    server
        .wait_for_run(&token, &run, |r| r["status"] == "RUNNING")
        .await;
    server.kill().await;
    server.restart(&[]).await;
    let failed = server.wait_until_ended(&token, &run).await;
    assert_eq!(failed["status"], "FAILED", "{failed}");
    assert_eq!(failed["endCause"], "RECOVERY_LIMIT", "{failed}");

    let note = json!({ "r": run, "n": "the worker's host was replaced" });
    let refused = server.gql_error(&token, REQUEUE, note.clone()).await;
    assert_eq!(refused["extensions"]["code"], "FORBIDDEN", "{refused}");

    let operator = server.operator_token("ops", "olga");
    let requeued = server.gql(&operator, REQUEUE, note.clone()).await;
    assert_eq!(requeued["requeueRun"]["status"], "QUEUED", "{requeued}");
    let completed = server.wait_until_ended(&token, &run).await;
    assert_eq!(completed["status"], "COMPLETED", "{completed}");
    assert!(completed["error"].is_null(), "{completed}");
    // Only a RECOVERY_LIMIT failure is queued again.
    let again = server.gql_error(&operator, REQUEUE, note).await;
    assert_eq!(again["extensions"]["code"], "CONFLICT", "{again}");

    // Another tenant's run: hidden from its own tenant's peers, cancelled
    // by an operator.
    let (_, long) = server.send(&token, &conversation, "/hold 30").await;
    server
        .wait_for_run(&token, &long, |r| r["status"] == "RUNNING")
        .await;
    let stranger = server.token("other", "eve");
    let hidden = server
        .gql_error(&stranger, CANCEL, json!({ "r": long }))
        .await;
    assert_eq!(hidden["extensions"]["code"], "NOT_FOUND", "{hidden}");
    // An operator whose identity provider vouches for them (`iss`).
    let operator = server.token_with(
        "ops",
        "olga",
        json!({ OPERATOR_CLAIM: true, "iss": "https://id.example" }),
    );
    let cancelled = server.cancel(&operator, &long).await;
    assert_eq!(cancelled["id"], long.as_str(), "{cancelled}");
    let ended = server.wait_until_ended(&token, &long).await;
    assert_eq!(ended["status"], "CANCELLED", "{ended}");

    // Both actions are audited, each with the run's tenant and who acted.
    let store = tether::store::Store::connect(server.database_url(), Default::default())
        .await
        .unwrap();
    use tether::store::entities::operator_action;
    let audit = operator_action::Entity::find()
        .all(store.db())
        .await
        .unwrap();
    let of = |action: &str| audit.iter().find(|a| a.action == action).cloned();
    let requeued = of("requeueRun").expect("the requeue is audited");
    assert_eq!(
        requeued.run_id.map(|id| id.to_string()).as_deref(),
        Some(run.as_str())
    );
    assert_eq!(
        (requeued.operator.as_str(), requeued.issuer.as_deref()),
        ("olga", None)
    );
    let cancel = of("cancelRun").expect("the cancel is audited");
    assert_eq!(
        cancel.run_id.map(|id| id.to_string()).as_deref(),
        Some(long.as_str())
    );
    assert_eq!(cancel.tenant, "acme");
    assert_eq!(cancel.operator, "olga");
    assert_eq!(cancel.issuer.as_deref(), Some("https://id.example"));
    assert_eq!(
        cancel.detail["before"]["status"], "RUNNING",
        "{:?}",
        cancel.detail
    );
    assert_eq!(audit.len(), 2, "{audit:?}");
}
