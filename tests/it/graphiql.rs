//! The GraphiQL playground over real HTTP: its page and assets come from the
//! server itself, and `[api] playground = false` takes away the page and
//! introspection. (The browser test, `scripts/graphiql/e2e.mjs`, runs the
//! page offline in Chromium.)

use serde_json::json;

use crate::support::{Server, WsClient};

/// The `src` and `href` values of a page, in order.
fn references(page: &str) -> Vec<String> {
    let mut found = Vec::new();
    for attribute in ["src=\"", "href=\""] {
        let mut rest = page;
        while let Some(start) = rest.find(attribute) {
            let value = &rest[start + attribute.len()..];
            let end = value.find('"').expect("a closing quote");
            found.push(value[..end].to_owned());
            rest = &value[end..];
        }
    }
    found
}

/// The settings block the page hands its script.
fn settings(page: &str) -> serde_json::Value {
    let open = "<script type=\"application/json\" id=\"tether-graphiql-config\">";
    let start = page.find(open).expect("the settings block") + open.len();
    let end = start + page[start..].find("</script>").expect("its end");
    serde_json::from_str(&page[start..end]).expect("JSON settings")
}

#[tokio::test]
async fn graphiql_is_served_with_its_assets_from_the_server() {
    let server = Server::start().await;
    let response = server.get("/graphiql").await;
    assert_eq!(response.status().as_u16(), 200);
    let headers = response.headers().clone();
    assert_eq!(headers["content-type"], "text/html; charset=utf-8");
    assert_eq!(headers["cache-control"], "no-store");
    let policy = headers["content-security-policy"].to_str().unwrap();
    assert!(policy.contains("default-src 'none'"), "{policy}");
    assert!(policy.contains("script-src 'self'"), "{policy}");
    let page = response.text().await.unwrap();

    // Exactly one script and one stylesheet, both on this server.
    let references = references(&page);
    assert_eq!(references.len(), 2, "{page}");
    let mut kinds = Vec::new();
    for reference in &references {
        assert!(
            reference.starts_with("graphiql/assets/graphiql."),
            "a relative asset path: {reference}"
        );
        let response = server.get(&format!("/{reference}")).await;
        assert_eq!(response.status().as_u16(), 200, "{reference}");
        let content_type = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(
            response.headers()["cache-control"],
            "public, max-age=31536000, immutable"
        );
        assert_eq!(response.headers()["x-content-type-options"], "nosniff");
        let body = response.bytes().await.unwrap();
        assert!(body.len() > 10_000, "{reference}: {} bytes", body.len());
        // Built for production: no source map, no React development build.
        let text = String::from_utf8_lossy(&body);
        assert!(!text.contains("sourceMappingURL"), "{reference}");
        if reference.ends_with(".js") {
            assert_eq!(content_type, "text/javascript; charset=utf-8");
            assert!(!text.contains("react-dom.development"), "{reference}");
        } else {
            assert_eq!(content_type, "text/css; charset=utf-8");
        }
        kinds.push(content_type);
    }
    kinds.sort();
    assert_eq!(
        kinds,
        ["text/css; charset=utf-8", "text/javascript; charset=utf-8"]
    );

    // Another name under the assets' path is not served.
    let response = server
        .get("/graphiql/assets/graphiql.0000000000000000.js")
        .await;
    assert_eq!(response.status().as_u16(), 404);
    let response = server.get("/graphiql/assets/..%2F..%2FCargo.toml").await;
    assert_eq!(response.status().as_u16(), 404);

    // Without a token the page carries none; the schema is introspectable.
    assert_eq!(
        settings(&page),
        json!({ "endpoint": "graphql", "token": null })
    );
    let token = server.token("acme", "ada");
    let data = server
        .gql(&token, "{ __schema { queryType { name } } }", json!({}))
        .await;
    assert_eq!(data["__schema"]["queryType"]["name"], "Query");
}

#[tokio::test]
async fn a_token_in_the_url_reaches_the_page_only_when_it_is_shaped_like_a_jwt() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let page = server
        .get(&format!("/graphiql?token={token}"))
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(settings(&page)["token"], token.as_str());

    for hostile in [
        "%3C%2Fscript%3E%3Cscript%3Ealert(1)%3C%2Fscript%3E",
        "a%22%2C%22endpoint%22%3A%22https%3A%2F%2Fevil.example",
        "a.b%26c",
        "a%20b",
    ] {
        let response = server.get(&format!("/graphiql?token={hostile}")).await;
        assert_eq!(response.status().as_u16(), 200, "{hostile}");
        let page = response.text().await.unwrap();
        assert_eq!(
            settings(&page)["token"],
            serde_json::Value::Null,
            "{hostile}"
        );
        assert_eq!(settings(&page)["endpoint"], "graphql", "{hostile}");
        assert!(
            !page.contains("alert(1)") && !page.contains("evil.example"),
            "{hostile}"
        );
        assert_eq!(page.matches("<script").count(), 2, "{hostile}");
    }
}

#[tokio::test]
async fn without_the_playground_graphiql_is_gone_and_introspection_refused() {
    let server = Server::with_api("playground = false").await;
    let on = Server::start().await;
    let page = on.get("/graphiql").await.text().await.unwrap();
    for path in references(&page)
        .iter()
        .map(|r| format!("/{r}"))
        .chain(["/graphiql".to_owned(), "/graphiql?token=a.b.c".to_owned()])
    {
        let response = server.get(&path).await;
        assert_eq!(response.status().as_u16(), 404, "{path}");
    }

    let token = server.token("acme", "ada");
    for query in [
        "{ __schema { types { name } } }",
        "{ __type(name: \"Run\") { fields { name } } }",
    ] {
        let (status, body) = server.post(Some(&token), query, json!({})).await;
        assert!(
            body["data"].is_null() || body.get("data").is_none(),
            "{query}: {body}"
        );
        let error = &body["errors"][0];
        assert_eq!(
            error["extensions"]["code"], "BAD_USER_INPUT",
            "{query}: {body}"
        );
        assert_eq!(
            error["message"], "introspection is disabled on this server",
            "{query}: {body}"
        );
        assert!(status == 200 || status == 400, "{query}: {status}");
    }
    // Over a WebSocket too, where the same schema answers.
    let mut socket = WsClient::connect(&server, &token).await;
    socket
        .subscribe("1", "{ __schema { queryType { name } } }", json!({}))
        .await;
    let answer = socket.next_json().await.expect("an answer");
    assert_eq!(answer["id"], "1", "{answer}");
    let errors = match answer["type"].as_str() {
        Some("error") => &answer["payload"],
        _ => &answer["payload"]["errors"],
    };
    assert_eq!(
        errors[0]["message"], "introspection is disabled on this server",
        "{answer}"
    );
    assert!(answer["payload"]["data"]["__schema"].is_null(), "{answer}");

    // Everything else is served as before, `__typename` included.
    let data = server
        .gql(&token, "{ agents { name __typename } }", json!({}))
        .await;
    assert_eq!(data["agents"][0]["name"], "demo");
    assert_eq!(data["agents"][0]["__typename"], "Agent");
}
