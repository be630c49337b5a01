//! Start-up: configuration refusals name their key; the sample starts; the
//! probes answer.

use std::time::Duration;

use crate::support::{Server, ServerOptions, TestDb, tether_command};

async fn refused_with(config: &str) -> String {
    let db = TestDb::new().await;
    let dir = std::env::temp_dir();
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tether_command(&db, config, &dir).arg("serve").output(),
    )
    .await
    .expect("tether exits in time")
    .unwrap();
    assert!(!output.status.success(), "started with a bad configuration");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test]
async fn a_bad_configuration_stops_start_up_naming_the_key() {
    let stderr = refused_with("[runtime]\nlease_secs = 15\nheartbeat_sec = 5\n").await;
    assert!(stderr.contains("heartbeat_sec"), "{stderr}");
    let stderr = refused_with(
        "[[agents]]\nname = \"a\"\nprovider = \"anthropic\"\nmodel = \"m\"\napi_key_env = \"TETHER_TEST_UNSET_KEY\"\n",
    )
    .await;
    assert!(stderr.contains("agents[0].api_key_env"), "{stderr}");
    assert!(stderr.contains("TETHER_TEST_UNSET_KEY"), "{stderr}");
    let stderr = refused_with(
        "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n[agents.retry]\nmax_attempts = -1\n",
    )
    .await;
    assert!(stderr.contains("max_attempts"), "{stderr}");
}

#[tokio::test]
async fn the_sample_configuration_serves_the_probes_and_graphiql() {
    let sample =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tether.toml")).unwrap();
    let server = Server::start_with(ServerOptions {
        config: sample,
        ..Default::default()
    })
    .await;
    let response = server.get("/healthz").await;
    assert_eq!(response.status().as_u16(), 200);
    let response = server.get("/readyz").await;
    assert_eq!(response.status().as_u16(), 200);
    let response = server.get("/graphiql").await;
    assert_eq!(response.status().as_u16(), 200);
    let page = response.text().await.unwrap();
    assert!(
        page.contains(r#""endpoint":"graphql""#),
        "GraphiQL points at the API"
    );
    let token = server.token("acme", "ada");
    let data = server
        .gql(&token, "{ agents { name } }", serde_json::json!({}))
        .await;
    assert_eq!(data["agents"][0]["name"], "demo");

    // GraphiQL's own introspection query passes the depth and complexity
    // limits of the sample configuration.
    let data = server
        .gql(&token, INTROSPECTION, serde_json::json!({}))
        .await;
    assert!(data["__schema"]["types"].as_array().unwrap().len() > 20);
}

#[tokio::test]
async fn a_file_without_agents_serves_the_demo_agent() {
    let server = Server::start_with(ServerOptions {
        config: "[api]\nmax_query_depth = 12\n".to_owned(),
        role: "all",
        ..Default::default()
    })
    .await;
    let token = server.token("acme", "ada");
    let data = server
        .gql(&token, "{ agents { name } }", serde_json::json!({}))
        .await;
    assert_eq!(data["agents"], serde_json::json!([{ "name": "demo" }]));
    // New conversations get it, and it answers.
    let data = server
        .gql(
            &token,
            "mutation { createConversation(input: {}) { id agent } }",
            serde_json::json!({}),
        )
        .await;
    assert_eq!(data["createConversation"]["agent"], "demo");
    let conversation = data["createConversation"]["id"].as_str().unwrap();
    let (_, run) = server.send(&token, conversation, "hello").await;
    let run = server.wait_until_ended(&token, &run).await;
    assert_eq!(run["status"], "COMPLETED", "{run}");
}

const INTROSPECTION: &str = r#"
query IntrospectionQuery {
  __schema {
    queryType { name }
    mutationType { name }
    subscriptionType { name }
    types { ...FullType }
    directives { name description locations args { ...InputValue } }
  }
}
fragment FullType on __Type {
  kind name description
  fields(includeDeprecated: true) {
    name description
    args { ...InputValue }
    type { ...TypeRef }
    isDeprecated deprecationReason
  }
  inputFields { ...InputValue }
  interfaces { ...TypeRef }
  enumValues(includeDeprecated: true) { name description isDeprecated deprecationReason }
  possibleTypes { ...TypeRef }
}
fragment InputValue on __InputValue { name description type { ...TypeRef } defaultValue }
fragment TypeRef on __Type {
  kind name
  ofType { kind name ofType { kind name ofType { kind name ofType { kind name ofType { kind name ofType { kind name ofType { kind name } } } } } } }
}
"#;

async fn refused_with_env(config: &str, env: &[(&str, &str)]) -> String {
    let db = TestDb::new().await;
    let dir = std::env::temp_dir();
    let mut command = tether_command(&db, config, &dir);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = tokio::time::timeout(Duration::from_secs(60), command.arg("serve").output())
        .await
        .expect("tether exits in time")
        .unwrap();
    assert!(!output.status.success(), "started with a bad configuration");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

const AGENT: &str = "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n";

#[tokio::test]
async fn a_tool_naming_an_unconfigured_provider_is_refused_at_start_up() {
    let stderr = refused_with(&format!(
        "{AGENT}[[tools]]\nname = \"repos\"\ndescription = \"d\"\ninput_schema = {{ type = \"object\" }}\nhttp = {{ url = \"http://127.0.0.1:9/\" }}\nconnection = {{ provider = \"github\" }}\n"
    ))
    .await;
    assert!(stderr.contains("tools[0].connection.provider"), "{stderr}");
}

#[tokio::test]
async fn huge_durations_are_refused_naming_the_key() {
    for (config, key) in [
        (
            format!("[policy]\napproval_ttl_secs = {}\n{AGENT}", u64::MAX),
            "approval_ttl_secs",
        ),
        (
            format!("[policy]\nquestion_ttl_secs = {}\n{AGENT}", i64::MAX),
            "policy.question_ttl_secs",
        ),
        (
            format!("{AGENT}[agents.limits]\ntimeout_secs = {}\n", i64::MAX),
            "agents[0].limits.timeout_secs",
        ),
        (
            "[runtime]\nlease_secs = 1e300\nheartbeat_secs = 5\n".to_owned(),
            "runtime.lease_secs",
        ),
    ] {
        let stderr = refused_with(&config).await;
        assert!(stderr.contains(key), "{key}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[tokio::test]
async fn weak_or_missing_secrets_are_refused_naming_the_variable() {
    let stderr = refused_with_env(AGENT, &[("TETHER_JWT_SECRET", "only-twenty-bytes!!!")]).await;
    assert!(
        stderr.contains("TETHER_JWT_SECRET") && stderr.contains("32 bytes"),
        "{stderr}"
    );
    // Off an SQLite file there is nowhere to keep a generated secret. The
    // refusal comes before any attempt to reach the database.
    for url in ["postgres://127.0.0.1:1/none", "sqlite::memory:"] {
        let stderr = refused_with_env(
            AGENT,
            &[("TETHER_JWT_SECRET", ""), ("TETHER_DATABASE_URL", url)],
        )
        .await;
        assert!(
            stderr.contains("TETHER_JWT_SECRET") && stderr.contains("TETHER_JWKS_URL"),
            "{url}: {stderr}"
        );
    }
}

/// The API's reads and the writes share one database also when it lives in
/// memory (each pool opened on such a URL would be a database of its own).
#[tokio::test]
async fn an_in_memory_database_serves_reads_and_writes() {
    let server = Server::start_with(ServerOptions {
        env: vec![("TETHER_DATABASE_URL".into(), "sqlite::memory:".into())],
        role: "all",
        ..Default::default()
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "hello").await;
    server.wait_until_ended(&token, &run).await;
    let data = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { messages { role } } }",
            serde_json::json!({ "c": conversation }),
        )
        .await;
    assert_eq!(
        data["conversation"]["messages"],
        serde_json::json!([{ "role": "USER" }, { "role": "ASSISTANT" }])
    );
}
