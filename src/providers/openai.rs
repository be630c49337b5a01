//! OpenAI-compatible chat completions, streaming (OpenAI, Ollama, vLLM,
//! llama.cpp server, LiteLLM, OpenRouter, …).

use futures_util::StreamExt;
use serde_json::{Value, json};

use super::{ModelEvent, ModelRequest, ModelStream, Provider, ProviderError, http};
use crate::domain::MessageRole;

pub const DEFAULT_BASE_URL: &str = "https://api.openai.com";

pub struct OpenAi(pub http::Endpoint);

fn describe(body: &Value) -> Option<(String, String)> {
    let error = body.get("error")?;
    let message = error.get("message")?.as_str()?.to_owned();
    let code = error
        .get("type")
        .and_then(Value::as_str)
        .or_else(|| error.get("code").and_then(Value::as_str))
        .unwrap_or("api_error")
        .to_owned();
    Some((code, message))
}

/// `{base}/v1/chat/completions`; a base that already ends in `/v1` (as
/// `OPENAI_BASE_URL` conventionally does) is not given a second one.
pub fn endpoint(base: &str) -> String {
    let base = base.trim_end_matches('/');
    if base.ends_with("/v1") {
        format!("{base}/chat/completions")
    } else {
        format!("{base}/v1/chat/completions")
    }
}

pub fn body(request: &ModelRequest) -> Value {
    let mut messages = Vec::new();
    if let Some(system) = &request.system {
        messages.push(json!({ "role": "system", "content": system }));
    }
    for turn in &request.turns {
        let role = match turn.role {
            MessageRole::User => "user",
            MessageRole::Assistant => "assistant",
        };
        messages.push(json!({ "role": role, "content": turn.plain_text() }));
    }
    json!({
        "model": request.model,
        "max_tokens": request.max_tokens,
        "stream": true,
        "stream_options": { "include_usage": true },
        "messages": messages,
    })
}

#[async_trait::async_trait]
impl Provider for OpenAi {
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let mut builder = http::client()?
            .post(endpoint(&self.0.base_url))
            .json(&body(&request));
        if let Some(key) = &self.0.api_key {
            builder = builder.bearer_auth(key);
        }
        let response = http::send(builder, describe).await?;
        let mut events = Box::pin(http::events(response, self.0.idle_timeout));
        let stream = async_stream::stream! {
            let mut stop_reason: Option<String> = None;
            while let Some(event) = events.next().await {
                let event = match event {
                    Ok(event) => event,
                    Err(err) => {
                        yield Err(err);
                        return;
                    }
                };
                if event.data.trim() == "[DONE]" {
                    yield Ok(ModelEvent::Finished { stop_reason: stop_reason.unwrap_or_default() });
                    return;
                }
                let Ok(chunk) = serde_json::from_str::<Value>(&event.data) else {
                    continue;
                };
                if let Some((code, message)) = describe(&chunk) {
                    yield Err(ProviderError::Stream { code, message });
                    return;
                }
                if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
                    yield Ok(ModelEvent::Usage {
                        input_tokens: usage["prompt_tokens"].as_i64().unwrap_or(0),
                        output_tokens: usage["completion_tokens"].as_i64().unwrap_or(0),
                    });
                }
                for choice in chunk["choices"].as_array().into_iter().flatten() {
                    let delta = &choice["delta"];
                    for field in ["reasoning_content", "reasoning"] {
                        if let Some(text) = delta[field].as_str().filter(|t| !t.is_empty()) {
                            yield Ok(ModelEvent::Reasoning(text.to_owned()));
                        }
                    }
                    if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                        yield Ok(ModelEvent::Text(text.to_owned()));
                    }
                    if let Some(reason) = choice["finish_reason"].as_str() {
                        stop_reason = Some(reason.to_owned());
                    }
                }
            }
            // Some servers end without `[DONE]`; a finish reason is enough.
            match stop_reason {
                Some(stop_reason) => yield Ok(ModelEvent::Finished { stop_reason }),
                None => yield Err(ProviderError::Network("the stream ended before it finished".into())),
            }
        };
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Turn;

    #[test]
    fn the_endpoint_takes_bases_with_and_without_v1() {
        assert_eq!(endpoint("http://h:1"), "http://h:1/v1/chat/completions");
        assert_eq!(endpoint("http://h:1/v1/"), "http://h:1/v1/chat/completions");
    }

    #[test]
    fn the_body_streams_with_usage_and_the_system_prompt_first() {
        let request = ModelRequest {
            model: "gpt-x".into(),
            system: Some("Be brief.".into()),
            turns: vec![Turn::text(MessageRole::User, "hi")],
            tools: Vec::new(),
            max_tokens: 50,
            thinking_budget: None,
            attempt: 1,
        };
        let body = body(&request);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["messages"][0]["role"], "system");
        assert_eq!(body["messages"][1]["content"], "hi");
    }
}
