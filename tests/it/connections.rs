//! Connections end to end: a tool call that lacks a connection pauses the
//! run with a login URL, a real OAuth 2.0 authorization server (started by
//! the test) gives consent, `completeConnection` resumes the run exactly
//! once, and the downstream service receives the bearer token.

use sea_orm::{ConnectionTrait, Database};
use serde_json::{Value, json};

use crate::downstream::Downstream;
use crate::oauth_server::{AuthServer, CLIENT_SECRET, CONFIDENTIAL_CLIENT};
use crate::support::{Server, ServerOptions, of_type};
use crate::tools::tool_calls;

/// base64 of 32 bytes: the test's `TETHER_ENCRYPTION_KEY`.
const KEY: &str = "dGV0aGVyLXRlc3QtZW5jcnlwdGlvbi1rZXktMzJieXQ=";

const PENDING: &str = "query($r: ID!) { pendingConnection(runId: $r) { id interactionId runId provider gap requiredScopes loginUrl expiresAt } }";
const COMPLETE: &str = "mutation($s: String!, $c: String, $e: String) { completeConnection(input: { state: $s, code: $c, error: $e }) { resumed run { id status } } }";
const CONNECTIONS: &str = "{ connections { provider scopes status expiresAt } }";

fn tool(name: &str, connection: &str, downstream: &Downstream) -> String {
    format!(
        "\n[[tools]]\nname = {name:?}\ndescription = \"Needs a connection\"\ninput_schema = {{ type = \"object\", properties = {{ text = {{ type = \"string\" }} }}, required = [\"text\"], additionalProperties = false }}\nrecovery = \"idempotent\"\nhttp = {{ url = \"{}/effect\" }}\nconnection = {connection}\n",
        downstream.base
    )
}

fn provider(name: &str, auth: &AuthServer, ttl_secs: u64) -> String {
    format!(
        "\n[[connections]]\nprovider = {name:?}\nmode = \"oauth2\"\nauthorize_url = \"{}\"\ntoken_url = \"{}\"\nclient_id = \"{}\"\nclient_secret_env = \"GITHUB_CLIENT_SECRET\"\nredirect_uri = \"http://localhost:5173/oauth/callback\"\nconsent_ttl_secs = {ttl_secs}\n",
        auth.authorize_url(),
        auth.token_url(),
        CONFIDENTIAL_CLIENT,
    )
}

fn config(downstream: &Downstream, auth: &AuthServer) -> String {
    let mut text = String::from(
        "default_agent = \"helper\"\n\n[runtime]\nlease_secs = 3\nheartbeat_secs = 0.5\ncheckpoint_ms = 40\npoll_ms = 200\n\n[[agents]]\nname = \"helper\"\nprovider = \"scripted\"\nstream_delay_ms = 0\ntools = [\"repos\", \"repos_admin\", \"acme_lookup\", \"brief\", \"demo_publish\", \"release\"]\n",
    );
    text.push_str(&tool(
        "repos",
        "{ provider = \"github\", scopes = [\"repo\"] }",
        downstream,
    ));
    text.push_str(&tool(
        "repos_admin",
        "{ provider = \"github\", scopes = [\"repo\", \"admin\"] }",
        downstream,
    ));
    // Gated as well: an approval first, then the connection.
    text.push_str(&tool(
        "release",
        "{ provider = \"github\", scopes = [\"repo\"] }",
        downstream,
    ));
    text.push_str("risk = \"publish\"\n");
    text.push_str(&tool("acme_lookup", "{ provider = \"acme\" }", downstream));
    text.push_str(&tool("brief", "{ provider = \"brief\" }", downstream));
    text.push_str(&provider("github", auth, 900));
    text.push_str(&provider("brief", auth, 1));
    text.push_str(
        "\n[[connections]]\nprovider = \"acme\"\nmode = \"token\"\ntoken_env = \"ACME_API_TOKEN\"\n",
    );
    text
}

async fn start(downstream: &Downstream, auth: &AuthServer, env: &[(&str, &str)]) -> Server {
    serve(config(downstream, auth), env).await
}

/// A Tether with workers of `config`, with the key and client secret.
async fn serve(config: String, env: &[(&str, &str)]) -> Server {
    serve_as("all", config, env).await
}

/// `serve` in the given role.
async fn serve_as(role: &'static str, config: String, env: &[(&str, &str)]) -> Server {
    let mut vars = vec![
        ("TETHER_ENCRYPTION_KEY".to_owned(), KEY.to_owned()),
        ("GITHUB_CLIENT_SECRET".to_owned(), CLIENT_SECRET.to_owned()),
        ("RUST_LOG".to_owned(), "debug".to_owned()),
    ];
    vars.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    Server::start_with(ServerOptions {
        config,
        env: vars,
        role,
    })
    .await
}

/// A downstream service, the authorization server, a Tether with
/// workers using both, ada's token and a conversation of hers.
struct Rig {
    downstream: Downstream,
    auth: AuthServer,
    server: Server,
    token: String,
    conversation: String,
}

impl Rig {
    async fn start() -> Rig {
        let downstream = Downstream::start().await;
        let auth = AuthServer::start().await;
        let server = start(&downstream, &auth, &[]).await;
        let token = server.token("acme", "ada");
        let conversation = server.create_conversation(&token).await;
        Rig {
            downstream,
            auth,
            server,
            token,
            conversation,
        }
    }
}

/// Sends `text`, waits for the run to wait for a connection, and returns
/// the run and its pending connection.
async fn paused(server: &Server, token: &str, conversation: &str, text: &str) -> (String, Value) {
    let (_, run) = server.send(token, conversation, text).await;
    server
        .wait_for_run(token, &run, |r| r["status"] == "WAITING_FOR_CONNECTION")
        .await;
    let pending =
        server.gql(token, PENDING, json!({ "r": run })).await["pendingConnection"].clone();
    assert!(pending.is_object(), "no pending connection for {run}");
    (run, pending)
}

/// The person consents at the authorization server and the front end
/// completes the connection: the run resumes.
async fn consent_to(server: &Server, auth: &AuthServer, token: &str, pending: &Value) {
    let (code, state) = auth.consent(pending["loginUrl"].as_str().unwrap()).await;
    let body = complete(server, token, &state, Some(&code), None).await;
    assert!(resumed(&body), "{body}");
}

/// `completeConnection`, returning the whole response body.
async fn complete(
    server: &Server,
    token: &str,
    state: &str,
    code: Option<&str>,
    error: Option<&str>,
) -> Value {
    server
        .post(
            Some(token),
            COMPLETE,
            json!({ "s": state, "c": code, "e": error }),
        )
        .await
        .1
}

fn resumed(body: &Value) -> bool {
    body["data"]["completeConnection"]["resumed"]
        .as_bool()
        .unwrap_or_else(|| panic!("completeConnection failed: {body}"))
}

fn bearer_of(downstream: &Downstream) -> Vec<String> {
    downstream
        .requests_to("/effect")
        .into_iter()
        .filter_map(|r| r.authorization)
        .collect()
}

#[tokio::test]
async fn a_missing_connection_pauses_for_consent_and_the_tool_gets_the_token() {
    let Rig {
        downstream,
        auth,
        mut server,
        token,
        conversation,
    } = Rig::start().await;
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"list\"}",
    )
    .await;
    assert_eq!(pending["id"], pending["interactionId"]);
    assert_eq!(pending["runId"], run.as_str());
    assert_eq!(pending["provider"], "github");
    assert_eq!(pending["gap"], "ABSENT");
    assert_eq!(pending["requiredScopes"], json!(["repo"]));
    let login_url = pending["loginUrl"].as_str().unwrap();
    assert!(login_url.starts_with(&auth.authorize_url()), "{login_url}");
    for parameter in [
        "code_challenge_method=S256",
        "response_type=code",
        &format!("client_id={CONFIDENTIAL_CLIENT}"),
    ] {
        assert!(login_url.contains(parameter), "{parameter} in {login_url}");
    }
    assert!(!login_url.contains("code_verifier"), "{login_url}");
    assert!(downstream.requests().is_empty(), "nothing ran yet");

    // The pause is a CONNECTION part, and its event pair.
    let parts = server
        .parts_of(
            &token,
            &conversation,
            "kind interactionId connection { provider gap status }",
        )
        .await;
    let part = parts.iter().find(|p| p["kind"] == "CONNECTION").unwrap();
    assert_eq!(part["interactionId"], pending["interactionId"]);
    assert_eq!(
        part["connection"],
        json!({ "provider": "github", "gap": "ABSENT", "status": "PENDING" })
    );

    // The person's browser: the authorization server redirects back with
    // a code and the state.
    let (code, state) = auth.consent(login_url).await;
    let first = complete(&server, &token, &state, Some(&code), None).await;
    assert!(resumed(&first), "{first}");
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["outcome"], "SUCCEEDED", "{}", calls[0]);
    let seen = downstream.requests_to("/effect");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key.as_deref(), calls[0]["idempotencyKey"].as_str());
    let bearer = seen[0].authorization.clone().expect("a bearer token");
    let access_token = bearer.strip_prefix("Bearer ").expect("a bearer token");
    assert!(access_token.len() > 10, "{bearer}");

    // Once resolved: no pending connection, a later completion resumes
    // nothing, and the part says so.
    let after = server.gql(&token, PENDING, json!({ "r": run })).await;
    assert!(after["pendingConnection"].is_null(), "{after}");
    assert!(!resumed(
        &complete(&server, &token, &state, Some(&code), None).await
    ));
    let events = server.all_events(&token, &conversation).await;
    assert_eq!(of_type(&events, "connection.requested").len(), 1);
    assert_eq!(of_type(&events, "connection.completed").len(), 1);
    let queued = of_type(&events, "run.queued");
    assert_eq!(queued.len(), 2, "queued at send and once on consent");

    // The caller's connections show scopes and status, never a token.
    let listed = server.gql(&token, CONNECTIONS, json!({})).await;
    let connections = listed["connections"].as_array().unwrap();
    assert_eq!(connections.len(), 1, "{listed}");
    assert_eq!(connections[0]["provider"], "github");
    assert_eq!(connections[0]["status"], "ACTIVE");
    assert!(
        connections[0]["scopes"]
            .as_array()
            .unwrap()
            .contains(&json!("repo"))
    );
    assert!(!listed.to_string().contains(access_token));
    let other = server.token("acme", "bob");
    let theirs = server.gql(&other, CONNECTIONS, json!({})).await;
    assert_eq!(
        theirs["connections"],
        json!([]),
        "another principal's are not shown"
    );

    // At rest the tokens are sealed.
    let db = Database::connect(server.database_url()).await.unwrap();
    let rows = db
        .query_all_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT access_token, refresh_token, key_id FROM connections",
        ))
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    let stored_access: String = rows[0].try_get("", "access_token").unwrap();
    assert!(!stored_access.contains(access_token));
    let key_id: String = rows[0].try_get("", "key_id").unwrap();
    assert!(!key_id.is_empty());
    db.close().await.unwrap();

    // A run of the tool now goes straight through with the stored token.
    let (_, again) = server
        .send(&token, &conversation, "/tool repos {\"text\": \"again\"}")
        .await;
    server.wait_until_ended(&token, &again).await;
    assert_eq!(bearer_of(&downstream), vec![bearer.clone(), bearer.clone()]);

    // Neither the token nor the key reaches the logs, even at debug.
    let logs = server.logs_after_exit().await;
    assert!(logs.contains("DEBUG"), "the run logged at debug level");
    for secret in [access_token, KEY, CLIENT_SECRET, code.as_str()] {
        assert!(!logs.contains(secret), "a secret in the logs: {secret}");
    }
}

#[tokio::test]
async fn each_gap_pauses_with_its_name_and_an_expired_token_is_refreshed_once() {
    let Rig {
        downstream,
        auth,
        server,
        token,
        conversation,
    } = Rig::start().await;
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"a\"}",
    )
    .await;
    consent_to(&server, &auth, &token, &pending).await;
    server.wait_until_ended(&token, &run).await;

    // Missing a scope.
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos_admin {\"text\": \"b\"}",
    )
    .await;
    assert_eq!(pending["gap"], "INSUFFICIENT_SCOPE");
    assert_eq!(pending["requiredScopes"], json!(["repo", "admin"]));
    consent_to(&server, &auth, &token, &pending).await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );

    // Expired, with a refresh token: two calls of one batch refresh once,
    // without pausing.
    let db = Database::connect(server.database_url()).await.unwrap();
    db.execute_unprepared("UPDATE connections SET expires_at = 1")
        .await
        .unwrap();
    let refreshes = auth.token_requests("refresh_token").await;
    let (_, run) = server
        .send(
            &token,
            &conversation,
            "/tool repos {\"text\": \"c\"}\n/tool repos_admin {\"text\": \"d\"}",
        )
        .await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(auth.token_requests("refresh_token").await, refreshes + 1);
    let calls = tool_calls(&server, &token, &run).await;
    assert!(
        calls.iter().all(|c| c["outcome"] == "SUCCEEDED"),
        "{calls:?}"
    );
    let bearers = bearer_of(&downstream);
    let last_two = &bearers[bearers.len() - 2..];
    assert_eq!(
        last_two[0], last_two[1],
        "both calls sent the refreshed token"
    );
    assert_ne!(last_two[0], bearers[0], "a new access token");

    // The server rotated the refresh token (and refuses the old one): the
    // next refresh works only if the new one was stored.
    db.execute_unprepared("UPDATE connections SET expires_at = 1")
        .await
        .unwrap();
    let (_, run) = server
        .send(&token, &conversation, "/tool repos {\"text\": \"rotated\"}")
        .await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    assert_eq!(auth.token_requests("refresh_token").await, refreshes + 2);
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "SUCCEEDED", "{}", calls[0]);

    // Expired with no refresh token.
    db.execute_unprepared("UPDATE connections SET expires_at = 1, refresh_token = NULL")
        .await
        .unwrap();
    let (_, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"e\"}",
    )
    .await;
    assert_eq!(pending["gap"], "EXPIRED");
    db.close().await.unwrap();
}

#[tokio::test]
async fn a_token_provider_sends_its_token_or_fails_the_call_naming_the_variable() {
    let Rig {
        downstream,
        auth,
        server,
        token,
        conversation,
    } = Rig::start().await;
    let (_, run) = server
        .send(&token, &conversation, "/tool acme_lookup {\"text\": \"x\"}")
        .await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(
        ended["status"], "COMPLETED",
        "the model hears the failure: {ended}"
    );
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls[0]["outcome"], "FAILED");
    let error = calls[0]["output"]["error"].as_str().unwrap();
    assert!(error.contains("token_env = ACME_API_TOKEN"), "{error}");
    assert_eq!(calls[0]["output"]["connection"]["gap"], "ABSENT");
    assert!(downstream.requests().is_empty());

    let with_token = start(
        &downstream,
        &auth,
        &[("ACME_API_TOKEN", "acme-static-token")],
    )
    .await;
    let token = with_token.token("acme", "ada");
    let conversation = with_token.create_conversation(&token).await;
    let (_, run) = with_token
        .send(&token, &conversation, "/tool acme_lookup {\"text\": \"y\"}")
        .await;
    with_token.wait_until_ended(&token, &run).await;
    assert_eq!(
        bearer_of(&downstream),
        vec!["Bearer acme-static-token".to_owned()]
    );
}

#[tokio::test]
async fn a_replayed_completion_resumes_once_and_strangers_get_one_not_found() {
    let Rig {
        downstream,
        auth,
        server,
        token,
        conversation,
    } = Rig::start().await;
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"a\"}",
    )
    .await;
    let (code, state) = auth.consent(pending["loginUrl"].as_str().unwrap()).await;

    // Input that is not one of code and error changes nothing.
    for (code, error) in [(None, None), (Some(code.as_str()), Some("access_denied"))] {
        let body = complete(&server, &token, &state, code, error).await;
        assert_eq!(
            body["errors"][0]["extensions"]["code"], "BAD_USER_INPUT",
            "{body}"
        );
    }
    // A code the authorization server refuses: a typed error, and the pause
    // stays open.
    let body = complete(&server, &token, &state, Some("not-a-code"), None).await;
    assert_eq!(
        body["errors"][0]["extensions"]["code"], "BAD_USER_INPUT",
        "{body}"
    );
    assert_eq!(body["errors"][0]["extensions"]["key"], "code", "{body}");
    let still = server.gql(&token, PENDING, json!({ "r": run })).await;
    assert_eq!(
        still["pendingConnection"]["interactionId"],
        pending["interactionId"]
    );

    // Strangers, a random state: the same NOT_FOUND, word for word. The
    // login URL (it carries the state) is shown to ada alone.
    let bob = server.token("acme", "bob");
    let eve = server.token("other", "ada");
    for stranger in [&bob, &eve] {
        let shown = server.gql(stranger, PENDING, json!({ "r": run })).await;
        assert!(shown["pendingConnection"].is_null(), "{shown}");
    }
    let mut refusals = Vec::new();
    for (caller, state) in [
        (&bob, state.as_str()),
        (&eve, state.as_str()),
        (&token, "random-state"),
    ] {
        let body = complete(&server, caller, state, Some(&code), None).await;
        refusals.push(body["errors"].clone());
    }
    assert_eq!(refusals[0][0]["message"], "not found");
    assert_eq!(refusals[0][0]["extensions"]["code"], "NOT_FOUND");
    assert!(refusals.iter().all(|r| r == &refusals[0]), "{refusals:?}");

    // Twice at once: one resumes.
    let (a, b) = tokio::join!(
        complete(&server, &token, &state, Some(&code), None),
        complete(&server, &token, &state, Some(&code), None)
    );
    assert_eq!(
        u8::from(resumed(&a)) + u8::from(resumed(&b)),
        1,
        "exactly one resumed: {a} {b}"
    );
    assert!(!resumed(
        &complete(&server, &token, &state, Some(&code), None).await
    ));
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let events = server.all_events(&token, &conversation).await;
    assert_eq!(of_type(&events, "connection.completed").len(), 1);
    assert_eq!(downstream.requests_to("/effect").len(), 1);

    // An expired consent: the run ends CONSENT_EXPIRED, and its state is
    // as unknown as a random one.
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool brief {\"text\": \"b\"}",
    )
    .await;
    let (code, state) = auth.consent(pending["loginUrl"].as_str().unwrap()).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "FAILED");
    assert_eq!(ended["endCause"], "CONSENT_EXPIRED");
    assert_eq!(ended["error"]["code"], "CONSENT_EXPIRED");
    assert!(
        ended["error"]["message"]
            .as_str()
            .unwrap()
            .contains("brief"),
        "{ended}"
    );
    let body = complete(&server, &token, &state, Some(&code), None).await;
    assert_eq!(body["errors"], refusals[0]);
}

#[tokio::test]
async fn declined_consent_fails_the_call_once_and_the_run_goes_on() {
    let Rig {
        downstream,
        auth,
        server,
        token,
        conversation,
    } = Rig::start().await;
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"a\"}",
    )
    .await;
    let login_url = pending["loginUrl"].as_str().unwrap();
    let (_, state) = auth.consent(login_url).await;
    let body = complete(&server, &token, &state, None, Some("access_denied")).await;
    assert!(resumed(&body), "{body}");
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["outcome"], "FAILED");
    let error = calls[0]["output"]["error"].as_str().unwrap();
    assert!(
        error.contains("declined") && error.contains("access_denied"),
        "{error}"
    );
    assert!(downstream.requests().is_empty());
    let events = server.all_events(&token, &conversation).await;
    assert_eq!(of_type(&events, "tool.failed").len(), 1);
}

#[tokio::test]
async fn a_pending_consent_survives_a_restart_and_a_disconnect_asks_again() {
    let Rig {
        downstream: _downstream,
        auth,
        mut server,
        token,
        conversation,
    } = Rig::start().await;
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"a\"}",
    )
    .await;
    server.terminate();
    server.exited().await;
    server.restart(&[]).await;
    let kept = server.gql(&token, PENDING, json!({ "r": run })).await;
    assert_eq!(kept["pendingConnection"], pending);
    consent_to(&server, &auth, &token, &pending).await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );

    let disconnect = "mutation { disconnect(provider: \"github\") }";
    assert_eq!(
        server.gql(&token, disconnect, json!({})).await["disconnect"],
        true
    );
    assert_eq!(
        server.gql(&token, disconnect, json!({})).await["disconnect"],
        false
    );
    assert_eq!(
        server.gql(&token, CONNECTIONS, json!({})).await["connections"],
        json!([])
    );
    let (_, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"b\"}",
    )
    .await;
    assert_eq!(pending["gap"], "ABSENT");
}

#[tokio::test]
async fn a_sealed_token_copied_into_another_tenants_row_does_not_open() {
    let Rig {
        downstream,
        auth,
        server,
        token: ada,
        conversation,
    } = Rig::start().await;
    let (run, pending) = paused(
        &server,
        &ada,
        &conversation,
        "/tool repos {\"text\": \"a\"}",
    )
    .await;
    consent_to(&server, &auth, &ada, &pending).await;
    server.wait_until_ended(&ada, &run).await;

    // Another tenant connects too, and then ada's sealed tokens are
    // copied into its row.
    let eve = server.token("other", "ada");
    let theirs = server.create_conversation(&eve).await;
    let (run, pending) = paused(&server, &eve, &theirs, "/tool repos {\"text\": \"b\"}").await;
    consent_to(&server, &auth, &eve, &pending).await;
    server.wait_until_ended(&eve, &run).await;
    assert_eq!(downstream.requests_to("/effect").len(), 2);
    let db = Database::connect(server.database_url()).await.unwrap();
    let copied = db
        .execute_unprepared(
            "UPDATE connections SET \
             access_token = (SELECT access_token FROM connections WHERE tenant = 'acme'), \
             refresh_token = (SELECT refresh_token FROM connections WHERE tenant = 'acme') \
             WHERE tenant = 'other'",
        )
        .await
        .unwrap();
    assert_eq!(copied.rows_affected(), 1);
    db.close().await.unwrap();
    let (_, pending) = paused(&server, &eve, &theirs, "/tool repos {\"text\": \"c\"}").await;
    assert_eq!(pending["gap"], "ABSENT", "the copied token does not open");
    assert_eq!(
        downstream.requests_to("/effect").len(),
        2,
        "nothing ran with it"
    );
}

#[tokio::test]
async fn a_disconnect_during_a_slow_refresh_stays_and_the_call_asks_for_consent() {
    let Rig {
        downstream,
        auth,
        server,
        token,
        conversation,
    } = Rig::start().await;
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"a\"}",
    )
    .await;
    consent_to(&server, &auth, &token, &pending).await;
    server.wait_until_ended(&token, &run).await;
    let sent = downstream.requests_to("/effect").len();

    // The token has expired; its refresh is held at the provider while
    // the person disconnects.
    let db = Database::connect(server.database_url()).await.unwrap();
    db.execute_unprepared("UPDATE connections SET expires_at = 1")
        .await
        .unwrap();
    db.close().await.unwrap();
    auth.set_refresh_delay(std::time::Duration::from_secs(2))
        .await;
    let refreshes = auth.token_requests("refresh_token").await;
    let (_, run) = server
        .send(&token, &conversation, "/tool repos {\"text\": \"b\"}")
        .await;
    let deadline = tokio::time::Instant::now() + crate::support::PATIENCE;
    while auth.token_requests("refresh_token").await == refreshes {
        assert!(tokio::time::Instant::now() < deadline, "no refresh came");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let disconnect = "mutation { disconnect(provider: \"github\") }";
    assert_eq!(
        server.gql(&token, disconnect, json!({})).await["disconnect"],
        true
    );

    // The refresh's answer comes back and is dropped: the call pauses for
    // a new consent, and the connection stays gone.
    server
        .wait_for_run(&token, &run, |r| r["status"] == "WAITING_FOR_CONNECTION")
        .await;
    let pending = server.gql(&token, PENDING, json!({ "r": run })).await;
    assert_eq!(pending["pendingConnection"]["gap"], "ABSENT", "{pending}");
    assert_eq!(
        server.gql(&token, CONNECTIONS, json!({})).await["connections"],
        json!([])
    );
    assert_eq!(
        downstream.requests_to("/effect").len(),
        sent,
        "the call sent nothing with the refreshed token"
    );
}

/// Two processes, one run each, both needing the same expired connection
/// at once, against a provider that lets each refresh token be used once:
/// one refresh, and both calls send a valid token.
#[tokio::test]
async fn two_processes_refresh_one_connection_once() {
    if !crate::support::on_postgres() {
        return;
    }
    let downstream = Downstream::start().await;
    let auth = AuthServer::start().await;
    // One run at a time in each process, so that the two runs below go to
    // two processes: the first holds its slot through its slow refresh.
    let one_each =
        config(&downstream, &auth).replacen("[runtime]\n", "[runtime]\nconcurrency = 1\n", 1);
    assert!(one_each.contains("concurrency = 1"), "{one_each}");
    let server = serve(one_each.clone(), &[]).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (run, pending) = paused(
        &server,
        &token,
        &conversation,
        "/tool repos {\"text\": \"consent\"}",
    )
    .await;
    consent_to(&server, &auth, &token, &pending).await;
    server.wait_until_ended(&token, &run).await;
    let _other = server.companion_with("worker", &one_each, &[]).await;
    let db = Database::connect(server.database_url()).await.unwrap();
    db.execute_unprepared("UPDATE connections SET expires_at = 1")
        .await
        .unwrap();
    db.close().await.unwrap();
    auth.set_refresh_delay(std::time::Duration::from_millis(1500))
        .await;
    let refreshes = auth.token_requests("refresh_token").await;
    let sent = downstream.requests_to("/effect").len();
    let mut runs = Vec::new();
    for text in ["first", "second"] {
        let conversation = server.create_conversation(&token).await;
        let message = format!("/tool repos {{\"text\": \"{text}\"}}");
        runs.push(server.send(&token, &conversation, &message).await.1);
    }
    for run in &runs {
        let ended = server.wait_until_ended(&token, run).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
    }
    assert_eq!(auth.token_requests("refresh_token").await, refreshes + 1);
    let requests = downstream.requests_to("/effect");
    assert_eq!(requests.len(), sent + 2);
    let bearers: Vec<&str> = requests[sent..]
        .iter()
        .map(|r| r.authorization.as_deref().unwrap_or_default())
        .collect();
    assert_eq!(bearers[0], bearers[1], "{bearers:?}");
    assert!(bearers[0].starts_with("Bearer "), "{bearers:?}");
}

/// A call that needs an approval and then a connection, both given
/// through a process whose clock is 10 minutes behind the one that asked
/// for the approval: the connection's interaction has the earlier id, and
/// the call still acts on it, so the downstream gets the request with the
/// bearer token.
#[tokio::test]
async fn an_approval_then_a_connection_through_a_process_ten_minutes_behind() {
    if !crate::support::on_postgres() {
        return;
    }
    let downstream = Downstream::start().await;
    let auth = AuthServer::start().await;
    let config = config(&downstream, &auth);
    let server = serve_as("api", config.clone(), &[]).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut on_time = server.companion_with("worker", &config, &[]).await;
    let (_, run) = server
        .send(&token, &conversation, "/tool release {\"text\": \"v2\"}")
        .await;
    server
        .wait_for_run(&token, &run, |r| r["status"] == "WAITING_FOR_APPROVAL")
        .await;
    let approvals = server
        .gql(
            &token,
            "query($r: ID!) { pendingApprovals(runId: $r) { interactionId } }",
            json!({ "r": run }),
        )
        .await;
    let approval = approvals["pendingApprovals"][0]["interactionId"]
        .as_str()
        .unwrap_or_else(|| panic!("no pending approval: {approvals}"))
        .to_owned();
    on_time.child.kill().await.unwrap();

    let behind = server
        .companion_with("all", &config, &[("TETHER_CLOCK_SKEW_MS", "-600000")])
        .await;
    let (_, decided) = server
        .post_at(
            &behind.base,
            Some(&token),
            "mutation($i: ID!) { decideApproval(input: {interactionId: $i, decision: ALLOW_ONCE}) { resumed } }",
            json!({ "i": approval }),
        )
        .await;
    assert_eq!(
        decided["data"]["decideApproval"]["resumed"], true,
        "{decided}"
    );
    server
        .wait_for_run(&token, &run, |r| r["status"] == "WAITING_FOR_CONNECTION")
        .await;
    let (_, pending) = server
        .post_at(&behind.base, Some(&token), PENDING, json!({ "r": run }))
        .await;
    let pending = pending["data"]["pendingConnection"].clone();
    let connection = pending["interactionId"].as_str().unwrap();
    // UUID v7 ids sort by the clock that made them: the later interaction
    // sorts first.
    assert!(connection < approval.as_str(), "{connection} < {approval}");
    let (code, state) = auth.consent(pending["loginUrl"].as_str().unwrap()).await;
    let (_, completed) = server
        .post_at(
            &behind.base,
            Some(&token),
            COMPLETE,
            json!({ "s": state, "c": code, "e": null }),
        )
        .await;
    assert!(resumed(&completed), "{completed}");

    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(&server, &token, &run).await;
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["outcome"], "SUCCEEDED", "{}", calls[0]);
    assert_eq!(calls[0]["attempt"], 1, "{}", calls[0]);
    let bearers = bearer_of(&downstream);
    assert_eq!(bearers.len(), 1, "requested once: {bearers:?}");
    assert!(bearers[0].starts_with("Bearer "), "{bearers:?}");
}
