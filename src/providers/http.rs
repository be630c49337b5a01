//! What both HTTP providers share: one client, error statuses with their
//! `retry-after`, and server-sent events with an idle timeout. HTTP tools use
//! the same client, failure kinds and capped body reads.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

pub use eventsource_stream::Event;
use eventsource_stream::{EventStreamError, Eventsource};
use futures_util::{Stream, StreamExt};
use reqwest::header::HeaderMap;

use super::{ModelEvent, ModelStream, ProviderError};
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

/// The most bytes one server-sent event may take, its line breaks not
/// counted: a line or an event longer than this fails the stream (no
/// provider event comes near it; an endless line would otherwise be held in
/// memory whole).
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// Watches an SSE body's bytes before they are parsed: it bounds the bytes
/// of the event being read, and passes on only whole UTF-8 characters,
/// refusing invalid UTF-8 (the SSE parser would otherwise hold everything
/// after an invalid byte, unread, until the stream ends).
struct Guard {
    limit: usize,
    /// Bytes of the current event so far.
    event: usize,
    /// The current line has bytes (a line break now does not end the event).
    line_open: bool,
    /// The last byte was a carriage return (its line feed is the same break).
    after_cr: bool,
    /// The start of a character cut by the end of the last chunk.
    carry: Vec<u8>,
}

impl Guard {
    fn new(limit: usize) -> Guard {
        Guard {
            limit,
            event: 0,
            line_open: false,
            after_cr: false,
            carry: Vec::new(),
        }
    }

    /// The chunk's bytes to parse: the character cut at the end of the last
    /// chunk completed, the one cut at the end of this one kept back.
    fn check(&mut self, chunk: &[u8]) -> Result<Vec<u8>, ProviderError> {
        for &byte in chunk {
            match byte {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\n' | b'\r' => {
                    // A blank line ends the event.
                    if !self.line_open {
                        self.event = 0;
                    }
                    self.line_open = false;
                    self.after_cr = byte == b'\r';
                }
                _ => {
                    self.after_cr = false;
                    self.line_open = true;
                    self.event += 1;
                    if self.event > self.limit {
                        return Err(ProviderError::Unusable {
                            code: "event_too_large".into(),
                            message: format!(
                                "the provider sent a server-sent event over {} bytes",
                                self.limit
                            ),
                        });
                    }
                }
            }
        }
        let mut bytes = std::mem::take(&mut self.carry);
        bytes.extend_from_slice(chunk);
        match std::str::from_utf8(&bytes) {
            Ok(_) => Ok(bytes),
            Err(err) if err.error_len().is_none() => {
                self.carry = bytes.split_off(err.valid_up_to());
                Ok(bytes)
            }
            Err(err) => Err(invalid_utf8(err)),
        }
    }

    /// The end of the body: a character still cut is invalid.
    fn finish(&self) -> Result<(), ProviderError> {
        match std::str::from_utf8(&self.carry) {
            Ok(_) => Ok(()),
            Err(err) => Err(invalid_utf8(err)),
        }
    }
}

fn invalid_utf8(err: std::str::Utf8Error) -> ProviderError {
    ProviderError::Stream {
        code: "invalid_utf8".into(),
        message: format!("the provider's stream is not valid UTF-8: {err}"),
    }
}

/// The response's server-sent events; silence longer than `idle` between
/// two chunks is a network error.
pub fn events(
    response: reqwest::Response,
    idle: Duration,
) -> impl Stream<Item = Result<Event, ProviderError>> + Send {
    sse(response.bytes_stream(), idle, MAX_EVENT_BYTES, network)
}

/// A provider's stream parser: what its server-sent events mean.
pub trait EventParser: Default + Send + 'static {
    /// The model events of one server-sent event.
    fn event(&mut self, event: &Event) -> Vec<Result<ModelEvent, ProviderError>>;

    /// The model events of a stream that ran out before an error or its
    /// finish.
    fn ended(&mut self) -> Vec<Result<ModelEvent, ProviderError>>;
}

/// Server-sent events as model events through a `P`, ending at the first
/// error or at the finish.
pub fn model_events<P: EventParser>(
    events: impl Stream<Item = Result<Event, ProviderError>> + Send + 'static,
) -> ModelStream {
    let mut events = Box::pin(events);
    let stream = async_stream::stream! {
        let mut parser = P::default();
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(err) => {
                    yield Err(err);
                    return;
                }
            };
            for item in parser.event(&event) {
                let last = matches!(item, Err(_) | Ok(ModelEvent::Finished { .. }));
                yield item;
                if last {
                    return;
                }
            }
        }
        for item in parser.ended() {
            let last = item.is_err();
            yield item;
            if last {
                return;
            }
        }
    };
    stream.boxed()
}

/// The server-sent events of a body's chunks, each event at most `limit`
/// bytes; `transport` says what a failed chunk means.
pub fn sse<S, B, E>(
    body: S,
    idle: Duration,
    limit: usize,
    transport: fn(E) -> ProviderError,
) -> impl Stream<Item = Result<Event, ProviderError>> + Send
where
    S: Stream<Item = Result<B, E>> + Send + 'static,
    B: AsRef<[u8]> + Send,
    E: Send,
{
    let checked = async_stream::stream! {
        let mut guard = Guard::new(limit);
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = body.next().await {
            match chunk.map_err(transport).and_then(|c| guard.check(c.as_ref())) {
                Ok(bytes) => yield Ok(bytes),
                Err(err) => {
                    yield Err(err);
                    return;
                }
            }
        }
        if let Err(err) = guard.finish() {
            yield Err(err);
        }
    };
    let mut source = Box::pin(checked.eventsource());
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
                Ok(Some(Err(EventStreamError::Transport(err)))) => {
                    yield Err(err);
                    return;
                }
                Ok(Some(Err(err))) => {
                    // A parse error quotes the stream: capped and masked.
                    yield Err(ProviderError::Stream {
                        code: "invalid_event".into(),
                        message: format!(
                            "the provider's stream is not valid SSE: {}",
                            redact::message(&err.to_string())
                        ),
                    });
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use futures_util::stream::BoxStream;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;
    use reqwest::header::HeaderValue;
    use serde_json::Value;

    /// The events of a body arriving in these chunks.
    pub(crate) fn events_of(
        chunks: Vec<Vec<u8>>,
        limit: usize,
    ) -> impl Stream<Item = Result<Event, ProviderError>> + Send {
        let body = futures_util::stream::iter(chunks.into_iter().map(Ok));
        sse(
            body,
            Duration::from_secs(5),
            limit,
            |e: std::convert::Infallible| match e {},
        )
    }

    /// Everything `sse` makes of these chunks.
    fn sse_of(chunks: Vec<Vec<u8>>, limit: usize) -> Vec<Result<Event, ProviderError>> {
        collect(events_of(chunks, limit))
    }

    /// Every item of a stream, on a runtime of its own.
    pub(crate) fn collect<T>(stream: impl Stream<Item = T>) -> Vec<T> {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(stream.collect())
    }

    /// `bytes` cut at these points (taken modulo its length).
    pub(crate) fn cut(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        at.extend([0, bytes.len()]);
        at.sort_unstable();
        at.dedup();
        at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect()
    }

    /// Every model event a provider's parser (`model_events`) makes of
    /// `body` arriving cut at these points.
    pub(crate) fn model_events_of(
        model_events: impl FnOnce(BoxStream<'static, Result<Event, ProviderError>>) -> ModelStream,
        body: &[u8],
        cuts: &[usize],
    ) -> Vec<Result<ModelEvent, ProviderError>> {
        collect(model_events(
            events_of(cut(body, cuts), MAX_EVENT_BYTES).boxed(),
        ))
    }

    /// The JSON text of `input` three characters at a time, as a model
    /// streams a tool call's input.
    pub(crate) fn pieces_of(input: &Value) -> Vec<String> {
        let json: Vec<char> = input.to_string().chars().collect();
        json.chunks(3).map(|piece| piece.iter().collect()).collect()
    }

    /// `event` with the JSON of its data line cut short, keeping at least
    /// `min` of its bytes: JSON text cut short is never valid.
    pub(crate) fn with_broken_data(event: &str, keep: prop::sample::Index, min: usize) -> String {
        let data = event
            .lines()
            .find_map(|line| line.strip_prefix("data: "))
            .unwrap();
        let broken = &data[..data.floor_char_boundary(min + keep.index(data.len() - min))];
        event.replace(data, broken)
    }

    /// The text (or the reasoning) of these events, joined.
    fn joined(events: &[ModelEvent], reasoning: bool) -> String {
        events
            .iter()
            .filter_map(|e| match e {
                ModelEvent::Text(t) if !reasoning => Some(t.as_str()),
                ModelEvent::Reasoning(t) if reasoning => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }

    /// A whole stream's items are events that hold all its `text` and
    /// `reasoning`, its tool `call`, and end with `stop_reason`; the events.
    pub(crate) fn check_whole(
        items: Vec<Result<ModelEvent, ProviderError>>,
        text: &[String],
        reasoning: &str,
        call: &ModelEvent,
        stop_reason: &str,
    ) -> Result<Vec<ModelEvent>, TestCaseError> {
        let events: Vec<ModelEvent> = items.into_iter().collect::<Result<_, _>>().unwrap();
        prop_assert_eq!(joined(&events, false), text.concat());
        prop_assert_eq!(joined(&events, true), reasoning);
        prop_assert!(events.contains(call));
        prop_assert_eq!(
            events.last(),
            Some(&ModelEvent::Finished {
                stop_reason: stop_reason.into()
            })
        );
        Ok(events)
    }

    /// A stream with broken JSON in an event ends with `invalid_event` and
    /// never finishes.
    pub(crate) fn check_broken(
        items: &[Result<ModelEvent, ProviderError>],
    ) -> Result<(), TestCaseError> {
        prop_assert!(
            matches!(items.last(), Some(Err(ProviderError::Stream { code, .. })) if code == "invalid_event"),
            "{:?}",
            items
        );
        let finished = items
            .iter()
            .any(|i| matches!(i, Ok(ModelEvent::Finished { .. })));
        prop_assert!(!finished);
        Ok(())
    }

    fn code_of(item: &Result<Event, ProviderError>) -> Option<&str> {
        match item {
            Err(ProviderError::Stream { code, .. } | ProviderError::Unusable { code, .. }) => {
                Some(code)
            }
            _ => None,
        }
    }

    /// Event names and data lines, without line breaks, as (name, data).
    fn events_strategy() -> impl Strategy<Value = Vec<(String, String)>> {
        let name = prop::sample::select(vec!["", "message", "content_block_delta", "ping"]);
        prop::collection::vec((name, "[^\r\n\u{fffd}]{0,40}"), 0..8)
            .prop_map(|events| events.into_iter().map(|(n, d)| (n.to_owned(), d)).collect())
    }

    fn body_of(events: &[(String, String)], crlf: bool) -> Vec<u8> {
        let end = if crlf { "\r\n" } else { "\n" };
        let mut body = String::new();
        for (name, data) in events {
            if !name.is_empty() {
                body += &format!("event: {name}{end}");
            }
            body += &format!("data: {data}{end}{end}");
        }
        body.into_bytes()
    }

    proptest! {
        #[test]
        fn events_come_out_whole_however_the_body_is_cut(
            events in events_strategy(),
            cuts in prop::collection::vec(any::<usize>(), 0..24),
            crlf in any::<bool>(),
        ) {
            let body = body_of(&events, crlf);
            let got: Vec<(String, String)> = sse_of(cut(&body, &cuts), MAX_EVENT_BYTES)
                .into_iter()
                .map(|e| e.map(|e| (e.event, e.data)))
                .collect::<Result<_, _>>()
                .unwrap();
            let expected: Vec<(String, String)> = events
                .into_iter()
                .map(|(n, d)| (if n.is_empty() { "message".into() } else { n }, d))
                .collect();
            prop_assert_eq!(got, expected);
        }

        #[test]
        fn invalid_utf8_anywhere_fails_the_stream_and_nothing_garbled_comes_out(
            events in events_strategy(),
            bad in prop::sample::select(vec![vec![0xff], vec![0x80], vec![0xc3, 0x28], vec![0xed, 0xa0, 0x80], vec![0xe2, 0x82]]),
            at in any::<usize>(),
            cuts in prop::collection::vec(any::<usize>(), 0..24),
        ) {
            let mut body = body_of(&events, false);
            let at = at % (body.len() + 1);
            body.splice(at..at, bad);
            let got = sse_of(cut(&body, &cuts), MAX_EVENT_BYTES);
            prop_assert_eq!(got.last().and_then(code_of), Some("invalid_utf8"), "{:?}", got);
            for event in got.iter().flatten() {
                prop_assert!(!event.data.contains(char::REPLACEMENT_CHARACTER));
            }
        }

        #[test]
        fn an_event_over_the_limit_fails_the_stream_and_one_at_it_passes(
            size in 1usize..200,
            over in any::<bool>(),
            cuts in prop::collection::vec(any::<usize>(), 0..24),
        ) {
            // `data: ` and the text count; the line breaks do not.
            let limit = "data: ".len() + size;
            let text = "é".repeat(size / 2) + &"x".repeat(size % 2 + usize::from(over));
            let body = format!("data: {text}\n\ndata: x\n\n").into_bytes();
            let got = sse_of(cut(&body, &cuts), limit);
            if over {
                prop_assert_eq!(got.len(), 1);
                prop_assert_eq!(code_of(&got[0]), Some("event_too_large"));
                prop_assert!(!got[0].as_ref().unwrap_err().is_transient());
            } else {
                let data: Vec<&str> = got.iter().map(|e| e.as_ref().unwrap().data.as_str()).collect();
                prop_assert_eq!(data, [text.as_str(), "x"]);
            }
        }

        #[test]
        fn arbitrary_bytes_end_the_stream_without_panicking(
            bytes in prop::collection::vec(any::<u8>(), 0..400),
            cuts in prop::collection::vec(any::<usize>(), 0..24),
        ) {
            let got = sse_of(cut(&bytes, &cuts), 64);
            // Only the last item may be an error.
            for item in got.iter().rev().skip(1) {
                prop_assert!(item.is_ok());
            }
        }
    }

    #[test]
    fn an_endless_line_fails_once_the_limit_is_reached() {
        // Never ends: a parser that buffered until the line's end would
        // never return.
        let body = futures_util::stream::repeat(Ok(vec![b'a'; 1024]));
        let events = sse(
            body,
            Duration::from_secs(5),
            64 * 1024,
            |e: std::convert::Infallible| match e {},
        );
        let got = collect(events);
        assert_eq!(got.len(), 1);
        assert_eq!(code_of(&got[0]), Some("event_too_large"));
    }

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
