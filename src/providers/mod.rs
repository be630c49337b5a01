//! Model providers: a streaming interface and its implementations.

pub mod anthropic;
pub mod http;
pub mod openai;
pub mod scripted;

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::BoxStream;
use serde_json::Value;

use crate::config::{AgentConfig, ProviderKind};
use crate::domain::MessageRole;
use crate::domain::retry::retryable_status;
use crate::redact;

/// One block of a turn, in the order the model produced or receives it.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    Text(String),
    /// The model's reasoning. With a `signature` (Anthropic's extended
    /// thinking) it is sent back unchanged; without one it is shown to people
    /// only and never sent.
    Reasoning {
        text: String,
        signature: Option<String>,
    },
    /// Reasoning the provider encrypted (Anthropic's `redacted_thinking`):
    /// opaque data, never shown as text, sent back unchanged in its place.
    RedactedReasoning {
        data: String,
    },
    /// A tool call as the model made it (`id` is the provider's own).
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    /// The one result of a tool call, in a user turn right after it.
    ToolResult {
        tool_use_id: String,
        output: String,
        is_error: bool,
    },
}

/// One turn of the history sent to the model, rebuilt from committed facts.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub role: MessageRole,
    pub content: Vec<Content>,
}

impl Turn {
    pub fn text(role: MessageRole, text: impl Into<String>) -> Turn {
        Turn {
            role,
            content: vec![Content::Text(text.into())],
        }
    }

    /// The turn's text blocks, joined.
    pub fn plain_text(&self) -> String {
        let mut text = String::new();
        for content in &self.content {
            if let Content::Text(chunk) = content {
                text.push_str(chunk);
            }
        }
        text
    }

    /// Whether this turn carries tool results (and so is not a person's
    /// message).
    pub fn has_tool_results(&self) -> bool {
        self.content
            .iter()
            .any(|c| matches!(c, Content::ToolResult { .. }))
    }

    /// Everything the turn carries, as readable text: for size estimates
    /// and for a summarizer that is given no tools.
    pub fn as_text(&self) -> String {
        let pieces: Vec<String> = self
            .content
            .iter()
            .map(|content| match content {
                Content::Text(text) | Content::Reasoning { text, .. } => text.clone(),
                Content::ToolUse { name, input, .. } => format!("[called {name} with {input}]"),
                Content::ToolResult { output, .. } => format!("[tool result: {output}]"),
                Content::RedactedReasoning { .. } => String::new(),
            })
            .collect();
        pieces.join("\n")
    }
}

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelRequest {
    pub model: String,
    pub system: Option<String>,
    pub turns: Vec<Turn>,
    pub tools: Vec<ToolSpec>,
    pub max_tokens: u32,
    /// Extended thinking's token budget, when the agent turns it on.
    pub thinking_budget: Option<u32>,
    /// Which attempt of this model request this is, from 1.
    pub attempt: u32,
}

/// What a model streams back.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelEvent {
    Text(String),
    Reasoning(String),
    /// The signature that closes a thinking block (sent back with it); the
    /// next reasoning is another block.
    ReasoningSignature(String),
    /// A whole block of encrypted reasoning (its opaque data).
    RedactedReasoning(String),
    /// A complete tool call (its input assembled from the streamed
    /// fragments).
    ToolCall {
        id: String,
        name: String,
        input: Value,
    },
    /// Tokens of this request so far (providers report them at start and end).
    Usage {
        input_tokens: i64,
        output_tokens: i64,
    },
    /// The model is done; why, in the provider's words.
    Finished {
        stop_reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// The provider answered with an error status.
    #[error("{message}")]
    Http {
        status: u16,
        /// The provider's error type, for example `rate_limit_error`.
        code: String,
        message: String,
        /// From `retry-after-ms` or `retry-after`.
        retry_after: Option<Duration>,
    },
    /// An `error` event in a stream that had started well.
    #[error("{message}")]
    Stream { code: String, message: String },
    #[error("network error: {0}")]
    Network(String),
    /// The provider cannot be used at all (configuration).
    #[error("{0}")]
    Unavailable(String),
    /// A response that cannot be used and that asking again would not mend:
    /// cut off by the token limit inside a tool call, or a stream line over
    /// the size limit.
    #[error("{message}")]
    Unusable { code: String, message: String },
}

impl ProviderError {
    /// An error event in the provider's own words, as it may be shown and
    /// stored: anything key-like masked, capped.
    pub fn reported(code: &str, message: &str) -> ProviderError {
        ProviderError::Stream {
            code: redact::message(code),
            message: redact::message(message),
        }
    }

    /// Worth another attempt: transient statuses, network trouble, and
    /// errors reported inside a stream.
    pub fn is_transient(&self) -> bool {
        match self {
            ProviderError::Http { status, .. } => retryable_status(*status),
            ProviderError::Stream { .. } | ProviderError::Network(_) => true,
            ProviderError::Unavailable(_) | ProviderError::Unusable { .. } => false,
        }
    }

    /// The error's class, for metrics: `rate_limited` (429), `overloaded`
    /// (503, 529), `server` (other 5xx), `client` (other statuses),
    /// `stream`, `network`, `unavailable` or `unusable`.
    pub fn class(&self) -> &'static str {
        match self {
            ProviderError::Http { status: 429, .. } => "rate_limited",
            ProviderError::Http {
                status: 503 | 529, ..
            } => "overloaded",
            ProviderError::Http { status, .. } if *status >= 500 => "server",
            ProviderError::Http { .. } => "client",
            ProviderError::Stream { .. } => "stream",
            ProviderError::Network(_) => "network",
            ProviderError::Unavailable(_) => "unavailable",
            ProviderError::Unusable { .. } => "unusable",
        }
    }

    /// A response that hit the token limit before a tool call's input was
    /// complete: the same request would be cut off again.
    pub fn cut_off_in_tool_call() -> ProviderError {
        ProviderError::Unusable {
            code: "max_tokens".into(),
            message: "the model's response hit the token limit (max_tokens) inside a tool \
                      call, so the call's input is incomplete; raise the agent's max_tokens"
                .into(),
        }
    }

    /// An event whose data is not the JSON the provider's format promises:
    /// the stream is garbled (a proxy, a cut connection), so the attempt is
    /// abandoned rather than any of it skipped in silence.
    pub fn invalid_event(why: impl std::fmt::Display) -> ProviderError {
        ProviderError::Stream {
            code: "invalid_event".into(),
            message: format!("the provider sent an event that is not valid JSON: {why}"),
        }
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ProviderError::Http { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

pub type ModelStream = BoxStream<'static, Result<ModelEvent, ProviderError>>;

#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// Starts a streaming request. Dropping the stream aborts it.
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError>;
}

fn endpoint(agent: &AgentConfig, default_base: &str, idle_timeout: Duration) -> http::Endpoint {
    http::Endpoint {
        base_url: agent
            .base_url
            .clone()
            .unwrap_or_else(|| default_base.to_owned()),
        api_key: agent.api_key.clone(),
        idle_timeout,
    }
}

/// The provider an agent is configured with.
pub fn for_agent(agent: &AgentConfig) -> Arc<dyn Provider> {
    let idle_timeout = Duration::from_secs(agent.idle_timeout_secs);
    match agent.provider {
        ProviderKind::Scripted => Arc::new(scripted::Scripted::new(agent.stream_delay_ms)),
        ProviderKind::Anthropic => Arc::new(anthropic::Anthropic(endpoint(
            agent,
            anthropic::DEFAULT_BASE_URL,
            idle_timeout,
        ))),
        ProviderKind::Openai => Arc::new(openai::OpenAi(endpoint(
            agent,
            openai::DEFAULT_BASE_URL,
            idle_timeout,
        ))),
    }
}
