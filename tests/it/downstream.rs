//! A downstream service for HTTP tools: a real HTTP server in the test that
//! records every request with its `Idempotency-Key` and behaves as its path
//! says. Like a real idempotent API (Stripe's, say), `/effect` performs its
//! effect once per key and answers a repeated key with the recorded result.
//!
//! | path | answer |
//! |---|---|
//! | `/effect` | 200 `{"done": input, "effect": n}`, one effect per key |
//! | `/fail` | 422 `{"error": "refused"}` |
//! | `/unavailable` | 503 every time |
//! | `/flaky` | 503 for the first request of a key, then as `/effect` |
//! | `/big` | 200 with a 2,000-character string |
//! | `/hang` | never answers; notices the client closing the connection |
//! | `/slow` | answers only once `slow_until` requests have arrived in all |
//! | `/held` | the first request is recorded (its effect done) and held until the client goes; later ones as `/effect` |
//! | `/redirect` | 307 to the URL given to `redirect_to` |
//! | `/gated` | as `/effect`, answered once the test opens the gate (`open_gate`) |
//! | `/endless` | 200 with a body that never ends (chunks of `x` until the client goes) |

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::support::PATIENCE;

#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    pub key: Option<String>,
    pub run_id: Option<String>,
    pub tool_call_id: Option<String>,
    pub authorization: Option<String>,
    /// The W3C trace context the request carried.
    pub traceparent: Option<String>,
    pub body: Value,
}

#[derive(Default)]
struct Shared {
    requests: Mutex<Vec<Recorded>>,
    /// Results recorded per idempotency key (the effect happened once).
    results: Mutex<HashMap<String, Value>>,
    effects: Mutex<usize>,
    /// Requests whose client went away before the answer, and when each
    /// was noticed.
    closed: Mutex<usize>,
    closed_at: Mutex<Vec<std::time::Instant>>,
    changed: Notify,
    slow_until: Mutex<usize>,
    redirect_to: Mutex<String>,
    gate_open: Mutex<bool>,
}

pub struct Downstream {
    pub base: String,
    shared: Arc<Shared>,
}

impl Downstream {
    pub async fn start() -> Downstream {
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/{behaviour}", post(handle))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Downstream { base, shared }
    }

    /// `/slow` answers once this many requests have arrived in all.
    pub fn slow_until(&self, requests: usize) {
        *self.shared.slow_until.lock().unwrap() = requests;
    }

    /// Lets every `/gated` request, held or to come, have its answer.
    pub fn open_gate(&self) {
        *self.shared.gate_open.lock().unwrap() = true;
        self.shared.changed.notify_waiters();
    }

    /// Where `/redirect` points.
    pub fn redirect_to(&self, url: &str) {
        *self.shared.redirect_to.lock().unwrap() = url.to_owned();
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    pub fn requests_to(&self, path: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.path == path)
            .collect()
    }

    /// Effects performed, over every key.
    pub fn effects(&self) -> usize {
        *self.shared.effects.lock().unwrap()
    }

    pub fn closed(&self) -> usize {
        *self.shared.closed.lock().unwrap()
    }

    /// When each request whose client went away was noticed closing.
    pub fn closed_at(&self) -> Vec<std::time::Instant> {
        self.shared.closed_at.lock().unwrap().clone()
    }

    /// Waits until `check` holds for the service.
    pub async fn wait_for(&self, what: &str, check: impl Fn(&Downstream) -> bool) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let changed = self.shared.changed.notified();
            if check(self) {
                return;
            }
            assert!(
                tokio::time::timeout_at(deadline, changed).await.is_ok() || check(self),
                "the downstream service never saw {what}: {:?}",
                self.requests()
            );
        }
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Notes the client closing the connection before the answer.
struct Watch {
    shared: Arc<Shared>,
    answered: bool,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.answered {
            *self.shared.closed.lock().unwrap() += 1;
            self.shared
                .closed_at
                .lock()
                .unwrap()
                .push(std::time::Instant::now());
            self.shared.changed.notify_waiters();
        }
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    Path(behaviour): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let key = header(&headers, "idempotency-key");
    let first_of_key = key.as_ref().is_none_or(|k| {
        !shared
            .requests
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.key.as_ref() == Some(k))
    });
    shared.requests.lock().unwrap().push(Recorded {
        path: format!("/{behaviour}"),
        key: key.clone(),
        run_id: header(&headers, "x-tether-run-id"),
        tool_call_id: header(&headers, "x-tether-tool-call-id"),
        authorization: header(&headers, "authorization"),
        traceparent: header(&headers, "traceparent"),
        body: body.clone(),
    });
    shared.changed.notify_waiters();
    let mut watch = Watch {
        shared: shared.clone(),
        answered: false,
    };
    let response = match behaviour.as_str() {
        "effect" => effect(&shared, key, body).into_response(),
        "fail" => (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::Json(json!({ "error": "refused" })),
        )
            .into_response(),
        "unavailable" => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({ "error": "try later" })),
        )
            .into_response(),
        "flaky" if first_of_key => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({ "error": "try later" })),
        )
            .into_response(),
        "flaky" => effect(&shared, key, body).into_response(),
        "big" => axum::Json(json!({ "text": "x".repeat(2000) })).into_response(),
        "redirect" => {
            let location = shared.redirect_to.lock().unwrap().clone();
            (StatusCode::TEMPORARY_REDIRECT, [("location", location)]).into_response()
        }
        "endless" => {
            // Paced, so that a client reading it whole fills its memory
            // slowly (16 MB/s) until its timeout, not the machine's at once.
            let body = async_stream::stream! {
                let chunk = Bytes::from(vec![b'x'; 16 * 1024]);
                loop {
                    yield Ok::<Bytes, std::io::Error>(chunk.clone());
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            };
            Response::new(axum::body::Body::from_stream(body))
        }
        "hang" => std::future::pending().await,
        "slow" => {
            let deadline = tokio::time::Instant::now() + PATIENCE;
            loop {
                let changed = shared.changed.notified();
                let wanted = *shared.slow_until.lock().unwrap();
                if shared.requests.lock().unwrap().len() >= wanted {
                    break;
                }
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    return (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the other calls never came",
                    )
                        .into_response();
                }
            }
            axum::Json(json!({ "slow": "done" })).into_response()
        }
        "gated" => {
            let result = effect(&shared, key, body);
            loop {
                let changed = shared.changed.notified();
                if *shared.gate_open.lock().unwrap() {
                    break;
                }
                changed.await;
            }
            result.into_response()
        }
        "held" => {
            let result = effect(&shared, key, body);
            if first_of_key {
                std::future::pending::<()>().await;
            }
            result.into_response()
        }
        _ => (StatusCode::NOT_FOUND, "no such behaviour").into_response(),
    };
    watch.answered = true;
    response
}

/// The effect, once per key; a repeated key gets the recorded result.
fn effect(shared: &Shared, key: Option<String>, input: Value) -> axum::Json<Value> {
    let mut results = shared.results.lock().unwrap();
    if let Some(key) = &key
        && let Some(recorded) = results.get(key)
    {
        return axum::Json(recorded.clone());
    }
    let mut effects = shared.effects.lock().unwrap();
    *effects += 1;
    let result = json!({ "done": input, "effect": *effects });
    if let Some(key) = key {
        results.insert(key, result.clone());
    }
    shared.changed.notify_waiters();
    axum::Json(result)
}
