//! Running one tool call's effect: in-process tools, and HTTP tools with
//! their idempotency key, timeout and retry policy. No database here: the
//! engine commits before and after.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use super::registry::{Runner, Tool};
use crate::config::{HttpTarget, Recovery};
use crate::domain::retry::RetryPolicy;
use crate::providers::http;

/// One call to make.
pub struct Invocation<'a> {
    pub tool: &'a Tool,
    /// The validated, normalized input.
    pub input: &'a Value,
    pub run_id: Uuid,
    pub tool_call_id: Uuid,
    pub idempotency_key: &'a str,
    /// For transient failures of idempotent tools.
    pub retry: &'a RetryPolicy,
    /// A person approved this call, or a standing grant covers it. A tool
    /// with a risk category never runs without it.
    pub cleared: bool,
    /// The token of the tool's connection, sent as `Authorization: Bearer`.
    pub bearer: Option<&'a str>,
}

/// How the effect came out, and whether its output is cut short.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub effect: Effect,
    /// The tool answered more than `http.max_response_bytes`: the output
    /// holds the first bytes only, and the rest was never read.
    pub cut: bool,
}

impl From<Effect> for Outcome {
    fn from(effect: Effect) -> Outcome {
        Outcome { effect, cut: false }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    Succeeded(Value),
    /// The tool refused or failed; the model reads why.
    Failed(Value),
    /// It may or may not have happened, and the tool must not be called
    /// again (`never_replay`).
    Unknown(Value),
}

pub async fn invoke(call: Invocation<'_>) -> Outcome {
    let tool = call.tool;
    // Fail closed: whatever path led here, a gated tool runs only with an
    // approval or a grant behind it.
    if let Some(risk) = &tool.risk
        && !call.cleared
    {
        return Effect::Failed(json!({
            "error": format!(
                "{} needs a person's approval (risk category {risk:?}); it did not run",
                tool.name
            )
        }))
        .into();
    }
    match &tool.runner {
        // Questions are asked by the batch itself, never executed.
        Runner::AskQuestions => Effect::Failed(json!({
            "error": "ask_questions is not an effect; it did not run"
        }))
        .into(),
        Runner::DemoPublish => Effect::Succeeded(json!({ "published": call.input })).into(),
        Runner::Http(target) => http_call(target, &call).await,
    }
}

/// A transient failure: worth another try when the tool allows replays.
struct Transient {
    error: Value,
    retry_after: Option<Duration>,
    /// Whether the request may have reached the tool.
    sent: bool,
    /// The error holds the first bytes of a longer answer.
    cut: bool,
}

async fn http_call(target: &HttpTarget, call: &Invocation<'_>) -> Outcome {
    let client = match http::client() {
        Ok(client) => client,
        Err(err) => return Effect::Failed(json!({ "error": err.to_string() })).into(),
    };
    let method =
        Method::from_bytes(target.method.to_ascii_uppercase().as_bytes()).unwrap_or(Method::POST);
    let mut failed_attempts = 0u32;
    loop {
        let request = client
            .request(method.clone(), &target.url)
            .timeout(Duration::from_secs(target.timeout_secs))
            .header("Idempotency-Key", call.idempotency_key)
            .header("X-Tether-Run-Id", call.run_id.to_string())
            .header("X-Tether-Tool-Call-Id", call.tool_call_id.to_string())
            .json(call.input);
        let request = match call.bearer {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        let request = crate::logs::trace_headers()
            .into_iter()
            .fold(request, |request, (name, value)| {
                request.header(name, value)
            });
        let transient = match attempt(request, target.max_response_bytes).await {
            Ok(outcome) => return outcome,
            Err(transient) => transient,
        };
        failed_attempts += 1;
        let cut = transient.cut;
        let effect = match call.tool.recovery {
            Recovery::NeverReplay if transient.sent => Effect::Unknown(json!({
                "error": transient.error,
                "outcome": "UNKNOWN",
                "note": "the request may have reached the tool, which must not be called \
                         twice: it may or may not have taken effect; check before repeating it",
            })),
            Recovery::NeverReplay => Effect::Failed(json!({ "error": transient.error })),
            Recovery::Idempotent if !call.retry.allows_another(failed_attempts) => {
                Effect::Failed(json!({
                    "error": transient.error,
                    "attempts": failed_attempts,
                }))
            }
            Recovery::Idempotent => {
                let delay =
                    call.retry
                        .delay(failed_attempts, transient.retry_after, fastrand::f64());
                tracing::info!(
                    tool = %call.tool.name,
                    attempt = failed_attempts,
                    delay_ms = delay.as_millis() as u64,
                    "tool call failed transiently; retrying with the same key"
                );
                tokio::time::sleep(delay).await;
                continue;
            }
        };
        return Outcome { effect, cut };
    }
}

/// One request: a 2xx JSON body is the output (any other body is kept as
/// text), 3xx and 4xx a failed call, 5xx/408/429 and network trouble
/// transient (409 is a tool's answer, unlike a model provider's). The body
/// is read up to `max_bytes`. What reaches the model and clients names the
/// kind of failure, never reqwest's text (it carries the URL, and webhook
/// URLs carry tokens).
async fn attempt(request: reqwest::RequestBuilder, max_bytes: usize) -> Result<Outcome, Transient> {
    let response = request.send().await.map_err(|e| Transient {
        sent: !e.is_connect(),
        error: json!(format!("network error: {}", http::failure(e))),
        retry_after: None,
        cut: false,
    })?;
    let status = response.status();
    let retry_after = http::retry_after(response.headers());
    if status.is_redirection() {
        // The location is not passed on: it may carry a token too.
        return Ok(Effect::Failed(json!({
            "status": status.as_u16(),
            "error": "the tool answered with a redirect, and redirects are not followed",
        }))
        .into());
    }
    let (body, cut) = http::read_capped(response, max_bytes)
        .await
        .map_err(|e| Transient {
            error: json!(format!(
                "network error while reading the answer: {}",
                http::failure(e)
            )),
            retry_after: None,
            sent: true,
            cut: false,
        })?;
    let body = if cut {
        Value::String(format!(
            "{}…\n[response truncated: only its first {max_bytes} bytes were read]",
            String::from_utf8_lossy(&body)
        ))
    } else {
        serde_json::from_slice(&body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()))
    };
    if status.is_success() {
        return Ok(Outcome {
            effect: Effect::Succeeded(body),
            cut,
        });
    }
    let error = json!({ "status": status.as_u16(), "body": body });
    if matches!(status.as_u16(), 408 | 429) || status.is_server_error() {
        return Err(Transient {
            error,
            retry_after,
            sent: true,
            cut,
        });
    }
    Ok(Outcome {
        effect: Effect::Failed(error),
        cut,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What `attempt` makes of an answer with this status and body, from a
    /// server on loopback that sends exactly these bytes.
    fn answered(status: u16, body: Vec<u8>) -> Result<Effect, Value> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/tool", listener.local_addr().unwrap());
            tokio::spawn(async move {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut request = Vec::new();
                let mut buffer = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    let read = socket.read(&mut buffer).await.unwrap();
                    if read == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..read]);
                }
                let head = format!(
                    "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                socket.write_all(head.as_bytes()).await.unwrap();
                socket.write_all(&body).await.unwrap();
            });
            http::install_tls();
            let request = reqwest::Client::new().post(url);
            attempt(request, 1024 * 1024)
                .await
                .map(|outcome| outcome.effect)
                .map_err(|t| t.error)
        })
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            // Quarters print and parse back exactly.
            any::<i32>().prop_map(|n| Value::from(f64::from(n) / 4.0)),
            "\\PC{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map("\\PC{0,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn a_json_body_is_the_output_as_it_was_sent(value in json_value()) {
            let body = serde_json::to_vec(&value).unwrap();
            match answered(200, body) {
                Ok(Effect::Succeeded(output)) => prop_assert_eq!(output, value),
                other => prop_assert!(false, "{:?}", other),
            }
        }

        #[test]
        fn any_other_body_is_kept_as_text(body in prop::collection::vec(any::<u8>(), 0..300)) {
            let expected = serde_json::from_slice::<Value>(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
            match answered(200, body) {
                Ok(Effect::Succeeded(output)) => prop_assert_eq!(output, expected),
                other => prop_assert!(false, "{:?}", other),
            }
        }

        #[test]
        fn a_refusal_carries_its_status_and_body(
            status in prop::sample::select(vec![400u16, 404, 409, 422]),
            text in "\\PC{0,40}",
        ) {
            match answered(status, text.clone().into_bytes()) {
                Ok(Effect::Failed(error)) => {
                    prop_assert_eq!(&error["status"], status);
                    let expected = serde_json::from_str::<Value>(&text).unwrap_or(Value::String(text));
                    prop_assert_eq!(&error["body"], &expected);
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }

        #[test]
        fn a_server_error_is_transient_with_its_status(status in 500u16..600) {
            match answered(status, b"{\"busy\": true}".to_vec()) {
                Err(error) => prop_assert_eq!(&error["status"], status),
                other => prop_assert!(false, "{:?}", other),
            }
        }
    }
}
