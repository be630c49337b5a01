//! What operators' tools read: Prometheus's `/metrics` after a scripted
//! scenario, who may read it, and `/readyz` through a SIGTERM drain.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::downstream::Downstream;
use crate::support::{PATIENCE, Server, ServerOptions, WsClient, http_client, on_postgres};

const DECIDE: &str = "mutation($i: ID!) { decideApproval(input: {interactionId: $i, decision: ALLOW_ONCE}) { resumed } }";
const PENDING_APPROVAL: &str = "query($r: ID!) { pendingApproval(runId: $r) { interactionId } }";

/// Workers on the scripted model with a plain tool and a gated one.
fn config(downstream: &Downstream, extra: &str) -> String {
    format!(
        r#"
default_agent = "helper"

[runtime]
lease_secs = 3
heartbeat_secs = 0.5
checkpoint_ms = 40
poll_ms = 200
shutdown_grace_secs = 30

[[agents]]
name = "helper"
provider = "scripted"
stream_delay_ms = 0
tools = ["effect", "publish", "slow"]

[agents.retry]
max_attempts = 3
initial_delay_ms = 50
max_delay_ms = 100

[[tools]]
name = "effect"
description = "Has an effect"
input_schema = {{ type = "object", properties = {{ text = {{ type = "string" }} }}, required = ["text"], additionalProperties = false }}
recovery = "idempotent"
http = {{ url = "{base}/effect" }}

[[tools]]
name = "publish"
description = "Publish a post"
input_schema = {{ type = "object", properties = {{ text = {{ type = "string" }} }}, required = ["text"], additionalProperties = false }}
risk = "publish"
recovery = "idempotent"
http = {{ url = "{base}/effect" }}

[[tools]]
name = "slow"
description = "Answers once another request arrives"
input_schema = {{ type = "object", properties = {{ text = {{ type = "string" }} }}, required = ["text"], additionalProperties = false }}
recovery = "idempotent"
http = {{ url = "{base}/slow" }}
{extra}
"#,
        base = downstream.base
    )
}

/// One sample of the exposition: its name, labels and value.
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("a sample has a value");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let labels = rest
                        .trim_end_matches('}')
                        .split(',')
                        .filter(|pair| !pair.is_empty())
                        .map(|pair| {
                            let (key, value) = pair.split_once('=').expect("label=value");
                            (key.to_owned(), value.trim_matches('"').to_owned())
                        })
                        .collect();
                    (name.to_owned(), labels)
                }
                None => (series.to_owned(), BTreeMap::new()),
            };
            Sample {
                name,
                labels,
                value: value.parse().expect("a number"),
            }
        })
        .collect()
}

/// The value of `name` with exactly these labels, if it is exposed.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let wanted: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    samples(text)
        .into_iter()
        .find(|s| s.name == name && s.labels == wanted)
        .map(|s| s.value)
}

fn expect(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    value(text, name, labels).unwrap_or_else(|| panic!("no {name} {labels:?} in:\n{text}"))
}

async fn scrape(server: &Server) -> String {
    let response = server.get("/metrics").await;
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    response.text().await.unwrap()
}

#[tokio::test]
async fn metrics_count_a_scenario_of_runs_a_retry_tool_calls_and_an_approval() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream, "")).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;

    let (_, retried) = server.send(&token, &conversation, "/fail 429").await;
    assert_eq!(
        server.wait_until_ended(&token, &retried).await["status"],
        "COMPLETED"
    );
    let (_, tooled) = server
        .send(&token, &conversation, r#"/tool effect {"text": "a"}"#)
        .await;
    assert_eq!(
        server.wait_until_ended(&token, &tooled).await["status"],
        "COMPLETED"
    );
    let (_, gated) = server
        .send(&token, &conversation, r#"/tool publish {"text": "b"}"#)
        .await;
    server
        .wait_for_run(&token, &gated, |r| r["status"] == "WAITING_FOR_APPROVAL")
        .await;

    // A subscriber, to be counted and to receive the rest live.
    let mut ws = WsClient::connect(&server, &token).await;
    ws.subscribe(
        "1",
        "subscription($c: ID!) { conversationEvents(conversationId: $c) { type } }",
        json!({ "c": conversation }),
    )
    .await;

    let waiting = scrape(&server).await;
    assert_eq!(
        expect(
            &waiting,
            "tether_interactions_pending",
            &[("kind", "APPROVAL")]
        ),
        1.0
    );
    assert_eq!(
        expect(
            &waiting,
            "tether_interactions_pending",
            &[("kind", "QUESTION")]
        ),
        0.0
    );
    assert_eq!(
        expect(
            &waiting,
            "tether_runs",
            &[("status", "WAITING_FOR_APPROVAL")]
        ),
        1.0
    );
    assert_eq!(
        expect(&waiting, "tether_runs", &[("status", "QUEUED")]),
        0.0
    );
    assert_eq!(expect(&waiting, "tether_websocket_connections", &[]), 1.0);
    assert_eq!(expect(&waiting, "tether_subscriptions", &[]), 1.0);

    let pending = server
        .gql(&token, PENDING_APPROVAL, json!({ "r": gated }))
        .await;
    let interaction = pending["pendingApproval"]["interactionId"].clone();
    server
        .gql(&token, DECIDE, json!({ "i": interaction }))
        .await;
    assert_eq!(
        server.wait_until_ended(&token, &gated).await["status"],
        "COMPLETED"
    );
    // The subscriber received the run's end live.
    loop {
        let event = ws.next_event("1").await;
        if event["data"]["conversationEvents"]["type"] == "run.completed" {
            break;
        }
    }

    let text = scrape(&server).await;
    let completed = [("status", "COMPLETED"), ("cause", "NATURAL")];
    assert_eq!(expect(&text, "tether_runs_ended_total", &completed), 3.0);
    let rate_limited = [("provider", "scripted"), ("class", "rate_limited")];
    assert_eq!(
        expect(&text, "tether_provider_errors_total", &rate_limited),
        1.0
    );
    assert_eq!(
        expect(&text, "tether_provider_retries_total", &rate_limited),
        1.0
    );
    for tool in ["effect", "publish"] {
        let ended = [("tool", tool), ("outcome", "SUCCEEDED")];
        assert_eq!(
            expect(&text, "tether_tool_calls_ended_total", &ended),
            1.0,
            "{tool}"
        );
        assert_eq!(
            expect(
                &text,
                "tether_tool_duration_seconds_count",
                &[("tool", tool)]
            ),
            1.0,
            "{tool}"
        );
    }
    // Each run claimed, the retried one and the resumed one twice.
    assert_eq!(expect(&text, "tether_runs_claimed_total", &[]), 5.0);
    assert!(expect(&text, "tether_claim_duration_seconds_count", &[]) >= 1.0);
    // Two model requests a run: the failed attempt and its retry; a tool
    // call and the reply after it.
    assert_eq!(
        expect(
            &text,
            "tether_inference_duration_seconds_count",
            &[("provider", "scripted")]
        ),
        6.0
    );
    assert!(expect(&text, "tether_step_duration_seconds_count", &[]) >= 5.0);
    for (kind, count) in [
        ("run.completed", 3.0),
        ("run.retry-pending", 1.0),
        ("approval.requested", 1.0),
        ("approval.decided", 1.0),
        ("tool.completed", 2.0),
    ] {
        assert_eq!(
            expect(&text, "tether_events_committed_total", &[("type", kind)]),
            count,
            "{kind}"
        );
    }
    assert_eq!(
        expect(
            &text,
            "tether_interactions_pending",
            &[("kind", "APPROVAL")]
        ),
        0.0
    );
    assert_eq!(expect(&text, "tether_queue_depth", &[]), 0.0);
    assert_eq!(expect(&text, "tether_queue_oldest_age_seconds", &[]), 0.0);
    assert!(expect(&text, "tether_fanout_lag_seconds_count", &[]) >= 1.0);
    // Exposed from the start; whether the subscriber fell behind once (the
    // head watcher may see a commit before this process's bus has it)
    // depends on timing.
    expect(&text, "tether_subscriber_catch_ups_total", &[]);
    for pool in ["write", "read"] {
        assert!(expect(&text, "tether_db_pool_max_connections", &[("pool", pool)]) >= 1.0);
        expect(
            &text,
            "tether_db_pool_connections",
            &[("pool", pool), ("state", "idle")],
        );
        expect(
            &text,
            "tether_db_pool_connections",
            &[("pool", pool), ("state", "in_use")],
        );
    }
    if on_postgres() {
        assert_eq!(expect(&text, "tether_notify_listener_up", &[]), 1.0);
        assert_eq!(
            expect(&text, "tether_notify_listener_reconnects_total", &[]),
            0.0
        );
    } else {
        assert_eq!(value(&text, "tether_notify_listener_up", &[]), None);
    }
    // Every family says what it is.
    for family in [
        "tether_runs_ended_total",
        "tether_queue_depth",
        "tether_claim_duration_seconds",
        "tether_fanout_lag_seconds",
    ] {
        assert!(text.contains(&format!("# HELP {family} ")), "{family}");
    }
}

#[tokio::test]
async fn metrics_answer_loopback_callers_only_unless_a_token_is_configured() {
    let downstream = Downstream::start().await;
    let server = Server::start_workers(&config(&downstream, "")).await;
    let forwarded = server
        .http()
        .get(format!("{}/metrics", base(&server)))
        .header("x-forwarded-for", "203.0.113.9")
        .send()
        .await
        .unwrap();
    assert_eq!(
        forwarded.status(),
        403,
        "a proxied caller is not a local one"
    );
    // Nor is one whose proxy names it in any other header.
    for header in [
        "x-real-ip",
        "forwarded",
        "via",
        "x-forwarded-host",
        "true-client-ip",
    ] {
        let proxied = server
            .http()
            .get(format!("{}/metrics", base(&server)))
            .header(header, "1.2.3.4")
            .send()
            .await
            .unwrap();
        assert_eq!(proxied.status(), 403, "{header}");
    }
    let local = server
        .http()
        .get(format!("{}/metrics", base(&server)))
        .send()
        .await
        .unwrap();
    assert_eq!(
        local.status(),
        200,
        "a loopback caller on a loopback listener"
    );

    // A listener others can reach needs the token even from loopback.
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let exposed = Server::start_workers(&config(
        &downstream,
        &format!("\n[metrics]\nlisten = \"0.0.0.0:{port}\"\n"),
    ))
    .await;
    let refused = exposed
        .http()
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);

    let token = "metrics-token-of-at-least-32-bytes-long";
    let guarded = Server::start_with(ServerOptions {
        config: config(
            &downstream,
            "\n[metrics]\nbearer_token_env = \"TETHER_TEST_METRICS_TOKEN\"\n",
        ),
        env: vec![("TETHER_TEST_METRICS_TOKEN".into(), token.into())],
        role: "all",
    })
    .await;
    let url = format!("{}/metrics", base(&guarded));
    let client = http_client();
    let bare = client.get(&url).send().await.unwrap();
    assert_eq!(bare.status(), 401);
    assert_eq!(bare.headers()["www-authenticate"], "Bearer");
    let wrong = client
        .get(&url)
        .bearer_auth("metrics-token-of-at-least-32-bytes-lonG")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let right = client.get(&url).bearer_auth(token).send().await.unwrap();
    assert_eq!(right.status(), 200);
    assert!(right.text().await.unwrap().contains("tether_runs"));

    // An address of its own: the main listener no longer serves it.
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let apart = Server::start_workers(&config(
        &downstream,
        &format!("\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n"),
    ))
    .await;
    assert_eq!(apart.get("/metrics").await.status(), 404);
    let own = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(own.status(), 200);
    assert!(own.text().await.unwrap().contains("tether_queue_depth"));

    let off = Server::start_workers(&config(&downstream, "\n[metrics]\nenabled = false\n")).await;
    assert_eq!(off.get("/metrics").await.status(), 404);
}

fn base(server: &Server) -> String {
    format!("http://{}", server.addr)
}

#[tokio::test]
async fn readyz_answers_not_ready_while_sigterm_drains_a_run() {
    let downstream = Downstream::start().await;
    downstream.slow_until(2);
    let mut server = Server::start_workers(&config(&downstream, "")).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let ready = server.get("/readyz").await;
    assert_eq!(ready.status(), 200);
    assert_eq!(ready.text().await.unwrap(), "ready");
    server
        .send(&token, &conversation, r#"/tool slow {"text": "x"}"#)
        .await;
    downstream
        .wait_for("the tool's request", |d| d.requests().len() == 1)
        .await;

    server.terminate();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let body = loop {
        let response = server.get("/readyz").await;
        if response.status() == 503 {
            break response.text().await.unwrap();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz stayed ready after SIGTERM"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(body, "draining");
    // Liveness is another matter.
    assert_eq!(server.get("/healthz").await.status(), 200);

    // The held call answers once a second request arrives; the run reaches
    // its commit point and the process exits.
    let released: Value = http_client()
        .post(format!("{}/slow", downstream.base))
        .json(&json!({ "text": "release" }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(released["slow"], "done");
    assert!(server.exited().await.success());
}

#[tokio::test]
async fn readyz_answers_not_ready_while_the_listen_connection_is_down() {
    if !on_postgres() {
        return;
    }
    let server = Server::start_with(ServerOptions {
        role: "api",
        ..Default::default()
    })
    .await;
    let status = |wanted: u16| {
        let server = &server;
        async move {
            let deadline = tokio::time::Instant::now() + PATIENCE;
            loop {
                let response = server.get("/readyz").await;
                if response.status() == wanted {
                    return response.text().await.unwrap();
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "/readyz never answered {wanted}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(status(200).await, "ready");

    // The listener is cut and cannot come back while the database takes no
    // new connections; the pools keep theirs.
    let database = server.database_url().rsplit('/').next().unwrap().to_owned();
    let admin_url = std::env::var("TETHER_TEST_DATABASE_URL").unwrap();
    let admin = sea_orm::Database::connect(admin_url.as_str())
        .await
        .unwrap();
    let run = |sql: String| {
        let admin = &admin;
        async move {
            sea_orm::ConnectionTrait::execute_unprepared(admin, &sql)
                .await
                .unwrap()
        }
    };
    run(format!(
        "ALTER DATABASE \"{database}\" ALLOW_CONNECTIONS false"
    ))
    .await;
    let cut = run(format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = '{database}' AND query LIKE 'LISTEN%'"
    ))
    .await;
    assert!(cut.rows_affected() >= 1, "the server listens: {cut:?}");
    let body = status(503).await;
    run(format!(
        "ALTER DATABASE \"{database}\" ALLOW_CONNECTIONS true"
    ))
    .await;
    assert_eq!(body, "not listening for notifications");
    assert_eq!(status(200).await, "ready");
}
