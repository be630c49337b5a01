//! Authentication on HTTP and WebSocket, and tenant isolation.

use std::time::Duration;

use base64::Engine;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::support::{BASE_CONFIG, Ending, SECRET, Server, ServerOptions, WsClient};

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn sign(claims: Value, secret: &str) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()).unwrap(),
    )
    .unwrap()
}

/// Tokens the server must refuse, with what is wrong with each: the reason
/// the refusal gives.
fn bad_tokens() -> Vec<(&'static str, String)> {
    let b64 = |v: Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    let exp = now() + 600;
    vec![
        (
            "bad signature",
            sign(
                json!({"sub": "ada", "tenant": "acme", "exp": exp}),
                "not-the-secret",
            ),
        ),
        (
            "expired",
            sign(
                json!({"sub": "ada", "tenant": "acme", "exp": now() - 30}),
                SECRET,
            ),
        ),
        (
            "algorithm not accepted",
            format!(
                "{}.{}.",
                b64(json!({"alg": "none", "typ": "JWT"})),
                b64(json!({"sub": "ada", "tenant": "acme", "exp": exp}))
            ),
        ),
        (
            "missing claim tenant",
            sign(json!({"sub": "ada", "exp": exp}), SECRET),
        ),
        (
            "missing claim sub",
            sign(json!({"tenant": "acme", "exp": exp}), SECRET),
        ),
        (
            "missing claim exp",
            sign(json!({"sub": "ada", "tenant": "acme"}), SECRET),
        ),
        (
            "invalid claim tenant",
            sign(json!({"sub": "ada", "tenant": 7, "exp": exp}), SECRET),
        ),
        ("malformed token", "not.a.jwt".to_owned()),
    ]
}

#[tokio::test]
async fn http_refuses_missing_and_bad_tokens_with_401() {
    let server = Server::start().await;
    let (status, body) = server.post(None, "{ me { tenant } }", json!({})).await;
    assert_eq!(status, 401);
    assert_eq!(body["errors"][0]["extensions"]["code"], "UNAUTHENTICATED");
    assert_eq!(body["errors"][0]["message"], "unauthenticated");
    assert_eq!(body["errors"][0]["extensions"]["reason"], "missing token");
    for (what, token) in bad_tokens() {
        let (status, body) = server
            .post(Some(&token), "{ me { tenant } }", json!({}))
            .await;
        assert_eq!(status, 401, "{what}: {body}");
        assert_eq!(
            body["errors"][0]["extensions"]["code"], "UNAUTHENTICATED",
            "{what}"
        );
        assert_eq!(body["errors"][0]["message"], "unauthenticated", "{what}");
        assert_eq!(body["errors"][0]["extensions"]["reason"], what, "{body}");
        assert!(body.get("data").is_none(), "{what}");
    }
    // A mutation with a bad token stores nothing either.
    let (status, _) = server
        .post(
            Some(&bad_tokens()[0].1),
            "mutation { createConversation(input: {}) { id } }",
            json!({}),
        )
        .await;
    assert_eq!(status, 401);
    let token = server.token("acme", "ada");
    let data = server
        .gql(&token, "{ conversations { nodes { id } } }", json!({}))
        .await;
    assert_eq!(data["conversations"]["nodes"], json!([]));
}

/// The reason of a refused request with this `Authorization` header (or
/// none), over POST and GET alike.
async fn refusal_reason(server: &Server, authorization: Option<&str>) -> String {
    let query = "{ me { tenant } }";
    let mut post = server
        .http()
        .post(format!("{}/graphql", server.base))
        .json(&json!({ "query": query }));
    let mut get = server.http().get(format!(
        "{}/graphql?query=%7B%20me%20%7B%20tenant%20%7D%20%7D",
        server.base
    ));
    if let Some(value) = authorization {
        post = post.header("Authorization", value);
        get = get.header("Authorization", value);
    }
    let mut reasons = Vec::new();
    for request in [post, get] {
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), 401, "{authorization:?}");
        let body: Value = response.json().await.unwrap();
        let error = &body["errors"][0];
        assert_eq!(error["message"], "unauthenticated", "{body}");
        assert_eq!(error["extensions"]["code"], "UNAUTHENTICATED", "{body}");
        reasons.push(error["extensions"]["reason"].as_str().unwrap().to_owned());
    }
    assert_eq!(reasons[0], reasons[1], "POST and GET agree");
    reasons.remove(0)
}

#[tokio::test]
async fn every_refusal_gives_its_reason_and_logs_it_at_debug() {
    let server = Server::start_with(ServerOptions {
        config: format!(
            "{BASE_CONFIG}\n[auth]\nissuer = \"https://idp.test\"\naudience = \"tether\"\n"
        ),
        env: vec![("RUST_LOG".into(), "warn,tether::api::auth=debug".into())],
        ..Default::default()
    })
    .await;
    let exp = now() + 600;
    let claims = |iss: &str, aud: &str| json!({"sub": "ada", "tenant": "acme", "exp": exp, "iss": iss, "aud": aud});
    let bearer = |claims: Value, secret: &str| format!("Bearer {}", sign(claims, secret));
    let cases = [
        (None, "missing token"),
        (Some("Bearer ".to_owned()), "missing token"),
        (Some("Basic YWRhOnB3".to_owned()), "not a bearer token"),
        (Some("Bearer not.a.jwt".to_owned()), "malformed token"),
        (
            Some(bearer(
                claims("https://idp.test", "tether"),
                "not-the-secret",
            )),
            "bad signature",
        ),
        (
            Some(bearer(claims("https://idp.test", "someone-else"), SECRET)),
            "wrong audience",
        ),
        (
            Some(bearer(claims("https://evil.test", "tether"), SECRET)),
            "wrong issuer",
        ),
        (
            Some(bearer(
                json!({"sub": "ada", "tenant": "acme", "exp": now() - 30, "iss": "https://idp.test", "aud": "tether"}),
                SECRET,
            )),
            "expired",
        ),
        (
            Some(bearer(
                json!({"sub": "ada", "exp": exp, "iss": "https://idp.test", "aud": "tether"}),
                SECRET,
            )),
            "missing claim tenant",
        ),
        (
            Some(bearer(
                json!({"sub": "ada", "tenant": "acme", "exp": exp, "iss": "https://idp.test"}),
                SECRET,
            )),
            "missing claim aud",
        ),
    ];
    for (authorization, reason) in &cases {
        assert_eq!(
            refusal_reason(&server, authorization.as_deref()).await,
            *reason,
            "{authorization:?}"
        );
        server.wait_for_log(&format!("reason={reason}"), 1).await;
    }
    let (status, _) = server
        .post(
            Some(&sign(claims("https://idp.test", "tether"), SECRET)),
            "{ me { tenant } }",
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "a good token still gets in");
}

#[tokio::test]
async fn websocket_closes_4403_for_missing_and_bad_tokens() {
    let server = Server::start().await;
    for protocol in ["graphql-transport-ws", "graphql-ws"] {
        let mut client = WsClient::open(&server, protocol).await;
        client.init(json!({})).await;
        assert_eq!(
            client.ending().await,
            Ending::Closed(4403, "forbidden".into()),
            "{protocol}"
        );
        for (what, token) in bad_tokens() {
            let mut client = WsClient::open(&server, protocol).await;
            client
                .init(json!({ "Authorization": format!("Bearer {token}") }))
                .await;
            match client.ending().await {
                Ending::Closed(4403, _) => {}
                other => panic!("{protocol} {what}: {other:?}"),
            }
        }
    }
    // The payload key may come in any letter case.
    let token = server.token("acme", "ada");
    let mut client = WsClient::open(&server, "graphql-transport-ws").await;
    client
        .init(json!({ "authorization": format!("Bearer {token}") }))
        .await;
    assert_eq!(client.next_json().await.unwrap()["type"], "connection_ack");
}

#[tokio::test]
async fn websocket_closes_4403_when_the_token_expires_while_open() {
    let server = Server::start().await;
    let token = server.token_for("acme", "ada", Duration::from_secs(2));
    let mut client = WsClient::connect(&server, &token).await;
    let conversation = server
        .create_conversation(&server.token("acme", "ada"))
        .await;
    client
        .subscribe(
            "1",
            "subscription($c: ID!) { conversationEvents(conversationId: $c) { type } }",
            json!({ "c": conversation }),
        )
        .await;
    match client.ending().await {
        Ending::Closed(4403, reason) => assert!(reason.contains("expired"), "{reason}"),
        other => panic!("expected 4403, got {other:?}"),
    }
}

#[tokio::test]
async fn websocket_without_connection_init_is_closed_4408() {
    let config = format!("{}\n", crate::support::BASE_CONFIG)
        .replace("[api]\n", "[api]\nws_init_timeout_secs = 1\n");
    let server = Server::start_with(crate::support::ServerOptions {
        config,
        ..Default::default()
    })
    .await;
    let mut client = WsClient::open(&server, "graphql-transport-ws").await;
    match client.ending().await {
        Ending::Closed(4408, _) => {}
        other => panic!("expected 4408, got {other:?}"),
    }
}

#[tokio::test]
async fn another_tenant_sees_exactly_what_a_random_id_gets() {
    let server = Server::start().await;
    let alice = server.token("acme", "alice");
    let bob = server.token("globex", "bob");
    let conversation = server.create_conversation(&alice).await;
    let (message, run) = server.send(&alice, &conversation, "secret plans").await;
    let part = server
        .gql(
            &alice,
            "query($m: ID!) { message(id: $m) { parts { id } } }",
            json!({ "m": message }),
        )
        .await["message"]["parts"][0]["id"]
        .clone();
    let random = uuid::Uuid::now_v7().to_string();

    // Nullable lookups: null and no error, for theirs and for nothing.
    for (field, id) in [
        ("conversation", conversation.as_str()),
        ("message", message.as_str()),
        ("run", run.as_str()),
        ("part", part.as_str().unwrap()),
    ] {
        let query = format!("query($id: ID!) {{ {field}(id: $id) {{ id }} }}");
        for probe in [id, random.as_str(), "not-an-id"] {
            let (status, body) = server
                .post(Some(&bob), &query, json!({ "id": probe }))
                .await;
            assert_eq!(status, 200);
            assert_eq!(body, json!({ "data": { field: null } }), "{field} {probe}");
        }
    }

    // Everything else: the same NOT_FOUND, whose text never names the id.
    let not_found = |body: &Value| -> Value {
        let err = &body["errors"][0];
        json!({ "message": err["message"], "extensions": err["extensions"] })
    };
    let expected = json!({ "message": "not found", "extensions": { "code": "NOT_FOUND" } });
    let operations = [
        "query($id: ID!) { events(conversationId: $id) { hasMore } }",
        "mutation($id: ID!) { sendMessage(input: {conversationId: $id, text: \"hi\"}) { run { id } } }",
        "mutation($id: ID!) { cancelRun(runId: $id) { id } }",
    ];
    for query in operations {
        let theirs = if query.contains("cancelRun") {
            &run
        } else {
            &conversation
        };
        for probe in [theirs.as_str(), random.as_str(), "not-an-id"] {
            let (_, body) = server.post(Some(&bob), query, json!({ "id": probe })).await;
            assert_eq!(not_found(&body), expected, "{query} {probe}");
            assert!(!body.to_string().contains(probe), "the id leaked: {body}");
        }
    }

    // Bob's conversations list stays empty; Alice's data is untouched.
    let data = server
        .gql(&bob, "{ conversations { nodes { id } } }", json!({}))
        .await;
    assert_eq!(data["conversations"]["nodes"], json!([]));
    let events = server.all_events(&alice, &conversation).await;
    assert_eq!(events.len(), 2);
    let data = server
        .gql(
            &alice,
            "query($r: ID!) { run(id: $r) { status } }",
            json!({ "r": run }),
        )
        .await;
    assert_eq!(data["run"]["status"], "QUEUED");

    // Subscriptions: the same refusal for theirs and for nothing.
    let mut client = WsClient::connect(&server, &bob).await;
    for (i, probe) in [conversation.as_str(), random.as_str()].iter().enumerate() {
        let id = format!("s{i}");
        client
            .subscribe(
                &id,
                "subscription($c: ID!) { conversationEvents(conversationId: $c, after: \"0000000000000000\") { type } }",
                json!({ "c": probe }),
            )
            .await;
        let payload = client.next_event(&id).await;
        let errors = &payload["errors"];
        assert_eq!(errors[0]["message"], "not found", "{payload}");
        assert_eq!(errors[0]["extensions"]["code"], "NOT_FOUND", "{payload}");
        assert!(payload["data"].is_null(), "{payload}");
    }
    client
        .subscribe(
            "r",
            "subscription($r: ID!) { runEvents(runId: $r, after: \"0000000000000000\") { type } }",
            json!({ "r": run }),
        )
        .await;
    let payload = client.next_event("r").await;
    assert_eq!(
        payload["errors"][0]["extensions"]["code"], "NOT_FOUND",
        "{payload}"
    );
}

#[tokio::test]
async fn a_token_expiring_near_the_end_of_time_neither_panics_nor_wedges_the_socket() {
    let server = Server::start().await;
    let token = sign(
        json!({"sub": "ada", "tenant": "acme", "exp": i64::MAX}),
        SECRET,
    );
    let (status, body) = server
        .post(Some(&token), "{ me { tenant } }", json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["me"]["tenant"], "acme");
    let mut client = WsClient::connect(&server, &token).await;
    for id in ["1", "2"] {
        client
            .subscribe(id, "{ me { principal } }", json!({}))
            .await;
        assert_eq!(
            client.next_event(id).await["data"]["me"]["principal"],
            "ada"
        );
    }
    // The server is still up for everyone else.
    let data = server
        .gql(
            &server.token("acme", "bob"),
            "{ me { principal } }",
            json!({}),
        )
        .await;
    assert_eq!(data["me"]["principal"], "bob");
}

/// The development secret that was once built in; no build accepts it now.
const FORMER_DEVELOPMENT_SECRET: &str = "tether-development-secret-do-not-use-in-production";

#[tokio::test]
async fn without_a_configured_secret_an_sqlite_server_generates_one_that_tether_token_shares() {
    use crate::support::{ServerOptions, TestDb, tether_command};
    let dir = std::env::temp_dir().join(format!("tether-it-secret-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.join("tether.db").display());
    let env = vec![
        ("TETHER_JWT_SECRET".to_owned(), String::new()),
        ("TETHER_DATABASE_URL".to_owned(), url.clone()),
    ];
    let server = Server::start_with(ServerOptions {
        env: env.clone(),
        ..Default::default()
    })
    .await;
    let secret_file = dir.join("tether.db.jwt-secret");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&secret_file)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the secret file is private");
    }

    // `tether token` (the README's GraphiQL walk) signs with the same file.
    let db = TestDb::new().await;
    let mut command = tether_command(&db, crate::support::BASE_CONFIG, &dir);
    for (key, value) in &env {
        command.env(key, value);
    }
    let output = command
        .args(["token", "--tenant", "acme", "--sub", "ada"])
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let token = String::from_utf8(output.stdout).unwrap().trim().to_owned();
    let (status, body) = server
        .post(Some(&token), "{ me { tenant } }", json!({}))
        .await;
    assert_eq!(status, 200, "{body}");

    // No fixed secret gets in: not the former built-in one, not the tests'.
    for (what, secret) in [
        ("the former development secret", FORMER_DEVELOPMENT_SECRET),
        ("the test suite's secret", SECRET),
    ] {
        let forged = sign(
            json!({"sub": "ada", "tenant": "acme", "exp": now() + 600}),
            secret,
        );
        let (status, _) = server
            .post(Some(&forged), "{ me { tenant } }", json!({}))
            .await;
        assert_eq!(status, 401, "{what}");
    }
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
