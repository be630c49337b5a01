//! The command line as a new user meets it: database failures reported at
//! once with their cause, `tether token`'s refusals and warning, and logs
//! without colour codes when stderr is not a terminal.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

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
