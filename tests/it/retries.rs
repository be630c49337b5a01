//! The retry policy end to end, with the scripted model's `/fail STATUS`,
//! and a provider's `retry-after` against the run's time limit.

use crate::fakes::{FakeProvider, Wire};
use crate::providers::{error, server_with};
use crate::support::{Server, WORKER_CONFIG, events_with_retries as events, of_type};

#[tokio::test]
async fn a_rate_limited_attempt_waits_for_retry_after_then_succeeds() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/fail 429").await;
    let pending = server
        .wait_for_run(&token, &run, |r| {
            r["status"] != "QUEUED" && r["status"] != "RUNNING"
        })
        .await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert!(
        ended["error"].is_null(),
        "a success clears the error: {ended}"
    );
    let _ = pending;

    let events = events(&server, &token, &conversation).await;
    let retries = of_type(&events, "run.retry-pending");
    assert_eq!(retries.len(), 1, "{events:?}");
    let retry = retries[0];
    assert_eq!(retry["attempt"], 1);
    assert_eq!(retry["maxAttempts"], 3);
    assert!(
        retry["delayMs"].as_i64().unwrap() >= 1000,
        "retry-after: 1 is a floor: {retry}"
    );
    assert_eq!(retry["error"]["code"], "rate_limit_error");
    assert_eq!(retry["error"]["httpStatus"], 429);
    assert_eq!(retry["error"]["retryable"], true);
    // The second attempt did not start before nextAttemptAt.
    let next_attempt_at = retry["nextAttemptAt"].as_str().unwrap();
    let starts = of_type(&events, "run.started");
    assert_eq!(starts.len(), 2);
    assert!(
        starts[1]["at"].as_str().unwrap() >= next_attempt_at,
        "{starts:?} vs {next_attempt_at}"
    );

    // The failed attempt, which said nothing, leaves a notice in place of
    // an empty text, then the reply.
    let parts = server.reply_parts(&token, &conversation, &run).await;
    let kinds: Vec<&str> = parts.iter().map(|p| p["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["NOTICE", "TEXT"], "{parts:?}");
    assert!(
        parts[0]["text"]
            .as_str()
            .unwrap()
            .contains("attempt 2 of 3")
    );
    assert!(
        parts[1]["text"]
            .as_str()
            .unwrap()
            .contains("You said: \"/fail 429\"")
    );
}

#[tokio::test]
async fn client_errors_fail_at_once_with_the_providers_message() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/fail 400").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "FAILED");
    assert_eq!(ended["endCause"], "ERROR");
    assert_eq!(ended["error"]["code"], "invalid_request_error");
    assert!(
        ended["error"]["message"]
            .as_str()
            .unwrap()
            .contains("HTTP 400")
    );
    let events = events(&server, &token, &conversation).await;
    assert!(of_type(&events, "run.retry-pending").is_empty());
}

#[tokio::test]
async fn overloaded_and_unavailable_are_retried_and_exhaustion_keeps_the_last_error() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    for status in [529, 503] {
        let conversation = server.create_conversation(&token).await;
        let (_, run) = server
            .send(&token, &conversation, &format!("/fail {status}"))
            .await;
        let ended = server.wait_until_ended(&token, &run).await;
        assert_eq!(ended["status"], "COMPLETED", "{status}: {ended}");
        let events = events(&server, &token, &conversation).await;
        assert_eq!(of_type(&events, "run.retry-pending").len(), 1, "{status}");
    }
    // With a budget of one attempt, the first failure is the last.
    let conversation = server.conversation_with(&token, "once").await;
    let (_, run) = server.send(&token, &conversation, "/fail 503").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "FAILED");
    assert_eq!(ended["error"]["code"], "api_error");
    let events = events(&server, &token, &conversation).await;
    assert!(of_type(&events, "run.retry-pending").is_empty());
}

#[tokio::test]
async fn a_crash_during_the_wait_does_not_lose_the_retry() {
    let mut server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/fail 429").await;
    server
        .wait_for_run(&token, &run, |r| r["status"] == "RETRY_PENDING")
        .await;
    server.kill().await;
    server.restart(&[]).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let events = events(&server, &token, &conversation).await;
    let retry = of_type(&events, "run.retry-pending")[0];
    let starts = of_type(&events, "run.started");
    assert_eq!(starts.len(), 2);
    assert!(starts[1]["at"].as_str().unwrap() >= retry["nextAttemptAt"].as_str().unwrap());
}

#[tokio::test]
async fn a_retry_due_after_the_runs_deadline_ends_it_timeout_at_once() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([error(
        429,
        "rate_limit_error",
        vec![("retry-after", "3600")],
    )]);
    let server = server_with(&fake, "anthropic", "[agents.limits]\ntimeout_secs = 60\n").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "Hello").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "FAILED", "{ended}");
    assert_eq!(ended["endCause"], "TIMEOUT", "{ended}");
    assert_eq!(ended["error"]["code"], "TIMEOUT", "{ended}");
    let message = ended["error"]["message"].as_str().unwrap();
    assert!(message.contains("past the run's time limit"), "{message}");
    let events = events(&server, &token, &conversation).await;
    assert!(
        of_type(&events, "run.retry-pending").is_empty(),
        "never parked for the hour: {events:?}"
    );
    // The conversation does not wait behind it.
    let (_, next) = server.send(&token, &conversation, "Again").await;
    let ended = server.wait_until_ended(&token, &next).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
}
