//! Anthropic's Messages API, streaming.

use futures_util::StreamExt;
use serde_json::{Value, json};

use super::{ModelEvent, ModelRequest, ModelStream, Provider, ProviderError, Turn, http};
use crate::domain::MessageRole;

pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
const VERSION: &str = "2023-06-01";

pub struct Anthropic(pub http::Endpoint);

/// The provider's error type and message from an error body.
fn describe(body: &Value) -> Option<(String, String)> {
    let error = body.get("error")?;
    Some((
        error.get("type")?.as_str()?.to_owned(),
        error.get("message")?.as_str()?.to_owned(),
    ))
}

/// Turns as Messages API messages: consecutive turns of one role merged.
fn messages(turns: &[Turn]) -> Vec<Value> {
    let mut merged: Vec<(MessageRole, String)> = Vec::new();
    for turn in turns {
        match merged.last_mut() {
            Some((role, text)) if *role == turn.role => {
                text.push_str("\n\n");
                text.push_str(&turn.plain_text());
            }
            _ => merged.push((turn.role, turn.plain_text())),
        }
    }
    merged
        .into_iter()
        .map(|(role, text)| {
            let role = match role {
                MessageRole::User => "user",
                MessageRole::Assistant => "assistant",
            };
            json!({ "role": role, "content": [{ "type": "text", "text": text }] })
        })
        .collect()
}

pub fn body(request: &ModelRequest) -> Value {
    let mut body = json!({
        "model": request.model,
        "max_tokens": request.max_tokens,
        "stream": true,
        "messages": messages(&request.turns),
    });
    if let Some(system) = &request.system {
        body["system"] = json!(system);
    }
    body
}

#[async_trait::async_trait]
impl Provider for Anthropic {
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let key = self.0.api_key.clone().ok_or_else(|| {
            ProviderError::Unavailable(
                "no Anthropic API key: set ANTHROPIC_API_KEY or the agent's api_key_env".into(),
            )
        })?;
        let url = format!("{}/v1/messages", self.0.base_url.trim_end_matches('/'));
        let builder = http::client()?
            .post(url)
            .header("x-api-key", key)
            .header("anthropic-version", VERSION)
            .json(&body(&request));
        let response = http::send(builder, describe).await?;
        let mut events = Box::pin(http::events(response, self.0.idle_timeout));
        let stream = async_stream::stream! {
            let mut input_tokens = 0;
            let mut output_tokens;
            let mut stop_reason = String::new();
            while let Some(event) = events.next().await {
                let event = match event {
                    Ok(event) => event,
                    Err(err) => {
                        yield Err(err);
                        return;
                    }
                };
                let Ok(data) = serde_json::from_str::<Value>(&event.data) else {
                    continue;
                };
                let kind = data["type"].as_str().unwrap_or(event.event.as_str());
                match kind {
                    "message_start" => {
                        let usage = &data["message"]["usage"];
                        input_tokens = ["input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"]
                            .iter()
                            .filter_map(|k| usage[k].as_i64())
                            .sum();
                        output_tokens = usage["output_tokens"].as_i64().unwrap_or(0);
                        yield Ok(ModelEvent::Usage { input_tokens, output_tokens });
                    }
                    "content_block_delta" => {
                        let delta = &data["delta"];
                        match delta["type"].as_str() {
                            Some("text_delta") => {
                                if let Some(text) = delta["text"].as_str() {
                                    yield Ok(ModelEvent::Text(text.to_owned()));
                                }
                            }
                            Some("thinking_delta") => {
                                if let Some(text) = delta["thinking"].as_str() {
                                    yield Ok(ModelEvent::Reasoning(text.to_owned()));
                                }
                            }
                            _ => {}
                        }
                    }
                    "message_delta" => {
                        if let Some(reason) = data["delta"]["stop_reason"].as_str() {
                            stop_reason = reason.to_owned();
                        }
                        if let Some(tokens) = data["usage"]["output_tokens"].as_i64() {
                            output_tokens = tokens;
                            yield Ok(ModelEvent::Usage { input_tokens, output_tokens });
                        }
                    }
                    "message_stop" => {
                        yield Ok(ModelEvent::Finished { stop_reason });
                        return;
                    }
                    "error" => {
                        let (code, message) = describe(&data)
                            .unwrap_or_else(|| ("api_error".into(), event.data.clone()));
                        yield Err(ProviderError::Stream { code, message });
                        return;
                    }
                    _ => {}
                }
            }
            yield Err(ProviderError::Network("the stream ended before message_stop".into()));
        };
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_of_one_role_are_merged_and_the_system_prompt_is_separate() {
        let request = ModelRequest {
            model: "claude-x".into(),
            system: Some("Be brief.".into()),
            turns: vec![
                Turn::text(MessageRole::User, "a"),
                Turn::text(MessageRole::User, "b"),
                Turn::text(MessageRole::Assistant, "c"),
            ],
            tools: Vec::new(),
            max_tokens: 99,
            thinking_budget: None,
            attempt: 1,
        };
        let body = body(&request);
        assert_eq!(body["system"], "Be brief.");
        assert_eq!(body["max_tokens"], 99);
        assert_eq!(body["stream"], true);
        assert_eq!(body["messages"][0]["content"][0]["text"], "a\n\nb");
        assert_eq!(body["messages"][1]["role"], "assistant");
    }
}
