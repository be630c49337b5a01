//! Configuration: the TOML file named by `TETHER_CONFIG` (or `./tether.toml`)
//! plus the environment, validated once at start-up. Every refusal names the
//! key it is about.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde::Deserialize;

use crate::redact::{Hidden, Origin};

pub const DEFAULT_DATABASE_URL: &str = "sqlite://tether.db?mode=rwc";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_CONFIG_PATH: &str = "tether.toml";

/// The longest duration any configuration key may give (366 days), so that
/// no duration, however it is multiplied into milliseconds or added to a
/// clock, can overflow.
pub const MAX_DURATION_SECS: u64 = 366 * 24 * 3600;
const MAX_DURATION_MS: u64 = MAX_DURATION_SECS * 1000;

/// A shorter HS256 secret can be guessed offline from one token.
pub const MIN_SECRET_BYTES: usize = 32;

/// The asymmetric algorithms a JWKS may verify; HS256 goes with secrets only.
pub const JWKS_ALGORITHMS: &[&str] = &[
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA",
];

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
#[derive(Clone)]
pub struct Config {
    pub database_url: String,
    pub listen: SocketAddr,
    /// `TETHER_JWT_SECRET`. `None`: see [`Config::secret_source`].
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
    pub database: DatabaseConfig,
    #[serde(default)]
    pub auth: AuthConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
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
    /// Runs of one tenant executing at once, over every instance; unset:
    /// no cap (claims still take tenants in turn).
    pub max_runs_per_tenant: Option<usize>,
    /// Runs of one principal waiting to run (queued, or waiting for a
    /// retry); a `sendMessage` past it is `RATE_LIMITED`. 0: no limit.
    pub max_waiting_runs_per_principal: u64,
    /// The same for all of a tenant's principals together. 0 (the
    /// default): no limit; the per-principal one bounds each principal.
    pub max_waiting_runs_per_tenant: u64,
    /// How often workers look for runs without being woken.
    pub poll_ms: u64,
    /// How long shutdown waits for in-flight runs to reach a commit point.
    pub shutdown_grace_secs: f64,
    /// Calls of one batch that run at once.
    pub tool_concurrency: usize,
    /// Memory for the histories of conversations' ended runs that this
    /// process keeps between claims (`runtime::history::Histories`), in
    /// MiB; 0 keeps none.
    pub history_cache_mib: u64,
}

impl RuntimeConfig {
    /// How long a claim or a heartbeat makes a lease last, in milliseconds.
    pub fn lease_ms(&self) -> i64 {
        (self.lease_secs * 1000.0) as i64
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            lease_secs: 15.0,
            heartbeat_secs: 5.0,
            checkpoint_ms: 250,
            crash_retry_budget: 3,
            concurrency: 16,
            max_runs_per_tenant: None,
            max_waiting_runs_per_principal: 1_000,
            max_waiting_runs_per_tenant: 0,
            poll_ms: 1000,
            shutdown_grace_secs: 10.0,
            tool_concurrency: 4,
            history_cache_mib: 64,
        }
    }
}

/// `[database]`: the connection pools. (The API's read pool is sized by
/// `api.read_connections`.)
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Connections of the pool for writes and the workers' reads; by
    /// default 8 on SQLite and 16 on PostgreSQL.
    pub connections: Option<u32>,
    /// How long a query waits for a free connection before it fails.
    pub acquire_timeout_secs: f64,
    /// PostgreSQL's `statement_timeout` for the statements of this
    /// process's pools (migrations excepted); 0, the default, for none.
    pub statement_timeout_secs: f64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            connections: None,
            acquire_timeout_secs: 30.0,
            statement_timeout_secs: 0.0,
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
    /// Longest GraphQL document (the `query` text), in bytes.
    pub max_document_bytes: usize,
    /// Brackets open at once in a document's text, and selection sets
    /// nested once its fragments are expanded (fragments count a level).
    pub max_document_nesting: usize,
    /// Fragment definitions in one document.
    pub max_fragments: usize,
    /// Spreads (`...`) written in one document.
    pub max_spreads: usize,
    /// Selections (fields, spreads, inline fragments) one document may
    /// expand to, fragments counted wherever they are spread.
    pub max_query_nodes: usize,
    /// `sendMessage`s one principal may make a minute (up to this many at
    /// once), and one tenant over all its principals; 0: no limit.
    pub messages_per_minute: u32,
    pub tenant_messages_per_minute: u32,
    /// `createConversation`s, likewise.
    pub conversations_per_minute: u32,
    pub tenant_conversations_per_minute: u32,
    /// How long a long document (over 8 KiB) may wait for its turn to be
    /// parsed or validated before it is refused. One at a time is.
    pub admission_budget_ms: u64,
    /// How long a query may run before it is answered with `TIMEOUT`.
    pub request_timeout_secs: f64,
    /// Connections of the pool the API reads through, apart from the
    /// workers' pool.
    pub read_connections: u32,
    /// The most of `ToolCall.fullOutput` one field returns, in bytes.
    pub max_full_output_bytes: usize,
    /// The most of all `ToolCall.fullOutput`s one response carries; past
    /// it they are cut with the same marker.
    pub max_full_output_bytes_per_response: usize,
    /// How often the server pings an idle WebSocket.
    pub ws_keepalive_secs: u64,
    /// How often an idle Server-Sent Events stream gets a comment, so that
    /// proxies do not close it.
    pub sse_keepalive_secs: u64,
    /// The longest a token in an SSE URL (`?access_token=`, for
    /// `EventSource`, which cannot send headers) may still live; 0: no
    /// token is taken from a URL.
    pub sse_url_token_max_secs: u64,
    /// How long a new WebSocket may take to send `connection_init`.
    pub ws_init_timeout_secs: u64,
    /// How long an acknowledged WebSocket may run no operation before it
    /// is closed (1000, "idle"); counted in keepalive intervals.
    pub ws_idle_timeout_secs: u64,
    /// WebSockets served at once, of `max_connections`; the rest are kept
    /// for HTTP requests and the probes. Unset: three quarters of them.
    pub max_websockets: Option<usize>,
    /// How long a new connection may take to send its first byte before it
    /// is closed (a connection that sends nothing holds a slot no longer).
    pub first_byte_timeout_ms: u64,
    /// Operations (subscriptions) one WebSocket may run at once.
    pub ws_max_operations: usize,
    /// Subscriptions the whole process serves at once; more are refused
    /// with `UNAVAILABLE`.
    pub max_subscriptions: usize,
    /// Of those, what one principal, and one tenant, may hold at once; more
    /// are refused with `RATE_LIMITED`.
    pub max_subscriptions_per_principal: usize,
    pub max_subscriptions_per_tenant: usize,
    /// Acknowledged WebSockets one principal, and one tenant, may hold
    /// open at once; one more is closed with 1013 (try again later).
    pub max_sockets_per_principal: usize,
    pub max_sockets_per_tenant: usize,
    /// Queries and mutations one principal, and one tenant, may have in
    /// flight at once (from before the document is parsed to the answer),
    /// over HTTP and WebSockets; one more is `RATE_LIMITED`.
    pub max_requests_per_principal: usize,
    pub max_requests_per_tenant: usize,
    /// How long one frame may take to reach a WebSocket client before the
    /// connection is given up as stalled.
    pub ws_send_timeout_secs: u64,
    /// How long a connection may take to send a request's headers, from
    /// its start or from the end of its previous response.
    pub header_read_timeout_secs: u64,
    /// How long a keep-alive connection may wait for its next request.
    pub keepalive_idle_secs: u64,
    /// Connections served at once (WebSockets included); more wait to be
    /// accepted.
    pub max_connections: usize,
    /// Origins whose pages may call the API from a browser, each as the
    /// browser sends it (`scheme://host[:port]`). Empty: no CORS headers,
    /// so only same-origin pages and non-browser clients can call it.
    pub cors_origins: Vec<String>,
    /// Whether `/graphiql` is served and the schema answers introspection
    /// (`__schema`, `__type`). Off for a production API that only its own
    /// clients call.
    pub playground: bool,
}

impl ApiConfig {
    /// Valid once the configuration is: validation bounds the seconds.
    pub fn request_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.request_timeout_secs)
    }

    /// `max_websockets`, or three quarters of `max_connections` (at least
    /// one).
    pub fn websockets(&self) -> usize {
        self.max_websockets
            .unwrap_or((self.max_connections / 4 * 3).max(1))
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            max_message_bytes: 64 * 1024,
            max_title_chars: 200,
            max_request_bytes: 256 * 1024,
            max_query_depth: 16,
            max_query_complexity: 500_000,
            max_aliases: 50,
            max_document_bytes: 256 * 1024,
            max_document_nesting: 32,
            max_fragments: 500,
            max_spreads: 5_000,
            max_query_nodes: 50_000,
            admission_budget_ms: 2_000,
            messages_per_minute: 600,
            tenant_messages_per_minute: 6_000,
            conversations_per_minute: 120,
            tenant_conversations_per_minute: 1_200,
            request_timeout_secs: 30.0,
            read_connections: 8,
            max_full_output_bytes: 1024 * 1024,
            max_full_output_bytes_per_response: 4 * 1024 * 1024,
            ws_keepalive_secs: 15,
            sse_keepalive_secs: 15,
            sse_url_token_max_secs: 300,
            ws_init_timeout_secs: 10,
            ws_idle_timeout_secs: 600,
            max_websockets: None,
            first_byte_timeout_ms: 3_000,
            ws_max_operations: 100,
            max_subscriptions: 100_000,
            max_subscriptions_per_principal: 1_000,
            max_subscriptions_per_tenant: 50_000,
            max_sockets_per_principal: 64,
            max_sockets_per_tenant: 8_192,
            max_requests_per_principal: 64,
            max_requests_per_tenant: 4_096,
            ws_send_timeout_secs: 10,
            header_read_timeout_secs: 10,
            keepalive_idle_secs: 60,
            max_connections: 16_384,
            cors_origins: Vec::new(),
            playground: true,
        }
    }
}

/// `[metrics]`: Prometheus's `/metrics`. By default it is served on the
/// main listener to loopback callers only.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Serve `/metrics` at all.
    pub enabled: bool,
    /// An address of its own for `/metrics`; the main listener then does
    /// not serve it.
    pub listen: Option<SocketAddr>,
    /// The variable holding a bearer token `/metrics` requires; with it,
    /// callers from any address that send it are let in.
    pub bearer_token_env: Option<String>,
    /// Resolved at start-up from `bearer_token_env`.
    #[serde(skip)]
    pub bearer_token: Option<String>,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            enabled: true,
            listen: None,
            bearer_token_env: None,
            bearer_token: None,
        }
    }
}

impl std::fmt::Debug for MetricsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsConfig")
            .field("enabled", &self.enabled)
            .field("listen", &self.listen)
            .field("bearer_token_env", &self.bearer_token_env)
            .field(
                "bearer_token",
                &self.bearer_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl MetricsConfig {
    fn validate(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        self.bearer_token = match &self.bearer_token_env {
            Some(var) => {
                let key = "metrics.bearer_token_env";
                let token = required_env(key, Some(var), env)?.unwrap_or_default();
                strong_secret(key, &token)?;
                Some(token)
            }
            None => None,
        };
        Ok(())
    }
}

/// `[telemetry]`: how logs are written and where traces go.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// `text` or `json` (one object a line); `TETHER_LOG_FORMAT` overrides.
    pub log_format: LogFormat,
    /// An OTLP/HTTP collector (`/v1/traces` is appended); unset, the
    /// standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`; none of them, no traces.
    pub otlp_endpoint: Option<String>,
    /// The traces' `service.name`; `OTEL_SERVICE_NAME` overrides.
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            log_format: LogFormat::Text,
            otlp_endpoint: None,
            service_name: "tether".to_owned(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

impl TelemetryConfig {
    fn validate(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let set = |name: &str| env(name).filter(|value| !value.is_empty());
        if let Some(format) = set("TETHER_LOG_FORMAT") {
            self.log_format = match format.as_str() {
                "text" => LogFormat::Text,
                "json" => LogFormat::Json,
                _ => {
                    return Err(invalid(
                        "TETHER_LOG_FORMAT",
                        format!("{format:?} is not one of text, json"),
                    ));
                }
            };
        }
        if self.otlp_endpoint.is_none() {
            self.otlp_endpoint = set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                .or_else(|| set("OTEL_EXPORTER_OTLP_ENDPOINT"));
        }
        if let Some(url) = &self.otlp_endpoint
            && !url.starts_with("http://")
            && !url.starts_with("https://")
        {
            return Err(invalid(
                "telemetry.otlp_endpoint",
                "must be an http(s) URL (OTLP over HTTP)",
            ));
        }
        if let Some(name) = set("OTEL_SERVICE_NAME") {
            self.service_name = name;
        }
        if self.service_name.is_empty() {
            return Err(invalid("telemetry.service_name", "must not be empty"));
        }
        Ok(())
    }
}

/// How bearer tokens are verified: HS256 with `TETHER_JWT_SECRET` (and
/// earlier secrets, for rotation), and asymmetric tokens against an identity
/// provider's JWKS.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The identity provider's key set; `TETHER_JWKS_URL` overrides it.
    pub jwks_url: Option<String>,
    /// The `iss` every token must carry, when set.
    pub issuer: Option<String>,
    /// A value the token's `aud` must hold, when set.
    pub audience: Option<String>,
    pub tenant_claim: String,
    pub principal_claim: String,
    /// A claim that makes a token an operator's when it is `true`: tenant
    /// independent, for the operators' queries and mutations. Unset: no
    /// token is an operator's.
    pub operator_claim: Option<String>,
    /// Where an operator's token may come from: the `iss` values and the
    /// tenants whose tokens `operator_claim` makes an operator's. Empty:
    /// any (set both where several identity providers or tenants mint
    /// tokens, so that no tenant's own administrator becomes an operator).
    pub operator_issuers: Vec<String>,
    pub operator_tenants: Vec<String>,
    /// A claim that lets a token act on other principals' runs of its
    /// tenant when it is `true`: answer their questions, decide their
    /// approvals, cancel them (a support agent, a team lead). Unset: only
    /// a run's own principal may.
    pub delegation_claim: Option<String>,
    /// Algorithms accepted from the JWKS; empty: all of [`JWKS_ALGORITHMS`].
    pub algorithms: Vec<String>,
    /// Variables holding secrets that still verify HS256 tokens but no
    /// longer sign them.
    pub previous_secrets_env: Vec<String>,
    /// Resolved at start-up from `previous_secrets_env`.
    #[serde(skip)]
    pub previous_secrets: Vec<String>,
    /// How long a fetched key set is used before it is fetched again.
    pub jwks_refresh_secs: u64,
    /// The least time between two fetches, however many unknown `kid`s
    /// arrive.
    pub jwks_min_refetch_secs: u64,
    pub jwks_timeout_secs: u64,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            jwks_url: None,
            issuer: None,
            audience: None,
            tenant_claim: "tenant".to_owned(),
            principal_claim: "sub".to_owned(),
            operator_claim: None,
            operator_issuers: Vec::new(),
            operator_tenants: Vec::new(),
            delegation_claim: None,
            algorithms: Vec::new(),
            previous_secrets_env: Vec::new(),
            previous_secrets: Vec::new(),
            jwks_refresh_secs: 600,
            jwks_min_refetch_secs: 30,
            jwks_timeout_secs: 5,
        }
    }
}

impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthConfig")
            .field("jwks_url", &self.jwks_url)
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("tenant_claim", &self.tenant_claim)
            .field("principal_claim", &self.principal_claim)
            .field("operator_claim", &self.operator_claim)
            .field("operator_issuers", &self.operator_issuers)
            .field("operator_tenants", &self.operator_tenants)
            .field("delegation_claim", &self.delegation_claim)
            .field("algorithms", &self.algorithms)
            .field("previous_secrets_env", &self.previous_secrets_env)
            .field("previous_secrets", &"<redacted>")
            .field("jwks_refresh_secs", &self.jwks_refresh_secs)
            .field("jwks_min_refetch_secs", &self.jwks_min_refetch_secs)
            .field("jwks_timeout_secs", &self.jwks_timeout_secs)
            .finish()
    }
}

impl AuthConfig {
    /// The JWKS algorithms in force: the configured ones, or all.
    pub fn jwks_algorithms(&self) -> Vec<&str> {
        if self.algorithms.is_empty() {
            JWKS_ALGORITHMS.to_vec()
        } else {
            self.algorithms.iter().map(String::as_str).collect()
        }
    }

    fn validate(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        if let Some(url) = env("TETHER_JWKS_URL").filter(|u| !u.is_empty()) {
            self.jwks_url = Some(url);
        }
        if let Some(url) = &self.jwks_url
            && !url.starts_with("http://")
            && !url.starts_with("https://")
        {
            return Err(invalid("auth.jwks_url", "must be an http(s) URL"));
        }
        for (key, claim) in [
            ("auth.tenant_claim", &self.tenant_claim),
            ("auth.principal_claim", &self.principal_claim),
        ] {
            if claim.is_empty() {
                return Err(invalid(key, "must not be empty"));
            }
        }
        for (key, claim) in [
            ("auth.operator_claim", &self.operator_claim),
            ("auth.delegation_claim", &self.delegation_claim),
        ] {
            if let Some(claim) = claim
                && (claim.is_empty()
                    || *claim == self.tenant_claim
                    || *claim == self.principal_claim)
            {
                return Err(invalid(
                    key,
                    "must name a claim of its own, not empty nor the tenant's or the principal's",
                ));
            }
        }
        if self.operator_claim.is_none()
            && !(self.operator_issuers.is_empty() && self.operator_tenants.is_empty())
        {
            return Err(invalid(
                "auth.operator_issuers",
                "operator_issuers and operator_tenants restrict auth.operator_claim, which is not set",
            ));
        }
        // Every accepted token carries `auth.issuer` when it is set: an
        // operator issuer list without it would make no one an operator.
        if let Some(issuer) = &self.issuer
            && !self.operator_issuers.is_empty()
            && !self.operator_issuers.contains(issuer)
        {
            return Err(invalid(
                "auth.operator_issuers",
                "every token carries auth.issuer, which this list leaves out: no token could be an operator's",
            ));
        }
        if self.delegation_claim.is_some() && self.delegation_claim == self.operator_claim {
            return Err(invalid(
                "auth.delegation_claim",
                "must differ from auth.operator_claim",
            ));
        }
        for (i, alg) in self.algorithms.iter().enumerate() {
            if !JWKS_ALGORITHMS.contains(&alg.as_str()) {
                return Err(invalid(
                    format!("auth.algorithms[{i}]"),
                    format!(
                        "{alg:?} is not one of {}; HS256 tokens are verified with TETHER_JWT_SECRET",
                        JWKS_ALGORITHMS.join(", ")
                    ),
                ));
            }
        }
        self.previous_secrets = Vec::new();
        for (i, var) in self.previous_secrets_env.iter().enumerate() {
            let key = format!("auth.previous_secrets_env[{i}]");
            let secret = required_env(&key, Some(var), env)?.unwrap_or_default();
            strong_secret(&key, &secret)?;
            self.previous_secrets.push(secret);
        }
        at_least("auth.jwks_refresh_secs", self.jwks_refresh_secs, 1)?;
        at_most(
            "auth.jwks_refresh_secs",
            self.jwks_refresh_secs,
            MAX_DURATION_SECS,
        )?;
        at_least("auth.jwks_min_refetch_secs", self.jwks_min_refetch_secs, 1)?;
        at_most(
            "auth.jwks_min_refetch_secs",
            self.jwks_min_refetch_secs,
            MAX_DURATION_SECS,
        )?;
        at_least("auth.jwks_timeout_secs", self.jwks_timeout_secs, 1)?;
        at_most("auth.jwks_timeout_secs", self.jwks_timeout_secs, 300)?;
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    Anthropic,
    Openai,
    Scripted,
}

impl ProviderKind {
    /// As written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::Openai => "openai",
            ProviderKind::Scripted => "scripted",
        }
    }
}

#[derive(Clone, Deserialize)]
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

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpTarget {
    #[serde(default = "default_method")]
    pub method: String,
    pub url: String,
    #[serde(default = "default_tool_timeout")]
    pub timeout_secs: u64,
    /// The most of an answer's body that is read; the output of a longer
    /// one is its first bytes, marked truncated.
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: usize,
}

fn default_max_response_bytes() -> usize {
    1024 * 1024
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

#[derive(Clone, Deserialize)]
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

// What holds a secret (a key, a client secret, a token, a URL that may carry
// one) shows whether it is there, never what it is: configuration ends up
// in logs and panic messages. Fields left out are not shown at all.

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &Origin(&self.database_url))
            .field("listen", &self.listen)
            .field("jwt_secret", &Hidden(&self.jwt_secret))
            .field("encryption_key", &Hidden(&self.encryption_key))
            .field("file", &self.file)
            .finish()
    }
}

impl fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentConfig")
            .field("name", &self.name)
            .field("provider", &self.provider)
            .field("model", &self.model)
            .field("base_url", &self.base_url.as_deref().map(Origin))
            .field("api_key_env", &self.api_key_env)
            .field("api_key", &Hidden(&self.api_key))
            .field("tools", &self.tools)
            .field("max_tokens", &self.max_tokens)
            .field("limits", &self.limits)
            .field("retry", &self.retry)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for HttpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpTarget")
            .field("method", &self.method)
            .field("url", &Origin(&self.url))
            .field("timeout_secs", &self.timeout_secs)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish()
    }
}

impl fmt::Debug for ConnectionConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionConfig")
            .field("provider", &self.provider)
            .field("mode", &self.mode)
            .field("client_id", &self.client_id)
            .field("client_secret_env", &self.client_secret_env)
            .field("client_secret", &Hidden(&self.client_secret))
            .field("token_env", &self.token_env)
            .field("token", &Hidden(&self.token))
            .finish_non_exhaustive()
    }
}

/// The agent of the built-in configuration, also used when a file
/// configures none: `demo` on the scripted model, with the built-in tools.
fn demo_agent() -> AgentConfig {
    AgentConfig {
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
    }
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
            database: DatabaseConfig::default(),
            auth: AuthConfig::default(),
            metrics: MetricsConfig::default(),
            telemetry: TelemetryConfig::default(),
            agents: vec![demo_agent()],
            tools: Vec::new(),
            connections: Vec::new(),
        }
    }

    /// Where a tool's calls go, as an operator may be shown it: the method
    /// and the URL, its secrets masked (`redact::url`); `None` for a tool
    /// without an HTTP target or no longer configured.
    pub fn tool_target(&self, tool: &str) -> Option<String> {
        self.tools
            .iter()
            .find(|t| t.name == tool)
            .and_then(|t| t.http.as_ref())
            .map(|http| format!("{} {}", http.method, crate::redact::url(&http.url)))
    }

    pub fn parse(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: in_toml_terms(&e),
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
        duration_secs_f64("runtime.lease_secs", rt.lease_secs)?;
        at_least("runtime.checkpoint_ms", rt.checkpoint_ms, 1)?;
        duration_ms("runtime.checkpoint_ms", rt.checkpoint_ms)?;
        between("runtime.concurrency", rt.concurrency, 1, 10_000)?;
        if let Some(cap) = rt.max_runs_per_tenant {
            between("runtime.max_runs_per_tenant", cap, 1, 1_000_000)?;
        }
        between("runtime.tool_concurrency", rt.tool_concurrency, 1, 1_000)?;
        between(
            "runtime.history_cache_mib",
            rt.history_cache_mib,
            0,
            1 << 20,
        )?;
        at_least("runtime.poll_ms", rt.poll_ms, 10)?;
        duration_ms("runtime.poll_ms", rt.poll_ms)?;
        non_negative("runtime.shutdown_grace_secs", rt.shutdown_grace_secs)?;
        duration_secs_f64("runtime.shutdown_grace_secs", rt.shutdown_grace_secs)?;
        let database = &self.database;
        if let Some(connections) = database.connections {
            between("database.connections", connections, 1, 10_000)?;
        }
        positive(
            "database.acquire_timeout_secs",
            database.acquire_timeout_secs,
        )?;
        duration_secs_f64(
            "database.acquire_timeout_secs",
            database.acquire_timeout_secs,
        )?;
        non_negative(
            "database.statement_timeout_secs",
            database.statement_timeout_secs,
        )?;
        duration_secs_f64(
            "database.statement_timeout_secs",
            database.statement_timeout_secs,
        )?;
        let api = &self.api;
        at_least("api.max_message_bytes", api.max_message_bytes, 1)?;
        at_least("api.max_request_bytes", api.max_request_bytes, 1024)?;
        at_least("api.max_query_depth", api.max_query_depth, 4)?;
        at_least("api.max_query_complexity", api.max_query_complexity, 10)?;
        between("api.ws_keepalive_secs", api.ws_keepalive_secs, 1, 3_600)?;
        between("api.sse_keepalive_secs", api.sse_keepalive_secs, 1, 3_600)?;
        between(
            "api.sse_url_token_max_secs",
            api.sse_url_token_max_secs,
            0,
            3_600,
        )?;
        between(
            "api.ws_init_timeout_secs",
            api.ws_init_timeout_secs,
            1,
            3_600,
        )?;
        at_least("api.max_aliases", api.max_aliases, 1)?;
        between(
            "api.ws_idle_timeout_secs",
            api.ws_idle_timeout_secs,
            1,
            86_400 * 30,
        )?;
        between(
            "api.first_byte_timeout_ms",
            api.first_byte_timeout_ms,
            100,
            3_600_000,
        )?;
        if let Some(max) = api.max_websockets {
            between("api.max_websockets", max, 1, api.max_connections)?;
        }
        at_least("api.max_document_bytes", api.max_document_bytes, 1024)?;
        between(
            "api.max_document_nesting",
            api.max_document_nesting,
            4,
            1_000,
        )?;
        at_least("api.max_fragments", api.max_fragments, 1)?;
        at_least("api.max_spreads", api.max_spreads, 1)?;
        at_least("api.max_query_nodes", api.max_query_nodes, 10)?;
        between(
            "api.admission_budget_ms",
            api.admission_budget_ms,
            1,
            600_000,
        )?;
        positive("api.request_timeout_secs", api.request_timeout_secs)?;
        at_most(
            "api.request_timeout_secs",
            api.request_timeout_secs,
            MAX_REQUEST_TIMEOUT_SECS,
        )?;
        at_least("api.read_connections", api.read_connections, 1)?;
        at_least("api.max_full_output_bytes", api.max_full_output_bytes, 1024)?;
        at_least(
            "api.max_full_output_bytes_per_response",
            api.max_full_output_bytes_per_response,
            1024,
        )?;
        at_least("api.ws_max_operations", api.ws_max_operations, 1)?;
        for (key, value) in [
            (
                "api.max_subscriptions_per_principal",
                api.max_subscriptions_per_principal,
            ),
            (
                "api.max_subscriptions_per_tenant",
                api.max_subscriptions_per_tenant,
            ),
            (
                "api.max_sockets_per_principal",
                api.max_sockets_per_principal,
            ),
            ("api.max_sockets_per_tenant", api.max_sockets_per_tenant),
            (
                "api.max_requests_per_principal",
                api.max_requests_per_principal,
            ),
            ("api.max_requests_per_tenant", api.max_requests_per_tenant),
        ] {
            at_least(key, value, 1)?;
        }
        between(
            "api.max_subscriptions",
            api.max_subscriptions,
            1,
            tokio::sync::Semaphore::MAX_PERMITS.min(100_000_000),
        )?;
        between(
            "api.ws_send_timeout_secs",
            api.ws_send_timeout_secs,
            1,
            3_600,
        )?;
        between(
            "api.header_read_timeout_secs",
            api.header_read_timeout_secs,
            1,
            3_600,
        )?;
        between(
            "api.keepalive_idle_secs",
            api.keepalive_idle_secs,
            1,
            86_400,
        )?;
        between("api.max_connections", api.max_connections, 1, 1_000_000)?;
        for (i, origin) in api.cors_origins.iter().enumerate() {
            cors_origin(&format!("api.cors_origins[{i}]"), origin)?;
        }

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
                at_least(
                    &format!("{key}.http.max_response_bytes"),
                    http.max_response_bytes,
                    1,
                )?;
                duration_secs(&format!("{key}.http.timeout_secs"), http.timeout_secs)?;
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
                    // Checked here so that building a login URL cannot fail.
                    for (field, value) in [
                        ("authorize_url", &conn.authorize_url),
                        ("token_url", &conn.token_url),
                        ("redirect_uri", &conn.redirect_uri),
                    ] {
                        let url = value.as_deref().and_then(|v| reqwest::Url::parse(v).ok());
                        if !url.is_some_and(|u| {
                            u.has_host() && ["http", "https"].contains(&u.scheme())
                        }) {
                            return Err(invalid(
                                format!("{key}.{field}"),
                                "must be an absolute http:// or https:// URL",
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
                    // Read now, but a missing credential fails the calls
                    // that need it, naming `token_env`, rather than the
                    // whole server.
                    let Some(var) = conn.token_env.as_deref() else {
                        return Err(invalid(
                            format!("{key}.token_env"),
                            "is required for mode = \"token\"",
                        ));
                    };
                    conn.token = env(var).filter(|token| !token.is_empty());
                }
            }
            at_least(&format!("{key}.consent_ttl_secs"), conn.consent_ttl_secs, 1)?;
            duration_secs(&format!("{key}.consent_ttl_secs"), conn.consent_ttl_secs)?;
        }
        for (i, tool) in self.tools.iter().enumerate() {
            if let Some(connection) = &tool.connection
                && !providers.contains(&connection.provider)
            {
                return Err(invalid(
                    format!("tools[{i}].connection.provider"),
                    format!(
                        "names the provider {:?}, which no [[connections]] entry configures",
                        connection.provider
                    ),
                ));
            }
        }

        // A file that configures no agent keeps the one a missing file
        // gives, so that a file holding only, say, `[api]` keys still starts.
        if self.agents.is_empty() {
            self.agents.push(demo_agent());
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
            duration_secs(&format!("{key}.idle_timeout_secs"), agent.idle_timeout_secs)?;
            duration_ms(&format!("{key}.stream_delay_ms"), agent.stream_delay_ms)?;
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
            duration_secs(
                &format!("{key}.limits.timeout_secs"),
                agent.limits.timeout_secs,
            )?;
            duration_ms(
                &format!("{key}.retry.initial_delay_ms"),
                agent.retry.initial_delay_ms,
            )?;
            duration_ms(
                &format!("{key}.retry.max_delay_ms"),
                agent.retry.max_delay_ms,
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
        duration_secs("policy.approval_ttl_secs", self.policy.approval_ttl_secs)?;
        duration_secs("policy.question_ttl_secs", self.policy.question_ttl_secs)?;
        for (i, tenant) in self.policy.tenants.iter().enumerate() {
            let key = format!("policy.tenants[{i}]");
            if tenant.tenant.is_empty() {
                return Err(invalid(format!("{key}.tenant"), "must not be empty"));
            }
            if let Some(ttl) = tenant.approval_ttl_secs {
                duration_secs(&format!("{key}.approval_ttl_secs"), ttl)?;
            }
            if let Some(ttl) = tenant.question_ttl_secs {
                duration_secs(&format!("{key}.question_ttl_secs"), ttl)?;
            }
        }
        self.auth.validate(env)?;
        self.metrics.validate(env)?;
        self.telemetry.validate(env)?;
        Ok(())
    }
}

/// An origin as a browser sends it in `Origin`: `scheme://host[:port]`,
/// http or https, lower case, no path and no default port.
fn cors_origin(key: &str, origin: &str) -> Result<(), ConfigError> {
    if origin == "*" {
        return Err(invalid(
            key,
            "\"*\" is not accepted: list each origin that may call the API",
        ));
    }
    let url = reqwest::Url::parse(origin).ok().filter(|u| {
        ["http", "https"].contains(&u.scheme())
            && u.has_host()
            && u.username().is_empty()
            && u.password().is_none()
    });
    let Some(url) = url else {
        return Err(invalid(
            key,
            format!("{origin:?} is not an http:// or https:// origin (scheme://host[:port])"),
        ));
    };
    let canonical = url.origin().ascii_serialization();
    if canonical != origin {
        return Err(invalid(
            key,
            format!(
                "{origin:?} is not an origin as a browser sends it \
                 (scheme://host[:port], no path, no default port); write {canonical:?}"
            ),
        ));
    }
    Ok(())
}

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

fn duration_secs(key: &str, value: u64) -> Result<(), ConfigError> {
    at_most(key, value, MAX_DURATION_SECS)
}

fn duration_ms(key: &str, value: u64) -> Result<(), ConfigError> {
    at_most(key, value, MAX_DURATION_MS)
}

fn duration_secs_f64(key: &str, value: f64) -> Result<(), ConfigError> {
    // `MAX_DURATION_SECS` is far below 2^53: the cast is exact.
    at_most(key, value, MAX_DURATION_SECS as f64)
}

fn strong_secret(key: &str, secret: &str) -> Result<(), ConfigError> {
    if secret.len() >= MIN_SECRET_BYTES {
        Ok(())
    } else {
        Err(invalid(
            key,
            format!("the secret must be at least {MIN_SECRET_BYTES} bytes long"),
        ))
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

fn between<T: PartialOrd + std::fmt::Display + Copy>(
    key: &str,
    value: T,
    min: T,
    max: T,
) -> Result<(), ConfigError> {
    at_least(key, value, min)?;
    at_most(key, value, max)
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

/// Serde's words for the types a key expected (Rust's: `f64`, `u32`,
/// `struct AgentConfig`, `a sequence`) and for the value it found, and the
/// TOML words a configuration's author knows them by.
static TOML_TERMS: std::sync::LazyLock<[(regex::Regex, &str); 8]> =
    std::sync::LazyLock::new(|| {
        [
            (r"expected f(?:32|64)\b", "expected a number"),
            (
                r"expected u(?:8|16|32|64|128|size)\b",
                "expected a non-negative integer",
            ),
            (
                r"expected i(?:8|16|32|64|128|size)\b",
                "expected an integer",
            ),
            (r"expected a borrowed string\b", "expected a string"),
            (r"expected (?:a sequence|a tuple)\b", "expected an array"),
            (
                r"expected (?:a map|struct \w+|a \w+ table)\b",
                "expected a table",
            ),
            (
                r"invalid type: (?:map|newtype struct)\b",
                "invalid type: table",
            ),
            (r"invalid type: sequence\b", "invalid type: array"),
        ]
        .map(|(pattern, words)| {
            let pattern = regex::Regex::new(pattern).expect("the patterns are valid");
            (pattern, words)
        })
    });

/// A TOML error as the parser renders it (line, column, the line quoted),
/// its message in TOML's terms: "expected a number", not "expected f64".
fn in_toml_terms(err: &toml::de::Error) -> String {
    let rendered = err.to_string();
    let message = err.message();
    let mut reworded = message.replace("floating point `", "number `");
    for (pattern, words) in TOML_TERMS.iter() {
        reworded = pattern.replace_all(&reworded, *words).into_owned();
    }
    // The message comes after the quoted line, which is the author's and
    // stays as written.
    match rendered.rfind(message) {
        Some(at) => format!(
            "{}{reworded}{}",
            &rendered[..at],
            &rendered[at + message.len()..]
        ),
        None => rendered,
    }
}

/// The database URL schemes Tether speaks.
pub const DATABASE_SCHEMES: &[&str] = &["sqlite:", "postgres://", "postgresql://"];

/// Refuses a database URL of another scheme (a typo such as `postgress://`
/// would otherwise be tried as a database), naming the accepted ones.
fn database_scheme(url: &str) -> Result<(), ConfigError> {
    if DATABASE_SCHEMES
        .iter()
        .any(|scheme| url.starts_with(scheme))
    {
        return Ok(());
    }
    let given = match url.split_once(':') {
        Some((scheme, _)) => format!("the scheme {scheme:?} is not supported"),
        None => "is not a URL".to_owned(),
    };
    Err(invalid(
        "TETHER_DATABASE_URL",
        format!("{given}; use sqlite://PATH, postgres:// or postgresql://"),
    ))
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
        database_scheme(&database_url)?;
        let listen_text = env("TETHER_LISTEN").unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let listen: SocketAddr = listen_text.parse().map_err(|_| {
            invalid(
                "TETHER_LISTEN",
                format!("{listen_text:?} is not an address:port"),
            )
        })?;
        let jwt_secret = env("TETHER_JWT_SECRET").filter(|s| !s.is_empty());
        if let Some(secret) = &jwt_secret {
            strong_secret("TETHER_JWT_SECRET", secret)?;
        }
        if jwt_secret.is_none() {
            if !file.auth.previous_secrets.is_empty() {
                return Err(invalid(
                    "TETHER_JWT_SECRET",
                    "must be set when auth.previous_secrets_env is: the current secret signs",
                ));
            }
            if file.auth.jwks_url.is_none() && !listen.ip().is_loopback() {
                return Err(invalid(
                    "TETHER_JWT_SECRET",
                    "must be set (or TETHER_JWKS_URL) to serve on a non-loopback address",
                ));
            }
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

/// Where the HS256 secrets come from.
#[derive(PartialEq, Eq)]
pub enum SecretSource {
    /// `TETHER_JWT_SECRET`, then the previous secrets.
    Configured(Vec<String>),
    /// Nothing configured on an SQLite file: a random secret kept in this
    /// file beside it, made on first use.
    Generated(PathBuf),
    /// A JWKS alone verifies tokens; no HS256 token is accepted.
    None,
}

impl std::fmt::Debug for SecretSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretSource::Configured(secrets) => write!(f, "Configured({} secrets)", secrets.len()),
            SecretSource::Generated(path) => write!(f, "Generated({})", path.display()),
            SecretSource::None => write!(f, "None"),
        }
    }
}

impl Config {
    /// The HS256 secrets for `serve` and `token`. Only an SQLite database
    /// file has a place to keep a generated secret; anything else needs a
    /// configured secret or a JWKS.
    pub fn secret_source(&self) -> Result<SecretSource, ConfigError> {
        if let Some(secret) = &self.jwt_secret {
            let mut secrets = vec![secret.clone()];
            secrets.extend(self.file.auth.previous_secrets.iter().cloned());
            return Ok(SecretSource::Configured(secrets));
        }
        if self.file.auth.jwks_url.is_some() {
            return Ok(SecretSource::None);
        }
        match self.sqlite_file() {
            Some(db) => {
                let mut name = db.into_os_string();
                name.push(".jwt-secret");
                Ok(SecretSource::Generated(PathBuf::from(name)))
            }
            None => Err(invalid(
                "TETHER_JWT_SECRET",
                "must be set, or TETHER_JWKS_URL, on this database: a generated secret is kept only beside an SQLite database file",
            )),
        }
    }
}

impl Config {
    /// What `tether config check` prints of a valid configuration: its
    /// agents (provider, model, tools) and its tools. No secret, and of a
    /// tool's URL only its origin.
    pub fn describe(&self) -> String {
        use std::fmt::Write as _;
        let file = &self.file;
        let mut out = String::from("configuration is valid\n");
        let _ = writeln!(out, "agents ({}):", file.agents.len());
        for agent in &file.agents {
            let default = if agent.name == file.default_agent_name() {
                " (default)"
            } else {
                ""
            };
            let tools = if agent.tools.is_empty() {
                "none".to_owned()
            } else {
                agent.tools.join(", ")
            };
            let _ = writeln!(
                out,
                "  {}{default}: provider {}, model {}; tools: {tools}",
                agent.name,
                agent.provider.as_str(),
                agent.model_name(),
            );
        }
        let _ = writeln!(out, "tools ({}):", BUILTIN_TOOLS.len() + file.tools.len());
        for name in BUILTIN_TOOLS {
            let _ = writeln!(out, "  {name}: built in");
        }
        for tool in &file.tools {
            let target = match &tool.http {
                Some(http) => format!("{} {}", http.method, crate::redact::origin(&http.url)),
                None => "no target".to_owned(),
            };
            let risk = match &tool.risk {
                Some(risk) => format!("; risk {risk} (needs approval)"),
                None => String::new(),
            };
            let _ = writeln!(out, "  {}: {target}{risk}", tool.name);
        }
        out
    }
}

impl Config {
    /// The database file of an SQLite URL; `None` for in-memory databases,
    /// URI file names and other URLs.
    pub fn sqlite_file(&self) -> Option<PathBuf> {
        sqlite_file(&self.database_url)
    }
}

fn sqlite_file(url: &str) -> Option<PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let in_memory = path.is_empty()
        || path.starts_with(':')
        || path.starts_with("file:")
        || query.split('&').any(|pair| pair == "mode=memory");
    (!in_memory).then(|| PathBuf::from(path))
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
    fn type_errors_speak_toml_not_rust() {
        let cases = [
            ("[runtime]\nlease_secs = \"soon\"\n", "expected a number"),
            (
                "[runtime]\ncrash_retry_budget = 1.5\n",
                "invalid type: number `1.5`, expected a non-negative integer",
            ),
            (
                "[runtime]\nlease_secs = [1]\n",
                "invalid type: array, expected a number",
            ),
            ("[policy]\nallow_always = \"yes\"\n", "expected a boolean"),
            ("agents = 3\n", "expected an array"),
            ("runtime = 3\n", "expected a table"),
        ];
        for (toml, expected) in cases {
            let err = message(load_with(toml, &[]));
            assert!(err.contains(expected), "{toml}: {err}");
            assert!(err.contains("line "), "the line is kept: {err}");
            // What follows the file's path (a random temporary one, which
            // may itself hold "f64").
            let said = err
                .split_once(".toml")
                .map_or(err.as_str(), |(_, said)| said);
            for rust in ["f64", "u32", "u64", "struct ", "sequence", "map,"] {
                assert!(!said.contains(rust), "{toml}: {err}");
            }
        }
    }

    #[test]
    fn database_urls_of_other_schemes_are_refused_with_the_accepted_ones() {
        let err = message(load_with(
            AGENT,
            &[("TETHER_DATABASE_URL", "postgress://u:pw@h/db")],
        ));
        assert!(err.contains("\"postgress\""), "{err}");
        assert!(
            err.contains("postgres://") && err.contains("sqlite://"),
            "{err}"
        );
        assert!(!err.contains("pw"), "{err}");
        for url in ["sqlite::memory:", "postgres://h/db", "postgresql://h/db"] {
            assert!(database_scheme(url).is_ok(), "{url} is accepted");
        }
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
    fn a_file_without_agents_keeps_the_demo_agent() {
        let config = load_with("[api]\nmax_query_depth = 12\n", &[]).unwrap();
        assert_eq!(config.file.api.max_query_depth, 12);
        assert_eq!(config.file.default_agent_name(), "demo");
        let agent = config.file.agent("demo").unwrap();
        assert_eq!(agent.provider, ProviderKind::Scripted);
        assert_eq!(agent.tools, BUILTIN_TOOLS);
        assert_eq!(config.file.agents.len(), 1);
        // An empty file too, and `default_agent` may name it.
        let config = load_with("", &[]).unwrap();
        assert_eq!(config.file.default_agent_name(), "demo");
        let config = load_with("default_agent = \"demo\"\n", &[]).unwrap();
        assert_eq!(config.file.default_agent_name(), "demo");
        // Naming another agent is still refused.
        let err = message(load_with("default_agent = \"claude\"\n", &[]));
        assert!(err.contains("default_agent"), "{err}");
        // Agents in the file replace the demo agent rather than join it.
        let config = load_with(AGENT, &[]).unwrap();
        assert!(config.file.agent("demo").is_none());
        assert_eq!(config.file.default_agent_name(), "a");
    }

    #[test]
    fn the_playground_is_on_by_default_and_takes_a_boolean() {
        assert!(load_with("", &[]).unwrap().file.api.playground);
        let config = load_with("[api]\nplayground = false\n", &[]).unwrap();
        assert!(!config.file.api.playground);
        let err = message(load_with("[api]\nplayground = \"no\"\n", &[]));
        assert!(err.contains("playground"), "{err}");
    }

    #[test]
    fn cors_origins_are_none_by_default_and_must_be_origins() {
        let config = load_with("", &[]).unwrap();
        assert!(config.file.api.cors_origins.is_empty());
        let config = load_with(
            "[api]\ncors_origins = [\"http://localhost:5173\", \"https://app.example.com\", \"http://[::1]:8080\"]\n",
            &[],
        )
        .unwrap();
        assert_eq!(config.file.api.cors_origins.len(), 3);
        for (bad, hint) in [
            ("*", "list each origin"),
            ("http://localhost:5173/", "\"http://localhost:5173\""),
            ("http://localhost:5173/app", "\"http://localhost:5173\""),
            ("http://LOCALHOST:5173", "\"http://localhost:5173\""),
            ("https://app.example.com:443", "\"https://app.example.com\""),
            ("localhost:5173", "not an http:// or https:// origin"),
            (
                "ftp://files.example.com",
                "not an http:// or https:// origin",
            ),
            ("http://user@localhost", "not an http:// or https:// origin"),
            ("null", "not an http:// or https:// origin"),
            ("", "not an http:// or https:// origin"),
        ] {
            let err = message(load_with(
                &format!("[api]\ncors_origins = [\"http://ok.example\", {bad:?}]\n"),
                &[],
            ));
            assert!(err.contains("api.cors_origins[1]"), "{bad}: {err}");
            assert!(err.contains(hint), "{bad}: {err}");
        }
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
        for (toml, key) in [
            ("[database]\nconnections = 0\n", "database.connections"),
            (
                "[database]\nacquire_timeout_secs = 0\n",
                "database.acquire_timeout_secs",
            ),
            (
                "[database]\nstatement_timeout_secs = -1\n",
                "database.statement_timeout_secs",
            ),
        ] {
            let err = message(load_with(toml, &[]));
            assert!(err.contains(key), "{err}");
        }
        let database = load_with(
            "[database]\nconnections = 4\nstatement_timeout_secs = 2.5\n",
            &[],
        )
        .unwrap()
        .file
        .database;
        assert_eq!(database.connections, Some(4));
        assert_eq!(database.statement_timeout_secs, 2.5);
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
    fn oauth2_connection_urls_must_be_absolute_http_urls() {
        let key = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        let toml = |token_url: &str| {
            format!(
                "{AGENT}[[connections]]\nprovider = \"acme\"\nmode = \"oauth2\"\nauthorize_url = \"https://a.example/authorize?x=1\"\ntoken_url = \"{token_url}\"\nclient_id = \"c\"\nclient_secret_env = \"ACME_SECRET\"\nredirect_uri = \"https://t.example/cb\"\n"
            )
        };
        let env = [
            ("TETHER_ENCRYPTION_KEY", key.as_str()),
            ("ACME_SECRET", "s"),
        ];
        load_with(&toml("https://a.example/token"), &env).unwrap();
        for bad in ["/token", "ftp://a.example/token", "https://"] {
            let err = message(load_with(&toml(bad), &env));
            assert!(err.contains("connections[0].token_url"), "{bad}: {err}");
        }
    }

    const AGENT: &str = "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n";
    const LONG_SECRET: &str = "a-configured-secret-of-32-bytes-or-more";

    #[test]
    fn secrets_shorter_than_32_bytes_are_refused() {
        let err = message(load_with(AGENT, &[("TETHER_JWT_SECRET", "too-short")]));
        assert!(
            err.contains("TETHER_JWT_SECRET") && err.contains("32"),
            "{err}"
        );
        let toml = format!("{AGENT}[auth]\nprevious_secrets_env = [\"OLD\"]\n");
        let err = message(load_with(
            &toml,
            &[("TETHER_JWT_SECRET", LONG_SECRET), ("OLD", "short")],
        ));
        assert!(err.contains("auth.previous_secrets_env[0]"), "{err}");
        let err = message(load_with(&toml, &[("OLD", LONG_SECRET)]));
        assert!(err.contains("TETHER_JWT_SECRET"), "{err}");
        let config = load_with(
            &toml,
            &[
                ("TETHER_JWT_SECRET", LONG_SECRET),
                ("OLD", "b".repeat(32).as_str()),
            ],
        )
        .unwrap();
        assert_eq!(
            config.secret_source().unwrap(),
            SecretSource::Configured(vec![LONG_SECRET.to_owned(), "b".repeat(32)])
        );
    }

    #[test]
    fn without_a_secret_only_an_sqlite_file_gets_a_generated_one() {
        let source = |url: &str| {
            load_with(AGENT, &[("TETHER_DATABASE_URL", url)])
                .unwrap()
                .secret_source()
        };
        assert_eq!(
            source("sqlite://tether.db?mode=rwc").unwrap(),
            SecretSource::Generated(PathBuf::from("tether.db.jwt-secret"))
        );
        assert_eq!(
            source("sqlite:///var/lib/tether/t.db").unwrap(),
            SecretSource::Generated(PathBuf::from("/var/lib/tether/t.db.jwt-secret"))
        );
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite://file:t?mode=memory&cache=shared",
            "sqlite://t.db?mode=memory",
            "postgres://db/tether",
        ] {
            let err = source(url).expect_err(url).to_string();
            assert!(
                err.contains("TETHER_JWT_SECRET") && err.contains("TETHER_JWKS_URL"),
                "{url}: {err}"
            );
        }
        let jwks = load_with(
            AGENT,
            &[
                ("TETHER_DATABASE_URL", "postgres://db/tether"),
                (
                    "TETHER_JWKS_URL",
                    "https://idp.example/.well-known/jwks.json",
                ),
                ("TETHER_LISTEN", "0.0.0.0:8080"),
            ],
        )
        .unwrap();
        assert_eq!(jwks.secret_source().unwrap(), SecretSource::None);
    }

    #[test]
    fn the_auth_section_is_checked() {
        for (toml, key) in [
            ("[auth]\njwks_url = \"ftp://idp\"\n", "auth.jwks_url"),
            ("[auth]\nalgorithms = [\"HS256\"]\n", "auth.algorithms[0]"),
            ("[auth]\ntenant_claim = \"\"\n", "auth.tenant_claim"),
            (
                "[auth]\nprevious_secrets_env = [\"TETHER_TEST_UNSET\"]\n",
                "auth.previous_secrets_env[0]",
            ),
            (
                "[auth]\njwks_timeout_secs = 100000\n",
                "auth.jwks_timeout_secs",
            ),
            (
                "[auth]\njwks_min_refetch_secs = 0\n",
                "auth.jwks_min_refetch_secs",
            ),
        ] {
            let err = message(load_with(&format!("{AGENT}{toml}"), &[]));
            assert!(err.contains(key), "{toml}: {err}");
        }
        let config = load_with(
            &format!("{AGENT}[auth]\njwks_url = \"https://a\"\nalgorithms = [\"ES256\"]\ntenant_claim = \"org_id\"\n"),
            &[("TETHER_JWKS_URL", "https://b")],
        )
        .unwrap();
        assert_eq!(config.file.auth.jwks_url.as_deref(), Some("https://b"));
        assert_eq!(config.file.auth.jwks_algorithms(), ["ES256"]);
        assert_eq!(config.file.auth.tenant_claim, "org_id");
        assert_eq!(config.file.auth.principal_claim, "sub");
    }

    #[test]
    fn durations_have_an_upper_bound_named_by_their_key() {
        let huge = i64::MAX;
        for (toml, key) in [
            (
                format!("[policy]\napproval_ttl_secs = {huge}\n"),
                "policy.approval_ttl_secs",
            ),
            (
                format!("[policy]\nquestion_ttl_secs = {huge}\n"),
                "policy.question_ttl_secs",
            ),
            (
                format!("[[policy.tenants]]\ntenant = \"t\"\napproval_ttl_secs = {huge}\n"),
                "policy.tenants[0].approval_ttl_secs",
            ),
            (
                "[runtime]\nlease_secs = 1e300\n".to_owned(),
                "runtime.lease_secs",
            ),
            (
                "[runtime]\nshutdown_grace_secs = 1e300\n".to_owned(),
                "runtime.shutdown_grace_secs",
            ),
            (format!("[runtime]\npoll_ms = {huge}\n"), "runtime.poll_ms"),
            (
                format!("[api]\nws_keepalive_secs = {huge}\n"),
                "api.ws_keepalive_secs",
            ),
            (
                format!("[agents.limits]\ntimeout_secs = {huge}\n"),
                "agents[0].limits.timeout_secs",
            ),
            (
                format!("[agents.retry]\nmax_delay_ms = {huge}\n"),
                "agents[0].retry.max_delay_ms",
            ),
            (
                format!("idle_timeout_secs = {huge}\n"),
                "agents[0].idle_timeout_secs",
            ),
        ] {
            let text = if toml.starts_with("[agents") || toml.starts_with("idle") {
                format!("{AGENT}{toml}")
            } else {
                format!("{toml}{AGENT}")
            };
            let err = message(load_with(&text, &[]));
            assert!(err.contains(key), "{toml}: {err}");
        }
        // A TOML integer cannot hold u64::MAX: the parser refuses it, at the key.
        let err = message(load_with(
            &format!("[policy]\napproval_ttl_secs = {}\n{AGENT}", u64::MAX),
            &[],
        ));
        assert!(err.contains("approval_ttl_secs"), "{err}");
        let at_bound = format!("[policy]\napproval_ttl_secs = {MAX_DURATION_SECS}\n{AGENT}");
        assert!(load_with(&at_bound, &[]).is_ok());
    }

    #[test]
    fn a_tool_needs_a_configured_provider_and_connections_a_key() {
        let key = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        let tool = "[[tools]]\nname = \"t\"\ndescription = \"d\"\ninput_schema = { type = \"object\" }\nhttp = { url = \"http://127.0.0.1:9/\" }\nconnection = { provider = \"acme\" }\n";
        let acme = "[[connections]]\nprovider = \"acme\"\nmode = \"token\"\ntoken_env = \"ACME\"\n";
        let err = message(load_with(
            &format!("{AGENT}{tool}"),
            &[("TETHER_ENCRYPTION_KEY", &key)],
        ));
        assert!(err.contains("tools[0].connection.provider"), "{err}");
        // A missing token fails the calls that need it, not start-up.
        let config = load_with(
            &format!("{AGENT}{tool}{acme}"),
            &[("TETHER_ENCRYPTION_KEY", &key)],
        )
        .unwrap();
        assert!(config.file.connections[0].token.is_none());
        for bad in ["", "c2hvcnQ=", "not base64!"] {
            let err = message(load_with(
                &format!("{AGENT}{tool}{acme}"),
                &[("ACME", "t"), ("TETHER_ENCRYPTION_KEY", bad)],
            ));
            assert!(err.contains("TETHER_ENCRYPTION_KEY"), "{bad:?}: {err}");
        }
        let err = message(load_with(&format!("{AGENT}{tool}{acme}"), &[("ACME", "t")]));
        assert!(err.contains("TETHER_ENCRYPTION_KEY"), "{err}");
    }

    #[test]
    fn a_public_address_needs_a_real_secret() {
        let err = message(load_with(
            "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n",
            &[("TETHER_LISTEN", "0.0.0.0:8080")],
        ));
        assert!(err.contains("TETHER_JWT_SECRET"), "{err}");
    }

    #[test]
    fn debug_output_shows_no_secret() {
        let toml = r#"
[[agents]]
name = "a"
provider = "anthropic"
model = "m"
base_url = "http://127.0.0.1:9/v1?key=base-url-secret"
api_key_env = "MY_KEY"

[[tools]]
name = "hook"
description = "A webhook"
input_schema = { type = "object" }
http = { url = "https://hooks.example.com/T0/path-secret?token=query-secret" }

[[connections]]
provider = "acme"
mode = "token"
token_env = "ACME"
"#;
        let key = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        let jwt = "jwt-secret-jwt-secret-jwt-secret-0123";
        let config = load_with(
            toml,
            &[
                ("MY_KEY", "sk-ant-api-key-secret"),
                ("ACME", "connection-token-secret"),
                ("TETHER_ENCRYPTION_KEY", &key),
                ("TETHER_JWT_SECRET", jwt),
                (
                    "TETHER_DATABASE_URL",
                    "postgres://tether:db-password-secret@db.internal:5432/tether",
                ),
            ],
        )
        .unwrap();
        assert_eq!(
            config.file.agents[0].api_key.as_deref(),
            Some("sk-ant-api-key-secret")
        );
        let shown = format!("{config:?} {config:#?}");
        for secret in [
            "sk-ant-api-key-secret",
            "base-url-secret",
            "path-secret",
            "query-secret",
            "connection-token-secret",
            jwt,
            "db-password-secret",
            &key,
            "[7, 7, 7",
        ] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        // What it is about still shows.
        assert!(shown.contains("https://hooks.example.com"), "{shown}");
        assert!(shown.contains("MY_KEY"), "{shown}");
        assert!(shown.contains("Some([redacted])"), "{shown}");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        const SAMPLE: &str = include_str!("../tether.toml");

        /// The lines of the sample that set a key, with the key.
        fn settings() -> Vec<(usize, String)> {
            SAMPLE
                .lines()
                .enumerate()
                .filter_map(|(i, line)| {
                    let (key, _) = line.split_once('=')?;
                    let key = key.trim();
                    (!key.is_empty() && !key.starts_with('#') && !key.contains(' '))
                        .then(|| (i, key.to_owned()))
                })
                .collect()
        }

        /// Values of every kind, odd ones included.
        fn value() -> impl Strategy<Value = String> {
            prop_oneof![
                prop::sample::select(vec![
                    "-1",
                    "0",
                    "\"\"",
                    "\"x\"",
                    "true",
                    "[]",
                    "{}",
                    "[1, \"a\"]",
                    "1.5",
                    "-9223372036854775808",
                    "18446744073709551616",
                    "1e400",
                    "nan",
                    "inf",
                    "1979-05-27T07:32:00Z",
                    "{ a = 1 }",
                ])
                .prop_map(str::to_owned),
                any::<i64>().prop_map(|n| n.to_string()),
                any::<u64>().prop_map(|n| n.to_string()),
                "\\PC{0,12}".prop_map(|s| format!("{s:?}")),
            ]
        }

        proptest! {
            #[test]
            fn arbitrary_text_is_refused_or_taken_never_a_panic(text in "\\PC{0,200}") {
                let _ = FileConfig::from_toml(&text);
            }

            #[test]
            fn a_sample_with_one_value_changed_is_refused_naming_a_key(
                which in any::<prop::sample::Index>(),
                value in value(),
            ) {
                let settings = settings();
                let (line, key) = &settings[which.index(settings.len())];
                let text: Vec<String> = SAMPLE
                    .lines()
                    .enumerate()
                    .map(|(i, l)| if i == *line { format!("{key} = {value}") } else { l.to_owned() })
                    .collect();
                let text = text.join("\n");
                match FileConfig::from_toml(&text) {
                    Ok(_) => {}
                    // The parser's message quotes the line, key and all.
                    Err(ConfigError::Parse { message, .. }) => {
                        prop_assert!(message.contains(key.as_str()), "{key}: {message}");
                    }
                    // A refusal names a key the file has.
                    Err(ConfigError::Invalid { key: named, message }) => {
                        let last = named.rsplit(['.', '[']).next().unwrap_or_default();
                        let last = last.trim_end_matches(']');
                        prop_assert!(
                            !last.is_empty() && (text.contains(last) || named.contains(key.as_str())),
                            "{named}: {message}"
                        );
                    }
                    Err(other) => prop_assert!(false, "{other}"),
                }
            }
        }
    }
}
