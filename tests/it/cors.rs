//! CORS: a page served from a configured origin may call the API, its
//! preflight answered and every answer, refusals included, readable; other
//! origins get no CORS headers, and with no origins configured a preflight
//! is refused as before.

use futures_util::{SinkExt, StreamExt};
use reqwest::{Method, Response};
use serde_json::json;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;

use crate::support::{PATIENCE, Server, TestDb, base_config_with_api, tether_command};

const ALLOWED: &str = "http://localhost:5173";

async fn server_allowing(origins: &str) -> Server {
    Server::with_api(&format!("cors_origins = {origins}")).await
}

/// What a browser sends before a cross-origin POST with a bearer token.
async fn preflight(server: &Server, origin: &str) -> Response {
    server
        .http()
        .request(Method::OPTIONS, format!("{}/graphql", server.base))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type",
        )
        .send()
        .await
        .unwrap()
}

fn header<'a>(response: &'a Response, name: &str) -> Option<&'a str> {
    response.headers().get(name).map(|v| v.to_str().unwrap())
}

/// The comma-separated items of a header, lower case.
fn items(response: &Response, name: &str) -> Vec<String> {
    header(response, name)
        .unwrap_or_default()
        .split(',')
        .map(|item| item.trim().to_ascii_lowercase())
        .filter(|item| !item.is_empty())
        .collect()
}

async fn post_from(server: &Server, origin: &str, token: Option<&str>, body: String) -> Response {
    let mut request = server
        .http()
        .post(format!("{}/graphql", server.base))
        .header("origin", origin)
        .header("content-type", "application/json")
        .body(body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn a_preflight_from_a_configured_origin_is_allowed() {
    let server = server_allowing(r#"["https://app.example.com", "http://localhost:5173"]"#).await;
    let response = preflight(&server, ALLOWED).await;
    assert!(
        response.status().is_success(),
        "status {}",
        response.status()
    );
    assert_eq!(
        header(&response, "access-control-allow-origin"),
        Some(ALLOWED)
    );
    let methods = items(&response, "access-control-allow-methods");
    for method in ["get", "post", "options"] {
        assert!(methods.contains(&method.to_owned()), "{methods:?}");
    }
    let headers = items(&response, "access-control-allow-headers");
    for name in ["authorization", "content-type", "last-event-id"] {
        assert!(headers.contains(&name.to_owned()), "{headers:?}");
    }
    // Bearer tokens, not cookies: no credentials mode.
    assert_eq!(header(&response, "access-control-allow-credentials"), None);
    // Caches keep answers for different origins apart.
    assert!(
        items(&response, "vary").contains(&"origin".to_owned()),
        "{:?}",
        header(&response, "vary")
    );

    // Each configured origin is answered as itself.
    let response = preflight(&server, "https://app.example.com").await;
    assert_eq!(
        header(&response, "access-control-allow-origin"),
        Some("https://app.example.com")
    );
}

#[tokio::test]
async fn another_origin_gets_no_cors_headers() {
    let server = server_allowing(r#"["http://localhost:5173"]"#).await;
    for origin in [
        "http://localhost:5174",
        "https://localhost:5173",
        "http://evil.example",
        "null",
    ] {
        let response = preflight(&server, origin).await;
        assert_eq!(
            header(&response, "access-control-allow-origin"),
            None,
            "{origin}"
        );
        let token = server.token("acme", "ada");
        let response = post_from(
            &server,
            origin,
            Some(&token),
            json!({ "query": "{ me { tenant } }" }).to_string(),
        )
        .await;
        // The server answers (CORS is the browser's to enforce), but gives
        // the page no leave to read the answer.
        assert_eq!(response.status(), 200, "{origin}");
        assert_eq!(
            header(&response, "access-control-allow-origin"),
            None,
            "{origin}"
        );
    }
}

#[tokio::test]
async fn every_answer_to_a_configured_origin_is_readable_refusals_included() {
    let server = server_allowing(r#"["http://localhost:5173"]"#).await;
    let token = server.token("acme", "ada");
    let query = json!({ "query": "{ me { tenant } }" }).to_string();

    let response = post_from(&server, ALLOWED, Some(&token), query.clone()).await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        header(&response, "access-control-allow-origin"),
        Some(ALLOWED)
    );
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["data"]["me"]["tenant"], "acme", "{body}");

    // The 401 the handler gives itself, so that the page can tell the user
    // to sign in again.
    let response = post_from(&server, ALLOWED, None, query.clone()).await;
    assert_eq!(response.status(), 401);
    assert_eq!(
        header(&response, "access-control-allow-origin"),
        Some(ALLOWED)
    );
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "UNAUTHENTICATED");
    let response = post_from(&server, ALLOWED, Some("not-a-token"), query).await;
    assert_eq!(response.status(), 401);
    assert_eq!(
        header(&response, "access-control-allow-origin"),
        Some(ALLOWED)
    );

    // The 413 for a body over max_request_bytes (65536 in the base
    // configuration).
    let big = json!({ "query": "{ me { tenant } }", "variables": { "pad": "x".repeat(70_000) } });
    let response = post_from(&server, ALLOWED, Some(&token), big.to_string()).await;
    assert_eq!(response.status(), 413);
    assert_eq!(
        header(&response, "access-control-allow-origin"),
        Some(ALLOWED)
    );

    // A query over GET.
    let response = server
        .http()
        .get(format!(
            "{}/graphql?query=%7Bme%7Btenant%7D%7D",
            server.base
        ))
        .header("origin", ALLOWED)
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        header(&response, "access-control-allow-origin"),
        Some(ALLOWED)
    );
}

#[tokio::test]
async fn subscriptions_still_upgrade_behind_the_cors_layer() {
    let server = server_allowing(r#"["http://localhost:5173"]"#).await;
    let token = server.token("acme", "ada");
    let mut request = format!("ws://{}/graphql", server.addr)
        .into_client_request()
        .unwrap();
    let headers = request.headers_mut();
    headers.insert(
        "sec-websocket-protocol",
        HeaderValue::from_static("graphql-transport-ws"),
    );
    headers.insert("origin", HeaderValue::from_static(ALLOWED));
    let (mut socket, response) = tokio_tungstenite::connect_async(request).await.unwrap();
    assert_eq!(response.status(), 101);
    socket
        .send(
            json!({
                "type": "connection_init",
                "payload": { "Authorization": format!("Bearer {token}") },
            })
            .to_string()
            .into(),
        )
        .await
        .unwrap();
    let ack = tokio::time::timeout(PATIENCE, socket.next())
        .await
        .expect("connection_ack in time")
        .expect("the socket stays open")
        .unwrap();
    let ack: serde_json::Value = serde_json::from_str(ack.to_text().unwrap()).unwrap();
    assert_eq!(ack["type"], "connection_ack", "{ack}");
}

#[tokio::test]
async fn without_cors_origins_a_preflight_is_not_allowed() {
    let server = Server::start().await;
    let response = preflight(&server, ALLOWED).await;
    assert_eq!(response.status(), 405);
    assert_eq!(header(&response, "access-control-allow-origin"), None);
    assert_eq!(header(&response, "access-control-allow-methods"), None);

    let token = server.token("acme", "ada");
    let response = post_from(
        &server,
        ALLOWED,
        Some(&token),
        json!({ "query": "{ me { tenant } }" }).to_string(),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "access-control-allow-origin"), None);
}

#[tokio::test]
async fn a_wildcard_or_a_url_with_a_path_is_refused_at_start_up() {
    for (origins, key, said) in [
        (r#"["*"]"#, "api.cors_origins[0]", "list each origin"),
        (
            r#"["http://localhost:5173", "http://localhost:5173/app"]"#,
            "api.cors_origins[1]",
            "no path",
        ),
    ] {
        let config = base_config_with_api(&format!("cors_origins = {origins}"));
        let db = TestDb::new().await;
        let output = tokio::time::timeout(
            PATIENCE,
            tether_command(&db, &config, &std::env::temp_dir())
                .arg("serve")
                .output(),
        )
        .await
        .expect("tether exits in time")
        .unwrap();
        assert!(!output.status.success(), "{origins}: started");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(key), "{origins}: {stderr}");
        assert!(stderr.contains(said), "{origins}: {stderr}");
    }
}
