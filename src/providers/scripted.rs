//! The built-in scripted model: deterministic and offline. It quotes the
//! latest user message in a reply streamed in small chunks; a line of that
//! message may direct it (`/hold SECONDS`, `/fail STATUS`).

use std::time::Duration;

use futures_util::StreamExt;

use super::{ModelEvent, ModelRequest, ModelStream, Provider, ProviderError};
use crate::domain::MessageRole;

/// Characters per streamed chunk.
const CHUNK_CHARS: usize = 8;
/// The pace of `/hold`: one chunk this often.
const HOLD_TICK: Duration = Duration::from_millis(100);
/// The longest quote of the user's message, in characters.
const QUOTE_CHARS: usize = 120;

pub struct Scripted {
    delay: Duration,
}

impl Scripted {
    pub fn new(stream_delay_ms: u64) -> Scripted {
        Scripted {
            delay: Duration::from_millis(stream_delay_ms),
        }
    }
}

/// What the latest user message asks of the model.
#[derive(Debug, Clone, PartialEq)]
pub enum Directive {
    Reply,
    Hold(Duration),
    /// The first attempt fails as a provider would with this HTTP status.
    Fail(u16),
}

pub fn directive(text: &str) -> Directive {
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("/hold"), Some(seconds)) => {
                if let Ok(seconds) = seconds.parse::<f64>()
                    && seconds.is_finite()
                    && seconds >= 0.0
                {
                    return Directive::Hold(Duration::from_secs_f64(seconds.min(3600.0)));
                }
            }
            (Some("/fail"), Some(status)) => {
                if let Ok(status) = status.parse::<u16>()
                    && (400..=599).contains(&status)
                {
                    return Directive::Fail(status);
                }
            }
            _ => {}
        }
    }
    Directive::Reply
}

/// The error a provider would answer with for `status` (Anthropic's error
/// types); 429 comes with `retry-after: 1`.
pub fn failure(status: u16) -> ProviderError {
    let code = match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    };
    ProviderError::Http {
        status,
        code: code.to_owned(),
        message: format!(
            "The scripted model failed this attempt with HTTP {status}, as /fail asked."
        ),
        retry_after: (status == 429).then(|| Duration::from_secs(1)),
    }
}

/// The reply to a request: about forty tokens that quote the user and say
/// how much history the model was given.
pub fn reply(request: &ModelRequest) -> String {
    let latest = request
        .turns
        .iter()
        .rev()
        .find(|t| t.role == MessageRole::User)
        .map_or("", |t| t.text.as_str());
    let mut quote: String = latest.trim().chars().take(QUOTE_CHARS).collect();
    if latest.trim().chars().count() > QUOTE_CHARS {
        quote.push('…');
    }
    let earlier = request.turns.len().saturating_sub(1);
    format!(
        "You said: \"{quote}\". This is Tether's scripted model, streaming its reply in small \
         chunks so that you can watch the message grow; it sees {earlier} earlier messages in \
         this conversation."
    )
}

fn chunks(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars
        .chunks(CHUNK_CHARS)
        .map(|c| c.iter().collect())
        .collect()
}

/// A rough token count: characters / 4, at least one.
pub fn estimate_tokens(text: &str) -> i64 {
    (text.chars().count() as i64 / 4).max(1)
}

#[async_trait::async_trait]
impl Provider for Scripted {
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let latest = request
            .turns
            .iter()
            .rev()
            .find(|t| t.role == MessageRole::User)
            .map(|t| t.text.clone())
            .unwrap_or_default();
        let input_tokens: i64 = request
            .turns
            .iter()
            .map(|t| estimate_tokens(&t.text))
            .sum::<i64>()
            + request.system.as_deref().map_or(0, estimate_tokens);
        let text = reply(&request);
        let output_tokens = estimate_tokens(&text);
        let hold = match directive(&latest) {
            Directive::Hold(duration) => duration,
            Directive::Fail(status) if request.attempt <= 1 => return Err(failure(status)),
            Directive::Fail(_) | Directive::Reply => Duration::ZERO,
        };
        let delay = self.delay;
        let stream = async_stream::stream! {
            yield Ok(ModelEvent::Usage { input_tokens, output_tokens: 0 });
            let until = tokio::time::Instant::now() + hold;
            let mut tick = 0usize;
            while tokio::time::Instant::now() < until {
                tick += 1;
                yield Ok(ModelEvent::Text(format!("holding {tick}… ")));
                tokio::time::sleep(HOLD_TICK).await;
            }
            for chunk in chunks(&text) {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                yield Ok(ModelEvent::Text(chunk));
            }
            yield Ok(ModelEvent::Usage { input_tokens, output_tokens });
            yield Ok(ModelEvent::Finished { stop_reason: "end_turn".to_owned() });
        };
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Turn;

    fn request(texts: &[(MessageRole, &str)]) -> ModelRequest {
        ModelRequest {
            model: "scripted".into(),
            system: None,
            turns: texts
                .iter()
                .map(|(role, text)| Turn {
                    role: *role,
                    text: (*text).to_owned(),
                })
                .collect(),
            max_tokens: 100,
            attempt: 1,
        }
    }

    #[test]
    fn directives_are_read_from_any_line() {
        assert_eq!(directive("hello"), Directive::Reply);
        assert_eq!(
            directive("first line\n/hold 2.5"),
            Directive::Hold(Duration::from_millis(2500))
        );
        assert_eq!(directive("/hold soon"), Directive::Reply);
        assert_eq!(directive("/fail 429"), Directive::Fail(429));
        assert_eq!(directive("/fail 200"), Directive::Reply);
    }

    #[tokio::test]
    async fn the_stream_is_the_reply_in_chunks_with_usage() {
        let request = request(&[
            (MessageRole::User, "hi"),
            (MessageRole::Assistant, "hello"),
            (MessageRole::User, "héllo wörld"),
        ]);
        let events: Vec<_> = Scripted::new(0)
            .stream(request.clone())
            .await
            .unwrap()
            .collect()
            .await;
        let text: String = events
            .iter()
            .filter_map(|e| match e {
                Ok(ModelEvent::Text(t)) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(text, reply(&request));
        assert!(text.contains("\"héllo wörld\""));
        assert!(text.contains("sees 2 earlier messages"));
        assert!(matches!(
            events.last(),
            Some(Ok(ModelEvent::Finished { .. }))
        ));
        let words = text.split_whitespace().count();
        assert!((25..=60).contains(&words), "{words} words");
    }
}

#[cfg(test)]
mod fail_tests {
    use super::*;
    use crate::providers::Turn;

    #[tokio::test]
    async fn fail_fails_the_first_attempt_only() {
        let mut request = ModelRequest {
            model: "scripted".into(),
            system: None,
            turns: vec![Turn {
                role: MessageRole::User,
                text: "/fail 429".into(),
            }],
            max_tokens: 100,
            attempt: 1,
        };
        let Err(err) = Scripted::new(0).stream(request.clone()).await else {
            panic!("the first attempt fails");
        };
        assert!(err.is_transient());
        assert_eq!(err.retry_after(), Some(Duration::from_secs(1)));
        request.attempt = 2;
        assert!(Scripted::new(0).stream(request).await.is_ok());
        assert!(!failure(400).is_transient());
        assert!(failure(529).is_transient());
    }
}
