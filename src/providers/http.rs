//! What both HTTP providers share: one client, error statuses with their
//! `retry-after`, and server-sent events with an idle timeout. HTTP tools use
//! the same client, failure kinds and capped body reads.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures_util::{Stream, StreamExt};
use reqwest::header::HeaderMap;

use super::ProviderError;
use crate::redact;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where an HTTP provider is and how to reach it.
#[derive(Clone)]
pub struct Endpoint {
    pub base_url: String,
    /// Local OpenAI-compatible servers often need none.
    pub api_key: Option<String>,
    /// Longest silence allowed between two chunks of a response.
    pub idle_timeout: Duration,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("base_url", &redact::Origin(&self.base_url))
            .field("api_key", &redact::Hidden(&self.api_key))
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

/// Chooses the process's TLS backend (ring), once; needed before any
/// reqwest client is built. Another choice made earlier stands.
pub fn install_tls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The process's HTTP client for providers and tools (one connection
/// pool). It follows no redirect: reqwest would carry headers such as
/// Anthropic's `x-api-key` to whatever host a redirect names, so a 3xx is
/// the answer.
pub fn client() -> Result<&'static reqwest::Client, ProviderError> {
    static CLIENT: OnceLock<Result<reqwest::Client, String>> = OnceLock::new();
    CLIENT
        .get_or_init(|| {
            install_tls();
            reqwest::Client::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| ProviderError::Unavailable(format!("cannot build the HTTP client: {e}")))
}

/// The longest `retry-after` taken at its word; a larger one (or one too
/// large to represent) waits this long, and the run's own timeout still
/// applies.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

fn seconds(value: f64) -> Option<Duration> {
    (value.is_finite() && value >= 0.0).then(|| {
        Duration::try_from_secs_f64(value)
            .unwrap_or(MAX_RETRY_AFTER)
            .min(MAX_RETRY_AFTER)
    })
}

/// `retry-after-ms` (milliseconds), else `retry-after` (seconds or an HTTP
/// date), as a duration from now, at most a day.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(wait) = text("retry-after-ms")
        .and_then(|v| v.parse::<f64>().ok())
        .and_then(|ms| seconds(ms / 1000.0))
    {
        return Some(wait);
    }
    let value = text("retry-after")?;
    if let Ok(value) = value.parse::<f64>() {
        return seconds(value);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
            .min(MAX_RETRY_AFTER),
    )
}

/// Sends a request; a non-2xx answer becomes `ProviderError::Http` with the
/// provider's error type and message, read by `describe` from the body.
/// The response's headers, and an error's body, must come within `wait`.
pub async fn send(
    request: reqwest::RequestBuilder,
    describe: fn(&serde_json::Value) -> Option<(String, String)>,
    wait: Duration,
) -> Result<reqwest::Response, ProviderError> {
    let silent = || ProviderError::Network(format!("no answer within {} s", wait.as_secs()));
    let response = tokio::time::timeout(wait, request.send())
        .await
        .map_err(|_| silent())?
        .map_err(network)?;
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let retry_after = retry_after(response.headers());
    if status.is_redirection() {
        // Where it points is not repeated: a location may carry a token.
        return Err(ProviderError::Http {
            status: status.as_u16(),
            code: "redirect".to_owned(),
            message: format!(
                "HTTP {status}: the provider redirected, and redirects are not followed"
            ),
            retry_after,
        });
    }
    let (body, _) = tokio::time::timeout(wait, read_capped(response, MAX_ERROR_BODY_BYTES))
        .await
        .map_err(|_| silent())?
        .unwrap_or_default();
    let (code, message) = serde_json::from_slice(&body)
        .ok()
        .and_then(|json| describe(&json))
        .map(|(code, message)| (redact::message(&code), redact::message(&message)))
        .unwrap_or_else(|| {
            let text = redact::message(&String::from_utf8_lossy(&body));
            (
                format!("http_{}", status.as_u16()),
                if text.is_empty() {
                    format!("HTTP {status}")
                } else {
                    text
                },
            )
        });
    Err(ProviderError::Http {
        status: status.as_u16(),
        code,
        message,
        retry_after,
    })
}

/// An error body is read this far; the message in it is capped further.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// The body, read chunk by chunk up to `max` bytes; `true` when there was
/// more (the rest is not read, and the connection is dropped).
pub async fn read_capped(
    mut response: reqwest::Response,
    max: usize,
) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = max - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, true));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, false))
}

pub fn network(err: reqwest::Error) -> ProviderError {
    ProviderError::Network(failure(err))
}

/// What went wrong with a request, as clients and models may read it: a
/// kind such as "connection refused", never reqwest's text, which carries
/// the whole URL. The detail is logged, with the URL's origin only.
pub fn failure(err: reqwest::Error) -> String {
    let kind = failure_kind(&err);
    let to = err
        .url()
        .map(|url| redact::origin(url.as_str()))
        .unwrap_or_default();
    let err = err.without_url();
    let mut detail = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        detail.push_str(": ");
        detail.push_str(&cause.to_string());
        source = cause.source();
    }
    tracing::warn!(to, detail = %redact::secrets(&detail), "outgoing request failed: {kind}");
    kind.to_owned()
}

fn failure_kind(err: &reqwest::Error) -> &'static str {
    if err.is_timeout() {
        "timed out"
    } else if err.is_connect() {
        let mut source = std::error::Error::source(err);
        while let Some(cause) = source {
            if cause
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
            {
                return "connection refused";
            }
            source = cause.source();
        }
        "could not connect"
    } else if err.is_redirect() {
        "redirect not followed"
    } else if err.is_body() || err.is_decode() {
        "the connection broke while reading the answer"
    } else if err.is_builder() {
        "invalid request"
    } else {
        "the request failed"
    }
}

/// The response's server-sent events; silence longer than `idle` between
/// two chunks is a network error.
pub fn events(
    response: reqwest::Response,
    idle: Duration,
) -> impl Stream<Item = Result<Event, ProviderError>> + Send {
    let mut source = response.bytes_stream().eventsource();
    async_stream::stream! {
        loop {
            match tokio::time::timeout(idle, source.next()).await {
                Err(_) => {
                    yield Err(ProviderError::Network(format!(
                        "no data from the provider for {} s",
                        idle.as_secs()
                    )));
                    return;
                }
                Ok(None) => return,
                Ok(Some(Ok(event))) => yield Ok(event),
                Ok(Some(Err(err))) => {
                    yield Err(match err {
                        EventStreamError::Transport(err) => network(err),
                        // A parse error quotes the stream: capped.
                        other => ProviderError::Network(redact::message(&other.to_string())),
                    });
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn huge_or_odd_retry_after_values_are_capped_not_trusted() {
        let wait = |name: &'static str, value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(name, HeaderValue::from_static(value));
            retry_after(&headers)
        };
        assert_eq!(wait("retry-after", "1e20"), Some(MAX_RETRY_AFTER));
        assert_eq!(wait("retry-after-ms", "1e30"), Some(MAX_RETRY_AFTER));
        assert_eq!(wait("retry-after", "-1"), None);
        assert_eq!(wait("retry-after", "NaN"), None);
    }

    #[tokio::test]
    async fn a_server_that_never_answers_is_a_network_error() {
        install_tls();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Accepts and holds connections, never answering.
        let held = tokio::spawn(async move {
            let mut sockets = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                sockets.push(socket);
            }
        });
        let request = client().unwrap().post(format!("http://{addr}/v1/messages"));
        let err = send(request, |_| None, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Network(_)), "{err:?}");
        assert!(err.is_transient());
        held.abort();
    }

    #[tokio::test]
    async fn a_refused_connection_reads_as_its_kind() {
        install_tls();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}/hook/s3cr3t?token=t0k3n");
        let err = client().unwrap().get(url).send().await.unwrap_err();
        assert!(
            err.to_string().contains("s3cr3t"),
            "reqwest's own text has the URL"
        );
        assert_eq!(failure(err), "connection refused");
    }

    #[test]
    fn an_endpoint_shows_neither_its_key_nor_its_path() {
        let endpoint = Endpoint {
            base_url: "https://proxy.example.com/k/s3cr3t?key=t0k3n".into(),
            api_key: Some("sk-ant-secret".into()),
            idle_timeout: Duration::from_secs(1),
        };
        let shown = format!("{endpoint:?}");
        for secret in ["s3cr3t", "t0k3n", "sk-ant-secret"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("https://proxy.example.com"), "{shown}");
    }

    #[test]
    fn retry_after_reads_milliseconds_seconds_and_dates() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers), None);
        headers.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(2)));
        headers.insert("retry-after-ms", HeaderValue::from_static("1500"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(1500)));
        let mut headers = HeaderMap::new();
        let soon = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
        headers.insert("retry-after", HeaderValue::from_str(&soon).unwrap());
        let wait = retry_after(&headers).unwrap();
        assert!(
            wait > Duration::from_secs(25) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
        headers.insert("retry-after", HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&headers), None);
    }
}
