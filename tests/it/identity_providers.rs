//! Tokens from identity providers (Auth0, Clerk, Supabase, Cognito,
//! Keycloak): RS256, ES256 and EdDSA signatures checked against a JWKS that
//! a fake provider in the test serves, with its keys made by the test. The
//! issuer, audience, `nbf` and the configured claim names are held to; a
//! rotated key is picked up; nothing else gets in, on HTTP (401) or
//! WebSocket (4403).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use base64::Engine as _;
use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::support::{Ending, PATIENCE, SECRET, Server, ServerOptions, WsClient};

const ISSUER: &str = "https://idp.example.test/";
const AUDIENCE: &str = "tether-api";

/// A signing key the fake provider publishes (or not).
struct Key {
    kid: String,
    alg: Algorithm,
    encoding: EncodingKey,
    jwk: Value,
}

fn random_bytes() -> [u8; 32] {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).unwrap();
    bytes
}

impl Key {
    fn new(kid: &str, alg: Algorithm, encoding: EncodingKey) -> Key {
        let mut jwk = Jwk::from_encoding_key(&encoding, alg).unwrap();
        jwk.common.key_id = Some(kid.to_owned());
        Key {
            kid: kid.to_owned(),
            alg,
            encoding,
            jwk: serde_json::to_value(jwk).unwrap(),
        }
    }

    fn rsa(kid: &str) -> Key {
        use rsa::pkcs1::EncodeRsaPrivateKey;
        use rsa::{Generate, PrivateKey};
        let key = PrivateKey::generate();
        let der = key.to_pkcs1_der().unwrap();
        Key::new(
            kid,
            Algorithm::RS256,
            EncodingKey::from_rsa_der(der.as_bytes()),
        )
    }

    fn ec(kid: &str) -> Key {
        use p256::pkcs8::EncodePrivateKey;
        let key = p256::SecretKey::from_slice(&random_bytes()).unwrap();
        let der = key.to_pkcs8_der().unwrap();
        Key::new(
            kid,
            Algorithm::ES256,
            EncodingKey::from_ec_der(der.as_bytes()),
        )
    }

    fn ed(kid: &str) -> Key {
        use ed25519_dalek::pkcs8::EncodePrivateKey;
        let key = ed25519_dalek::SigningKey::from_bytes(&random_bytes());
        let der = key.to_pkcs8_der().unwrap();
        // jsonwebtoken derives JWKs only from the shortest PKCS#8 form; this
        // one carries the public key too, so the JWK is written out here.
        let x =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key.verifying_key().as_bytes());
        Key {
            kid: kid.to_owned(),
            alg: Algorithm::EdDSA,
            encoding: EncodingKey::from_ed_der(der.as_bytes()),
            jwk: json!({ "kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid }),
        }
    }

    fn sign(&self, claims: &Value) -> String {
        self.sign_as(self.alg, &self.kid, claims)
    }

    fn sign_as(&self, alg: Algorithm, kid: &str, claims: &Value) -> String {
        let mut header = Header::new(alg);
        header.kid = Some(kid.to_owned());
        jsonwebtoken::encode(&header, claims, &self.encoding).unwrap()
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// What a provider such as Auth0 puts in an access token, with the tenant
/// in `org_id`.
fn claims() -> Value {
    json!({
        "iss": ISSUER,
        "aud": [AUDIENCE, "https://idp.example.test/userinfo"],
        "sub": "auth0|ada",
        "org_id": "org_acme",
        "iat": now(),
        "nbf": now() - 5,
        "exp": now() + 600,
    })
}

fn with(mut claims: Value, field: &str, value: Value) -> Value {
    match value {
        Value::Null => {
            claims.as_object_mut().unwrap().remove(field);
        }
        value => claims[field] = value,
    }
    claims
}

/// The fake provider: serves whatever key set the test gives it at
/// `/.well-known/jwks.json` (or 503 while it is down), and counts the
/// fetches.
struct Provider {
    url: String,
    keys: Arc<Mutex<Vec<Value>>>,
    fetches: Arc<AtomicUsize>,
    down: Arc<AtomicBool>,
}

type ProviderState = (Arc<Mutex<Vec<Value>>>, Arc<AtomicUsize>, Arc<AtomicBool>);

async fn jwks(State((keys, fetches, down)): State<ProviderState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    fetches.fetch_add(1, Ordering::SeqCst);
    if down.load(Ordering::SeqCst) {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let keys = keys.lock().unwrap().clone();
    axum::Json(json!({ "keys": keys })).into_response()
}

impl Provider {
    async fn start(keys: &[&Key]) -> Provider {
        let provider_keys = Arc::new(Mutex::new(Vec::new()));
        let fetches = Arc::new(AtomicUsize::new(0));
        let down = Arc::new(AtomicBool::new(false));
        let app = Router::new()
            .route("/.well-known/jwks.json", get(jwks))
            .with_state((provider_keys.clone(), fetches.clone(), down.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let provider = Provider {
            url: format!("http://{addr}/.well-known/jwks.json"),
            keys: provider_keys,
            fetches,
            down,
        };
        provider.publish(keys);
        provider
    }

    fn publish(&self, keys: &[&Key]) {
        *self.keys.lock().unwrap() = keys.iter().map(|k| k.jwk.clone()).collect();
    }

    fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }
}

/// A server that knows only the provider: no HS256 secret at all.
async fn server_for(provider: &Provider, auth_extra: &str) -> Server {
    let config = format!(
        "{}\n[auth]\njwks_url = \"{}\"\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\ntenant_claim = \"org_id\"\n{auth_extra}",
        crate::support::BASE_CONFIG,
        provider.url
    );
    Server::start_with(ServerOptions {
        config,
        env: vec![("TETHER_JWT_SECRET".into(), String::new())],
        ..Default::default()
    })
    .await
}

const ME: &str = "{ me { tenant principal } }";

async fn me_over_http(server: &Server, token: &str) -> (u16, Value) {
    server.post(Some(token), ME, json!({})).await
}

async fn me_over_websocket(server: &Server, token: &str) -> Value {
    let mut client = WsClient::connect(server, token).await;
    client.subscribe("me", ME, json!({})).await;
    client.next_event("me").await
}

async fn assert_refused(server: &Server, what: &str, token: &str) {
    let (status, body) = me_over_http(server, token).await;
    assert_eq!(status, 401, "{what}: {body}");
    assert_eq!(
        body["errors"][0]["extensions"]["code"], "UNAUTHENTICATED",
        "{what}"
    );
    let mut client = WsClient::open(server, "graphql-transport-ws").await;
    client
        .init(json!({ "Authorization": format!("Bearer {token}") }))
        .await;
    match client.ending().await {
        Ending::Closed(4403, _) => {}
        other => panic!("{what}: expected 4403, got {other:?}"),
    }
}

#[tokio::test]
async fn rs256_es256_and_eddsa_tokens_are_accepted_over_http_and_websocket() {
    let keys = [Key::rsa("rsa-1"), Key::ec("ec-1"), Key::ed("ed-1")];
    let provider = Provider::start(&keys.iter().collect::<Vec<_>>()).await;
    let server = server_for(&provider, "").await;
    let expected = json!({ "me": { "tenant": "org_acme", "principal": "auth0|ada" } });
    for key in &keys {
        let token = key.sign(&claims());
        let (status, body) = me_over_http(&server, &token).await;
        assert_eq!(status, 200, "{:?}: {body}", key.alg);
        assert_eq!(body["data"], expected, "{:?}", key.alg);
        let payload = me_over_websocket(&server, &token).await;
        assert_eq!(payload["data"], expected, "{:?}: {payload}", key.alg);
    }
    // One fetch served all three keys.
    assert_eq!(provider.fetches(), 1);
}

#[tokio::test]
async fn wrong_issuer_audience_time_or_key_and_alg_confusion_are_refused() {
    let rsa = Key::rsa("rsa-1");
    let ec = Key::ec("ec-1");
    let provider = Provider::start(&[&rsa, &ec]).await;
    let server = server_for(&provider, "").await;
    // The set is fetched once, so that "unknown kid" cases below are not
    // first sightings.
    assert_eq!(me_over_http(&server, &rsa.sign(&claims())).await.0, 200);

    let stranger = Key::ec("ec-1");
    let hs256 = |secret: &[u8], claims: &Value| {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(secret).unwrap(),
        )
        .unwrap()
    };
    let rsa_public_key = serde_json::to_vec(&rsa.jwk).unwrap();
    // What each is, and the reason the refusal gives.
    let cases: Vec<(&str, &str, String)> = vec![
        (
            "another issuer",
            "wrong issuer",
            rsa.sign(&with(claims(), "iss", json!("https://evil.example.test/"))),
        ),
        (
            "no issuer",
            "missing claim iss",
            rsa.sign(&with(claims(), "iss", Value::Null)),
        ),
        (
            "another audience",
            "wrong audience",
            rsa.sign(&with(claims(), "aud", json!("someone-else"))),
        ),
        (
            "no audience",
            "missing claim aud",
            rsa.sign(&with(claims(), "aud", Value::Null)),
        ),
        (
            "not yet valid",
            "not yet valid",
            rsa.sign(&with(claims(), "nbf", json!(now() + 600))),
        ),
        (
            "expired",
            "expired",
            ec.sign(&with(claims(), "exp", json!(now() - 30))),
        ),
        (
            "no tenant claim",
            "missing claim org_id",
            ec.sign(&with(claims(), "org_id", Value::Null)),
        ),
        (
            "a key not in the set, under a kid that is",
            "bad signature",
            stranger.sign(&claims()),
        ),
        (
            "a key not in the set, under its own kid",
            "unknown signing key",
            stranger.sign_as(Algorithm::ES256, "ec-2", &claims()),
        ),
        ("no kid", "unknown signing key", {
            let mut header = Header::new(Algorithm::RS256);
            header.kid = None;
            jsonwebtoken::encode(&header, &claims(), &rsa.encoding).unwrap()
        }),
        (
            "an RSA key claimed as PS256 where the set pins RS256",
            "algorithm not accepted",
            rsa.sign_as(Algorithm::PS256, "rsa-1", &claims()),
        ),
        (
            "HS256 with the secret of the test suite (no secret is configured)",
            "algorithm not accepted",
            hs256(SECRET.as_bytes(), &claims()),
        ),
        (
            "HS256 keyed with the published RSA key",
            "algorithm not accepted",
            hs256(&rsa_public_key, &claims()),
        ),
    ];
    for (what, reason, token) in &cases {
        assert_refused(&server, what, token).await;
        let (_, body) = me_over_http(&server, token).await;
        assert_eq!(
            body["errors"][0]["extensions"]["reason"], *reason,
            "{what}: {body}"
        );
    }
    // The same good token still gets in.
    assert_eq!(me_over_http(&server, &ec.sign(&claims())).await.0, 200);
}

#[tokio::test]
async fn a_rotated_key_is_picked_up_and_a_retired_one_is_refused() {
    let old = Key::ec("2026-11");
    let provider = Provider::start(&[&old]).await;
    let server = server_for(&provider, "jwks_min_refetch_secs = 1\n").await;
    assert_eq!(me_over_http(&server, &old.sign(&claims())).await.0, 200);

    let new = Key::ed("2026-12");
    provider.publish(&[&new]);
    let token = new.sign(&claims());
    // The unknown kid leads to a fetch as soon as the last one is a second
    // old.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let (status, body) = me_over_http(&server, &token).await;
        if status == 200 {
            assert_eq!(body["data"]["me"]["tenant"], "org_acme");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the rotated key was never picked up: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        me_over_websocket(&server, &token).await["data"]["me"]["principal"],
        "auth0|ada"
    );
    assert_refused(&server, "the retired key", &old.sign(&claims())).await;
}

#[tokio::test]
async fn a_flood_of_unknown_kids_does_not_make_the_server_hammer_the_provider() {
    let key = Key::ec("ec-1");
    let provider = Provider::start(&[&key]).await;
    let server = server_for(&provider, "").await;
    assert_eq!(me_over_http(&server, &key.sign(&claims())).await.0, 200);
    assert_eq!(provider.fetches(), 1);
    let server = Arc::new(server);
    let mut flood = tokio::task::JoinSet::new();
    for i in 0..100 {
        let token = key.sign_as(Algorithm::ES256, &format!("bogus-{i}"), &claims());
        let server = server.clone();
        flood.spawn(async move { me_over_http(&server, &token).await.0 });
    }
    while let Some(status) = flood.join_next().await {
        assert_eq!(status.unwrap(), 401);
    }
    // The default least interval between fetches is 30 seconds.
    assert_eq!(provider.fetches(), 1);
    assert_eq!(me_over_http(&server, &key.sign(&claims())).await.0, 200);
}

#[tokio::test]
async fn a_key_set_behind_a_redirect_is_not_followed() {
    let key = Key::ec("ec-1");
    let provider = Provider::start(&[&key]).await;
    let moved = Router::new().route(
        "/jwks",
        get({
            let target = provider.url.clone();
            move || async move { axum::response::Redirect::temporary(&target) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, moved).await.unwrap() });
    let redirecting = Provider {
        url: format!("http://{addr}/jwks"),
        keys: provider.keys.clone(),
        fetches: provider.fetches.clone(),
        down: provider.down.clone(),
    };
    let server = server_for(&redirecting, "").await;
    assert_refused(
        &server,
        "a key served only after a redirect",
        &key.sign(&claims()),
    )
    .await;
    assert_eq!(provider.fetches(), 0);
}

#[tokio::test]
async fn keys_already_held_keep_serving_while_the_provider_is_down() {
    let key = Key::rsa("rsa-1");
    let provider = Provider::start(&[&key]).await;
    let server = server_for(
        &provider,
        "jwks_refresh_secs = 1\njwks_min_refetch_secs = 1\n",
    )
    .await;
    let token = key.sign(&claims());
    assert_eq!(me_over_http(&server, &token).await.0, 200);
    provider.down.store(true, Ordering::SeqCst);
    // Once the set is stale, requests try to fetch it again and fail; the
    // key held still verifies.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while provider.fetches() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no refetch of a stale set"
        );
        let (status, body) = me_over_http(&server, &token).await;
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(me_over_http(&server, &token).await.0, 200);
}
