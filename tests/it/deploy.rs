//! The layout `deploy/` describes, run as its systemd units say (on
//! PostgreSQL: two worker processes cannot share an SQLite file): each
//! unit's `ExecStart` with its environment, and `deploy/tether.toml`. Two
//! API instances and two worker instances serve a run sent through one API
//! and watched through the other, and a rolling restart of the workers
//! (SIGTERM, then the same instance id again) loses no run.

use std::collections::HashMap;
use std::path::Path;

use serde_json::json;

use crate::support::{Server, ServerOptions, WsClient, on_postgres};

const EVENTS: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { cursor type runId } }";

/// A systemd unit's `ExecStart` arguments (after the binary) and its
/// `Environment=` settings.
fn unit(name: &str) -> (Vec<String>, HashMap<String, String>) {
    let text = std::fs::read_to_string(Path::new("deploy/systemd").join(name)).unwrap();
    let mut args = Vec::new();
    let mut env = HashMap::new();
    for line in text.lines() {
        if let Some(command) = line.strip_prefix("ExecStart=") {
            let mut words = command.split_whitespace();
            assert_eq!(words.next(), Some("/usr/local/bin/tether"), "{name}");
            args = words.map(str::to_owned).collect();
        }
        if let Some(setting) = line.strip_prefix("Environment=") {
            let (key, value) = setting.split_once('=').unwrap();
            env.insert(key.to_owned(), value.to_owned());
        }
    }
    assert!(!args.is_empty(), "{name} has an ExecStart");
    (args, env)
}

#[tokio::test]
async fn the_deployed_layout_serves_and_rolls_without_losing_runs() {
    if !on_postgres() {
        return;
    }
    let config = std::fs::read_to_string("deploy/tether.toml").unwrap();
    let (api_args, api_env) = unit("tether-api@.service");
    let (worker_args, worker_env) = unit("tether-worker@.service");
    assert_eq!(api_args, ["serve", "--role", "api"]);
    assert_eq!(worker_args, ["serve", "--role", "worker"]);
    assert_eq!(api_env["TETHER_INSTANCE_ID"], "api-%i");
    assert_eq!(worker_env["TETHER_INSTANCE_ID"], "worker-%i");
    // The shared environment file names what every instance needs.
    let shared = std::fs::read_to_string("deploy/systemd/tether.env").unwrap();
    for key in ["TETHER_DATABASE_URL", "TETHER_JWT_SECRET", "TETHER_CONFIG"] {
        assert!(shared.contains(&format!("{key}=")), "tether.env sets {key}");
    }

    let api_1 = Server::start_with(ServerOptions {
        config: config.clone(),
        role: "api",
        env: vec![("TETHER_INSTANCE_ID".into(), "api-1".into())],
    })
    .await;
    let api_2 = api_1
        .companion_with("api", &config, &[("TETHER_INSTANCE_ID", "api-2")])
        .await;
    let mut worker_1 = api_1
        .companion_with("worker", &config, &[("TETHER_INSTANCE_ID", "worker-1")])
        .await;
    let _worker_2 = api_1
        .companion_with("worker", &config, &[("TETHER_INSTANCE_ID", "worker-2")])
        .await;
    let token = api_1.token("acme", "ada");
    let conversation = api_1.create_conversation(&token).await;
    let mut watcher = WsClient::connect_at(&api_2.base, &token).await;
    watcher
        .subscribe(
            "e",
            EVENTS,
            json!({ "c": conversation, "a": "0000000000000000" }),
        )
        .await;

    // Runs held by the workers while one of them is stopped as a rolling
    // deploy would (SIGTERM), then started again with its instance id.
    let mut runs = Vec::new();
    for i in 0..6 {
        let (_, run) = api_1
            .send(&token, &conversation, &format!("/hold 0.5\nmessage {i}"))
            .await;
        runs.push(run);
    }
    api_1
        .wait_for_run(&token, &runs[0], |r| r["status"] == "RUNNING")
        .await;
    let pid = worker_1.child.id().unwrap();
    let stopped = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), worker_1.child.wait())
        .await
        .expect("a worker stops within its grace period")
        .unwrap();
    assert!(status.success(), "SIGTERM is a clean stop: {status}");
    let _worker_1 = api_1
        .companion_with("worker", &config, &[("TETHER_INSTANCE_ID", "worker-1")])
        .await;

    let mut completed = 0;
    while completed < runs.len() {
        let event = watcher.next_event("e").await["data"]["conversationEvents"].clone();
        match event["type"].as_str() {
            Some("run.completed") => completed += 1,
            Some("run.failed" | "run.cancelled") => panic!("a run was lost: {event}"),
            _ => {}
        }
    }
    for run in &runs {
        let ended = api_1.wait_until_ended(&token, run).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
    }
}
