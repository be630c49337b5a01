//! Configuration: the TOML file named by `TETHER_CONFIG` (or `./tether.toml`)
//! plus the environment, validated once at start-up. Every refusal names the
//! key it is about.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde::Deserialize;

pub const DEFAULT_DATABASE_URL: &str = "sqlite://tether.db?mode=rwc";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_CONFIG_PATH: &str = "tether.toml";

/// In-process tools every deployment has.
pub const BUILTIN_TOOLS: &[&str] = &["ask_questions", "demo_publish"];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("configuration file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("configuration key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

/// Everything the server needs to start, validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: String,
    pub listen: SocketAddr,
    /// `None`: the development secret is in use (loopback only).
    pub jwt_secret: Option<String>,
    pub encryption_key: Option<[u8; 32]>,
    pub file: FileConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub default_agent: Option<String>,
    #[serde(default)]
    pub runtime: RuntimeConfig,
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub api: ApiConfig,
    #[serde(default)]
    pub agents: Vec<AgentConfig>,
    #[serde(default)]
    pub tools: Vec<ToolConfig>,
    #[serde(default)]
    pub connections: Vec<ConnectionConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    pub lease_secs: f64,
    pub heartbeat_secs: f64,
    pub checkpoint_ms: u64,
    pub crash_retry_budget: u32,
    /// Runs one instance executes at once.
    pub concurrency: usize,
    /// How often workers look for runs without being woken.
    pub poll_ms: u64,
    /// How long shutdown waits for in-flight runs to reach a commit point.
    pub shutdown_grace_secs: f64,
    /// Calls of one batch that run at once.
    pub tool_concurrency: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            lease_secs: 15.0,
            heartbeat_secs: 5.0,
            checkpoint_ms: 250,
            crash_retry_budget: 3,
            concurrency: 16,
            poll_ms: 1000,
            shutdown_grace_secs: 10.0,
            tool_concurrency: 4,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    pub allow_always: bool,
    pub approval_ttl_secs: u64,
    pub question_ttl_secs: u64,
    pub tenants: Vec<TenantPolicy>,
}

/// The policy one tenant gets: the defaults with its overrides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantRules {
    pub allow_always: bool,
    pub approval_ttl_secs: u64,
    pub question_ttl_secs: u64,
}

impl PolicyConfig {
    pub fn for_tenant(&self, tenant: &str) -> TenantRules {
        let custom = self.tenants.iter().find(|t| t.tenant == tenant);
        TenantRules {
            allow_always: custom
                .and_then(|t| t.allow_always)
                .unwrap_or(self.allow_always),
            approval_ttl_secs: custom
                .and_then(|t| t.approval_ttl_secs)
                .unwrap_or(self.approval_ttl_secs),
            question_ttl_secs: custom
                .and_then(|t| t.question_ttl_secs)
                .unwrap_or(self.question_ttl_secs),
        }
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            allow_always: true,
            approval_ttl_secs: 86_400,
            question_ttl_secs: 86_400,
            tenants: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantPolicy {
    pub tenant: String,
    pub allow_always: Option<bool>,
    pub approval_ttl_secs: Option<u64>,
    pub question_ttl_secs: Option<u64>,
}

/// Limits on what one request may ask of the API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// Largest accepted `sendMessage` text, in bytes of UTF-8.
    pub max_message_bytes: usize,
    /// Largest accepted conversation title, in characters.
    pub max_title_chars: usize,
    /// Largest accepted HTTP request body, in bytes.
    pub max_request_bytes: usize,
    pub max_query_depth: usize,
    /// The cost a request may add up to, list fields counted once per item
    /// they may return.
    pub max_query_complexity: usize,
    /// Aliased fields one request may hold, fragments counted where spread.
    pub max_aliases: usize,
    /// How long a query may run before it is answered with `TIMEOUT`.
    pub request_timeout_secs: f64,
    /// Connections of the pool the API reads through, apart from the
    /// workers' pool.
    pub read_connections: u32,
    /// The most of `ToolCall.fullOutput` one field returns, in bytes.
    pub max_full_output_bytes: usize,
    /// How often the server pings an idle WebSocket.
    pub ws_keepalive_secs: u64,
    /// How long a new WebSocket may take to send `connection_init`.
    pub ws_init_timeout_secs: u64,
    /// Operations (subscriptions) one WebSocket may run at once.
    pub ws_max_operations: usize,
}

impl ApiConfig {
    /// Valid once the configuration is: validation bounds the seconds.
    pub fn request_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.request_timeout_secs)
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            max_message_bytes: 64 * 1024,
            max_title_chars: 200,
            max_request_bytes: 256 * 1024,
            max_query_depth: 16,
            max_query_complexity: 50_000,
            max_aliases: 50,
            request_timeout_secs: 30.0,
            read_connections: 8,
            max_full_output_bytes: 1024 * 1024,
            ws_keepalive_secs: 15,
            ws_init_timeout_secs: 10,
            ws_max_operations: 100,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    Anthropic,
    Openai,
    Scripted,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub name: String,
    pub provider: ProviderKind,
    pub model: Option<String>,
    pub base_url: Option<String>,
    pub api_key_env: Option<String>,
    /// Resolved at start-up from `api_key_env`, or from the provider's
    /// conventional variable when that is set.
    #[serde(skip)]
    pub api_key: Option<String>,
    pub system: Option<String>,
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    pub price: Option<Price>,
    /// Extended thinking (Anthropic): its token budget per response; off
    /// when absent.
    pub thinking_budget_tokens: Option<u32>,
    /// Scripted model only: milliseconds between streamed chunks.
    #[serde(default = "default_stream_delay_ms")]
    pub stream_delay_ms: u64,
    /// Longest silence between two chunks of a streamed response.
    #[serde(default = "default_idle_timeout_secs")]
    pub idle_timeout_secs: u64,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default)]
    pub context: ContextConfig,
    #[serde(default)]
    pub stop: StopConfig,
}

fn default_max_tokens() -> u32 {
    4096
}

fn default_stream_delay_ms() -> u64 {
    30
}

fn default_idle_timeout_secs() -> u64 {
    90
}

impl AgentConfig {
    pub fn model_name(&self) -> &str {
        self.model.as_deref().unwrap_or("scripted")
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_steps: u32,
    pub max_tool_calls: u32,
    pub timeout_secs: u64,
    pub max_input_tokens: Option<u64>,
    pub max_output_tokens: Option<u64>,
    pub max_cost_usd: Option<f64>,
    pub max_inline_tool_output_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_steps: 20,
            max_tool_calls: 50,
            timeout_secs: 600,
            max_input_tokens: None,
            max_output_tokens: None,
            max_cost_usd: None,
            max_inline_tool_output_bytes: 16 * 1024,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    pub max_attempts: u32,
    pub initial_delay_ms: u64,
    pub max_delay_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 5,
            initial_delay_ms: 500,
            max_delay_ms: 8_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ContextConfig {
    pub budget_tokens: u64,
    pub keep_recent_messages: u32,
}

impl Default for ContextConfig {
    fn default() -> Self {
        ContextConfig {
            budget_tokens: 150_000,
            keep_recent_messages: 8,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StopConfig {
    pub consecutive_tool_errors: Option<u32>,
    pub repeated_calls: Option<u32>,
    pub on_tools: Vec<String>,
    pub content_match: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recovery {
    Idempotent,
    #[default]
    NeverReplay,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    pub name: String,
    pub description: String,
    pub input_schema: serde_json::Value,
    pub risk: Option<String>,
    pub summary: Option<String>,
    pub estimated_cost_usd: Option<f64>,
    #[serde(default)]
    pub recovery: Recovery,
    pub http: Option<HttpTarget>,
    pub connection: Option<ToolConnection>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpTarget {
    #[serde(default = "default_method")]
    pub method: String,
    pub url: String,
    #[serde(default = "default_tool_timeout")]
    pub timeout_secs: u64,
}

fn default_method() -> String {
    "POST".to_owned()
}

fn default_tool_timeout() -> u64 {
    30
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConnection {
    pub provider: String,
    #[serde(default)]
    pub scopes: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConnectionMode {
    Oauth2,
    Token,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionConfig {
    pub provider: String,
    pub mode: ConnectionMode,
    pub authorize_url: Option<String>,
    pub token_url: Option<String>,
    pub client_id: Option<String>,
    pub client_secret_env: Option<String>,
    #[serde(skip)]
    pub client_secret: Option<String>,
    pub redirect_uri: Option<String>,
    #[serde(default)]
    pub scopes: Vec<String>,
    #[serde(default = "default_consent_ttl")]
    pub consent_ttl_secs: u64,
    pub token_env: Option<String>,
    #[serde(skip)]
    pub token: Option<String>,
}

fn default_consent_ttl() -> u64 {
    900
}

impl FileConfig {
    /// The configuration used when no file is given: one agent `demo` on the
    /// built-in scripted model.
    pub fn builtin() -> FileConfig {
        FileConfig {
            default_agent: Some("demo".to_owned()),
            runtime: RuntimeConfig::default(),
            policy: PolicyConfig::default(),
            api: ApiConfig::default(),
            agents: vec![AgentConfig {
                name: "demo".to_owned(),
                provider: ProviderKind::Scripted,
                model: None,
                base_url: None,
                api_key_env: None,
                api_key: None,
                system: None,
                tools: BUILTIN_TOOLS.iter().map(|t| (*t).to_owned()).collect(),
                max_tokens: default_max_tokens(),
                price: None,
                thinking_budget_tokens: None,
                stream_delay_ms: default_stream_delay_ms(),
                idle_timeout_secs: default_idle_timeout_secs(),
                limits: Limits::default(),
                retry: RetryConfig::default(),
                context: ContextConfig::default(),
                stop: StopConfig::default(),
            }],
            tools: Vec::new(),
            connections: Vec::new(),
        }
    }

    pub fn parse(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Parses and validates a configuration text, resolving `*_env` keys
    /// from the process environment.
    pub fn from_toml(text: &str) -> Result<FileConfig, ConfigError> {
        let mut file = FileConfig::parse(Path::new("<inline>"), text)?;
        file.validate(&|name| std::env::var(name).ok())?;
        Ok(file)
    }

    pub fn agent(&self, name: &str) -> Option<&AgentConfig> {
        self.agents.iter().find(|a| a.name == name)
    }

    /// The agent new conversations get when they name none.
    pub fn default_agent_name(&self) -> &str {
        match &self.default_agent {
            Some(name) => name,
            None => &self.agents[0].name,
        }
    }

    /// Checks cross-references and ranges, and resolves secrets named by
    /// `*_env` keys.
    fn validate(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let rt = &self.runtime;
        positive("runtime.lease_secs", rt.lease_secs)?;
        positive("runtime.heartbeat_secs", rt.heartbeat_secs)?;
        if rt.heartbeat_secs >= rt.lease_secs {
            return Err(invalid(
                "runtime.heartbeat_secs",
                "must be shorter than runtime.lease_secs",
            ));
        }
        at_least("runtime.checkpoint_ms", rt.checkpoint_ms, 1)?;
        at_least("runtime.concurrency", rt.concurrency, 1)?;
        at_least("runtime.poll_ms", rt.poll_ms, 10)?;
        non_negative("runtime.shutdown_grace_secs", rt.shutdown_grace_secs)?;
        let api = &self.api;
        at_least("api.max_message_bytes", api.max_message_bytes, 1)?;
        at_least("api.max_request_bytes", api.max_request_bytes, 1024)?;
        at_least("api.max_query_depth", api.max_query_depth, 4)?;
        at_least("api.max_query_complexity", api.max_query_complexity, 10)?;
        at_least("api.max_aliases", api.max_aliases, 1)?;
        positive("api.request_timeout_secs", api.request_timeout_secs)?;
        at_most(
            "api.request_timeout_secs",
            api.request_timeout_secs,
            MAX_REQUEST_TIMEOUT_SECS,
        )?;
        at_least("api.read_connections", api.read_connections, 1)?;
        at_least("api.max_full_output_bytes", api.max_full_output_bytes, 1024)?;
        at_least("api.ws_keepalive_secs", api.ws_keepalive_secs, 1)?;
        at_least("api.ws_init_timeout_secs", api.ws_init_timeout_secs, 1)?;
        at_least("api.ws_max_operations", api.ws_max_operations, 1)?;

        let mut tool_names: HashSet<String> =
            BUILTIN_TOOLS.iter().map(|t| (*t).to_owned()).collect();
        for (i, tool) in self.tools.iter().enumerate() {
            let key = format!("tools[{i}]");
            identifier(&format!("{key}.name"), &tool.name)?;
            if !tool_names.insert(tool.name.clone()) {
                return Err(invalid(
                    format!("{key}.name"),
                    format!(
                        "tool {:?} is defined twice or shadows a built-in",
                        tool.name
                    ),
                ));
            }
            if !tool.input_schema.is_object() {
                return Err(invalid(
                    format!("{key}.input_schema"),
                    "must be a JSON Schema object",
                ));
            }
            if let Err(e) = jsonschema::validator_for(&tool.input_schema) {
                return Err(invalid(
                    format!("{key}.input_schema"),
                    format!("not a valid JSON Schema: {e}"),
                ));
            }
            if let Some(http) = &tool.http {
                if !http.url.starts_with("http://") && !http.url.starts_with("https://") {
                    return Err(invalid(format!("{key}.http.url"), "must be an http(s) URL"));
                }
                if !["GET", "POST", "PUT", "PATCH", "DELETE"].contains(&http.method.as_str()) {
                    return Err(invalid(
                        format!("{key}.http.method"),
                        "must be one of GET, POST, PUT, PATCH, DELETE",
                    ));
                }
                at_least(&format!("{key}.http.timeout_secs"), http.timeout_secs, 1)?;
            }
            if let Some(conn) = &tool.connection
                && !self.connections.iter().any(|c| c.provider == conn.provider)
            {
                return Err(invalid(
                    format!("{key}.connection.provider"),
                    format!("no [[connections]] entry for provider {:?}", conn.provider),
                ));
            }
        }

        let mut providers = HashSet::new();
        for (i, conn) in self.connections.iter_mut().enumerate() {
            let key = format!("connections[{i}]");
            if !providers.insert(conn.provider.clone()) {
                return Err(invalid(
                    format!("{key}.provider"),
                    format!("provider {:?} is configured twice", conn.provider),
                ));
            }
            match conn.mode {
                ConnectionMode::Oauth2 => {
                    for (field, value) in [
                        ("authorize_url", &conn.authorize_url),
                        ("token_url", &conn.token_url),
                        ("client_id", &conn.client_id),
                        ("redirect_uri", &conn.redirect_uri),
                    ] {
                        if value.is_none() {
                            return Err(invalid(
                                format!("{key}.{field}"),
                                "is required for mode = \"oauth2\"",
                            ));
                        }
                    }
                    conn.client_secret = required_env(
                        &format!("{key}.client_secret_env"),
                        conn.client_secret_env.as_deref(),
                        env,
                    )?;
                }
                ConnectionMode::Token => {
                    conn.token =
                        required_env(&format!("{key}.token_env"), conn.token_env.as_deref(), env)?;
                }
            }
            at_least(&format!("{key}.consent_ttl_secs"), conn.consent_ttl_secs, 1)?;
        }

        if self.agents.is_empty() {
            return Err(invalid(
                "agents",
                "at least one [[agents]] entry is required",
            ));
        }
        let mut agent_names = HashSet::new();
        for (i, agent) in self.agents.iter_mut().enumerate() {
            let key = format!("agents[{i}]");
            identifier(&format!("{key}.name"), &agent.name)?;
            if !agent_names.insert(agent.name.clone()) {
                return Err(invalid(
                    format!("{key}.name"),
                    format!("agent {:?} is defined twice", agent.name),
                ));
            }
            let (conventional, conventional_base) = match agent.provider {
                ProviderKind::Anthropic => (Some("ANTHROPIC_API_KEY"), Some("ANTHROPIC_BASE_URL")),
                ProviderKind::Openai => (Some("OPENAI_API_KEY"), Some("OPENAI_BASE_URL")),
                ProviderKind::Scripted => (None, None),
            };
            if agent.base_url.is_none() {
                agent.base_url = conventional_base.and_then(env).filter(|u| !u.is_empty());
            }
            if conventional.is_some() && agent.model.is_none() {
                return Err(invalid(
                    format!("{key}.model"),
                    "is required for this provider",
                ));
            }
            agent.api_key = match (&agent.api_key_env, conventional) {
                (Some(var), _) => required_env(&format!("{key}.api_key_env"), Some(var), env)?,
                (None, Some(var)) => env(var),
                (None, None) => None,
            };
            if let Some(url) = &agent.base_url
                && !url.starts_with("http://")
                && !url.starts_with("https://")
            {
                return Err(invalid(format!("{key}.base_url"), "must be an http(s) URL"));
            }
            if let Some(budget) = agent.thinking_budget_tokens {
                // Anthropic's minimum for extended thinking.
                at_least(&format!("{key}.thinking_budget_tokens"), budget, 1024)?;
            }
            for (j, tool) in agent.tools.iter().enumerate() {
                if !tool_names.contains(tool) {
                    return Err(invalid(
                        format!("{key}.tools[{j}]"),
                        format!("unknown tool {tool:?}"),
                    ));
                }
            }
            for (j, tool) in agent.stop.on_tools.iter().enumerate() {
                if !agent.tools.contains(tool) {
                    return Err(invalid(
                        format!("{key}.stop.on_tools[{j}]"),
                        format!("{tool:?} is not one of this agent's tools"),
                    ));
                }
            }
            if let Some(pattern) = &agent.stop.content_match
                && let Err(e) = regex::Regex::new(pattern)
            {
                return Err(invalid(format!("{key}.stop.content_match"), e.to_string()));
            }
            at_least(&format!("{key}.max_tokens"), agent.max_tokens, 1)?;
            at_least(
                &format!("{key}.idle_timeout_secs"),
                agent.idle_timeout_secs,
                1,
            )?;
            at_least(
                &format!("{key}.limits.max_steps"),
                agent.limits.max_steps,
                1,
            )?;
            at_least(
                &format!("{key}.limits.timeout_secs"),
                agent.limits.timeout_secs,
                1,
            )?;
            at_least(
                &format!("{key}.retry.max_attempts"),
                agent.retry.max_attempts,
                1,
            )?;
            if agent.retry.max_delay_ms < agent.retry.initial_delay_ms {
                return Err(invalid(
                    format!("{key}.retry.max_delay_ms"),
                    "must not be less than retry.initial_delay_ms",
                ));
            }
            if let Some(cost) = agent.limits.max_cost_usd {
                positive(&format!("{key}.limits.max_cost_usd"), cost)?;
            }
            if let Some(price) = &agent.price {
                non_negative(&format!("{key}.price.input_per_mtok"), price.input_per_mtok)?;
                non_negative(
                    &format!("{key}.price.output_per_mtok"),
                    price.output_per_mtok,
                )?;
            }
        }
        if let Some(name) = &self.default_agent
            && !agent_names.contains(name)
        {
            return Err(invalid("default_agent", format!("no agent named {name:?}")));
        }
        for (i, tenant) in self.policy.tenants.iter().enumerate() {
            if tenant.tenant.is_empty() {
                return Err(invalid(
                    format!("policy.tenants[{i}].tenant"),
                    "must not be empty",
                ));
            }
        }
        Ok(())
    }
}

fn positive(key: &str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(invalid(key, "must be a positive number"))
    }
}

fn non_negative(key: &str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(invalid(key, "must not be negative"))
    }
}

/// A day: far beyond any useful query, and small enough for a `Duration`.
const MAX_REQUEST_TIMEOUT_SECS: f64 = 86_400.0;

fn at_most<T: PartialOrd + std::fmt::Display>(
    key: &str,
    value: T,
    max: T,
) -> Result<(), ConfigError> {
    if value <= max {
        Ok(())
    } else {
        Err(invalid(key, format!("must be at most {max}")))
    }
}

fn at_least<T: PartialOrd + std::fmt::Display>(
    key: &str,
    value: T,
    min: T,
) -> Result<(), ConfigError> {
    if value >= min {
        Ok(())
    } else {
        Err(invalid(key, format!("must be at least {min}")))
    }
}

fn identifier(key: &str, value: &str) -> Result<(), ConfigError> {
    let ok = !value.is_empty()
        && value.len() <= 64
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            key,
            "must be 1 to 64 characters of letters, digits, '_' or '-'",
        ))
    }
}

/// A variable named by an explicit `*_env` key must be set.
fn required_env(
    key: &str,
    var: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<String>, ConfigError> {
    let Some(var) = var else {
        return Err(invalid(key, "is required"));
    };
    match env(var) {
        Some(value) if !value.is_empty() => Ok(Some(value)),
        _ => Err(invalid(
            key,
            format!("environment variable {var} is not set"),
        )),
    }
}

impl Config {
    /// Reads the process environment and the configuration file.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::load(&|name| std::env::var(name).ok())
    }

    pub fn load(env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let mut file = match env("TETHER_CONFIG") {
            Some(path) => read_file(Path::new(&path))?,
            None if Path::new(DEFAULT_CONFIG_PATH).exists() => {
                read_file(Path::new(DEFAULT_CONFIG_PATH))?
            }
            None => FileConfig::builtin(),
        };
        file.validate(env)?;

        let database_url =
            env("TETHER_DATABASE_URL").unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
        if !database_url.starts_with("sqlite:") && !database_url.starts_with("postgres") {
            return Err(invalid(
                "TETHER_DATABASE_URL",
                "must be a sqlite:// or postgres:// URL",
            ));
        }
        let listen_text = env("TETHER_LISTEN").unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let listen: SocketAddr = listen_text.parse().map_err(|_| {
            invalid(
                "TETHER_LISTEN",
                format!("{listen_text:?} is not an address:port"),
            )
        })?;
        let jwt_secret = env("TETHER_JWT_SECRET").filter(|s| !s.is_empty());
        if jwt_secret.is_none() && !listen.ip().is_loopback() {
            return Err(invalid(
                "TETHER_JWT_SECRET",
                "must be set to serve on a non-loopback address",
            ));
        }
        let encryption_key = match env("TETHER_ENCRYPTION_KEY") {
            Some(text) => Some(decode_key(&text)?),
            None if !file.connections.is_empty() => {
                return Err(invalid(
                    "TETHER_ENCRYPTION_KEY",
                    "is required once a [[connections]] entry is configured",
                ));
            }
            None => None,
        };
        Ok(Config {
            database_url,
            listen,
            jwt_secret,
            encryption_key,
            file,
        })
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    FileConfig::parse(path, &text)
}

fn decode_key(text: &str) -> Result<[u8; 32], ConfigError> {
    base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .ok()
        .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
        .ok_or_else(|| {
            invalid(
                "TETHER_ENCRYPTION_KEY",
                "must be base64 of exactly 32 bytes",
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn load_with(toml: &str, vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let dir = std::env::temp_dir().join(format!("tether-config-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tether.toml");
        std::fs::write(&path, toml).unwrap();
        let mut map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        map.insert("TETHER_CONFIG".into(), path.display().to_string());
        let result = Config::load(&|name| map.get(name).cloned());
        std::fs::remove_dir_all(&dir).unwrap();
        result
    }

    fn message(result: Result<Config, ConfigError>) -> String {
        result
            .expect_err("configuration should be refused")
            .to_string()
    }

    #[test]
    fn the_sample_file_in_the_repository_is_valid() {
        let text = include_str!("../tether.toml");
        let config = load_with(text, &[]).expect("tether.toml must start as it is");
        assert!(
            config
                .file
                .agent(config.file.default_agent_name())
                .is_some()
        );
    }

    #[test]
    fn no_file_means_the_demo_agent_on_the_scripted_model() {
        let mut file = FileConfig::builtin();
        file.validate(&|_| None).unwrap();
        assert_eq!(file.default_agent_name(), "demo");
        let agent = file.agent("demo").unwrap();
        assert_eq!(agent.provider, ProviderKind::Scripted);
        assert_eq!(agent.tools, BUILTIN_TOOLS);
    }

    #[test]
    fn defaults_for_the_database_and_the_address() {
        let config = load_with("[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n", &[]).unwrap();
        assert_eq!(config.database_url, DEFAULT_DATABASE_URL);
        assert_eq!(config.listen.to_string(), DEFAULT_LISTEN);
        assert!(config.jwt_secret.is_none());
    }

    #[test]
    fn query_cost_keys_are_bounded() {
        let err = message(load_with("[api]\nrequest_timeout_secs = 1e300\n", &[]));
        assert!(err.contains("api.request_timeout_secs"), "{err}");
        let err = message(load_with("[api]\nrequest_timeout_secs = 0\n", &[]));
        assert!(err.contains("api.request_timeout_secs"), "{err}");
        let err = message(load_with("[api]\nmax_aliases = 0\n", &[]));
        assert!(err.contains("api.max_aliases"), "{err}");
        let err = message(load_with("[api]\nread_connections = 0\n", &[]));
        assert!(err.contains("api.read_connections"), "{err}");
        let config = load_with(
            "[api]\nrequest_timeout_secs = 0.25\n[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(
            config.file.api.request_timeout(),
            std::time::Duration::from_millis(250)
        );
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = message(load_with("[runtime]\nlease_seconds = 3\n", &[]));
        assert!(err.contains("lease_seconds"), "{err}");
        let err = message(load_with(
            "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\ncolour = \"red\"\n",
            &[],
        ));
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn bad_values_are_named() {
        let err = message(load_with("[runtime]\nlease_secs = \"long\"\n", &[]));
        assert!(err.contains("lease_secs"), "{err}");
        let err = message(load_with(
            "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n[agents.limits]\nmax_steps = 0\n",
            &[],
        ));
        assert!(err.contains("agents[0].limits.max_steps"), "{err}");
        let err = message(load_with(
            "[[agents]]\nname = \"a\"\nprovider = \"gemini\"\n",
            &[],
        ));
        assert!(err.contains("provider") || err.contains("gemini"), "{err}");
        let err = message(load_with(
            "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\ntools = [\"launch_rockets\"]\n",
            &[],
        ));
        assert!(err.contains("agents[0].tools[0]"), "{err}");
        let err = message(load_with(
            "default_agent = \"b\"\n[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n",
            &[],
        ));
        assert!(err.contains("default_agent"), "{err}");
    }

    #[test]
    fn an_explicit_env_key_must_name_a_set_variable() {
        let toml = "[[agents]]\nname = \"a\"\nprovider = \"anthropic\"\nmodel = \"m\"\napi_key_env = \"MY_KEY\"\n";
        let err = message(load_with(toml, &[]));
        assert!(
            err.contains("agents[0].api_key_env") && err.contains("MY_KEY"),
            "{err}"
        );
        let config = load_with(toml, &[("MY_KEY", "sk-1")]).unwrap();
        assert_eq!(config.file.agents[0].api_key.as_deref(), Some("sk-1"));
    }

    #[test]
    fn a_tool_schema_must_compile() {
        let toml = "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n[[tools]]\nname = \"t\"\ndescription = \"d\"\ninput_schema = { type = \"object\", properties = { n = { type = \"nonsense\" } } }\n";
        let err = message(load_with(toml, &[]));
        assert!(err.contains("tools[0].input_schema"), "{err}");
    }

    #[test]
    fn connections_need_the_encryption_key() {
        let toml = "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n[[connections]]\nprovider = \"acme\"\nmode = \"token\"\ntoken_env = \"ACME\"\n";
        let err = message(load_with(toml, &[("ACME", "t")]));
        assert!(err.contains("TETHER_ENCRYPTION_KEY"), "{err}");
        let key = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        assert!(load_with(toml, &[("ACME", "t"), ("TETHER_ENCRYPTION_KEY", &key)]).is_ok());
    }

    #[test]
    fn a_public_address_needs_a_real_secret() {
        let err = message(load_with(
            "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n",
            &[("TETHER_LISTEN", "0.0.0.0:8080")],
        ));
        assert!(err.contains("TETHER_JWT_SECRET"), "{err}");
    }
}
