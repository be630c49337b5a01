//! The command line as a new user meets it: database failures reported at
//! once with their cause, `tether token`'s refusals and warning, the global
//! flags and their variables, `tether config check`, and logs without
//! colour codes when stderr is not a terminal.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::support::SECRET;

/// Longer than a start-up that fails at once takes, far shorter than the
/// pool's 30 s acquire timeout that a failed connect used to wait out.
const FAIL_FAST: Duration = Duration::from_secs(10);

/// The binary with a clean environment and a folder of its own to work in.
fn tether(dir: &std::path::Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tether"));
    command
        .current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

fn scratch() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-cli-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs to its end, within `limit`; returns the output and how long it took.
async fn run_within(command: &mut Command, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    let output = tokio::time::timeout(limit, command.output())
        .await
        .unwrap_or_else(|_| panic!("tether did not exit within {limit:?}"))
        .unwrap();
    (output, started.elapsed())
}

async fn run(command: &mut Command) -> Output {
    run_within(command, Duration::from_secs(60)).await.0
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `tether SUBCOMMAND` on this database URL: it must fail, and within
/// `FAIL_FAST`; returns its stderr.
async fn refused_at_once(subcommand: &str, database_url: &str) -> String {
    let (output, took) = run_within(
        tether(&scratch())
            .arg(subcommand)
            .env("TETHER_JWT_SECRET", SECRET)
            .env("TETHER_LISTEN", "127.0.0.1:0")
            .env("TETHER_DATABASE_URL", database_url),
        FAIL_FAST,
    )
    .await;
    let stderr = stderr(&output);
    assert!(!output.status.success(), "{subcommand}: {stderr}");
    assert!(took < FAIL_FAST, "{subcommand} took {took:?}");
    // One line: the error, its causes each once.
    assert_eq!(stderr.lines().count(), 1, "{subcommand}: {stderr}");
    stderr
}

#[tokio::test]
async fn an_unreachable_database_is_reported_at_once_with_its_cause_and_address() {
    for subcommand in ["serve", "migrate"] {
        let stderr = refused_at_once(
            subcommand,
            "postgres://postgres:hunter2-db-password@127.0.0.1:1/x",
        )
        .await;
        assert!(
            stderr.contains("connection refused at 127.0.0.1:1"),
            "{subcommand}: {stderr}"
        );
        // The URL, its password removed.
        assert!(
            stderr.contains("postgres://postgres@127.0.0.1:1/x"),
            "{subcommand}: {stderr}"
        );
        assert!(!stderr.contains("hunter2"), "{subcommand}: {stderr}");
        assert_eq!(
            stderr.matches("connection refused").count(),
            1,
            "said once: {stderr}"
        );
    }
}

#[tokio::test]
async fn a_database_url_scheme_typo_is_refused_with_the_accepted_schemes() {
    let stderr = refused_at_once(
        "serve",
        "postgress://postgres:hunter2-db-password@127.0.0.1:5432/test",
    )
    .await;
    assert!(stderr.contains("\"postgress\""), "{stderr}");
    for scheme in ["sqlite://", "postgres://", "postgresql://"] {
        assert!(stderr.contains(scheme), "{scheme}: {stderr}");
    }
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[tokio::test]
async fn an_sqlite_file_in_a_missing_folder_is_named() {
    for subcommand in ["serve", "migrate"] {
        let stderr = refused_at_once(subcommand, "sqlite:///no/such/dir/t.db").await;
        assert!(
            stderr.contains("/no/such/dir/t.db"),
            "{subcommand}: {stderr}"
        );
        assert!(
            stderr.contains("the folder /no/such/dir does not exist"),
            "{subcommand}: {stderr}"
        );
        assert_eq!(
            stderr.matches("does not exist").count(),
            1,
            "said once: {stderr}"
        );
    }
}

#[tokio::test]
async fn token_warns_when_it_signs_with_the_generated_secret() {
    let dir = scratch();
    let output = run(tether(&dir)
        .args(["token", "--tenant", "acme", "--sub", "ada"])
        .env("TETHER_DATABASE_URL", "sqlite://t.db?mode=rwc"))
    .await;
    let (out, err) = (stdout(&output), stderr(&output));
    assert!(output.status.success(), "{err}");
    assert_eq!(out.trim().split('.').count(), 3, "a JWT: {out}");
    assert!(err.contains("warning"), "{err}");
    assert!(err.contains("TETHER_JWT_SECRET is not set"), "{err}");
    assert!(err.contains("t.db.jwt-secret"), "{err}");

    let output = run(tether(&dir)
        .args(["token", "--tenant", "acme", "--sub", "ada"])
        .env("TETHER_JWT_SECRET", SECRET)
        .env("TETHER_DATABASE_URL", "sqlite://t.db?mode=rwc"))
    .await;
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        !stderr(&output).contains("warning"),
        "a configured secret is no cause for a warning: {}",
        stderr(&output)
    );
}

#[tokio::test]
async fn token_refuses_an_empty_tenant_or_subject_and_a_zero_ttl() {
    let dir = scratch();
    for (args, flag, why) in [
        (
            ["--tenant", "", "--sub", "ada", "--ttl", "1h"],
            "--tenant",
            "must not be empty",
        ),
        (
            ["--tenant", "acme", "--sub", " ", "--ttl", "1h"],
            "--sub",
            "must not be empty",
        ),
        (
            ["--tenant", "acme", "--sub", "ada", "--ttl", "0s"],
            "--ttl",
            "at least one second",
        ),
    ] {
        let output = run(tether(&dir)
            .arg("token")
            .args(args)
            .env("TETHER_JWT_SECRET", SECRET))
        .await;
        let err = stderr(&output);
        assert!(!output.status.success(), "{args:?}");
        assert!(stdout(&output).is_empty(), "no token printed: {args:?}");
        assert!(err.contains(flag) && err.contains(why), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn help_shows_every_flag_with_its_variable_and_every_subcommand() {
    let dir = scratch();
    let output = run(tether(&dir).arg("--help").env(
        "TETHER_DATABASE_URL",
        "postgres://u:hunter2-db-password@h/db",
    ))
    .await;
    let help = stdout(&output);
    assert!(output.status.success(), "{}", stderr(&output));
    for shown in [
        "--config <PATH>",
        "[env: TETHER_CONFIG",
        "--listen <ADDRESS:PORT>",
        "[env: TETHER_LISTEN",
        "--database-url <URL>",
        "[env: TETHER_DATABASE_URL]",
        "serve",
        "migrate",
        "token",
        "schema",
        "config",
    ] {
        assert!(help.contains(shown), "{shown}: {help}");
    }
    assert!(!help.contains("hunter2"), "{help}");
    // Every subcommand and flag says what it is for.
    for subcommand in [
        vec![],
        vec!["serve"],
        vec!["migrate"],
        vec!["token"],
        vec!["config"],
        vec!["config", "check"],
    ] {
        let output = run(tether(&dir).args(&subcommand).arg("-h")).await;
        let help = stdout(&output);
        assert!(output.status.success(), "{subcommand:?}");
        assert!(help.contains("--config"), "global flags are shown: {help}");
        assert_eq!(
            undescribed(&help),
            Vec::<String>::new(),
            "{subcommand:?}: {help}"
        );
    }
}

/// The entries of a short help's "Commands:" and "Options:" lists that have
/// no text after their name.
fn undescribed(help: &str) -> Vec<String> {
    let mut listing = false;
    let mut missing = Vec::new();
    for line in help.lines() {
        if line.ends_with(':') && !line.starts_with(' ') {
            listing = line == "Commands:" || line == "Options:";
            continue;
        }
        // Indented deeper: a wrapped description.
        if !listing || line.trim().is_empty() || line.starts_with("          ") {
            continue;
        }
        let entry = line.trim();
        let described = entry
            .split_once("  ")
            .is_some_and(|(_, text)| !text.trim().is_empty());
        if !described {
            missing.push(entry.to_owned());
        }
    }
    missing
}

/// Starts `serve`; once it prints its address, asks it for its agents'
/// names and stops it. Its stderr if it exited instead.
async fn agents_served(command: &mut Command) -> Result<Vec<String>, String> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("tether prints its address or exits within a minute")
        .unwrap();
    let Some(line) = line else {
        let output = child.wait_with_output().await.unwrap();
        return Err(stderr(&output));
    };
    let base = line
        .strip_prefix("tether listening on ")
        .unwrap_or_else(|| panic!("{line}"));
    assert!(!base.ends_with(":8080"), "the port asked for: {base}");
    let token = tether::api::auth::Authenticator::new(SECRET)
        .unwrap()
        .mint("acme", "ada", Duration::from_secs(60))
        .unwrap();
    let body: serde_json::Value = crate::support::http_client()
        .post(format!("{base}/graphql"))
        .bearer_auth(token)
        .json(&serde_json::json!({ "query": "{ agents { name } }" }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    child.kill().await.unwrap();
    let agents = body["data"]["agents"]
        .as_array()
        .unwrap_or_else(|| panic!("{body}"));
    Ok(agents
        .iter()
        .map(|agent| agent["name"].as_str().unwrap().to_owned())
        .collect())
}

#[tokio::test]
async fn flags_before_or_after_serve_mean_what_their_variables_mean() {
    let dir = scratch();
    let config = dir.join("flags.toml");
    std::fs::write(
        &config,
        "[[agents]]\nname = \"flagged\"\nprovider = \"scripted\"\n",
    )
    .unwrap();
    let config = config.display().to_string();
    let url = |name: &str| format!("sqlite://{}?mode=rwc", dir.join(name).display());
    let flags = |db: &str| {
        [
            "--config".to_owned(),
            config.clone(),
            "--listen".to_owned(),
            "127.0.0.1:0".to_owned(),
            "--database-url".to_owned(),
            url(db),
        ]
    };
    let mut after = tether(&dir);
    after.arg("serve").args(flags("after.db"));
    let mut before = tether(&dir);
    before.args(flags("before.db")).arg("serve");
    let mut variables = tether(&dir);
    variables
        .arg("serve")
        .env("TETHER_CONFIG", &config)
        .env("TETHER_LISTEN", "127.0.0.1:0")
        .env("TETHER_DATABASE_URL", url("variables.db"));
    // Flags win over their variables.
    let mut both = tether(&dir);
    both.args(flags("flags.db"))
        .arg("serve")
        .env("TETHER_CONFIG", "/no/such/tether.toml")
        .env("TETHER_LISTEN", "not an address")
        .env("TETHER_DATABASE_URL", url("ignored.db"));
    for (what, mut command, db) in [
        ("flags after serve", after, "after.db"),
        ("flags before serve", before, "before.db"),
        ("variables", variables, "variables.db"),
        ("flags and other variables", both, "flags.db"),
    ] {
        let agents = agents_served(command.env("TETHER_JWT_SECRET", SECRET))
            .await
            .unwrap_or_else(|stderr| panic!("{what}: {stderr}"));
        assert_eq!(agents, ["flagged"], "{what}: the configuration given");
        assert!(dir.join(db).exists(), "{what}: the database given");
    }
    assert!(!dir.join("ignored.db").exists());

    // A flag's value is checked as its variable's is.
    let refused = agents_served(
        tether(&dir)
            .args(["--listen", "not an address", "serve"])
            .env("TETHER_DATABASE_URL", url("env.db"))
            .env("TETHER_JWT_SECRET", SECRET),
    )
    .await
    .unwrap_err();
    assert!(
        refused.contains("TETHER_LISTEN") && refused.contains("not an address"),
        "{refused}"
    );
    let refused = agents_served(
        tether(&dir)
            .args(["serve", "--config", "/no/such/tether.toml"])
            .env("TETHER_DATABASE_URL", url("env.db"))
            .env("TETHER_JWT_SECRET", SECRET),
    )
    .await
    .unwrap_err();
    assert!(refused.contains("/no/such/tether.toml"), "{refused}");
}

const CHECKED: &str = r#"
default_agent = "assistant"

[[agents]]
name = "assistant"
provider = "anthropic"
model = "claude-sonnet-4-5"
api_key_env = "CHECK_ANTHROPIC_KEY"
tools = ["ask_questions", "publish_post"]

[[agents]]
name = "plain"
provider = "scripted"

[[tools]]
name = "publish_post"
description = "Publish a post"
input_schema = { type = "object" }
risk = "publish"
http = { method = "POST", url = "http://127.0.0.1:9200/publish?token=hunter2-tool-secret" }
"#;

#[tokio::test]
async fn config_check_lists_the_agents_and_tools_of_a_valid_file() {
    let dir = scratch();
    let path = dir.join("checked.toml");
    std::fs::write(&path, CHECKED).unwrap();
    let output = run(tether(&dir)
        .args(["config", "check", "--config"])
        .arg(&path)
        .env("CHECK_ANTHROPIC_KEY", "sk-ant-hunter2-secret-key"))
    .await;
    let out = stdout(&output);
    assert!(output.status.success(), "{}", stderr(&output));
    for listed in [
        "assistant (default): provider anthropic, model claude-sonnet-4-5; tools: ask_questions, publish_post",
        "plain: provider scripted, model scripted; tools: none",
        "publish_post: POST http://127.0.0.1:9200; risk publish",
        "ask_questions: built in",
    ] {
        assert!(out.contains(listed), "{listed}: {out}");
    }
    assert!(!out.contains("hunter2"), "no secret: {out}");

    // The same through the variable, the flag before the subcommands.
    let output = run(tether(&dir)
        .arg("--config")
        .arg(&path)
        .args(["config", "check"])
        .env("CHECK_ANTHROPIC_KEY", "sk-ant-hunter2-secret-key"))
    .await;
    assert!(output.status.success(), "{}", stderr(&output));
    let output = run(tether(&dir)
        .args(["config", "check"])
        .env("TETHER_CONFIG", &path)
        .env("CHECK_ANTHROPIC_KEY", "sk-ant-hunter2-secret-key"))
    .await;
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout(&output).contains("assistant (default)"));
}

#[tokio::test]
async fn config_check_refuses_a_bad_file_with_its_error_in_toml_terms() {
    let dir = scratch();
    // A variable the file names but the environment lacks.
    let path = dir.join("unset.toml");
    std::fs::write(&path, CHECKED).unwrap();
    let output = run(tether(&dir)
        .args(["config", "check", "--config"])
        .arg(&path))
    .await;
    let err = stderr(&output);
    assert!(!output.status.success());
    assert!(
        err.contains("agents[0].api_key_env") && err.contains("CHECK_ANTHROPIC_KEY"),
        "{err}"
    );
    assert!(stdout(&output).is_empty(), "{}", stdout(&output));

    // A value of the wrong type, in the file's own words.
    let path = dir.join("typed.toml");
    std::fs::write(&path, "[runtime]\nlease_secs = \"soon\"\n").unwrap();
    let output = run(tether(&dir)
        .args(["config", "check", "--config"])
        .arg(&path))
    .await;
    let err = stderr(&output);
    assert!(!output.status.success());
    assert!(err.contains("typed.toml"), "{err}");
    assert!(err.contains("line 2"), "{err}");
    assert!(err.contains("lease_secs"), "{err}");
    assert!(err.contains("expected a number"), "{err}");
    assert!(!err.contains("f64"), "{err}");
}

#[tokio::test]
async fn logs_carry_no_colour_codes_when_stderr_is_not_a_terminal() {
    let dir = scratch();
    // `token` without a secret logs at info where its generated secret is.
    let output = run(tether(&dir)
        .args(["token", "--tenant", "acme", "--sub", "ada"])
        .env("RUST_LOG", "info")
        .env("TETHER_DATABASE_URL", "sqlite://t.db?mode=rwc"))
    .await;
    let err = stderr(&output);
    assert!(output.status.success(), "{err}");
    assert!(err.contains("INFO"), "a log line was written: {err}");
    assert!(!err.contains('\u{1b}'), "{err:?}");
}
