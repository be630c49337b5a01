//! The crash matrix around a tool call: the real binary dies at each commit
//! point (an abort through TETHER_FAILPOINTS) or by SIGKILL while the
//! downstream service holds the request, then starts again. Idempotent
//! tools are replayed with their key and take effect once; `never_replay`
//! tools are never sent twice and end SUCCEEDED or UNKNOWN. Every run
//! completes and every call has exactly one result.

use crate::downstream::Downstream;
use crate::support::{Server, ServerOptions};
use crate::tools::{config, final_text, tool_calls};

/// Where the process dies.
#[derive(Clone, Copy, Debug)]
enum Crash {
    At(&'static str),
    /// SIGKILL while the service holds the first request.
    DuringRequest,
}

struct Expect {
    /// Requests the service saw in all.
    requests: usize,
    outcome: &'static str,
    /// EXECUTING commits.
    attempt: i64,
}

async fn crash(crash: Crash, tool: &str, expect: Expect) {
    crash_with(crash, tool, "", expect).await;
}

/// `crash` with `agent` added to the agent's configuration.
async fn crash_with(crash: Crash, tool: &str, agent: &str, expect: Expect) {
    let downstream = Downstream::start().await;
    let env = match crash {
        Crash::At(point) => vec![("TETHER_FAILPOINTS".to_owned(), format!("{point}=abort"))],
        Crash::DuringRequest => Vec::new(),
    };
    let mut server = Server::start_with(ServerOptions {
        config: config(&downstream, "", &[("tools", agent)]),
        env,
        role: "all",
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.conversation_with(&token, "tools").await;
    let (_, run) = server
        .send(
            &token,
            &conversation,
            &format!("/tool {tool} {{\"text\": \"x\"}}"),
        )
        .await;
    match crash {
        Crash::At(_) => {
            let status = server.exited().await;
            assert!(!status.success(), "{crash:?}: the failpoint aborted");
        }
        Crash::DuringRequest => {
            downstream
                .wait_for("the first request", |d| d.requests().len() == 1)
                .await;
            server.kill().await;
        }
    }
    server.restart(&[("TETHER_FAILPOINTS", "")]).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{crash:?} {tool}: {ended}");

    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls.len(), 1, "{crash:?} {tool}: {calls:?}");
    let call = &calls[0];
    assert_eq!(call["outcome"], expect.outcome, "{crash:?} {tool}: {call}");
    assert_eq!(call["attempt"], expect.attempt, "{crash:?} {tool}: {call}");
    let requests = downstream.requests();
    assert_eq!(
        requests.len(),
        expect.requests,
        "{crash:?} {tool}: {requests:?}"
    );
    assert!(
        requests
            .iter()
            .all(|r| r.key.as_deref() == call["idempotencyKey"].as_str()),
        "{crash:?} {tool}: every request carried the call's one key"
    );
    assert!(
        downstream.effects() <= 1,
        "{crash:?} {tool}: one effect at most"
    );
    // The model read exactly one result for its one call.
    let reply = final_text(&server, &token, &conversation, &run).await;
    assert_eq!(
        reply.matches(&format!("{tool} returned")).count(),
        1,
        "{crash:?} {tool}: {reply}"
    );
}

#[tokio::test]
async fn idempotent_calls_take_effect_once_whatever_the_crash() {
    let cases = [
        (Crash::At("after_tools_requested"), 1, 1),
        // Started but not sent: replayed, counted as a second attempt.
        (Crash::At("after_tool_executing"), 1, 2),
        // Sent and done, not recorded: the replay gets the service's
        // recorded answer for the same key, with no second effect.
        (Crash::At("after_tool_response"), 2, 2),
        (Crash::At("after_tool_committed"), 1, 1),
        (Crash::At("after_step"), 1, 1),
        (Crash::DuringRequest, 2, 2),
    ];
    for (crash_at, requests, attempt) in cases {
        let tool = if matches!(crash_at, Crash::DuringRequest) {
            "held"
        } else {
            "effect"
        };
        crash(
            crash_at,
            tool,
            Expect {
                requests,
                outcome: "SUCCEEDED",
                attempt,
            },
        )
        .await;
    }
}

#[tokio::test]
async fn never_replay_calls_are_never_sent_twice_and_end_succeeded_or_unknown() {
    let cases = [
        (Crash::At("after_tools_requested"), 1, "SUCCEEDED"),
        // Cut off while executing: nobody can know, so UNKNOWN, once.
        (Crash::At("after_tool_executing"), 0, "UNKNOWN"),
        (Crash::At("after_tool_response"), 1, "UNKNOWN"),
        (Crash::At("after_tool_committed"), 1, "SUCCEEDED"),
        (Crash::DuringRequest, 1, "UNKNOWN"),
    ];
    for (crash_at, requests, outcome) in cases {
        let tool = if matches!(crash_at, Crash::DuringRequest) {
            "held_once"
        } else {
            "once"
        };
        crash(
            crash_at,
            tool,
            Expect {
                requests,
                outcome,
                attempt: 1,
            },
        )
        .await;
    }
}

/// A stop condition that reads the run's calls has the result committed
/// before the step's end, in a commit of its own (elsewhere a one-call
/// batch's result goes with the step's end): dying between the two loses
/// nothing and repeats nothing.
#[tokio::test]
async fn a_crash_between_a_result_committed_alone_and_the_step_end_repeats_nothing() {
    for tool in ["effect", "once"] {
        crash_with(
            Crash::At("after_tool_committed"),
            tool,
            "[agents.stop]\nrepeated_calls = 5",
            Expect {
                requests: 1,
                outcome: "SUCCEEDED",
                attempt: 1,
            },
        )
        .await;
    }
}
