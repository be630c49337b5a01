//! What tenants, models and logs never see: a tool URL's or a provider base
//! URL's secret (reqwest's error text carries the whole URL), a provider
//! key echoed in an error message, the JWT secret, a bearer token. Also:
//! redirects are not followed (they would carry `x-api-key` elsewhere), and
//! a tool's answer is read only up to its byte cap.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{HeaderMap, Method, Uri};
use serde_json::{Value, json};

use crate::downstream::Downstream;
use crate::fakes::{
    FakeProvider, FakeToolCall, KEY, Reply, Wire, anthropic_sse, anthropic_sse_tool_calls, key_env,
    model_config, server_with_key,
};
use crate::support::{SECRET, Server, ServerOptions, events_with_retries};
use crate::tools::{run_to_end, tool_calls};

const PATH_SECRET: &str = "T0-PATHSECRET-1f2e";
const QUERY_SECRET: &str = "QUERYSECRET-9a8b";
const BASE_URL_KEY: &str = "PROVIDER-QUERYKEY-77c3";

/// Records every request it gets, whatever its method or path: where a
/// redirect would have led.
struct Catcher {
    base: String,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Catcher {
    async fn start() -> Catcher {
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let record = seen.clone();
        let app = Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap| {
            let record = record.clone();
            async move {
                record
                    .lock()
                    .unwrap()
                    .push(format!("{method} {uri} {headers:?}"));
                "caught"
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Catcher { base, seen }
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

/// A local port nothing listens on (bound, then released).
async fn closed_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

/// Everything a tenant can read about a conversation and its run: messages
/// with every part, the run with its error and end reason, its tool calls,
/// and the events (with the retry events' errors).
async fn tenant_view(server: &Server, token: &str, conversation: &str, run: &str) -> String {
    let conversation_data = server
        .gql(
            token,
            "query($c: ID!) { conversation(id: $c) { messages(last: 20) { role parts { kind state text data approval { toolName input summary } toolCall { output fullOutput } } } } }",
            json!({ "c": conversation }),
        )
        .await;
    let run_data = server
        .gql(
            token,
            "query($r: ID!) { run(id: $r) { status endCause endReason error { code message httpStatus retryable } } }",
            json!({ "r": run }),
        )
        .await;
    let calls = tool_calls(server, token, run).await;
    let events = events_with_retries(server, token, conversation).await;
    json!([conversation_data, run_data, calls, events]).to_string()
}

fn assert_hidden(what: &str, text: &str, secrets: &[&str]) {
    for secret in secrets {
        assert!(!text.contains(secret), "{secret:?} is in {what}: {text}");
    }
}

/// A server whose agent `model` talks to the Anthropic fake at `base_url`
/// and offers `tools` (their `[[tools]]` sections in `tool_sections`).
async fn anthropic_server(base_url: &str, agent_keys: &str, tool_sections: &str) -> Server {
    let agent = format!("idle_timeout_secs = 5\n{agent_keys}");
    let rest = format!(
        "\n[agents.retry]\nmax_attempts = 2\ninitial_delay_ms = 50\nmax_delay_ms = 100\n{tool_sections}"
    );
    server_with_key(model_config("anthropic", base_url, "", &agent, &rest)).await
}

/// A `[[tools]]` section calling `url` with `POST`.
fn tool_section(name: &str, url: &str, extra: &str) -> String {
    format!(
        "\n[[tools]]\nname = {name:?}\ndescription = \"A test tool\"\ninput_schema = {{ type = \"object\", properties = {{ text = {{ type = \"string\" }} }}, required = [\"text\"], additionalProperties = false }}\n{extra}\nhttp = {{ url = {url:?}, timeout_secs = 5 }}\n"
    )
}

#[tokio::test]
async fn an_unreachable_tool_url_keeps_its_secret_from_tenants_the_model_and_the_log() {
    let port = closed_port().await;
    let url = format!("http://127.0.0.1:{port}/hooks/{PATH_SECRET}?token={QUERY_SECRET}");
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let call = FakeToolCall::new("call_1", "hook", json!({ "text": "a" }));
    fake.script([
        Reply::sse(anthropic_sse_tool_calls(&[], &[call]), 64),
        Reply::sse(anthropic_sse(&["It failed."], 10, 5), 64),
    ]);
    let tools = tool_section("hook", &url, "");
    let mut server = anthropic_server(&fake.base_url, "tools = [\"hook\"]", &tools).await;
    let token = server.token("acme", "ada");
    let (conversation, run, ended) = run_to_end(&server, &token, "model", "Call the hook.").await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "FAILED", "{calls:?}");
    let output = calls[0]["output"].to_string();
    assert!(output.contains("connection refused"), "{output}");
    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let results = requests[1]["messages"].to_string();
    assert!(
        results.contains("tool_result") && results.contains("connection refused"),
        "the model reads what kind of failure it was: {results}"
    );

    let secrets = [PATH_SECRET, QUERY_SECRET];
    let seen = tenant_view(&server, &token, &conversation, &run).await;
    assert_hidden("what the tenant sees", &seen, &secrets);
    assert_hidden(
        "the model's requests",
        &json!(requests).to_string(),
        &secrets,
    );
    let logs = server.logs_after_exit().await;
    assert!(
        logs.contains(&format!("http://127.0.0.1:{port}")),
        "the log says where the request went: {logs}"
    );
    assert_hidden("the server's log", &logs, &secrets);
}

#[tokio::test]
async fn an_unreachable_provider_base_url_keeps_its_key_from_run_errors_and_retry_events() {
    let port = closed_port().await;
    let base_url = format!("http://127.0.0.1:{port}/proxy?key={BASE_URL_KEY}");
    let mut server = anthropic_server(&base_url, "", "").await;
    let token = server.token("acme", "ada");
    let (conversation, run, ended) = run_to_end(&server, &token, "model", "Hello?").await;
    assert_eq!(ended["status"], "FAILED", "{ended}");
    let message = ended["error"]["message"].as_str().unwrap();
    assert!(message.contains("connection refused"), "{ended}");

    let events = events_with_retries(&server, &token, &conversation).await;
    let retries: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "run.retry-pending")
        .collect();
    assert_eq!(retries.len(), 1, "{events:?}");
    assert!(
        retries[0]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("connection refused"),
        "{retries:?}"
    );
    let seen = tenant_view(&server, &token, &conversation, &run).await;
    assert_hidden("what the tenant sees", &seen, &[BASE_URL_KEY, KEY]);
    let logs = server.logs_after_exit().await;
    assert_hidden("the server's log", &logs, &[BASE_URL_KEY, KEY]);
}

#[tokio::test]
async fn a_provider_redirect_fails_the_run_with_its_status_and_the_key_goes_nowhere() {
    let catcher = Catcher::start().await;
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([Reply::Redirect {
        location: format!("{}/v1/messages", catcher.base),
    }]);
    let server = anthropic_server(&fake.base_url, "", "").await;
    let token = server.token("acme", "ada");
    let (_, _, ended) = run_to_end(&server, &token, "model", "Hello?").await;
    assert_eq!(ended["status"], "FAILED", "{ended}");
    assert_eq!(ended["error"]["code"], "redirect", "{ended}");
    let message = ended["error"]["message"].as_str().unwrap();
    assert!(message.contains("307"), "{ended}");
    assert_eq!(fake.requests().len(), 1, "a redirect is not retried");
    assert_eq!(catcher.seen(), Vec::<String>::new());
}

/// Agent `tools` on the scripted model offering `tools`.
fn scripted_config(agent_keys: &str, tools: &str) -> String {
    format!(
        "[runtime]\ncheckpoint_ms = 40\npoll_ms = 100\n\n[[agents]]\nname = \"model\"\nprovider = \"scripted\"\nstream_delay_ms = 0\n{agent_keys}\n{tools}"
    )
}

#[tokio::test]
async fn a_tool_redirect_is_a_failed_call_the_model_reads_and_goes_nowhere() {
    let catcher = Catcher::start().await;
    let downstream = Downstream::start().await;
    downstream.redirect_to(&format!("{}/effect", catcher.base));
    let tools = tool_section(
        "moved",
        &format!("{}/redirect", downstream.base),
        "recovery = \"idempotent\"",
    );
    let config = scripted_config("tools = [\"moved\"]", &tools);
    let server = Server::start_workers(&config).await;
    let token = server.token("acme", "ada");
    let (_, run, ended) =
        run_to_end(&server, &token, "model", "/tool moved {\"text\": \"a\"}").await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "FAILED", "{calls:?}");
    assert_eq!(calls[0]["output"]["status"], 307, "{calls:?}");
    assert_eq!(calls[0]["attempt"], 1, "a redirect is not transient");
    assert_eq!(downstream.requests_to("/redirect").len(), 1);
    assert_eq!(catcher.seen(), Vec::<String>::new());
}

#[tokio::test]
async fn an_endless_tool_answer_is_read_up_to_its_cap_and_marked_truncated() {
    let downstream = Downstream::start().await;
    let tools = tool_section(
        "endless",
        &format!("{}/endless", downstream.base),
        "recovery = \"idempotent\"",
    )
    .replace(
        "timeout_secs = 5",
        "timeout_secs = 5, max_response_bytes = 65536",
    );
    // The inline limit is above the cap: only the cap can mark it truncated.
    let agent = "tools = [\"endless\"]\n\n[agents.limits]\nmax_inline_tool_output_bytes = 1048576";
    let server = Server::start_workers(&scripted_config(agent, &tools)).await;
    let token = server.token("acme", "ada");
    let (_, run, ended) =
        run_to_end(&server, &token, "model", "/tool endless {\"text\": \"a\"}").await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    let call = &calls[0];
    assert_eq!(call["outcome"], "SUCCEEDED", "{call}");
    assert_eq!(call["outputTruncated"], true, "{call}");
    let output = call["output"].as_str().unwrap();
    assert!(output.starts_with(&"x".repeat(65536)), "{}", &output[..100]);
    assert!(!output.contains(&"x".repeat(65537)), "no more than the cap");
    assert!(
        output.ends_with("[response truncated: only its first 65536 bytes were read]"),
        "{}",
        &output[output.len().saturating_sub(200)..]
    );
}

const PENDING_APPROVALS: &str =
    "query($r: ID!) { pendingApprovals(runId: $r) { interactionId toolName } }";
const DECIDE: &str = "mutation($i: ID!, $d: ApprovalDecision!) { decideApproval(input: {interactionId: $i, decision: $d}) { resumed } }";

/// A whole scenario with `RUST_LOG=debug`: a provider error that echoes the
/// key (retried), a failing tool with a secret URL, an approved tool with a
/// secret in its query; neither the log nor what the tenant sees holds a
/// secret, the JWT secret or the caller's bearer token.
#[tokio::test]
async fn a_debug_log_of_a_whole_scenario_holds_no_secret_key_or_token() {
    let port = closed_port().await;
    let downstream = Downstream::start().await;
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let calls = [
        FakeToolCall::new("call_1", "hook", json!({ "text": "a" })),
        FakeToolCall::new("call_2", "publish", json!({ "text": "b" })),
    ];
    fake.script([
        Reply::Error {
            status: 429,
            kind: "rate_limit_error",
            message: "Number of requests for key sk-test-key exceeded; Authorization: Bearer sk-test-key",
            headers: vec![("retry-after", "0")],
        },
        Reply::sse(anthropic_sse_tool_calls(&["Calling."], &calls), 64),
        Reply::sse(anthropic_sse(&["Done."], 10, 5), 64),
    ]);
    let tools = [
        tool_section(
            "hook",
            &format!("http://127.0.0.1:{port}/hooks/{PATH_SECRET}?token={QUERY_SECRET}"),
            "",
        ),
        tool_section(
            "publish",
            &format!("{}/effect?token={QUERY_SECRET}", downstream.base),
            "risk = \"publish\"",
        ),
    ]
    .concat();
    let rest = format!(
        "\n[agents.retry]\nmax_attempts = 3\ninitial_delay_ms = 50\nmax_delay_ms = 100\n{tools}"
    );
    let mut server = Server::start_with(ServerOptions {
        config: model_config(
            "anthropic",
            &fake.base_url,
            "",
            "tools = [\"hook\", \"publish\"]",
            &rest,
        ),
        env: vec![key_env(), ("RUST_LOG".into(), "debug".into())],
        role: "all",
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.conversation_with(&token, "model").await;
    let (_, run) = server.send(&token, &conversation, "Go.").await;
    server
        .wait_for_run(&token, &run, |r| r["status"] == "WAITING_FOR_APPROVAL")
        .await;
    let pending = server
        .gql(&token, PENDING_APPROVALS, json!({ "r": run }))
        .await;
    let interaction = pending["pendingApprovals"][0]["interactionId"]
        .as_str()
        .unwrap()
        .to_owned();
    let decided = server
        .gql(
            &token,
            DECIDE,
            json!({ "i": interaction, "d": "ALLOW_ONCE" }),
        )
        .await;
    assert_eq!(decided["decideApproval"]["resumed"], true, "{decided}");
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    let calls = tool_calls(&server, &token, &run).await;
    let outcomes: Vec<&Value> = calls.iter().map(|c| &c["outcome"]).collect();
    assert_eq!(
        outcomes,
        [&json!("FAILED"), &json!("SUCCEEDED")],
        "{calls:?}"
    );
    assert_eq!(downstream.requests_to("/effect").len(), 1);
    let events = events_with_retries(&server, &token, &conversation).await;
    let retry = events
        .iter()
        .find(|e| e["type"] == "run.retry-pending")
        .expect("the rate limit was retried");
    let said = retry["error"]["message"].as_str().unwrap();
    assert!(said.contains("Number of requests for key"), "{said}");

    let secrets = [KEY, PATH_SECRET, QUERY_SECRET, SECRET, token.as_str()];
    let seen = tenant_view(&server, &token, &conversation, &run).await;
    assert_hidden("what the tenant sees", &seen, &secrets);
    let logs = server.logs_after_exit().await;
    assert!(
        logs.contains("DEBUG"),
        "the server logged at debug level: {logs}"
    );
    assert_hidden("the server's debug log", &logs, &secrets);
}
