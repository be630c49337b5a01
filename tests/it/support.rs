//! Test harness: a fresh database per test (SQLite file, or a new PostgreSQL
//! database when `TETHER_TEST_DATABASE_URL` is set), the real `tether`
//! binary on port 0, and GraphQL clients over HTTP and WebSocket.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tether::api::auth::Authenticator;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message as WsFrame;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use uuid::Uuid;

pub const SECRET: &str = "integration-test-secret-at-least-32-bytes";

/// The claim that makes a token an operator's, where tests configure one
/// (`[auth] operator_claim`).
pub const OPERATOR_CLAIM: &str = "tether_operator";

/// How long any single expected thing may take before a test fails.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// The configuration tests run with unless they pass their own.
pub const BASE_CONFIG: &str = r#"
default_agent = "demo"

[api]
max_message_bytes = 4096
max_request_bytes = 65536
max_query_depth = 10

[[agents]]
name = "demo"
provider = "scripted"
tools = ["ask_questions", "demo_publish"]

[[agents]]
name = "other"
provider = "scripted"
"#;

/// `BASE_CONFIG` with more `[api]` keys.
pub fn base_config_with_api(keys: &str) -> String {
    BASE_CONFIG.replacen("[api]\n", &format!("[api]\n{keys}\n"), 1)
}

/// A configuration with workers tuned for tests: fast streaming, frequent
/// checkpoints, short leases.
pub const WORKER_CONFIG: &str = r#"
default_agent = "demo"

[runtime]
lease_secs = 3
heartbeat_secs = 0.5
checkpoint_ms = 40
poll_ms = 200

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = 5

[agents.retry]
max_attempts = 3
initial_delay_ms = 100
max_delay_ms = 400

[[agents]]
name = "once"
provider = "scripted"
stream_delay_ms = 5

[agents.retry]
max_attempts = 1

[[agents]]
name = "brief"
provider = "scripted"
stream_delay_ms = 5

[agents.limits]
timeout_secs = 1
"#;

/// An HTTP client for tests (the TLS backend chosen first, as the server does).
pub fn http_client() -> reqwest::Client {
    tether::providers::http::install_tls();
    reqwest::Client::new()
}

/// Whether the tests run on PostgreSQL (else on SQLite files).
pub fn on_postgres() -> bool {
    std::env::var("TETHER_TEST_DATABASE_URL").is_ok_and(|u| u.starts_with("postgres"))
}

/// A database of its own for one test, removed afterwards.
pub struct TestDb {
    pub url: String,
    dir: PathBuf,
    postgres: Option<(String, String)>,
}

impl TestDb {
    pub async fn new() -> TestDb {
        let dir = std::env::temp_dir().join(format!("tether-it-{}", Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        match std::env::var("TETHER_TEST_DATABASE_URL") {
            Ok(base) if base.starts_with("postgres") => {
                let name = format!("tether_it_{}", Uuid::now_v7().simple());
                let admin = sea_orm::Database::connect(base.as_str())
                    .await
                    .expect("TETHER_TEST_DATABASE_URL must be reachable");
                use sea_orm::ConnectionTrait;
                admin
                    .execute_unprepared(&format!("CREATE DATABASE \"{name}\""))
                    .await
                    .unwrap();
                admin.close().await.unwrap();
                let url = with_database(&base, &name);
                TestDb {
                    url,
                    dir,
                    postgres: Some((base, name)),
                }
            }
            _ => TestDb {
                url: format!("sqlite://{}?mode=rwc", dir.join("tether.db").display()),
                dir,
                postgres: None,
            },
        }
    }
}

fn with_database(base: &str, name: &str) -> String {
    let (without_query, query) = match base.split_once('?') {
        Some((head, query)) => (head, format!("?{query}")),
        None => (base, String::new()),
    };
    let prefix = match without_query.rfind('/') {
        Some(i) if i > "postgres://".len() => &without_query[..i],
        _ => without_query,
    };
    format!("{prefix}/{name}{query}")
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some((base, name)) = self.postgres.take() {
            // Drop runs outside any runtime we may block: use a thread.
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    use sea_orm::ConnectionTrait;
                    if let Ok(admin) = sea_orm::Database::connect(base.as_str()).await {
                        let _ = admin
                            .execute_unprepared(&format!(
                                "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                            ))
                            .await;
                        let _ = admin.close().await;
                    }
                });
            })
            .join();
        }
    }
}

/// The real binary, serving on a port the system chose.
pub struct Server {
    pub base: String,
    pub addr: String,
    http: reqwest::Client,
    auth: Authenticator,
    // Dropping them kills the process and removes the database.
    child: Child,
    db: TestDb,
    options: ServerOptions,
    instance: String,
    logs: Logs,
}

/// What the server's processes wrote to stderr (passed on to the test's
/// own stderr as well), and whether the latest one has closed it.
#[derive(Clone)]
struct Logs {
    text: Arc<Mutex<String>>,
    open: watch::Sender<bool>,
}

impl Logs {
    fn new() -> Logs {
        Logs {
            text: Arc::default(),
            open: watch::Sender::new(false),
        }
    }

    /// Echoes and keeps a process's stderr; its lines also come on the
    /// returned channel as they are read.
    fn follow(
        &self,
        stderr: tokio::process::ChildStderr,
    ) -> tokio::sync::mpsc::UnboundedReceiver<String> {
        let logs = self.clone();
        let (log_tx, log) = tokio::sync::mpsc::unbounded_channel();
        logs.open.send_replace(true);
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("{line}");
                {
                    let mut text = logs.text.lock().unwrap();
                    text.push_str(&line);
                    text.push('\n');
                }
                let _ = log_tx.send(line);
            }
            logs.open.send_replace(false);
        });
        log
    }
}

async fn spawn(
    db: &TestDb,
    options: &ServerOptions,
    instance: &str,
    extra_env: &[(&str, &str)],
    logs: &Logs,
) -> (Child, String) {
    match launch(db, options, instance, extra_env, logs).await {
        Launch::Serving { child, base, .. } => (child, base),
        Launch::Exited { status, stderr } => {
            panic!("tether exited ({status}) before printing its address: {stderr}")
        }
    }
}

/// How a launched process went: serving, or ended before it printed its
/// address.
pub enum Launch {
    Serving {
        child: Child,
        base: String,
        /// Its log lines (stderr), as they come; they are echoed too.
        log: tokio::sync::mpsc::UnboundedReceiver<String>,
    },
    Exited {
        status: std::process::ExitStatus,
        stderr: String,
    },
}

async fn launch(
    db: &TestDb,
    options: &ServerOptions,
    instance: &str,
    extra_env: &[(&str, &str)],
    logs: &Logs,
) -> Launch {
    let mut command = tether_command(db, &options.config, &db.dir);
    command
        .args(["serve", "--role", options.role])
        .env("TETHER_INSTANCE_ID", instance)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in &options.env {
        command.env(key, value);
    }
    for (key, value) in extra_env {
        command.env(key, value);
    }
    let mut child = command.spawn().expect("the tether binary starts");
    let mut log = logs.follow(child.stderr.take().unwrap());
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("tether prints its address or exits within a minute")
        .unwrap();
    let Some(line) = line else {
        let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
            .await
            .expect("a process that closed its stdout ends")
            .unwrap();
        let mut stderr = Vec::new();
        while let Some(line) = log.recv().await {
            stderr.push(line);
        }
        return Launch::Exited {
            status,
            stderr: stderr.join("\n"),
        };
    };
    let base = line
        .strip_prefix("tether listening on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .to_owned();
    // Keep reading stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Launch::Serving { child, base, log }
}

/// Another process on a `Server`'s database; it stops when dropped.
pub struct Companion {
    pub child: Child,
    /// Where it serves, `http://host:port`.
    pub base: String,
    /// Its `TETHER_INSTANCE_ID`, which its leases carry.
    pub instance: String,
}

pub struct ServerOptions {
    pub config: String,
    pub env: Vec<(String, String)>,
    /// `api` (no workers: runs stay queued) or `all`.
    pub role: &'static str,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            config: BASE_CONFIG.to_owned(),
            env: Vec::new(),
            role: "api",
        }
    }
}

/// Runs the binary with a configuration file and the test's database.
pub fn tether_command(db: &TestDb, config: &str, dir: &std::path::Path) -> Command {
    let config_path = dir.join(format!("tether-{}.toml", Uuid::now_v7().simple()));
    std::fs::write(&config_path, config).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_tether"));
    command
        .current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("TETHER_CONFIG", &config_path)
        .env("TETHER_DATABASE_URL", &db.url)
        .env("TETHER_LISTEN", "127.0.0.1:0")
        .env("TETHER_JWT_SECRET", SECRET)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    command
}

impl Server {
    /// The API alone: runs stay queued, as no worker takes them.
    pub async fn start() -> Server {
        Server::start_with(ServerOptions::default()).await
    }

    pub async fn start_with(options: ServerOptions) -> Server {
        let db = TestDb::new().await;
        let instance = format!("it-{}", Uuid::now_v7().simple());
        let logs = Logs::new();
        let (child, base) = spawn(&db, &options, &instance, &[], &logs).await;
        let addr = base.trim_start_matches("http://").to_owned();
        Server {
            base,
            addr,
            http: http_client(),
            auth: Authenticator::new(SECRET).expect("the test secret is long enough"),
            child,
            db,
            options,
            instance,
            logs,
        }
    }

    /// The default configuration with these keys added to its `[api]`.
    pub async fn with_api(keys: &str) -> Server {
        Server::start_with(ServerOptions {
            config: base_config_with_api(keys),
            ..Default::default()
        })
        .await
    }

    /// The API alone (`--role api`) on the given configuration: runs stay
    /// queued until a worker process joins (`companion`).
    pub async fn api_only(config: &str) -> Server {
        Server::start_with(ServerOptions {
            config: config.to_owned(),
            role: "api",
            ..Default::default()
        })
        .await
    }

    /// The API with workers, on the given configuration.
    pub async fn start_workers(config: &str) -> Server {
        Server::start_with(ServerOptions {
            config: config.to_owned(),
            role: "all",
            ..Default::default()
        })
        .await
    }

    /// Another process on the same database (a split deployment), with this
    /// server's configuration and the given role. It stops when dropped.
    pub async fn companion(&self, role: &'static str) -> Child {
        match self.launch_beside(role, false).await {
            Launch::Serving { child, .. } => child,
            Launch::Exited { status, stderr } => {
                panic!("the {role} companion exited ({status}): {stderr}")
            }
        }
    }

    /// `companion`, with its own configuration and `env` on top of this
    /// server's environment; its logs join this server's.
    pub async fn companion_with(
        &self,
        role: &'static str,
        config: &str,
        env: &[(&str, &str)],
    ) -> Companion {
        let options = ServerOptions {
            config: config.to_owned(),
            env: self.options.env.clone(),
            role,
        };
        let instance = format!("it-{}", Uuid::now_v7().simple());
        match launch(&self.db, &options, &instance, env, &self.logs).await {
            Launch::Serving { child, base, .. } => Companion {
                child,
                base,
                instance,
            },
            Launch::Exited { status, stderr } => {
                panic!("the {role} companion exited ({status}): {stderr}")
            }
        }
    }

    /// Launches another process on the same database with this server's
    /// configuration, the given role, and this server's instance id or a
    /// fresh one; it may refuse to start.
    pub async fn launch_beside(&self, role: &'static str, same_instance: bool) -> Launch {
        let options = ServerOptions {
            config: self.options.config.clone(),
            env: self.options.env.clone(),
            role,
        };
        let instance = if same_instance {
            self.instance.clone()
        } else {
            format!("it-{}", Uuid::now_v7().simple())
        };
        launch(&self.db, &options, &instance, &[], &Logs::new()).await
    }

    /// The server process's open file descriptors.
    pub fn open_fds(&self) -> usize {
        let pid = self.child.id().expect("the server is running");
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("the server's descriptors are readable")
            .count()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Kills the process with SIGKILL and waits for it to be gone.
    pub async fn kill(&mut self) {
        self.child.kill().await.unwrap();
    }

    /// Waits for the process to end by itself (a failpoint, a signal).
    pub async fn exited(&mut self) -> std::process::ExitStatus {
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("the process ends in time")
            .unwrap()
    }

    /// Sends SIGTERM, as a deployment would.
    pub fn terminate(&self) {
        let pid = self.child.id().expect("the process is running");
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Starts the binary again on the same database and instance id, with
    /// `extra_env` on top of the options' environment. The old process must
    /// be gone.
    pub async fn restart(&mut self, extra_env: &[(&str, &str)]) {
        let (child, base) = spawn(
            &self.db,
            &self.options,
            &self.instance,
            extra_env,
            &self.logs,
        )
        .await;
        self.addr = base.trim_start_matches("http://").to_owned();
        self.base = base;
        self.child = child;
    }

    /// Stops the process with SIGTERM and returns everything its processes
    /// wrote to stderr, once the last of it has been read.
    pub async fn logs_after_exit(&mut self) -> String {
        self.terminate();
        self.exited().await;
        let mut open = self.logs.open.subscribe();
        tokio::time::timeout(PATIENCE, open.wait_for(|open| !open))
            .await
            .expect("the server's stderr closes once it has exited")
            .unwrap();
        self.logs.text.lock().unwrap().clone()
    }

    /// Waits until the logs of this server's processes (companions
    /// started with `companion_with` included) hold `needle` `times` times;
    /// returns them.
    pub async fn wait_for_log(&self, needle: &str, times: usize) -> String {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let text = self.logs.text.lock().unwrap().clone();
            if text.matches(needle).count() >= times {
                return text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the logs never said {needle:?} {times} times: {text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The configuration the next `restart` uses (a deployment that changes
    /// it).
    pub fn set_config(&mut self, config: String) {
        self.options.config = config;
    }

    /// The server's database, for tests that read it in process.
    pub fn database_url(&self) -> &str {
        &self.db.url
    }

    /// One value of a run's row, read from the database itself: `column`
    /// (an SQL expression over `runs`) as `i64`.
    async fn run_value(&self, run: &str, column: &str) -> i64 {
        use sea_orm::ConnectionTrait;
        let db = sea_orm::Database::connect(self.database_url())
            .await
            .unwrap();
        let backend = db.get_database_backend();
        let placeholder = match backend {
            sea_orm::DatabaseBackend::Postgres => "$1",
            _ => "?",
        };
        let row = db
            .query_one_raw(sea_orm::Statement::from_sql_and_values(
                backend,
                format!("SELECT CAST({column} AS BIGINT) AS v FROM runs WHERE id = {placeholder}"),
                [Uuid::parse_str(run).unwrap().into()],
            ))
            .await
            .unwrap()
            .expect("the run's row");
        let value: i64 = row.try_get("", "v").unwrap();
        db.close().await.unwrap();
        value
    }

    /// How many times the run was recovered after losing its worker.
    pub async fn recoveries(&self, run: &str) -> i64 {
        self.run_value(run, "recoveries").await
    }

    /// Whether the run's lease has run out on the database's clock.
    pub async fn lease_ran_out(&self, run: &str) -> bool {
        let backend = if on_postgres() {
            sea_orm::DatabaseBackend::Postgres
        } else {
            sea_orm::DatabaseBackend::Sqlite
        };
        let now = tether::store::clock::now_sql(backend);
        let ran_out = format!("CASE WHEN lease_expires_at < {now} THEN 1 ELSE 0 END");
        self.run_value(run, &ran_out).await == 1
    }

    pub fn token(&self, tenant: &str, sub: &str) -> String {
        self.auth
            .mint(tenant, sub, Duration::from_secs(3600))
            .expect("the test secret signs")
    }

    pub fn token_for(&self, tenant: &str, sub: &str, ttl: Duration) -> String {
        self.auth
            .mint(tenant, sub, ttl)
            .expect("the test secret signs")
    }

    /// A token for `sub` of `tenant` with these claims besides, signed with
    /// the test secret.
    pub fn token_with(&self, tenant: &str, sub: &str, extra: Value) -> String {
        let exp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 3600;
        let mut claims = json!({ "sub": sub, "tenant": tenant, "exp": exp });
        if let (Some(claims), Value::Object(extra)) = (claims.as_object_mut(), extra) {
            claims.extend(extra);
        }
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap()
    }

    /// An operator's token, for a configuration whose `auth.operator_claim`
    /// is `OPERATOR_CLAIM`.
    pub fn operator_token(&self, tenant: &str, sub: &str) -> String {
        let config = tether::config::AuthConfig {
            operator_claim: Some(OPERATOR_CLAIM.to_owned()),
            ..Default::default()
        };
        Authenticator::from_config(&config, vec![SECRET.to_owned()])
            .expect("the test secret is long enough")
            .mint_operator(tenant, sub, Duration::from_secs(3600))
            .expect("the test secret signs")
    }

    /// Runs `tether ARGS` (an operator's command) on this server's database
    /// and configuration, to its end.
    pub async fn command(&self, args: &[&str]) -> std::process::Output {
        let mut command = tether_command(&self.db, &self.options.config, &self.db.dir);
        for (name, value) in &self.options.env {
            command.env(name, value);
        }
        tokio::time::timeout(PATIENCE, command.args(args).output())
            .await
            .expect("the command ends")
            .expect("the binary runs")
    }

    /// Posts a GraphQL request; returns the HTTP status and the JSON body.
    pub async fn post(&self, token: Option<&str>, query: &str, variables: Value) -> (u16, Value) {
        self.post_at(&self.base, token, query, variables).await
    }

    /// `post` to another process (a companion) serving at `base`.
    pub async fn post_at(
        &self,
        base: &str,
        token: Option<&str>,
        query: &str,
        variables: Value,
    ) -> (u16, Value) {
        let mut request = self
            .http
            .post(format!("{base}/graphql"))
            .json(&json!({ "query": query, "variables": variables }));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap())
    }

    /// Posts a GraphQL request that must succeed; returns its `data`.
    pub async fn gql(&self, token: &str, query: &str, variables: Value) -> Value {
        let (status, body) = self.post(Some(token), query, variables).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.get("errors").is_none(), "unexpected errors: {body}");
        body["data"].clone()
    }

    /// Posts a GraphQL request that must fail; returns its first error.
    pub async fn gql_error(&self, token: &str, query: &str, variables: Value) -> Value {
        let (_, body) = self.post(Some(token), query, variables).await;
        body["errors"]
            .get(0)
            .cloned()
            .unwrap_or_else(|| panic!("expected an error: {body}"))
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    pub async fn create_conversation(&self, token: &str) -> String {
        let data = self
            .gql(
                token,
                "mutation { createConversation(input: {}) { id } }",
                json!({}),
            )
            .await;
        data["createConversation"]["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// A conversation with the named agent.
    pub async fn conversation_with(&self, token: &str, agent: &str) -> String {
        let data = self
            .gql(
                token,
                "mutation($a: String) { createConversation(input: {agent: $a}) { id } }",
                json!({ "a": agent }),
            )
            .await;
        data["createConversation"]["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// Sends a message; returns (message id, run id).
    pub async fn send(&self, token: &str, conversation: &str, text: &str) -> (String, String) {
        self.send_at(&self.base, token, conversation, text).await
    }

    /// `send` through another process (a companion) serving at `base`.
    pub async fn send_at(
        &self,
        base: &str,
        token: &str,
        conversation: &str,
        text: &str,
    ) -> (String, String) {
        let (status, body) = self
            .post_at(
                base,
                Some(token),
                "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { message { id } run { id } } }",
                json!({ "c": conversation, "t": text }),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert!(body.get("errors").is_none(), "unexpected errors: {body}");
        let data = &body["data"];
        (
            data["sendMessage"]["message"]["id"]
                .as_str()
                .unwrap()
                .to_owned(),
            data["sendMessage"]["run"]["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        )
    }

    /// `cancelRun`; returns the run as the mutation answered.
    pub async fn cancel(&self, token: &str, run: &str) -> Value {
        self.gql(
            token,
            "mutation($r: ID!) { cancelRun(runId: $r) { id status endCause cancelRequested } }",
            json!({ "r": run }),
        )
        .await["cancelRun"]
            .clone()
    }

    /// Polls a run until `done` holds for it; returns the run.
    pub async fn wait_for_run(
        &self,
        token: &str,
        run: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let data = self
                .gql(
                    token,
                    "query($r: ID!) { run(id: $r) { id status endCause cancelRequested steps error { code message } usage { inputTokens outputTokens costUsd } } }",
                    json!({ "r": run }),
                )
                .await;
            if done(&data["run"]) {
                return data["run"].clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "run never reached the condition: {}",
                data["run"]
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the run has ended; returns it.
    pub async fn wait_until_ended(&self, token: &str, run: &str) -> Value {
        self.wait_for_run(token, run, |r| {
            matches!(
                r["status"].as_str(),
                Some("COMPLETED" | "FAILED" | "CANCELLED")
            )
        })
        .await
    }

    /// The parts of the assistant message of a run, in order.
    pub async fn reply_parts(&self, token: &str, conversation: &str, run: &str) -> Vec<Value> {
        let data = self
            .gql(
                token,
                "query($c: ID!) { conversation(id: $c) { messages { role runId parts { id kind state text } } } }",
                json!({ "c": conversation }),
            )
            .await;
        data["conversation"]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "ASSISTANT" && m["runId"] == run)
            .flat_map(|m| m["parts"].as_array().unwrap().clone())
            .collect()
    }

    /// Every part of a conversation, oldest message first, with `fields`
    /// selected on each part.
    pub async fn parts_of(&self, token: &str, conversation: &str, fields: &str) -> Vec<Value> {
        let query = format!(
            "query($c: ID!) {{ conversation(id: $c) {{ messages {{ parts {{ {fields} }} }} }} }}"
        );
        let data = self.gql(token, &query, json!({ "c": conversation })).await;
        data["conversation"]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|m| m["parts"].as_array().unwrap().clone())
            .collect()
    }

    /// Every persisted event of a conversation, through `events` pages.
    pub async fn all_events(&self, token: &str, conversation: &str) -> Vec<Value> {
        let mut events = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let data = self
                .gql(
                    token,
                    "query($c: ID!, $a: String) { events(conversationId: $c, after: $a, first: 1000) { endCursor hasMore events { cursor type runId } } }",
                    json!({ "c": conversation, "a": after }),
                )
                .await;
            let page = &data["events"];
            events.extend(page["events"].as_array().unwrap().iter().cloned());
            after = page["endCursor"].as_str().map(str::to_owned);
            if !page["hasMore"].as_bool().unwrap() {
                return events;
            }
        }
    }
}

pub type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A GraphQL WebSocket client speaking `graphql-transport-ws` or `graphql-ws`.
pub struct WsClient {
    socket: Socket,
    pub protocol: &'static str,
}

/// How a WebSocket conversation ended from the client's side.
#[derive(Debug, PartialEq)]
pub enum Ending {
    Closed(u16, String),
    Dropped,
}

impl WsClient {
    pub async fn open(server: &Server, protocol: &'static str) -> WsClient {
        WsClient::open_with(&server.addr, protocol, None).await
    }

    /// `open`, with the socket's receive buffer set to `receive_buffer`
    /// bytes: a client that stops reading then stalls the server's writes
    /// after a few frames, instead of the kernel absorbing megabytes.
    async fn open_with(
        addr: &str,
        protocol: &'static str,
        receive_buffer: Option<u32>,
    ) -> WsClient {
        let mut request = format!("ws://{addr}/graphql")
            .into_client_request()
            .unwrap();
        request
            .headers_mut()
            .insert("Sec-WebSocket-Protocol", HeaderValue::from_static(protocol));
        let tcp = tokio::net::TcpSocket::new_v4().unwrap();
        if let Some(bytes) = receive_buffer {
            tcp.set_recv_buffer_size(bytes).unwrap();
        }
        let stream = tcp.connect(addr.parse().unwrap()).await.unwrap();
        let stream = tokio_tungstenite::MaybeTlsStream::Plain(stream);
        let (socket, response) = tokio_tungstenite::client_async(request, stream)
            .await
            .unwrap();
        assert_eq!(
            response.headers().get("sec-websocket-protocol").unwrap(),
            protocol
        );
        WsClient { socket, protocol }
    }

    /// Opens and initialises with a token; panics unless acknowledged.
    pub async fn connect(server: &Server, token: &str) -> WsClient {
        WsClient::connect_with(&server.addr, token, None).await
    }

    /// `connect` to another process (a companion) serving at `base`.
    pub async fn connect_at(base: &str, token: &str) -> WsClient {
        WsClient::connect_with(base.trim_start_matches("http://"), token, None).await
    }

    /// `connect` with a small receive buffer (see `open_with`).
    pub async fn connect_slow(server: &Server, token: &str) -> WsClient {
        WsClient::connect_with(&server.addr, token, Some(4096)).await
    }

    async fn connect_with(addr: &str, token: &str, receive_buffer: Option<u32>) -> WsClient {
        let mut client = WsClient::open_with(addr, "graphql-transport-ws", receive_buffer).await;
        client.init_with(token).await;
        client
    }

    /// Initialises with a token; panics unless acknowledged.
    pub async fn init_with(&mut self, token: &str) {
        self.init(json!({ "Authorization": format!("Bearer {token}") }))
            .await;
        let ack = self.next_json().await.expect("connection_ack");
        assert_eq!(ack["type"], "connection_ack", "{ack}");
    }

    pub async fn init(&mut self, payload: Value) {
        self.send_json(json!({ "type": "connection_init", "payload": payload }))
            .await;
    }

    pub async fn send_json(&mut self, value: Value) {
        self.socket
            .send(WsFrame::Text(value.to_string().into()))
            .await
            .unwrap();
    }

    /// Queues `count` copies of a text frame and sends them at once, not
    /// waiting for the server to read any.
    pub async fn flood(&mut self, text: &str, count: usize) -> Result<(), String> {
        for _ in 0..count {
            self.feed(text).await?;
        }
        self.flush().await
    }

    /// Queues a text frame without sending it.
    pub async fn feed(&mut self, text: &str) -> Result<(), String> {
        self.socket
            .feed(WsFrame::Text(text.to_owned().into()))
            .await
            .map_err(|e| e.to_string())
    }

    pub async fn flush(&mut self) -> Result<(), String> {
        self.socket.flush().await.map_err(|e| e.to_string())
    }

    /// The next frame as it came, keepalives included; `None` once the
    /// socket ended.
    pub async fn next_frame(&mut self) -> Option<WsFrame> {
        tokio::time::timeout(PATIENCE, self.socket.next())
            .await
            .expect("a WebSocket frame in time")?
            .ok()
    }

    /// Sends one frame as it is.
    pub async fn send_frame(&mut self, frame: WsFrame) -> Result<(), String> {
        self.socket.send(frame).await.map_err(|e| e.to_string())
    }

    pub async fn subscribe(&mut self, id: &str, query: &str, variables: Value) {
        let kind = if self.protocol == "graphql-ws" {
            "start"
        } else {
            "subscribe"
        };
        self.send_json(json!({
            "id": id,
            "type": kind,
            "payload": { "query": query, "variables": variables },
        }))
        .await;
    }

    /// The next JSON message, skipping keepalives; `None` once the socket
    /// ended (see `ending`).
    pub async fn next_json(&mut self) -> Option<Value> {
        // One deadline for the whole wait: the server's pings (every 15 s)
        // must not keep a test waiting for good.
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let frame = tokio::time::timeout_at(deadline, self.socket.next())
                .await
                .expect("a WebSocket message in time")?;
            match frame {
                Ok(WsFrame::Text(text)) => {
                    let value: Value = serde_json::from_str(&text).unwrap();
                    match value["type"].as_str() {
                        Some("ping") => {
                            self.send_json(json!({"type": "pong"})).await;
                        }
                        Some("ka") => {}
                        _ => return Some(value),
                    }
                }
                Ok(WsFrame::Close(_)) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// Reads until the server sends a keepalive of its own.
    pub async fn wait_for_keepalive(&mut self) -> Value {
        loop {
            let frame = tokio::time::timeout(PATIENCE, self.socket.next())
                .await
                .expect("a keepalive in time")
                .expect("the socket stays open")
                .unwrap();
            if let WsFrame::Text(text) = frame {
                let value: Value = serde_json::from_str(&text).unwrap();
                if matches!(value["type"].as_str(), Some("ping" | "ka")) {
                    return value;
                }
            }
        }
    }

    /// Reads until the server closes; returns the close code and reason.
    pub async fn ending(&mut self) -> Ending {
        loop {
            let frame = tokio::time::timeout(PATIENCE, self.socket.next())
                .await
                .expect("the server closes in time");
            match frame {
                Some(Ok(WsFrame::Close(Some(frame)))) => {
                    return Ending::Closed(frame.code.into(), frame.reason.to_string());
                }
                Some(Ok(WsFrame::Close(None))) | None | Some(Err(_)) => return Ending::Dropped,
                Some(Ok(_)) => {}
            }
        }
    }

    /// The next `next`/`data` payload of subscription `id`.
    pub async fn next_event(&mut self, id: &str) -> Value {
        loop {
            let message = self.next_json().await.expect("the socket stays open");
            match message["type"].as_str() {
                Some("next" | "data") if message["id"] == id => return message["payload"].clone(),
                Some("error") => panic!("subscription error: {message}"),
                _ => {}
            }
        }
    }
}

/// Every event of a conversation with the fields of retries.
pub async fn events_with_retries(server: &Server, token: &str, conversation: &str) -> Vec<Value> {
    server
        .gql(
            token,
            "query($c: ID!) { events(conversationId: $c, first: 1000) { events { cursor type runId at ... on RunRetryPending { attempt maxAttempts delayMs nextAttemptAt error { code message httpStatus retryable } } ... on ContextCompacted { messagesCompacted } } } }",
            json!({ "c": conversation }),
        )
        .await["events"]["events"]
        .as_array()
        .unwrap()
        .clone()
}

/// The events of one type.
pub fn of_type<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["type"] == kind).collect()
}

/// `"2026-11-29T13:48:34.123Z"`: UTC, `Z`, exactly milliseconds.
pub fn assert_datetime(value: &Value) {
    let text = value
        .as_str()
        .unwrap_or_else(|| panic!("not a string: {value}"));
    let re = regex::Regex::new(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$").unwrap();
    assert!(re.is_match(text), "bad DateTime {text}");
}

/// `scripts/NAME`, an npm package the tests run with Node, its packages
/// installed (`npm ci`, once per test process) when `node_modules` lacks
/// `module`: `cargo test` works on a fresh machine that has Node and npm.
pub fn npm_package(name: &str, module: &str) -> PathBuf {
    static INSTALLING: Mutex<()> = Mutex::new(());
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name);
    let _one_at_a_time = INSTALLING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !dir.join("node_modules").join(module).is_dir() {
        let status = std::process::Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--prefix"])
            .arg(&dir)
            .stdout(Stdio::null())
            .status()
            .expect("npm runs (Node.js 20.19 or later is needed)");
        assert!(status.success(), "npm ci --prefix scripts/{name} failed");
    }
    dir
}
