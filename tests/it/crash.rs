//! Crash on purpose: kill the real binary mid-run (SIGKILL, or an abort at
//! each commit point through TETHER_FAILPOINTS), start it again, and check
//! that nothing committed was lost and the run completed exactly once.

use serde_json::Value;

use crate::support::{PATIENCE, Server, ServerOptions, WORKER_CONFIG};

fn with_failpoint(point: &str) -> ServerOptions {
    ServerOptions {
        config: WORKER_CONFIG.to_owned(),
        env: vec![("TETHER_FAILPOINTS".into(), format!("{point}=abort"))],
        role: "all",
    }
}

/// Cursors run 1, 2, 3, … with no repeat and no gap.
fn assert_log_is_whole(events: &[Value]) {
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["cursor"], format!("{:016}", i + 1), "{events:?}");
    }
}

fn count(events: &[Value], kind: &str, run: &str) -> usize {
    events
        .iter()
        .filter(|e| e["type"] == kind && e["runId"] == run)
        .count()
}

/// The texts of a run's reply parts, with their kinds and states.
async fn reply(
    server: &Server,
    token: &str,
    conversation: &str,
    run: &str,
) -> Vec<(String, String, String)> {
    server
        .reply_parts(token, conversation, run)
        .await
        .iter()
        .map(|p| {
            (
                p["kind"].as_str().unwrap().to_owned(),
                p["state"].as_str().unwrap().to_owned(),
                p["text"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_run_killed_mid_stream_resumes_after_restart_keeping_its_committed_text() {
    let mut server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/hold 2").await;
    // Wait until some streamed text is committed.
    let committed = loop {
        let parts = reply(&server, &token, &conversation, &run).await;
        if let Some((_, _, text)) = parts.first()
            && !text.is_empty()
        {
            break text.clone();
        }
        tokio::task::yield_now().await;
    };
    server.kill().await;
    server.restart(&[]).await;

    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let parts = reply(&server, &token, &conversation, &run).await;
    // The cut-off attempt: still visible, closed, with at least what was
    // committed before the kill; then a notice; then the complete reply.
    assert_eq!(parts[0].0, "TEXT");
    assert_eq!(parts[0].1, "DONE");
    assert!(parts[0].2.starts_with(&committed), "{parts:?}");
    assert_eq!(parts[1].0, "NOTICE", "{parts:?}");
    let last = parts.last().unwrap();
    assert_eq!((last.0.as_str(), last.1.as_str()), ("TEXT", "DONE"));
    assert!(last.2.contains("You said: \"/hold 2\""), "{parts:?}");
    // The abandoned text never reached the model: it saw no earlier turns.
    assert!(last.2.contains("sees 0 earlier messages"), "{parts:?}");

    let events = server.all_events(&token, &conversation).await;
    assert_log_is_whole(&events);
    assert_eq!(count(&events, "run.started", &run), 2);
    assert_eq!(count(&events, "run.completed", &run), 1);
}

#[tokio::test]
async fn a_crash_at_each_commit_point_loses_nothing_and_completes_once() {
    for point in [
        "after_claim",
        "after_begin",
        "after_checkpoint",
        "after_finish",
    ] {
        let mut server = Server::start_with(with_failpoint(point)).await;
        let token = server.token("acme", "ada");
        let conversation = server.create_conversation(&token).await;
        let (_, run) = server.send(&token, &conversation, "/hold 0.3").await;
        let status = server.exited().await;
        assert!(
            !status.success(),
            "{point}: the failpoint aborts the process"
        );
        server.restart(&[("TETHER_FAILPOINTS", "")]).await;
        let ended = server.wait_until_ended(&token, &run).await;
        assert_eq!(ended["status"], "COMPLETED", "{point}: {ended}");
        let events = server.all_events(&token, &conversation).await;
        assert_log_is_whole(&events);
        assert_eq!(count(&events, "run.completed", &run), 1, "{point}");
        let parts = reply(&server, &token, &conversation, &run).await;
        let last = parts.last().unwrap();
        assert!(
            last.2.contains("You said: \"/hold 0.3\""),
            "{point}: {parts:?}"
        );
        match point {
            // Nothing of the claim was visible: one start, one reply part.
            "after_claim" => {
                assert_eq!(count(&events, "run.started", &run), 1, "{point}");
                assert_eq!(parts.len(), 1, "{point}: {parts:?}");
            }
            // The empty part of the cut-off attempt becomes the notice,
            // and the retry streams into a new part.
            "after_begin" => {
                assert_eq!(count(&events, "run.started", &run), 2, "{point}");
                assert_eq!(parts[0].0, "NOTICE", "{point}: {parts:?}");
                assert_eq!(parts.len(), 2, "{point}: {parts:?}");
            }
            // The checkpointed text survives, closed, before the notice.
            "after_checkpoint" => {
                assert_eq!(count(&events, "run.started", &run), 2, "{point}");
                assert!(parts[0].2.starts_with("holding 1"), "{point}: {parts:?}");
                assert_eq!(parts[0].1, "DONE");
                assert_eq!(parts[1].0, "NOTICE", "{point}: {parts:?}");
            }
            // Finished before the crash: nothing runs again.
            _ => {
                assert_eq!(count(&events, "run.started", &run), 1, "{point}");
                assert_eq!(parts.len(), 1, "{point}: {parts:?}");
            }
        }
        server.kill().await;
    }
}

#[tokio::test]
async fn sigterm_gives_the_run_back_and_the_next_process_finishes_it() {
    let mut server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/hold 1").await;
    // Some of the first attempt's text is committed (an attempt stopped
    // before its first token leaves no text part, only the notice).
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while reply(&server, &token, &conversation, &run)
        .await
        .first()
        .is_none_or(|(kind, _, text)| kind != "TEXT" || text.is_empty())
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first attempt's text was never checkpointed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    server.terminate();
    assert!(server.exited().await.success(), "a clean exit on SIGTERM");
    server.restart(&[]).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    // The run was given back (run.queued after its start), not recovered
    // from a lost lease, and its first attempt stays visible.
    let events = server.all_events(&token, &conversation).await;
    assert_log_is_whole(&events);
    let kinds: Vec<&str> = events
        .iter()
        .filter(|e| e["runId"] == run.as_str() && e["type"].as_str().unwrap().starts_with("run."))
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "run.queued",
            "run.started",
            "run.queued",
            "run.started",
            "run.checkpointed",
            "run.completed"
        ]
    );
    let parts = reply(&server, &token, &conversation, &run).await;
    assert_eq!(parts[1].0, "NOTICE", "{parts:?}");
}
