//! Questions and approvals over GraphQL: runs pause durably, resolve once,
//! resume exactly once, and gated tools never run without a decision or a
//! grant.

use serde_json::{Value, json};

use crate::downstream::Downstream;
use crate::fakes::{
    FakeProvider, FakeToolCall, Reply, Wire, anthropic_sse, anthropic_sse_tool_calls,
    server_with_key,
};
use crate::support::{Server, ServerOptions, of_type, on_postgres};
use crate::tools::{final_text, tool_calls};

/// A scripted agent with the built-in tools and gated ones; tenant `hasty`
/// has one-second questions and approvals.
pub fn config(downstream: &Downstream) -> String {
    format!(
        r#"
default_agent = "helper"

[runtime]
lease_secs = 3
heartbeat_secs = 0.5
checkpoint_ms = 40
poll_ms = 200

[[policy.tenants]]
tenant = "strict"
allow_always = false

[[policy.tenants]]
tenant = "hasty"
question_ttl_secs = 1
approval_ttl_secs = 1

[[agents]]
name = "helper"
provider = "scripted"
stream_delay_ms = 0
tools = ["ask_questions", "demo_publish", "publish", "effect"]

[[tools]]
name = "publish"
description = "Publish a post"
input_schema = {{ type = "object", properties = {{ text = {{ type = "string" }}, channel = {{ type = "string", default = "blog" }} }}, required = ["text"], additionalProperties = false }}
risk = "publish"
summary = "Publish a post"
estimated_cost_usd = 0.25
recovery = "idempotent"
http = {{ url = "{base}/effect" }}

[[tools]]
name = "effect"
description = "Has an effect"
input_schema = {{ type = "object", properties = {{ text = {{ type = "string" }} }}, required = ["text"], additionalProperties = false }}
recovery = "idempotent"
http = {{ url = "{base}/effect" }}
"#,
        base = downstream.base
    )
}

const PENDING_QUESTION: &str = "query($r: ID!) { pendingQuestion(runId: $r) { id interactionId runId createdAt expiresAt questions { key prompt multiple allowOther options { value label description } } } }";
const PENDING_APPROVALS: &str = "query($r: ID!) { pendingApprovals(runId: $r) { id interactionId runId toolCallId toolName summary riskCategory input estimatedCostUsd expiresAt allowedDecisions } pendingApproval(runId: $r) { id } }";
const ANSWER: &str = "mutation($i: ID!, $a: [QuestionAnswerInput!]!) { answerQuestion(input: {interactionId: $i, answers: $a}) { resumed run { id status } } }";
const DECIDE: &str = "mutation($i: ID!, $d: ApprovalDecision!) { decideApproval(input: {interactionId: $i, decision: $d}) { resumed run { id status } } }";

async fn status_becomes(server: &Server, token: &str, run: &str, status: &str) -> Value {
    server
        .wait_for_run(token, run, |r| r["status"] == status)
        .await
}

async fn pending_question(server: &Server, token: &str, run: &str) -> Value {
    server
        .gql(token, PENDING_QUESTION, json!({ "r": run }))
        .await["pendingQuestion"]
        .clone()
}

async fn pending_approvals(server: &Server, token: &str, run: &str) -> Vec<Value> {
    server
        .gql(token, PENDING_APPROVALS, json!({ "r": run }))
        .await["pendingApprovals"]
        .as_array()
        .unwrap()
        .clone()
}

async fn answer(server: &Server, token: &str, interaction: &str, answers: Value) -> (u16, Value) {
    server
        .post(
            Some(token),
            ANSWER,
            json!({ "i": interaction, "a": answers }),
        )
        .await
}

async fn decide(server: &Server, token: &str, interaction: &str, decision: &str) -> Value {
    server
        .post(
            Some(token),
            DECIDE,
            json!({ "i": interaction, "d": decision }),
        )
        .await
        .1
}

/// Sends `text` and waits for the run to wait for approval; returns the run
/// and the earliest pending interaction.
pub async fn gated(
    server: &Server,
    token: &str,
    conversation: &str,
    text: &str,
) -> (String, String) {
    let (_, run) = server.send(token, conversation, text).await;
    status_becomes(server, token, &run, "WAITING_FOR_APPROVAL").await;
    let interaction = pending_approvals(server, token, &run).await[0]["interactionId"]
        .as_str()
        .unwrap()
        .to_owned();
    (run, interaction)
}

fn good_answers() -> Value {
    json!([
        { "key": "color", "values": ["blue"] },
        { "key": "days", "values": ["mon", "wed"] },
        { "key": "name", "values": [], "other": "  Spring sale " }
    ])
}

#[tokio::test]
async fn a_question_parks_the_run_validates_answers_and_resumes_exactly_once() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/ask").await;
    status_becomes(&server, &token, &run, "WAITING_FOR_QUESTION").await;

    let question = pending_question(&server, &token, &run).await;
    assert_eq!(question["id"], question["interactionId"]);
    assert_eq!(question["runId"], run.as_str());
    let specs = question["questions"].as_array().unwrap();
    assert_eq!(specs.len(), 3);
    assert_eq!(
        specs[0]["options"][0],
        json!({ "value": "red", "label": "Red", "description": null })
    );
    assert_eq!(
        (
            specs[0]["multiple"].as_bool(),
            specs[0]["allowOther"].as_bool()
        ),
        (Some(false), Some(false))
    );
    assert_eq!(specs[1]["multiple"], true);
    assert_eq!(specs[2]["options"], json!([]));
    assert_eq!(specs[2]["allowOther"], true);
    let interaction = question["interactionId"].as_str().unwrap().to_owned();

    // Refusals name the key and change nothing.
    let refusals = [
        (
            json!([{ "key": "color", "values": ["green"] }, { "key": "days", "values": ["mon"] }, { "key": "name", "values": [], "other": "x" }]),
            "color",
        ),
        (
            json!([{ "key": "color", "values": ["red", "blue"] }, { "key": "days", "values": ["mon"] }, { "key": "name", "values": [], "other": "x" }]),
            "color",
        ),
        (
            json!([{ "key": "color", "values": ["red"] }, { "key": "days", "values": ["mon"] }]),
            "name",
        ),
        (
            json!([{ "key": "color", "values": ["red"] }, { "key": "days", "values": ["mon"] }, { "key": "name", "values": [], "other": "  " }]),
            "name",
        ),
    ];
    for (answers, key) in refusals {
        let (_, body) = answer(&server, &token, &interaction, answers).await;
        let error = &body["errors"][0];
        assert_eq!(error["extensions"]["code"], "BAD_USER_INPUT", "{body}");
        assert_eq!(error["extensions"]["key"], key, "{body}");
    }
    assert!(pending_question(&server, &token, &run).await.is_object());

    let (_, body) = answer(&server, &token, &interaction, good_answers()).await;
    assert_eq!(body["data"]["answerQuestion"]["resumed"], true, "{body}");
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    // The same answers again: nothing resumes; different ones: CONFLICT.
    let (_, again) = answer(&server, &token, &interaction, good_answers()).await;
    assert_eq!(again["data"]["answerQuestion"]["resumed"], false, "{again}");
    let mut other = good_answers();
    other[0]["values"] = json!(["red"]);
    let (_, conflict) = answer(&server, &token, &interaction, other).await;
    assert_eq!(
        conflict["errors"][0]["extensions"]["code"], "CONFLICT",
        "{conflict}"
    );
    assert!(pending_question(&server, &token, &run).await.is_null());

    // The answers reached the model as a user turn (the scripted model
    // quotes the latest one).
    let reply = final_text(&server, &token, &conversation, &run).await;
    assert!(reply.contains("Answers to your questions"), "{reply}");
    let parts: Vec<Value> = server
        .parts_of(
            &token,
            &conversation,
            "kind interactionId question { status answers { key values other } }",
        )
        .await
        .into_iter()
        .filter(|p| p["kind"] == "QUESTION")
        .collect();
    assert_eq!(parts.len(), 1);
    assert_eq!(parts[0]["interactionId"], interaction.as_str());
    assert_eq!(parts[0]["question"]["status"], "RESOLVED");
    assert_eq!(parts[0]["question"]["answers"][2]["other"], "Spring sale");
    let events = server.all_events(&token, &conversation).await;
    assert_eq!(of_type(&events, "question.requested").len(), 1);
    assert_eq!(of_type(&events, "question.answered").len(), 1);
}

#[tokio::test]
async fn the_model_reads_the_answers_after_the_result_of_its_call() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let ask = FakeToolCall::new(
        "toolu_ask",
        "ask_questions",
        json!({ "questions": [{ "key": "size", "prompt": "Which size?", "options": [{ "value": "s" }, { "value": "m" }] }] }),
    );
    fake.script([
        Reply::sse(anthropic_sse_tool_calls(&["Let me ask."], &[ask]), 64),
        Reply::sse(anthropic_sse(&["Size m it is."], 10, 5), 64),
    ]);
    let config = format!(
        "[runtime]\npoll_ms = 100\n\n[[agents]]\nname = \"model\"\nprovider = \"anthropic\"\nmodel = \"fake\"\nbase_url = \"{}\"\napi_key_env = \"TETHER_TEST_PROVIDER_KEY\"\ntools = [\"ask_questions\"]\n",
        fake.base_url
    );
    let server = server_with_key(config).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "Order a shirt.").await;
    status_becomes(&server, &token, &run, "WAITING_FOR_QUESTION").await;
    let question = pending_question(&server, &token, &run).await;
    let interaction = question["interactionId"].as_str().unwrap();
    let (_, body) = answer(
        &server,
        &token,
        interaction,
        json!([{ "key": "size", "values": ["m"] }]),
    )
    .await;
    assert_eq!(body["data"]["answerQuestion"]["resumed"], true, "{body}");
    let ended = server.wait_until_ended(&token, &run).await;
    let messages = fake.requests_of_completed(&ended)[1]["messages"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(messages.len(), 3, "{messages:?}");
    let turn = messages[2]["content"].as_array().unwrap();
    assert_eq!(turn[0]["type"], "tool_result");
    assert_eq!(turn[0]["tool_use_id"], "toolu_ask");
    assert!(turn[0]["content"].as_str().unwrap().contains(interaction));
    assert_eq!(turn[1]["type"], "text");
    let text = turn[1]["text"].as_str().unwrap();
    assert!(text.contains("size (Which size?): m"), "{text}");
}

#[tokio::test]
async fn a_second_question_while_one_is_pending_fails_at_once() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/ask\n/ask").await;
    status_becomes(&server, &token, &run, "WAITING_FOR_QUESTION").await;
    let calls = tool_calls(&server, &token, &run).await;
    let mut outcomes: Vec<&str> = calls
        .iter()
        .map(|c| c["outcome"].as_str().unwrap())
        .collect();
    outcomes.sort();
    assert_eq!(outcomes, ["FAILED", "SUCCEEDED"]);
    let failed = calls.iter().find(|c| c["outcome"] == "FAILED").unwrap();
    assert!(
        failed["output"]["error"]
            .as_str()
            .unwrap()
            .contains("still waiting")
    );
    assert!(pending_question(&server, &token, &run).await.is_object());
}

const CANCEL: &str = "mutation($r: ID!) { cancelRun(runId: $r) { id status cancelRequested } }";

#[tokio::test]
async fn another_person_of_the_tenant_can_neither_resolve_nor_cancel_your_run() {
    let downstream = Downstream::start().await;
    let config = format!(
        "{}\n[auth]\ndelegation_claim = \"tether_delegate\"\n",
        config(&downstream)
    );
    let server = Server::start_workers(&config).await;
    let ada = server.token("acme", "ada");
    let bob = server.token("acme", "bob");
    let conversation = server.create_conversation(&ada).await;
    let (_, asked) = server.send(&ada, &conversation, "/ask").await;
    status_becomes(&server, &ada, &asked, "WAITING_FOR_QUESTION").await;
    let question = pending_question(&server, &ada, &asked).await;
    let question = question["interactionId"].as_str().unwrap().to_owned();
    let random = uuid::Uuid::now_v7().to_string();

    // Bob's answers, good or bad, are told what a random id is told.
    let (_, theirs) = answer(&server, &bob, &question, good_answers()).await;
    let (_, unknown) = answer(&server, &bob, &random, good_answers()).await;
    assert_eq!(
        theirs["errors"][0]["extensions"]["code"], "NOT_FOUND",
        "{theirs}"
    );
    assert_eq!(theirs["errors"], unknown["errors"]);
    let (_, bad) = answer(&server, &bob, &question, json!([])).await;
    assert_eq!(bad["errors"], unknown["errors"], "{bad}");
    let (_, cancelled) = server.post(Some(&bob), CANCEL, json!({ "r": asked })).await;
    let (_, no_run) = server
        .post(Some(&bob), CANCEL, json!({ "r": random }))
        .await;
    assert_eq!(
        cancelled["errors"][0]["extensions"]["code"], "NOT_FOUND",
        "{cancelled}"
    );
    assert_eq!(cancelled["errors"], no_run["errors"]);
    assert!(pending_question(&server, &ada, &asked).await.is_object());
    let (_, answered) = answer(&server, &ada, &question, good_answers()).await;
    assert_eq!(
        answered["data"]["answerQuestion"]["resumed"], true,
        "{answered}"
    );
    server.wait_until_ended(&ada, &asked).await;

    // Bob cannot decide Ada's approval either.
    let (gated_run, approval) = gated(
        &server,
        &ada,
        &conversation,
        "/tool publish {\"text\": \"ada's\"}",
    )
    .await;
    let theirs = decide(&server, &bob, &approval, "ALLOW_CONVERSATION").await;
    let unknown = decide(&server, &bob, &random, "ALLOW_CONVERSATION").await;
    assert_eq!(
        theirs["errors"][0]["extensions"]["code"], "NOT_FOUND",
        "{theirs}"
    );
    assert_eq!(theirs["errors"], unknown["errors"]);
    assert!(
        downstream.requests().is_empty(),
        "nothing ran on Bob's word"
    );

    // Ada allows it for the conversation: her grant covers her calls only.
    let decided = decide(&server, &ada, &approval, "ALLOW_CONVERSATION").await;
    assert_eq!(
        decided["data"]["decideApproval"]["resumed"], true,
        "{decided}"
    );
    assert_eq!(
        server.wait_until_ended(&ada, &gated_run).await["status"],
        "COMPLETED"
    );
    let (_, again) = server
        .send(
            &ada,
            &conversation,
            "/tool publish {\"text\": \"ada again\"}",
        )
        .await;
    assert_eq!(
        server.wait_until_ended(&ada, &again).await["status"],
        "COMPLETED"
    );
    assert_eq!(
        downstream.requests().len(),
        2,
        "Ada's grant covered her second call"
    );
    let (bobs_run, bobs_approval) = gated(
        &server,
        &bob,
        &conversation,
        "/tool publish {\"text\": \"bob's\"}",
    )
    .await;
    assert_eq!(
        downstream.requests().len(),
        2,
        "Ada's grant does not cover Bob's call"
    );

    // A token with the delegation claim may decide for Bob.
    let lead = server.token_with("acme", "lead", json!({ "tether_delegate": true }));
    let delegated = decide(&server, &lead, &bobs_approval, "ALLOW_ONCE").await;
    assert_eq!(
        delegated["data"]["decideApproval"]["resumed"], true,
        "{delegated}"
    );
    assert_eq!(
        server.wait_until_ended(&bob, &bobs_run).await["status"],
        "COMPLETED"
    );
    assert_eq!(downstream.requests().len(), 3);
    // The claim of another tenant's delegate reaches nothing of acme's.
    let outsider = server.token_with("globex", "lead", json!({ "tether_delegate": true }));
    let (_, theirs) = server
        .post(Some(&outsider), CANCEL, json!({ "r": bobs_run }))
        .await;
    assert_eq!(
        theirs["errors"][0]["extensions"]["code"], "NOT_FOUND",
        "{theirs}"
    );
}

#[tokio::test]
async fn each_decision_does_what_it_says_and_gated_tools_never_run_without_one() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("acme", "ada");

    // ALLOW_ONCE: the stored input runs once, with the stored key.
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server
        .send(&token, &conversation, "/tool publish {\"text\": \"hello\"}")
        .await;
    status_becomes(&server, &token, &run, "WAITING_FOR_APPROVAL").await;
    assert!(
        downstream.requests().is_empty(),
        "nothing runs before a decision"
    );
    let approvals = pending_approvals(&server, &token, &run).await;
    assert_eq!(approvals.len(), 1);
    let approval = &approvals[0];
    assert_eq!(approval["toolName"], "publish");
    assert_eq!(approval["riskCategory"], "publish");
    assert_eq!(approval["summary"], "Publish a post");
    assert_eq!(approval["estimatedCostUsd"], 0.25);
    assert_eq!(
        approval["input"],
        json!({ "channel": "blog", "text": "hello" })
    );
    assert_eq!(
        approval["allowedDecisions"],
        json!(["ALLOW_ONCE", "ALLOW_CONVERSATION", "ALLOW_ALWAYS", "DENY"])
    );
    let interaction = approval["interactionId"].as_str().unwrap().to_owned();
    let decided = decide(&server, &token, &interaction, "ALLOW_ONCE").await;
    assert_eq!(
        decided["data"]["decideApproval"]["resumed"], true,
        "{decided}"
    );
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "SUCCEEDED");
    let requests = downstream.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(
        requests[0].body,
        json!({ "channel": "blog", "text": "hello" })
    );
    assert_eq!(
        requests[0].key.as_deref(),
        calls[0]["idempotencyKey"].as_str()
    );
    let approval_part = server
        .parts_of(
            &token,
            &conversation,
            "kind approval { decision decidedBy decidedAt }",
        )
        .await
        .into_iter()
        .find(|p| p["kind"] == "APPROVAL")
        .unwrap();
    assert_eq!(approval_part["approval"]["decision"], "ALLOW_ONCE");
    assert_eq!(approval_part["approval"]["decidedBy"], "ada");
    assert!(approval_part["approval"]["decidedAt"].is_string());
    let again = decide(&server, &token, &interaction, "ALLOW_ONCE").await;
    assert_eq!(again["data"]["decideApproval"]["resumed"], false, "{again}");
    let other = decide(&server, &token, &interaction, "DENY").await;
    assert_eq!(
        other["errors"][0]["extensions"]["code"], "CONFLICT",
        "{other}"
    );
    // ALLOW_ONCE granted nothing: the next call asks again.
    let (_, next) = server
        .send(&token, &conversation, "/tool publish {\"text\": \"again\"}")
        .await;
    status_becomes(&server, &token, &next, "WAITING_FOR_APPROVAL").await;
    server.cancel(&token, &next).await;
    let cancelled = tool_calls(&server, &token, &next).await;
    assert_eq!(cancelled[0]["outcome"], "NOT_STARTED");
    assert!(pending_approvals(&server, &token, &next).await.is_empty());
    // Its closing is announced, so a client drops the card.
    let events = server.all_events(&token, &conversation).await;
    let closed: Vec<_> = of_type(&events, "approval.decided")
        .into_iter()
        .filter(|e| e["runId"] == next.as_str())
        .collect();
    assert_eq!(closed.len(), 1, "{events:?}");

    // DENY: the model gets a denied result; nothing runs.
    let conversation = server.create_conversation(&token).await;
    let (run, interaction) = gated(
        &server,
        &token,
        &conversation,
        "/tool publish {\"text\": \"no\"}",
    )
    .await;
    decide(&server, &token, &interaction, "DENY").await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "DENIED");
    let reply = final_text(&server, &token, &conversation, &run).await;
    assert!(reply.contains("denied"), "{reply}");
    assert_eq!(downstream.requests().len(), 1);

    // ALLOW_CONVERSATION: the next call in that conversation runs without
    // asking; a new conversation asks again.
    let (run, interaction) = gated(
        &server,
        &token,
        &conversation,
        "/tool publish {\"text\": \"one\"}",
    )
    .await;
    decide(&server, &token, &interaction, "ALLOW_CONVERSATION").await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let (_, run) = server
        .send(&token, &conversation, "/tool publish {\"text\": \"two\"}")
        .await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "ran without asking: {ended}");
    assert_eq!(
        tool_calls(&server, &token, &run).await[0]["outcome"],
        "SUCCEEDED"
    );
    let elsewhere = server.create_conversation(&token).await;
    let (_, run) = server
        .send(&token, &elsewhere, "/tool publish {\"text\": \"three\"}")
        .await;
    status_becomes(&server, &token, &run, "WAITING_FOR_APPROVAL").await;

    // ALLOW_ALWAYS: this principal's later calls anywhere run without asking.
    let interaction = pending_approvals(&server, &token, &run).await[0]["interactionId"]
        .as_str()
        .unwrap()
        .to_owned();
    decide(&server, &token, &interaction, "ALLOW_ALWAYS").await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let fresh = server.create_conversation(&token).await;
    let (_, run) = server
        .send(&token, &fresh, "/tool publish {\"text\": \"four\"}")
        .await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    // Another principal of the tenant still has to ask.
    let bob = server.token("acme", "bob");
    let theirs = server.create_conversation(&bob).await;
    let (_, run) = server
        .send(&bob, &theirs, "/tool publish {\"text\": \"five\"}")
        .await;
    status_becomes(&server, &bob, &run, "WAITING_FOR_APPROVAL").await;
    let bodies: Vec<String> = downstream
        .requests()
        .iter()
        .map(|r| r.body["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(bodies, ["hello", "one", "two", "three", "four"]);
}

#[tokio::test]
async fn allow_always_is_refused_where_the_tenant_policy_forbids_it() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("strict", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server
        .send(&token, &conversation, "/tool publish {\"text\": \"x\"}")
        .await;
    status_becomes(&server, &token, &run, "WAITING_FOR_APPROVAL").await;
    let approval = &pending_approvals(&server, &token, &run).await[0];
    assert_eq!(
        approval["allowedDecisions"],
        json!(["ALLOW_ONCE", "ALLOW_CONVERSATION", "DENY"])
    );
    let interaction = approval["interactionId"].as_str().unwrap();
    let refused = decide(&server, &token, interaction, "ALLOW_ALWAYS").await;
    assert_eq!(
        refused["errors"][0]["extensions"]["code"], "FORBIDDEN",
        "{refused}"
    );
    assert_eq!(
        pending_approvals(&server, &token, &run).await.len(),
        1,
        "nothing changed"
    );
}

#[tokio::test]
async fn two_concurrent_decisions_one_wins_and_the_call_runs_at_most_once() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (run, interaction) = gated(
        &server,
        &token,
        &conversation,
        "/tool publish {\"text\": \"race\"}",
    )
    .await;
    let (a, b) = tokio::join!(
        decide(&server, &token, &interaction, "ALLOW_ONCE"),
        decide(&server, &token, &interaction, "DENY"),
    );
    let wins: Vec<&Value> = [&a, &b]
        .into_iter()
        .filter(|r| r["data"]["decideApproval"]["resumed"] == true)
        .collect();
    let conflicts = [&a, &b]
        .into_iter()
        .filter(|r| r["errors"][0]["extensions"]["code"] == "CONFLICT")
        .count();
    assert_eq!((wins.len(), conflicts), (1, 1), "{a} {b}");
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let outcome = tool_calls(&server, &token, &run).await[0]["outcome"].clone();
    let expected_requests = usize::from(outcome == "SUCCEEDED");
    assert_eq!(downstream.requests().len(), expected_requests, "{outcome}");
}

#[tokio::test]
async fn in_a_parallel_batch_each_gated_call_waits_for_its_own_decision() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server
        .send(
            &token,
            &conversation,
            "/tool publish {\"text\": \"a\"}\n/tool publish {\"text\": \"b\"}\n/tool effect {\"text\": \"c\"}",
        )
        .await;
    status_becomes(&server, &token, &run, "WAITING_FOR_APPROVAL").await;
    // The plain call ran meanwhile.
    assert_eq!(downstream.requests().len(), 1);
    let approvals = pending_approvals(&server, &token, &run).await;
    let inputs: Vec<&Value> = approvals.iter().map(|a| &a["input"]["text"]).collect();
    assert_eq!(inputs, [&json!("a"), &json!("b")], "batch order");
    let first = approvals[0]["interactionId"].as_str().unwrap().to_owned();
    let second = approvals[1]["interactionId"].as_str().unwrap().to_owned();
    let data = server
        .gql(&token, PENDING_APPROVALS, json!({ "r": run }))
        .await;
    assert_eq!(data["pendingApproval"]["id"], first.as_str());

    decide(&server, &token, &first, "DENY").await;
    // One decision resumes just its call; the other still waits.
    status_becomes(&server, &token, &run, "WAITING_FOR_APPROVAL").await;
    let left = pending_approvals(&server, &token, &run).await;
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["interactionId"], second.as_str());
    decide(&server, &token, &second, "ALLOW_ONCE").await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );

    let calls = tool_calls(&server, &token, &run).await;
    let outcomes: Vec<&str> = calls
        .iter()
        .map(|c| c["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["DENIED", "SUCCEEDED", "SUCCEEDED"]);
    let reply = final_text(&server, &token, &conversation, &run).await;
    assert_eq!(
        reply.matches(" returned ").count(),
        3,
        "three results: {reply}"
    );
    let texts: Vec<String> = downstream
        .requests()
        .iter()
        .map(|r| r.body["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(texts, ["c", "b"]);
}

#[tokio::test]
async fn pending_questions_and_approvals_survive_a_restart_and_resume() {
    let downstream = Downstream::start().await;
    let mut server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("acme", "ada");
    let asking = server.create_conversation(&token).await;
    let (_, question_run) = server.send(&token, &asking, "/ask").await;
    let gated = server.create_conversation(&token).await;
    let (_, approval_run) = server
        .send(&token, &gated, "/tool publish {\"text\": \"later\"}")
        .await;
    status_becomes(&server, &token, &question_run, "WAITING_FOR_QUESTION").await;
    status_becomes(&server, &token, &approval_run, "WAITING_FOR_APPROVAL").await;
    server.kill().await;
    server.restart(&[]).await;

    let question = pending_question(&server, &token, &question_run).await;
    let approvals = pending_approvals(&server, &token, &approval_run).await;
    assert_eq!(approvals.len(), 1);
    let (_, body) = answer(
        &server,
        &token,
        question["interactionId"].as_str().unwrap(),
        good_answers(),
    )
    .await;
    assert_eq!(body["data"]["answerQuestion"]["resumed"], true, "{body}");
    let decided = decide(
        &server,
        &token,
        approvals[0]["interactionId"].as_str().unwrap(),
        "ALLOW_ONCE",
    )
    .await;
    assert_eq!(
        decided["data"]["decideApproval"]["resumed"], true,
        "{decided}"
    );
    for run in [&question_run, &approval_run] {
        let ended = server.wait_until_ended(&token, run).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
    }
    assert_eq!(downstream.requests().len(), 1);
}

#[tokio::test]
async fn unanswered_interactions_expire_and_the_run_goes_on() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("hasty", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server
        .send(
            &token,
            &conversation,
            "/ask\n/tool publish {\"text\": \"x\"}",
        )
        .await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    let publish = calls.iter().find(|c| c["name"] == "publish").unwrap();
    assert_eq!(publish["outcome"], "EXPIRED");
    assert!(downstream.requests().is_empty());
    assert!(pending_question(&server, &token, &run).await.is_null());
    let parts = server
        .parts_of(
            &token,
            &conversation,
            "kind question { status } approval { status decision }",
        )
        .await;
    let question = parts.iter().find(|p| p["kind"] == "QUESTION").unwrap();
    assert_eq!(question["question"]["status"], "EXPIRED");
    let approval = parts.iter().find(|p| p["kind"] == "APPROVAL").unwrap();
    assert_eq!(
        approval["approval"],
        json!({ "status": "EXPIRED", "decision": null })
    );
}

#[tokio::test]
async fn another_tenant_can_neither_see_nor_resolve_interactions() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("acme", "ada");
    let intruder = server.token("globex", "eve");
    let conversation = server.create_conversation(&token).await;
    let (_, asked) = server.send(&token, &conversation, "/ask").await;
    status_becomes(&server, &token, &asked, "WAITING_FOR_QUESTION").await;
    let other = server.create_conversation(&token).await;
    let (_, gated) = server
        .send(&token, &other, "/tool publish {\"text\": \"x\"}")
        .await;
    status_becomes(&server, &token, &gated, "WAITING_FOR_APPROVAL").await;
    let question = pending_question(&server, &token, &asked).await;
    let approval = pending_approvals(&server, &token, &gated).await[0].clone();

    assert!(pending_question(&server, &intruder, &asked).await.is_null());
    assert!(
        pending_approvals(&server, &intruder, &gated)
            .await
            .is_empty()
    );
    let random = uuid::Uuid::now_v7().to_string();
    let (_, theirs) = answer(
        &server,
        &intruder,
        question["interactionId"].as_str().unwrap(),
        good_answers(),
    )
    .await;
    let (_, unknown) = answer(&server, &intruder, &random, good_answers()).await;
    assert_eq!(theirs["errors"], unknown["errors"]);
    assert_eq!(theirs["errors"][0]["extensions"]["code"], "NOT_FOUND");
    let theirs = decide(
        &server,
        &intruder,
        approval["interactionId"].as_str().unwrap(),
        "ALLOW_ONCE",
    )
    .await;
    let unknown = decide(&server, &intruder, &random, "ALLOW_ONCE").await;
    assert_eq!(theirs["errors"], unknown["errors"]);
    // An interaction of the other kind is NOT_FOUND too.
    let wrong_kind = decide(
        &server,
        &token,
        question["interactionId"].as_str().unwrap(),
        "ALLOW_ONCE",
    )
    .await;
    assert_eq!(wrong_kind["errors"][0]["extensions"]["code"], "NOT_FOUND");
    assert!(pending_question(&server, &token, &asked).await.is_object());
    assert_eq!(pending_approvals(&server, &token, &gated).await.len(), 1);
}

#[tokio::test]
async fn two_workers_racing_to_resume_a_decided_run_execute_it_once() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream)).await;
    // A second worker process shares PostgreSQL; on a SQLite file one
    // process alone may run workers (it holds the file's worker lock).
    let _second_worker = if on_postgres() {
        Some(server.companion("worker").await)
    } else {
        None
    };
    let token = server.token("acme", "ada");
    let mut waiting = Vec::new();
    for i in 0..4 {
        let conversation = server.create_conversation(&token).await;
        let (_, run) = server
            .send(
                &token,
                &conversation,
                &format!("/tool publish {{\"text\": \"{i}\"}}"),
            )
            .await;
        waiting.push(run);
    }
    let mut interactions = Vec::new();
    for run in &waiting {
        status_becomes(&server, &token, run, "WAITING_FOR_APPROVAL").await;
        let approval = &pending_approvals(&server, &token, run).await[0];
        interactions.push(approval["interactionId"].as_str().unwrap().to_owned());
    }
    for interaction in &interactions {
        decide(&server, &token, interaction, "ALLOW_ONCE").await;
    }
    for run in &waiting {
        assert_eq!(
            server.wait_until_ended(&token, run).await["status"],
            "COMPLETED"
        );
        assert_eq!(tool_calls(&server, &token, run).await[0]["attempt"], 1);
    }
    let mut texts: Vec<String> = downstream
        .requests()
        .iter()
        .map(|r| r.body["text"].as_str().unwrap().to_owned())
        .collect();
    texts.sort();
    assert_eq!(
        texts,
        ["0", "1", "2", "3"],
        "each decided call ran exactly once"
    );
}

#[tokio::test]
async fn a_decision_made_while_other_calls_run_is_applied_without_waiting_for_them() {
    let downstream = Downstream::start().await;
    // The slow call answers only once a second request has arrived: the
    // approved call's. Applied only after the batch parked, it never would.
    downstream.slow_until(2);
    let mut config = config(&downstream);
    config.push_str(&format!(
        "\n[[tools]]\nname = \"slow\"\ndescription = \"Slow\"\ninput_schema = {{ type = \"object\" }}\nrecovery = \"idempotent\"\nhttp = {{ url = \"{}/slow\" }}\n",
        downstream.base
    ));
    let config = config.replace(
        "tools = [\"ask_questions\", \"demo_publish\", \"publish\", \"effect\"]",
        "tools = [\"ask_questions\", \"demo_publish\", \"publish\", \"effect\", \"slow\"]",
    );
    let server = Server::start_workers(&config).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server
        .send(
            &token,
            &conversation,
            "/tool slow {}\n/tool publish {\"text\": \"now\"}",
        )
        .await;
    downstream
        .wait_for("the slow request", |d| d.requests().len() == 1)
        .await;
    let approval = loop {
        let approvals = pending_approvals(&server, &token, &run).await;
        if let Some(first) = approvals.first() {
            break first.clone();
        }
        tokio::task::yield_now().await;
    };
    let run_now = server
        .gql(
            &token,
            "query($r: ID!) { run(id: $r) { status } }",
            json!({ "r": run }),
        )
        .await;
    assert_eq!(
        run_now["run"]["status"], "RUNNING",
        "the slow call still runs"
    );
    let decided = decide(
        &server,
        &token,
        approval["interactionId"].as_str().unwrap(),
        "ALLOW_ONCE",
    )
    .await;
    assert_eq!(
        decided["data"]["decideApproval"]["resumed"], true,
        "{decided}"
    );
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let outcomes: Vec<Value> = tool_calls(&server, &token, &run)
        .await
        .iter()
        .map(|c| c["outcome"].clone())
        .collect();
    assert_eq!(outcomes, [json!("SUCCEEDED"), json!("SUCCEEDED")]);
    assert_eq!(downstream.requests().len(), 2);
}

/// `publish` asked for and allowed once, with the process aborted right
/// after the decision was taken, then started again and the run ended
/// `COMPLETED`: the server, the token and the run.
async fn crash_after_the_decision(config: String) -> (Server, String, String) {
    let mut server = Server::start_with(ServerOptions {
        config,
        env: vec![(
            "TETHER_FAILPOINTS".into(),
            "after_decision_taken=abort".into(),
        )],
        role: "all",
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (run, interaction) = gated(
        &server,
        &token,
        &conversation,
        "/tool publish {\"text\": \"once\"}",
    )
    .await;
    decide(&server, &token, &interaction, "ALLOW_ONCE").await;
    assert!(!server.exited().await.success(), "the failpoint aborted");
    server.restart(&[("TETHER_FAILPOINTS", "")]).await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let events = server.all_events(&token, &conversation).await;
    assert_eq!(
        of_type(&events, "approval.requested").len(),
        1,
        "asked once"
    );
    (server, token, run)
}

#[tokio::test]
async fn a_crash_right_after_the_decision_is_taken_runs_the_call_once_without_asking_again() {
    let downstream = Downstream::start().await;
    let (server, token, run) = crash_after_the_decision(config(&downstream)).await;
    assert!(pending_approvals(&server, &token, &run).await.is_empty());
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "SUCCEEDED");
    assert_eq!(downstream.requests().len(), 1);
}

/// The decision taken and the call `EXECUTING` are one commit: a crash
/// right after it finds a `never_replay` call started and maybe sent, so it
/// ends `UNKNOWN`, never sent (its request had not gone out).
#[tokio::test]
async fn a_crash_right_after_the_decision_on_a_never_replay_tool_ends_it_unknown_unsent() {
    let downstream = Downstream::start().await;
    let once = config(&downstream).replacen(
        "recovery = \"idempotent\"",
        "recovery = \"never_replay\"",
        1,
    );
    assert_ne!(once, config(&downstream), "publish is never_replay here");
    let (server, token, run) = crash_after_the_decision(once).await;
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "UNKNOWN", "{}", calls[0]);
    assert_eq!(
        calls[0]["attempt"], 1,
        "started once, in the decision's commit"
    );
    assert!(downstream.requests().is_empty(), "never sent");
}

#[tokio::test]
async fn a_waiting_call_whose_tool_a_deployment_removed_gets_one_consistent_result() {
    let downstream = Downstream::start().await;
    let mut server = Server::start_workers(&config(&downstream)).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (run, interaction) = gated(
        &server,
        &token,
        &conversation,
        "/tool publish {\"text\": \"x\"}",
    )
    .await;
    server.kill().await;
    // The next deployment has no `publish` tool.
    let without = config(&downstream)
        .replace("\"publish\", ", "")
        .replace("name = \"publish\"", "name = \"publish_v2\"");
    server.set_config(without);
    server.restart(&[]).await;
    let decided = decide(&server, &token, &interaction, "ALLOW_ONCE").await;
    assert_eq!(
        decided["data"]["decideApproval"]["resumed"], true,
        "{decided}"
    );
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "NOT_STARTED");
    let error = calls[0]["output"]["error"].as_str().unwrap();
    assert!(error.contains("not configured any more"), "{error}");
    // The model read that very result.
    let reply = final_text(&server, &token, &conversation, &run).await;
    assert!(reply.contains("not configured any more"), "{reply}");
    assert!(downstream.requests().is_empty());
}

#[tokio::test]
async fn an_approval_wait_after_a_removed_tools_call_parks_instead_of_spinning() {
    let downstream = Downstream::start().await;
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let publish = FakeToolCall::new("toolu_1", "publish", json!({ "text": "x" }));
    fake.script([Reply::sse(
        anthropic_sse_tool_calls(&["Publishing."], &[publish]),
        64,
    )]);
    let config = |tools: &str, extra: &str| {
        format!(
            r#"
[runtime]
lease_secs = 3
heartbeat_secs = 0.5
poll_ms = 100

[[agents]]
name = "model"
provider = "anthropic"
model = "fake"
base_url = "{base}"
api_key_env = "TETHER_TEST_PROVIDER_KEY"
tools = [{tools}]
{extra}"#,
            base = fake.base_url
        )
    };
    let publish_tool = format!(
        r#"
[[tools]]
name = "publish"
description = "Publish a post"
input_schema = {{ type = "object", properties = {{ text = {{ type = "string" }} }}, required = ["text"] }}
risk = "publish"
summary = "Publish a post"
http = {{ url = "{}/effect" }}
"#,
        downstream.base
    );
    let mut server = server_with_key(config("\"publish\", \"demo_publish\"", &publish_tool)).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (run, first) = gated(&server, &token, &conversation, "Publish it.").await;
    server.kill().await;
    // The next deployment has no `publish` tool; in the next step the model
    // asks for another gated call.
    server.set_config(config("\"demo_publish\"", ""));
    server.restart(&[]).await;
    let again = FakeToolCall::new("toolu_2", "demo_publish", json!({ "text": "y" }));
    fake.script([
        Reply::sse(anthropic_sse_tool_calls(&["Another way."], &[again]), 64),
        Reply::sse(anthropic_sse(&["Done."], 10, 5), 64),
    ]);
    let decided = decide(&server, &token, &first, "ALLOW_ONCE").await;
    assert_eq!(
        decided["data"]["decideApproval"]["resumed"], true,
        "{decided}"
    );

    // The first call's decision was never taken (its tool is gone), yet the
    // second wait parks the run; it must not loop while holding the worker.
    status_becomes(&server, &token, &run, "WAITING_FOR_APPROVAL").await;
    let pending = pending_approvals(&server, &token, &run).await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0]["toolName"], "demo_publish");
    let second = pending[0]["interactionId"].as_str().unwrap().to_owned();
    let decided = decide(&server, &token, &second, "ALLOW_ONCE").await;
    assert_eq!(
        decided["data"]["decideApproval"]["resumed"], true,
        "{decided}"
    );
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    let outcomes: Vec<&str> = calls
        .iter()
        .map(|c| c["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["NOT_STARTED", "SUCCEEDED"], "{calls:?}");
    assert!(downstream.requests().is_empty());
}
