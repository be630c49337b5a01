//! The built-in scripted model: deterministic and offline. It quotes the
//! latest user message in a reply streamed in small chunks; a line of that
//! message may direct it (`/hold SECONDS`, `/fail STATUS`, `/stream
//! TOKENS`, `/ask`, `/tool NAME {json}`, and the extension `/loop NAME
//! {json}`).

use std::time::Duration;

use futures_util::StreamExt;

use serde_json::{Value, json};

use super::{Content, ModelEvent, ModelRequest, ModelStream, Provider, ProviderError};
use crate::domain::MessageRole;

/// Characters per streamed chunk.
const CHUNK_CHARS: usize = 8;
/// The pace of `/hold`: one chunk this often.
const HOLD_TICK: Duration = Duration::from_millis(100);
/// The longest quote of the user's message, in characters.
const QUOTE_CHARS: usize = 120;
/// The most tokens `/stream` streams.
const MAX_STREAM_TOKENS: usize = 1_000_000;
/// What `/stream` streams, one word a token, in turn: four characters each,
/// so that the usual estimate (characters / 4) counts one token a word.
const STREAM_WORDS: [&str; 4] = ["one ", "two ", "six ", "ten "];

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
    /// The reply is this many tokens, one chunk each, `stream_delay_ms`
    /// apart, each handed over on its own (for measuring long streams).
    Stream(usize),
    /// Calls these tools (one batch), then replies with their results.
    Tools(Vec<(String, Value)>),
    /// Calls this tool at every step and never replies (an extension for
    /// trying stop conditions and limits).
    Loop(String, Value),
}

/// A tool directive's input: JSON when it parses, else the text itself (a
/// string, which a schema will refuse, as a model's bad input would be).
fn tool_input(rest: &str) -> Value {
    let rest = rest.trim();
    if rest.is_empty() {
        return json!({});
    }
    serde_json::from_str(rest).unwrap_or_else(|_| Value::String(rest.to_owned()))
}

/// `NAME rest` of a tool line.
fn tool_line(rest: &str) -> Option<(String, Value)> {
    let rest = rest.trim_start();
    let name: String = rest.chars().take_while(|c| !c.is_whitespace()).collect();
    (!name.is_empty()).then(|| {
        let input = tool_input(&rest[name.len()..]);
        (name, input)
    })
}

/// What `/ask` asks: a single-choice, a multiple-choice and a free-text
/// question.
fn demo_questions() -> Value {
    json!({ "questions": [
        { "key": "color", "prompt": "Which colour should the banner be?", "options": [
            { "value": "red", "label": "Red" },
            { "value": "blue", "label": "Blue", "description": "The calm one" } ] },
        { "key": "days", "prompt": "Which days should it run?", "multiple": true, "options": [
            { "value": "mon", "label": "Monday" },
            { "value": "tue", "label": "Tuesday" },
            { "value": "wed", "label": "Wednesday" } ] },
        { "key": "name", "prompt": "What should we call it?" }
    ] })
}

pub fn directive(text: &str) -> Directive {
    let mut tools = Vec::new();
    let mut other = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("/tool ") {
            tools.extend(tool_line(rest));
            continue;
        }
        if line == "/ask" {
            tools.push(("ask_questions".to_owned(), demo_questions()));
            continue;
        }
        if let Some(rest) = line.strip_prefix("/loop ")
            && let Some((name, input)) = tool_line(rest)
        {
            return Directive::Loop(name, input);
        }
        let mut words = line.split_whitespace();
        let found = match (words.next(), words.next()) {
            (Some("/hold"), Some(seconds)) => seconds
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(|s| Directive::Hold(Duration::from_secs_f64(s.min(3600.0)))),
            (Some("/fail"), Some(status)) => status
                .parse::<u16>()
                .ok()
                .filter(|s| (400..=599).contains(s))
                .map(Directive::Fail),
            (Some("/stream"), Some(tokens)) => tokens
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .map(|n| Directive::Stream(n.min(MAX_STREAM_TOKENS))),
            _ => None,
        };
        if other.is_none() {
            other = found;
        }
    }
    if !tools.is_empty() {
        return Directive::Tools(tools);
    }
    other.unwrap_or(Directive::Reply)
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

/// The person's latest message, and the tool results that came after it
/// (with the names of their calls), newest batch last.
fn latest(request: &ModelRequest) -> (&str, Vec<(String, String)>) {
    let Some(at) = request
        .turns
        .iter()
        .rposition(|t| t.role == MessageRole::User && !t.plain_text().is_empty())
    else {
        return ("", Vec::new());
    };
    let person = request.turns[at]
        .content
        .iter()
        .find_map(|c| match c {
            Content::Text(text) => Some(text.as_str()),
            _ => None,
        })
        .unwrap_or("");
    let mut names = std::collections::HashMap::new();
    let mut results = Vec::new();
    for turn in &request.turns[at + 1..] {
        for content in &turn.content {
            match content {
                Content::ToolUse { id, name, .. } => {
                    names.insert(id.as_str(), name.as_str());
                }
                Content::ToolResult {
                    tool_use_id,
                    output,
                    ..
                } => results.push((
                    names
                        .get(tool_use_id.as_str())
                        .map_or_else(|| tool_use_id.clone(), |n| (*n).to_owned()),
                    output.clone(),
                )),
                _ => {}
            }
        }
    }
    (person, results)
}

fn quote(text: &str) -> String {
    let mut quote: String = text.trim().chars().take(QUOTE_CHARS).collect();
    if text.trim().chars().count() > QUOTE_CHARS {
        quote.push('…');
    }
    quote
}

/// The reply to a request: about forty tokens that quote the user and say
/// how much history the model was given, or what the tools returned.
pub fn reply(request: &ModelRequest) -> String {
    let (person, results) = latest(request);
    if !results.is_empty() {
        let said: Vec<String> = results
            .iter()
            .map(|(name, output)| format!("{name} returned {}", quote(output)))
            .collect();
        return format!("The tools answered: {}.", said.join("; "));
    }
    let earlier = request.turns.len().saturating_sub(1);
    format!(
        "You said: \"{}\". This is Tether's scripted model, streaming its reply in small \
         chunks so that you can watch the message grow; it sees {earlier} earlier messages in \
         this conversation.",
        quote(person)
    )
}

/// The `/stream` reply of `tokens` tokens, one chunk a token.
pub fn stream_tokens(tokens: usize) -> Vec<String> {
    (0..tokens)
        .map(|i| STREAM_WORDS[i % STREAM_WORDS.len()].to_owned())
        .collect()
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
        let (person, results) = latest(&request);
        let input_tokens: i64 = request
            .turns
            .iter()
            .map(|t| estimate_tokens(&t.as_text()))
            .sum::<i64>()
            + request.system.as_deref().map_or(0, estimate_tokens);
        let mut calls = Vec::new();
        let mut streamed = None;
        let hold = match directive(person) {
            Directive::Hold(duration) => duration,
            Directive::Stream(tokens) if results.is_empty() => {
                streamed = Some(stream_tokens(tokens));
                Duration::ZERO
            }
            Directive::Fail(status) if request.attempt <= 1 => return Err(failure(status)),
            Directive::Tools(tools) if results.is_empty() => {
                calls = tools;
                Duration::ZERO
            }
            Directive::Loop(name, input) => {
                calls = vec![(name, input)];
                Duration::ZERO
            }
            Directive::Fail(_) | Directive::Reply | Directive::Tools(_) | Directive::Stream(_) => {
                Duration::ZERO
            }
        };
        // `/stream` hands over each chunk as its own event, as chunks read
        // from a network would come; the others come as fast as polled.
        let one_by_one = streamed.is_some();
        let (pieces, output_tokens) = match streamed {
            Some(tokens) => {
                let count = tokens.len() as i64;
                (tokens, count)
            }
            None => {
                let text = if calls.is_empty() {
                    reply(&request)
                } else {
                    let names: Vec<&str> = calls.iter().map(|(name, _)| name.as_str()).collect();
                    format!("Calling {}.", names.join(", "))
                };
                (chunks(&text), estimate_tokens(&text))
            }
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
            for chunk in pieces {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                } else if one_by_one {
                    tokio::task::yield_now().await;
                }
                yield Ok(ModelEvent::Text(chunk));
            }
            let stop_reason = if calls.is_empty() { "end_turn" } else { "tool_use" };
            for (name, input) in calls {
                let id = format!("call_{}", uuid::Uuid::now_v7().simple());
                yield Ok(ModelEvent::ToolCall { id, name, input });
            }
            yield Ok(ModelEvent::Usage { input_tokens, output_tokens });
            yield Ok(ModelEvent::Finished { stop_reason: stop_reason.to_owned() });
        };
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Turn;

    fn request(turns: Vec<Turn>) -> ModelRequest {
        ModelRequest {
            model: "scripted".into(),
            system: None,
            turns,
            tools: Vec::new(),
            max_tokens: 100,
            thinking_budget: None,
            attempt: 1,
        }
    }

    fn texts(texts: &[(MessageRole, &str)]) -> ModelRequest {
        request(
            texts
                .iter()
                .map(|(role, text)| Turn::text(*role, *text))
                .collect(),
        )
    }

    async fn events(request: ModelRequest) -> Vec<ModelEvent> {
        Scripted::new(0)
            .stream(request)
            .await
            .unwrap()
            .map(Result::unwrap)
            .collect()
            .await
    }

    fn text_of(events: &[ModelEvent]) -> String {
        events
            .iter()
            .filter_map(|e| match e {
                ModelEvent::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
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
        assert_eq!(
            directive("/tool a {\"x\": 1}\n/tool b\n/tool c not json"),
            Directive::Tools(vec![
                ("a".into(), json!({ "x": 1 })),
                ("b".into(), json!({})),
                ("c".into(), json!("not json")),
            ])
        );
        let Directive::Tools(asked) = directive("/ask") else {
            panic!("/ask calls a tool");
        };
        assert_eq!(asked[0].0, "ask_questions");
        assert_eq!(asked[0].1["questions"].as_array().unwrap().len(), 3);
        assert_eq!(
            directive("/loop a {}"),
            Directive::Loop("a".into(), json!({}))
        );
        assert_eq!(directive("/stream 10000"), Directive::Stream(10_000));
        assert_eq!(
            directive("/stream 99999999"),
            Directive::Stream(MAX_STREAM_TOKENS)
        );
        assert_eq!(directive("/stream 0"), Directive::Reply);
        assert_eq!(directive("/stream many"), Directive::Reply);
    }

    #[tokio::test]
    async fn stream_streams_that_many_tokens_one_chunk_each() {
        let events = events(texts(&[(MessageRole::User, "/stream 1000")])).await;
        let chunks: Vec<&str> = events
            .iter()
            .filter_map(|e| match e {
                ModelEvent::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(chunks.len(), 1000);
        assert!(chunks.iter().all(|c| estimate_tokens(c) == 1), "{chunks:?}");
        assert_eq!(chunks.concat(), stream_tokens(1000).concat());
        assert!(events.contains(&ModelEvent::Usage {
            input_tokens: estimate_tokens("/stream 1000"),
            output_tokens: 1000
        }));
        assert_eq!(
            events.last(),
            Some(&ModelEvent::Finished {
                stop_reason: "end_turn".into()
            })
        );
    }

    #[tokio::test]
    async fn the_stream_is_the_reply_in_chunks_with_usage() {
        let request = texts(&[
            (MessageRole::User, "hi"),
            (MessageRole::Assistant, "hello"),
            (MessageRole::User, "héllo wörld"),
        ]);
        let events = events(request.clone()).await;
        let text = text_of(&events);
        assert_eq!(text, reply(&request));
        assert!(text.contains("\"héllo wörld\""));
        assert!(text.contains("sees 2 earlier messages"));
        assert!(matches!(events.last(), Some(ModelEvent::Finished { .. })));
        let words = text.split_whitespace().count();
        assert!((25..=60).contains(&words), "{words} words");
    }

    #[tokio::test]
    async fn tool_directives_call_once_then_reply_with_the_results() {
        let first = events(texts(&[(
            MessageRole::User,
            "/tool echo {\"n\": 1}\n/tool other",
        )]))
        .await;
        let calls: Vec<(String, String, Value)> = first
            .iter()
            .filter_map(|e| match e {
                ModelEvent::ToolCall { id, name, input } => {
                    Some((id.clone(), name.clone(), input.clone()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].1.as_str(), &calls[0].2),
            ("echo", &json!({ "n": 1 }))
        );
        assert_ne!(calls[0].0, calls[1].0, "call ids are distinct");
        assert_eq!(
            first.last(),
            Some(&ModelEvent::Finished {
                stop_reason: "tool_use".into()
            })
        );

        let mut turns = vec![Turn::text(MessageRole::User, "/tool echo {\"n\": 1}")];
        turns.push(Turn {
            role: MessageRole::Assistant,
            content: vec![Content::ToolUse {
                id: "c1".into(),
                name: "echo".into(),
                input: json!({ "n": 1 }),
            }],
        });
        turns.push(Turn {
            role: MessageRole::User,
            content: vec![Content::ToolResult {
                tool_use_id: "c1".into(),
                output: "{\"n\":1}".into(),
                is_error: false,
            }],
        });
        let second = events(request(turns.clone())).await;
        assert!(
            !second
                .iter()
                .any(|e| matches!(e, ModelEvent::ToolCall { .. }))
        );
        assert_eq!(
            text_of(&second),
            "The tools answered: echo returned {\"n\":1}."
        );

        // `/loop` calls again whatever came back.
        turns[0] = Turn::text(MessageRole::User, "/loop echo {}");
        let looped = events(request(turns)).await;
        assert!(
            looped
                .iter()
                .any(|e| matches!(e, ModelEvent::ToolCall { .. }))
        );
    }

    #[tokio::test]
    async fn fail_fails_the_first_attempt_only() {
        let mut request = texts(&[(MessageRole::User, "/fail 429")]);
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
