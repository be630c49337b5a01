//! What a query may cost: aliases are capped, list fields count once per
//! item they may return, `runs` and `fullOutput` are capped, and per-part
//! look-ups are batched without losing their answers.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::{Value, json};
use tether::api::auth::Viewer;
use tether::api::context::Services;
use tether::bus::Bus;
use tether::config::FileConfig;
use tether::store::Store;

use crate::downstream::Downstream;
use crate::support::{BASE_CONFIG, Server, ServerOptions, WORKER_CONFIG};
use crate::tools;

fn with_api_keys(config: &str, keys: &str) -> String {
    assert!(
        config.contains("[api]\n"),
        "the base configuration has [api]"
    );
    config.replacen("[api]\n", &format!("[api]\n{keys}\n"), 1)
}

async fn server_with_api(keys: &str) -> Server {
    Server::start_with(ServerOptions {
        config: with_api_keys(BASE_CONFIG, keys),
        ..Default::default()
    })
    .await
}

fn aliased(count: usize, field: &str) -> String {
    let fields: Vec<String> = (0..count).map(|i| format!("a{i}: {field}")).collect();
    fields.join("\n")
}

#[tokio::test]
async fn a_hundred_and_ten_aliases_are_refused_before_anything_runs() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;

    let nested = aliased(
        110,
        "conversations(first: 100) { nodes { messages(last: 100) { parts { toolCall { id } } } } }",
    );
    let (status, body) = server
        .post(Some(&token), &format!("{{ {nested} }}"), json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.get("data").is_none_or(Value::is_null), "{body}");
    let err = &body["errors"][0];
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{body}");
    assert_eq!(err["message"], "the query uses more than 50 aliases");

    // Refused before execution: a mutation with as many aliases creates
    // nothing.
    let creates = aliased(110, "createConversation(input: {}) { id }");
    let err = server
        .gql_error(&token, &format!("mutation {{ {creates} }}"), json!({}))
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");
    assert_eq!(err["message"], "the query uses more than 50 aliases");
    let data = server
        .gql(
            &token,
            "{ conversations(first: 100) { nodes { id } } }",
            json!({}),
        )
        .await;
    assert_eq!(
        data["conversations"]["nodes"],
        json!([{ "id": conversation }])
    );

    // Within the limit, aliases work.
    let few = aliased(50, "me { tenant }");
    let data = server.gql(&token, &format!("{{ {few} }}"), json!({})).await;
    assert_eq!(data["a49"]["tenant"], "acme");

    // A client's whole reload fits the default limits.
    server.send(&token, &conversation, "hello").await;
    let data = server
        .gql(&token, RELOAD, json!({ "c": conversation }))
        .await;
    assert_eq!(data["conversation"]["messages"][0]["role"], "USER");
    assert!(data["conversation"]["activeRun"]["id"].is_string());
}

/// Everything a client shows of a conversation, as a reload asks for it:
/// a tool call's `fullOutput` is read when someone opens it, not for every
/// part of a hundred messages at once.
const RELOAD: &str = r#"query($c: ID!) { conversation(id: $c) {
  id agent title createdAt lastCursor
  activeRun { id status endCause endReason cancelRequested attempt maxAttempts steps
    error { code message httpStatus retryable } usage { inputTokens outputTokens costUsd } }
  messages(last: 100) { id conversationId role runId createdAt
    parts { id messageId index kind state text data interactionId
      toolCall { id runId step name input status outcome output outputTruncated
        attempt idempotencyKey startedAt endedAt }
      question { status questions { key prompt multiple allowOther options { value label description } }
        answers { key values other } }
      approval { toolName summary riskCategory input decision decidedBy decidedAt status } } } } }"#;

#[tokio::test]
async fn list_fields_cost_what_they_may_return() {
    let server = server_with_api("max_query_complexity = 1000").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;

    // The same selection is refused or answered by `first` alone.
    let query = |first: u32| {
        format!(
            "{{ conversations(first: {first}) {{ nodes {{ id messages(last: 100) {{ id }} }} }} }}"
        )
    };
    let err = server.gql_error(&token, &query(100), json!({})).await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("complex"),
        "{err}"
    );
    let data = server.gql(&token, &query(2), json!({})).await;
    assert_eq!(data["conversations"]["nodes"][0]["id"], conversation);

    // And by `last` on messages and runs.
    let runs = |last: u32| {
        format!(
            "query($c: ID!) {{ conversation(id: $c) {{ runs(last: {last}) {{ id status }} }} }}"
        )
    };
    let err = server
        .gql_error(&token, &runs(500), json!({ "c": conversation }))
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");
    let data = server
        .gql(&token, &runs(10), json!({ "c": conversation }))
        .await;
    assert_eq!(data["conversation"]["runs"], json!([]));

    // A message's parts and a run's tool calls count by `first` (100 when
    // absent): five runs' tool calls by default may be 500, past 1000.
    let nested = |list: &str| format!("query($c: ID!) {{ conversation(id: $c) {{ {list} }} }}");
    for (costly, cheap) in [
        (
            "runs(last: 5) { toolCalls { id name status } }",
            "runs(last: 5) { toolCalls(first: 2) { id name status } }",
        ),
        (
            "messages(last: 5) { parts { id kind text } }",
            "messages(last: 5) { parts(first: 3) { id kind text } }",
        ),
    ] {
        let err = server
            .gql_error(&token, &nested(costly), json!({ "c": conversation }))
            .await;
        assert!(
            err["message"].as_str().unwrap().contains("complex"),
            "{costly}: {err}"
        );
        server
            .gql(&token, &nested(cheap), json!({ "c": conversation }))
            .await;
    }
}

#[tokio::test]
async fn parts_and_tool_calls_give_the_first_asked_for() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let text: Vec<String> = (0..3).map(|i| format!("/tool missing_{i} {{}}")).collect();
    let (_, run) = server.send(&token, &conversation, &text.join("\n")).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    const CALLS: &str = "query($r: ID!, $n: Int) { run(id: $r) { toolCalls(first: $n) { name } } }";
    let names = |data: &Value| -> Vec<String> {
        data["run"]["toolCalls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let all = server
        .gql(&token, CALLS, json!({ "r": run, "n": null }))
        .await;
    assert_eq!(names(&all), ["missing_0", "missing_1", "missing_2"]);
    let two = server.gql(&token, CALLS, json!({ "r": run, "n": 2 })).await;
    assert_eq!(names(&two), ["missing_0", "missing_1"]);

    const PARTS: &str = "query($c: ID!, $n: Int) { conversation(id: $c) { messages { role parts(first: $n) { index } } } }";
    let reply = |data: &Value| -> usize {
        let messages = data["conversation"]["messages"].as_array().unwrap();
        let reply = messages.iter().find(|m| m["role"] == "ASSISTANT").unwrap();
        reply["parts"].as_array().unwrap().len()
    };
    let every = server
        .gql(&token, PARTS, json!({ "c": conversation, "n": null }))
        .await;
    assert!(reply(&every) > 1, "{every}");
    let one = server
        .gql(&token, PARTS, json!({ "c": conversation, "n": 1 }))
        .await;
    assert_eq!(reply(&one), 1, "{one}");

    // Past the bounds: a typed error that names the argument.
    for n in [-1, 501] {
        for (query, vars) in [
            (CALLS, json!({ "r": run, "n": n })),
            (PARTS, json!({ "c": conversation, "n": n })),
        ] {
            let err = server.gql_error(&token, query, vars).await;
            assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");
            assert_eq!(err["extensions"]["key"], "first", "{err}");
            assert_eq!(err["message"], "first must be between 0 and 500", "{err}");
        }
    }
}

#[tokio::test]
async fn runs_are_the_last_asked_for_oldest_first() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut sent = Vec::new();
    for text in ["one", "two", "three"] {
        sent.push(server.send(&token, &conversation, text).await.1);
    }
    const RUNS: &str =
        "query($c: ID!, $n: Int!) { conversation(id: $c) { runs(last: $n) { id } } }";
    let ids = |data: &Value| -> Vec<String> {
        data["conversation"]["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let data = server
        .gql(&token, RUNS, json!({ "c": conversation, "n": 2 }))
        .await;
    assert_eq!(ids(&data), sent[1..]);
    let data = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { runs { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(ids(&data), sent);
    let err = server
        .gql_error(&token, RUNS, json!({ "c": conversation, "n": 501 }))
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");
    assert_eq!(err["extensions"]["key"], "last", "{err}");
}

#[tokio::test]
async fn many_tool_call_parts_each_show_their_own_call() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let acme = server.token("acme", "ada");
    let conversation = server.create_conversation(&acme).await;
    let text: Vec<String> = (0..30)
        .map(|i| format!("/tool missing_{i} {{\"n\": {i}}}"))
        .collect();
    let (_, run) = server.send(&acme, &conversation, &text.join("\n")).await;
    let ended = server.wait_until_ended(&acme, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    let parts = server
        .parts_of(
            &acme,
            &conversation,
            "id kind toolCall { id name input } question { status } approval { status }",
        )
        .await;
    let shown: Vec<&Value> = parts.iter().filter(|p| p["kind"] == "TOOL_CALL").collect();
    assert_eq!(shown.len(), 30, "{parts:?}");
    for (i, part) in shown.iter().enumerate() {
        assert_eq!(part["toolCall"]["name"], format!("missing_{i}"), "{part}");
        assert_eq!(part["toolCall"]["input"], json!({ "n": i }), "{part}");
        assert!(part["question"].is_null() && part["approval"].is_null());
    }
    for part in parts.iter().filter(|p| p["kind"] != "TOOL_CALL") {
        assert!(part["toolCall"].is_null(), "{part}");
    }
    let from_parts: HashSet<&str> = shown
        .iter()
        .map(|p| p["toolCall"]["id"].as_str().unwrap())
        .collect();
    let data = server
        .gql(
            &acme,
            "query($r: ID!) { run(id: $r) { toolCalls { id } } }",
            json!({ "r": run }),
        )
        .await;
    let of_run: HashSet<&str> = data["run"]["toolCalls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(from_parts, of_run);

    // One batch for the thirty calls: the same query, run in process on the
    // same database, takes a handful of statements, not one per part.
    let query = format!(
        "{{ conversation(id: \"{conversation}\") {{ messages {{ parts {{ kind toolCall {{ id }} }} }} }} }}"
    );
    let statements = statements_for(&server, "acme", &query).await;
    assert!((1..10).contains(&statements), "{statements} statements");

    // Another tenant's parts stay out of reach.
    let globex = server.token("globex", "gus");
    let data = server
        .gql(
            &globex,
            "query($p: ID!) { part(id: $p) { toolCall { id } } }",
            json!({ "p": shown[0]["id"] }),
        )
        .await;
    assert!(data["part"].is_null(), "{data}");
}

#[tokio::test]
async fn full_output_is_capped_with_a_marker() {
    let downstream = Downstream::start().await;
    let config = tools::config(
        &downstream,
        "",
        &[(
            "tools",
            "[agents.limits]\nmax_inline_tool_output_bytes = 256",
        )],
    );
    let config = config.replacen(
        "[runtime]\n",
        "[api]\nmax_full_output_bytes = 1024\nmax_full_output_bytes_per_response = 2560\n\n[runtime]\n",
        1,
    );
    let server = Server::start_workers(&config).await;
    let token = server.token("acme", "ada");
    let conversation = server.conversation_with(&token, "tools").await;
    let (_, run) = server
        .send(&token, &conversation, "/tool big {\"text\": \"a\"}")
        .await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tools::tool_calls(&server, &token, &run).await;
    let full = calls[0]["fullOutput"].as_str().unwrap();
    let (head, marker) = full.split_once("\n[truncated by the server: ").unwrap();
    assert_eq!(head.len(), 1024);
    assert!(head.starts_with("{\"text\":\"xxx"), "{head}");
    assert!(marker.starts_with("1024 of "), "{marker}");
    assert!(marker.ends_with(" bytes shown]"), "{marker}");

    // Many of them in one response share its budget (2,560 bytes): 1,024
    // each while it lasts, then what is left, then nothing but markers.
    let aliases: String = (0..5)
        .map(|i| format!("r{i}: run(id: $r) {{ toolCalls {{ fullOutput }} }} "))
        .collect();
    let data = server
        .gql(
            &token,
            &format!("query($r: ID!) {{ {aliases} }}"),
            serde_json::json!({ "r": run }),
        )
        .await;
    let mut shown: Vec<usize> = (0..5)
        .map(|i| {
            let full = data[format!("r{i}")]["toolCalls"][0]["fullOutput"]
                .as_str()
                .unwrap();
            let (head, _) = full.split_once("\n[truncated by the server: ").unwrap();
            head.len()
        })
        .collect();
    shown.sort_unstable();
    assert_eq!(shown, vec![0, 0, 512, 1024, 1024], "{data}");
}

/// On PostgreSQL a table lock held by another session stalls the API's read
/// for as long as the test likes; on SQLite, whose readers nothing blocks,
/// the extension's unit test (`api::cost`) covers the limit.
#[tokio::test]
async fn a_query_past_the_time_limit_gets_timeout_and_the_api_recovers() {
    let server = server_with_api("request_timeout_secs = 1").await;
    if !server.database_url().starts_with("postgres") {
        return;
    }
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let blocker = sea_orm::Database::connect(server.database_url())
        .await
        .unwrap();
    let lock = sea_orm::TransactionTrait::begin(&blocker).await.unwrap();
    sea_orm::ConnectionTrait::execute_unprepared(
        &lock,
        "LOCK TABLE conversations IN ACCESS EXCLUSIVE MODE",
    )
    .await
    .unwrap();
    const READ: &str = "query($c: ID!) { conversation(id: $c) { id } }";
    let (status, body) = server
        .post(Some(&token), READ, json!({ "c": conversation }))
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.get("data").is_none_or(Value::is_null), "{body}");
    let err = &body["errors"][0];
    assert_eq!(err["extensions"]["code"], "TIMEOUT", "{body}");
    assert_eq!(
        err["message"],
        "the query ran longer than the server's limit of 1 s"
    );
    lock.rollback().await.unwrap();
    let data = server.gql(&token, READ, json!({ "c": conversation })).await;
    assert_eq!(data["conversation"]["id"], conversation);
}

/// How many statements the API's read pool runs for `query`, executed in
/// process on the server's database for a viewer of `tenant`.
async fn statements_for(server: &Server, tenant: &str, query: &str) -> u64 {
    let store = Store::connect(server.database_url(), Bus::new())
        .await
        .unwrap();
    let config = FileConfig::from_toml(BASE_CONFIG).unwrap();
    let connections = Arc::new(tether::connections::Connections::new(&config, None));
    let schema = tether::api::schema(Services::new(store.clone(), Arc::new(config), connections));
    let before = store.read_statements();
    let response = schema
        .execute(async_graphql::Request::new(query).data(Viewer {
            tenant: tenant.to_owned(),
            principal: "ada".to_owned(),
            expires_at: i64::MAX,
            operator: false,
            delegate: false,
            issuer: None,
        }))
        .await;
    assert!(response.errors.is_empty(), "{:?}", response.errors);
    store.read_statements() - before
}

#[tokio::test]
async fn many_approval_parts_are_read_in_one_batch() {
    // The base configuration's agent offers the gated `demo_publish`.
    let server = Server::start_workers(BASE_CONFIG).await;
    let acme = server.token("acme", "ada");
    let conversation = server.create_conversation(&acme).await;
    let text: Vec<String> = (0..30)
        .map(|i| format!("/tool demo_publish {{\"text\": \"post {i}\"}}"))
        .collect();
    let (_, run) = server.send(&acme, &conversation, &text.join("\n")).await;
    server
        .wait_for_run(&acme, &run, |r| r["status"] == "WAITING_FOR_APPROVAL")
        .await;
    let parts = server
        .parts_of(
            &acme,
            &conversation,
            "kind approval { status input } question { status }",
        )
        .await;
    let approvals: Vec<&Value> = parts.iter().filter(|p| p["kind"] == "APPROVAL").collect();
    assert_eq!(approvals.len(), 30, "{parts:?}");
    let inputs: HashSet<String> = approvals
        .iter()
        .map(|part| {
            assert_eq!(part["approval"]["status"], "PENDING", "{part}");
            part["approval"]["input"]["text"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(inputs, (0..30).map(|i| format!("post {i}")).collect());
    let query = format!(
        "{{ conversation(id: \"{conversation}\") {{ messages {{ parts {{ kind approval {{ status }} question {{ status }} }} }} }} }}"
    );
    let statements = statements_for(&server, "acme", &query).await;
    assert!((1..10).contains(&statements), "{statements} statements");
}
