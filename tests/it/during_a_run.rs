//! Messages sent while a run is active: `STEER` joins the run at its next
//! step boundary (after a whole batch of tool calls, where a resumed pause
//! ends, never between a call and its result), or gets a run of its own when
//! the run ends first; `INTERRUPT` stops a running run before the next one
//! starts, so their effects never overlap. A fake Anthropic records what the
//! model is sent; readers see the order the model saw.

use serde_json::{Value, json};

use crate::downstream::Downstream;
use crate::fakes::{
    FakeProvider, FakeToolCall, Reply, Wire, anthropic_sse, anthropic_sse_tool_calls, key_env,
    model_config,
};
use crate::support::{Server, ServerOptions, http_client, of_type};
use crate::tools::{tool_calls, tool_sections};

const SEND: &str = "mutation($c: ID!, $t: String!, $k: String, $s: ActiveRunStrategy) { sendMessage(input: {conversationId: $c, text: $t, clientMessageId: $k, onActiveRun: $s}) { message { id runId } run { id status } } }";
const MESSAGES: &str = "query($c: ID!) { conversation(id: $c) { runs { id status } messages { id role runId steering parts { kind text } } } }";
const DECIDE: &str = "mutation($i: ID!) { decideApproval(input: {interactionId: $i, decision: ALLOW_ONCE}) { resumed } }";
const ANSWER: &str = "mutation($i: ID!) { answerQuestion(input: {interactionId: $i, answers: [{key: \"name\", values: [], other: \"Tether\"}]}) { resumed } }";

/// A gated tool: every call waits for a person's decision.
fn publish_tool(downstream: &Downstream) -> String {
    format!(
        "\n[[tools]]\nname = \"publish\"\ndescription = \"Publish a post\"\ninput_schema = {{ type = \"object\", properties = {{ text = {{ type = \"string\" }} }}, required = [\"text\"], additionalProperties = false }}\nrisk = \"publish\"\nsummary = \"Publish a post\"\nrecovery = \"idempotent\"\nhttp = {{ url = \"{}/effect\" }}\n",
        downstream.base
    )
}

/// The configuration of an Anthropic agent on `fake` with the test tools,
/// the gated `publish` and `ask_questions`; `agent` adds to the agent.
fn config(fake: &FakeProvider, downstream: &Downstream, runtime: &str, agent: &str) -> String {
    let agent = format!(
        "idle_timeout_secs = 5\ntools = [\"ask_questions\", \"slow\", \"effect\", \"held\", \"hang\", \"publish\"]\n{agent}"
    );
    let tools = format!("{}{}", tool_sections(downstream), publish_tool(downstream));
    model_config("anthropic", &fake.base_url, runtime, &agent, &tools)
}

/// A fake Anthropic playing `replies`, the downstream service, a server
/// with workers on them, and a conversation of ada's.
struct Scene {
    fake: FakeProvider,
    downstream: Downstream,
    server: Server,
    token: String,
    conversation: String,
}

impl Scene {
    /// `/slow` calls answer once `slow_until` requests reached the
    /// downstream service.
    async fn start(replies: impl IntoIterator<Item = Reply>, slow_until: usize) -> Scene {
        Scene::start_with(replies, slow_until, "").await
    }

    /// `start`, with `agent` added to the agent's configuration.
    async fn start_with(
        replies: impl IntoIterator<Item = Reply>,
        slow_until: usize,
        agent: &str,
    ) -> Scene {
        let fake = FakeProvider::start(Wire::Anthropic).await;
        fake.script(replies);
        let downstream = Downstream::start().await;
        downstream.slow_until(slow_until);
        let server = Server::start_with(ServerOptions {
            config: config(
                &fake,
                &downstream,
                "lease_secs = 3\nheartbeat_secs = 0.5",
                agent,
            ),
            env: vec![key_env()],
            role: "all",
        })
        .await;
        let token = server.token("acme", "ada");
        let conversation = server.create_conversation(&token).await;
        Scene {
            fake,
            downstream,
            server,
            token,
            conversation,
        }
    }

    /// Sends `text` (`QUEUE`); returns its run.
    async fn send(&self, text: &str) -> String {
        self.server
            .send(&self.token, &self.conversation, text)
            .await
            .1
    }

    /// Sends `text` (`QUEUE`) and waits until the run's call reaches the
    /// downstream service at `path`; returns the run.
    async fn send_until_called(&self, text: &str, path: &str) -> String {
        let run = self.send(text).await;
        self.downstream
            .wait_for(path, |d| d.requests_to(path).len() == 1)
            .await;
        run
    }

    /// Steers the active run with `text`; returns the message's id and the
    /// run's.
    async fn steer(&self, text: &str) -> (String, String) {
        let (message, run) = self.send_with(text, "STEER", None).await;
        (
            message["id"].as_str().unwrap().to_owned(),
            run["id"].as_str().unwrap().to_owned(),
        )
    }

    /// Sends `text` with `strategy`; returns the message and the run of the
    /// mutation's answer.
    async fn send_with(&self, text: &str, strategy: &str, key: Option<&str>) -> (Value, Value) {
        send_with(
            &self.server,
            &self.token,
            &self.conversation,
            text,
            strategy,
            key,
        )
        .await
    }

    async fn wait_until_ended(&self, run: &str) -> Value {
        self.server.wait_until_ended(&self.token, run).await
    }

    /// `Conversation.messages` and `runs`.
    async fn listed(&self) -> (Vec<Value>, Vec<Value>) {
        let data = self
            .server
            .gql(&self.token, MESSAGES, json!({ "c": self.conversation }))
            .await;
        (
            data["conversation"]["messages"].as_array().unwrap().clone(),
            data["conversation"]["runs"].as_array().unwrap().clone(),
        )
    }

    /// The conversation's runs, once there are `count`; the one at `index`
    /// is the run `steered` got of its own: it completes, and the message
    /// belongs to it, waiting no more.
    async fn own_run(&self, steered: &str, count: usize, index: usize) -> Vec<String> {
        let (_, runs) = self.listed().await;
        let ids: Vec<String> = runs
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ids.len(), count, "{runs:?}");
        let ended = self.wait_until_ended(&ids[index]).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
        let (messages, _) = self.listed().await;
        let message = messages.iter().find(|m| m["id"] == steered).unwrap();
        assert_eq!(
            message["runId"],
            ids[index].as_str(),
            "the message starts its own run"
        );
        assert_eq!(message["steering"], false);
        ids
    }

    async fn events(&self) -> Vec<Value> {
        self.server
            .all_events(&self.token, &self.conversation)
            .await
    }

    /// Waits for `run` to pause with `status`, steers it with `text`, and
    /// checks that the pause is untouched: the run still waits, and its
    /// interaction (`pending`: `pendingQuestion` or `pendingApproval`) is
    /// still pending. Returns that interaction.
    async fn steer_while_paused(
        &self,
        run: &str,
        status: &str,
        pending: &str,
        text: &str,
    ) -> String {
        self.server
            .wait_for_run(&self.token, run, |r| r["status"] == status)
            .await;
        let (_, steered_into) = self.steer(text).await;
        assert_eq!(steered_into, run);
        let query = format!(
            "query($r: ID!) {{ run(id: $r) {{ status }} {pending}(runId: $r) {{ interactionId }} }}"
        );
        let data = self
            .server
            .gql(&self.token, &query, json!({ "r": run }))
            .await;
        assert_eq!(data["run"]["status"], status, "{data}");
        assert_eq!(self.fake.requests().len(), 1);
        data[pending]["interactionId"]
            .as_str()
            .unwrap_or_else(|| panic!("the pause was resolved: {data}"))
            .to_owned()
    }
}

/// The model says `said` and calls `call`, then answers `answer`.
fn call_then_answer(said: &str, call: FakeToolCall, answer: &str) -> [Reply; 2] {
    [
        Reply::sse(anthropic_sse_tool_calls(&[said], &[call]), 64),
        Reply::sse(anthropic_sse(&[answer], 10, 5), 64),
    ]
}

/// Sends `text` with `strategy`; returns the message and the run of the
/// mutation's answer.
async fn send_with(
    server: &Server,
    token: &str,
    conversation: &str,
    text: &str,
    strategy: &str,
    key: Option<&str>,
) -> (Value, Value) {
    let data = server
        .gql(
            token,
            SEND,
            json!({ "c": conversation, "t": text, "k": key, "s": strategy }),
        )
        .await;
    (
        data["sendMessage"]["message"].clone(),
        data["sendMessage"]["run"].clone(),
    )
}

/// Answers the downstream service's held `/slow` call (it answers once a
/// second request has arrived).
async fn release_slow(downstream: &Downstream) {
    let status = http_client()
        .post(format!("{}/effect", downstream.base))
        .json(&json!({ "text": "the test's own request" }))
        .send()
        .await
        .unwrap()
        .status();
    assert!(status.is_success());
}

/// A model request as (role, block type, text or tool id) per block, in
/// order, the way the model reads it.
fn blocks(request: &Value) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for message in request["messages"].as_array().unwrap() {
        let role = message["role"].as_str().unwrap().to_owned();
        let content = match &message["content"] {
            Value::String(text) => vec![json!({ "type": "text", "text": text })],
            Value::Array(blocks) => blocks.clone(),
            other => panic!("unexpected content {other}"),
        };
        for block in content {
            let kind = block["type"].as_str().unwrap().to_owned();
            let what = match kind.as_str() {
                "text" => block["text"].as_str().unwrap().to_owned(),
                "tool_use" => block["id"].as_str().unwrap().to_owned(),
                "tool_result" => block["tool_use_id"].as_str().unwrap().to_owned(),
                _ => String::new(),
            };
            out.push((role.clone(), kind, what));
        }
    }
    out
}

fn block(role: &str, kind: &str, what: &str) -> (String, String, String) {
    (role.to_owned(), kind.to_owned(), what.to_owned())
}

/// The text of a listed message (its TEXT parts, joined).
fn text_of(message: &Value) -> String {
    message["parts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["kind"] == "TEXT")
        .filter_map(|p| p["text"].as_str())
        .collect()
}

/// The conversation as a reader lists it: (role, text) per message.
fn as_read(messages: &[Value]) -> Vec<(String, String)> {
    messages
        .iter()
        .map(|m| (m["role"].as_str().unwrap().to_owned(), text_of(m)))
        .collect()
}

fn said(role: &str, text: &str) -> (String, String) {
    (role.to_owned(), text.to_owned())
}

fn event_types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect()
}

fn position(types: &[String], kind: &str) -> usize {
    types
        .iter()
        .position(|t| t == kind)
        .unwrap_or_else(|| panic!("no {kind} in {types:?}"))
}

/// A run in a tool loop, steered with two messages while its call runs:
/// the next request has both, in order, after the batch's result; the run
/// says `run.steered`; every reader lists them where the model read them,
/// the reply going on in a message after them; a retried mutation with the
/// same `clientMessageId` stores nothing more.
#[tokio::test]
async fn two_steered_messages_reach_the_next_step_after_the_batch_results_in_order() {
    let call = FakeToolCall::new("toolu_1", "slow", json!({ "text": "a" }));
    let scene = Scene::start(call_then_answer("Working.", call, "Done, shorter."), 2).await;
    let run = scene.send_until_called("Write the report.", "/slow").await;

    let (first, answered) = scene
        .send_with("Make it shorter.", "STEER", Some("steer-1"))
        .await;
    assert_eq!(answered["id"], run.as_str(), "STEER returns the active run");
    assert_eq!(answered["status"], "RUNNING");
    assert_eq!(first["runId"], run.as_str());
    // Retried with the same key: the same message and run, nothing stored.
    let (again, answered) = scene
        .send_with("Make it shorter.", "STEER", Some("steer-1"))
        .await;
    assert_eq!(again["id"], first["id"]);
    assert_eq!(answered["id"], run.as_str());
    assert_eq!(scene.steer("And in French.").await.1, run);

    // Waiting, they are listed after the reply so far.
    let (messages, _) = scene.listed().await;
    assert_eq!(
        as_read(&messages),
        [
            said("USER", "Write the report."),
            said("ASSISTANT", "Working."),
            said("USER", "Make it shorter."),
            said("USER", "And in French."),
        ]
    );
    let waiting: Vec<&Value> = messages.iter().map(|m| &m["steering"]).collect();
    assert_eq!(waiting, [false, false, true, true]);

    release_slow(&scene.downstream).await;
    let ended = scene.wait_until_ended(&run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    let requests = scene.fake.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    assert_eq!(
        blocks(&requests[1]),
        [
            block("user", "text", "Write the report."),
            block("assistant", "text", "Working."),
            block("assistant", "tool_use", "toolu_1"),
            block("user", "tool_result", "toolu_1"),
            block("user", "text", "Make it shorter."),
            block("user", "text", "And in French."),
        ]
    );

    let (messages, runs) = scene.listed().await;
    assert_eq!(runs.len(), 1, "steering made no run: {runs:?}");
    assert_eq!(
        as_read(&messages),
        [
            said("USER", "Write the report."),
            said("ASSISTANT", "Working."),
            said("USER", "Make it shorter."),
            said("USER", "And in French."),
            said("ASSISTANT", "Done, shorter."),
        ]
    );
    assert!(messages.iter().all(|m| m["runId"] == run.as_str()));
    assert!(
        messages.iter().all(|m| m["steering"] == false),
        "{messages:?}"
    );
    assert_eq!(messages[1]["parts"][1]["kind"], "TOOL_CALL");

    let events = scene.events().await;
    let steered = of_type(&events, "run.steered");
    assert_eq!(steered.len(), 1, "{events:?}");
    assert_eq!(steered[0]["runId"], run.as_str());
    let types = event_types(&events);
    let at = position(&types, "run.steered");
    assert!(position(&types, "tool.completed") < at, "{types:?}");
    assert!(at < position(&types, "run.completed"), "{types:?}");
    // The reply goes on in its new message, made with the step's boundary.
    assert_eq!(types[at + 1], "message.created", "{types:?}");
}

/// A steered message that no step boundary reaches (the run answers
/// without tools) gets a run of its own, queued as the run ends, right
/// after it and before a message queued after the steered one was sent;
/// nothing says `run.steered`, and readers see nothing move.
#[tokio::test]
async fn a_steered_message_the_run_ends_before_gets_a_run_of_its_own_in_the_order_sent() {
    let slow = Reply::slow(anthropic_sse(&["A slow ", "first ", "answer."], 10, 5));
    let second = Reply::sse(anthropic_sse(&["Second answer."], 10, 5), 64);
    let third = Reply::sse(anthropic_sse(&["Third answer."], 10, 5), 64);
    let scene = Scene::start([slow, second, third], 0).await;
    let first = scene.send("First.").await;
    scene.fake.wait_for_requests(1).await;
    let (steered, run) = scene.steer("Also this.").await;
    assert_eq!(run, first, "the first run was still streaming");
    let queued = scene.send("Then this.").await;
    let ended = scene.wait_until_ended(&first).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let ended = scene.wait_until_ended(&queued).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    let ids = scene.own_run(&steered, 3, 1).await;
    assert_eq!((&ids[0], &ids[2]), (&first, &queued), "{ids:?}");
    let own = ids[1].as_str();
    let (messages, _) = scene.listed().await;

    let requests = scene.fake.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(
        blocks(&requests[1]),
        [
            block("user", "text", "First."),
            block("assistant", "text", "A slow first answer."),
            block("user", "text", "Also this."),
        ]
    );
    assert_eq!(
        blocks(&requests[2])[2..],
        [
            block("user", "text", "Also this."),
            block("assistant", "text", "Second answer."),
            block("user", "text", "Then this."),
        ]
    );
    assert_eq!(
        as_read(&messages),
        [
            said("USER", "First."),
            said("ASSISTANT", "A slow first answer."),
            said("USER", "Also this."),
            said("ASSISTANT", "Second answer."),
            said("USER", "Then this."),
            said("ASSISTANT", "Third answer."),
        ]
    );
    let events = scene.events().await;
    assert!(of_type(&events, "run.steered").is_empty(), "{events:?}");
    // Queued in the first run's ending transaction, right after it.
    let types = event_types(&events);
    let completed = position(&types, "run.completed");
    assert_eq!(types[completed + 1], "run.queued", "{types:?}");
    assert_eq!(events[completed + 1]["runId"], own);
}

/// A message that joins at the step boundary where the run then reaches its
/// step limit is not answered by it: it gets a run of its own.
#[tokio::test]
async fn a_steered_message_joined_at_the_last_step_gets_a_run_of_its_own() {
    let call = FakeToolCall::new("toolu_1", "slow", json!({ "text": "a" }));
    let scene = Scene::start_with(
        call_then_answer("Working.", call, "Answered."),
        2,
        "[agents.limits]\nmax_steps = 1",
    )
    .await;
    let run = scene.send_until_called("Go.", "/slow").await;
    let (steered, _) = scene.steer("One more thing.").await;
    release_slow(&scene.downstream).await;
    let ended = scene.wait_until_ended(&run).await;
    assert_eq!(ended["endCause"], "STEP_LIMIT", "{ended}");

    scene.own_run(&steered, 2, 1).await;
    let requests = scene.fake.requests();
    assert_eq!(requests.len(), 2, "the limited run asked nothing more");
    assert_eq!(
        blocks(&requests[1]).last().unwrap(),
        &block("user", "text", "One more thing.")
    );
}

/// A message steered into a run that a later message interrupts gets a
/// run of its own, as every steered message the run did not answer, but
/// after the interrupting message's run, which goes first as the interrupt
/// asked.
#[tokio::test]
async fn a_steered_message_of_an_interrupted_run_runs_after_the_interrupting_one() {
    let call = FakeToolCall::new("toolu_1", "hang", json!({ "text": "a" }));
    let [first, second] = call_then_answer("Working.", call, "Instead.");
    let third = Reply::sse(anthropic_sse(&["Steered too."], 10, 5), 64);
    let scene = Scene::start([first, second, third], 0).await;
    let run = scene.send_until_called("Go.", "/hang").await;
    let (steered, _) = scene.steer("Steered.").await;
    let (_, interrupting) = scene.send_with("Stop, do this.", "INTERRUPT", None).await;
    let interrupting = interrupting["id"].as_str().unwrap().to_owned();
    let ended = scene.wait_until_ended(&run).await;
    assert_eq!(ended["endCause"], "INTERRUPTED", "{ended}");

    let ids = scene.own_run(&steered, 3, 2).await;
    assert_eq!((&ids[0], &ids[1]), (&run, &interrupting));

    let requests = scene.fake.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(
        blocks(&requests[1]).last().unwrap(),
        &block("user", "text", "Stop, do this.")
    );
    assert_eq!(
        blocks(&requests[2])[blocks(&requests[2]).len() - 3..],
        [
            block("user", "text", "Stop, do this."),
            block("assistant", "text", "Instead."),
            block("user", "text", "Steered."),
        ]
    );
}

/// A message steered into a run that is still queued is read with the
/// message that started it, at the run's first request.
#[tokio::test]
async fn a_message_steered_into_a_queued_run_is_read_at_its_start() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    fake.script([Reply::sse(anthropic_sse(&["Both read."], 10, 5), 64)]);
    let downstream = Downstream::start().await;
    let api = Server::start_with(ServerOptions {
        config: config(&fake, &downstream, "", ""),
        env: vec![key_env()],
        role: "api",
    })
    .await;
    let token = api.token("acme", "ada");
    let conversation = api.create_conversation(&token).await;
    let (_, run) = api.send(&token, &conversation, "First.").await;
    let (_, joined) = send_with(&api, &token, &conversation, "And this.", "STEER", None).await;
    assert_eq!(joined["id"], run.as_str());
    assert_eq!(joined["status"], "QUEUED");
    let _worker = api.companion("worker").await;
    let ended = api.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(
        blocks(&fake.requests()[0]),
        [
            block("user", "text", "First."),
            block("user", "text", "And this."),
        ]
    );
}

/// Another person's message cannot steer a run (a run acts with its
/// principal's connections and grants): it is queued as a run of its own.
#[tokio::test]
async fn another_persons_message_is_queued_not_steered() {
    let slow = Reply::slow(anthropic_sse(&["Slowly."], 10, 5));
    let scene = Scene::start([slow], 0).await;
    let run = scene.send("Mine.").await;
    scene.fake.wait_for_requests(1).await;
    let bob = scene.server.token("acme", "bob");
    let (message, answered) = send_with(
        &scene.server,
        &bob,
        &scene.conversation,
        "Bob's.",
        "STEER",
        None,
    )
    .await;
    assert_ne!(answered["id"], run.as_str(), "{answered}");
    assert_eq!(answered["status"], "QUEUED");
    assert_eq!(message["runId"], answered["id"]);
}

/// SIGKILL while the run's call runs, after a message steered it: the
/// recovered run finishes the batch and reads the message once, at its
/// boundary.
#[tokio::test]
async fn a_run_killed_after_a_steering_commit_reads_the_message_once_after_recovery() {
    let call = FakeToolCall::new("toolu_1", "slow", json!({ "text": "a" }));
    // The call is held until a second request: the replay after recovery.
    let mut scene = Scene::start(call_then_answer("Working.", call, "Done."), 2).await;
    let run = scene.send_until_called("Start.", "/slow").await;
    assert_eq!(scene.steer("Steer once.").await.1, run);

    scene.server.kill().await;
    scene.server.restart(&[]).await;
    let ended = scene.wait_until_ended(&run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");

    let requests = scene.fake.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    let read = blocks(&requests[1]);
    assert_eq!(
        read.iter().filter(|b| b.2 == "Steer once.").count(),
        1,
        "{read:?}"
    );
    assert_eq!(read.last().unwrap(), &block("user", "text", "Steer once."));
    let events = scene.events().await;
    assert_eq!(of_type(&events, "run.steered").len(), 1, "{events:?}");
    let (messages, runs) = scene.listed().await;
    assert_eq!(runs.len(), 1);
    assert_eq!(
        as_read(&messages),
        [
            said("USER", "Start."),
            said("ASSISTANT", "Working."),
            said("USER", "Steer once."),
            said("ASSISTANT", "Done."),
        ]
    );
}

/// A message steered into a run that waits for an approval stays waiting:
/// the approval is still pending and the run still paused; after the
/// decision, the call runs and the message follows its result.
#[tokio::test]
async fn a_message_steered_during_a_pending_approval_is_read_after_the_decision() {
    let call = FakeToolCall::new("toolu_1", "publish", json!({ "text": "hello" }));
    let scene = Scene::start(call_then_answer("Publishing.", call, "Published."), 0).await;
    let run = scene.send("Publish it.").await;
    let interaction = scene
        .steer_while_paused(
            &run,
            "WAITING_FOR_APPROVAL",
            "pendingApproval",
            "Use a title.",
        )
        .await;
    assert_eq!(scene.downstream.effects(), 0);

    let decided = scene
        .server
        .gql(&scene.token, DECIDE, json!({ "i": interaction }))
        .await;
    assert_eq!(decided["decideApproval"]["resumed"], true);
    let ended = scene.wait_until_ended(&run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(scene.downstream.effects(), 1);
    assert_eq!(
        blocks(&scene.fake.requests()[1])[3..],
        [
            block("user", "tool_result", "toolu_1"),
            block("user", "text", "Use a title."),
        ]
    );
    let types = event_types(&scene.events().await);
    assert!(
        position(&types, "approval.decided") < position(&types, "run.steered"),
        "{types:?}"
    );
}

/// A question pause ends its step: the run resumed by the answer takes the
/// message steered meanwhile at its first commit, after the answer.
#[tokio::test]
async fn a_message_steered_during_a_question_is_read_after_the_answer() {
    let questions =
        json!({ "questions": [{ "key": "name", "prompt": "What should we call it?" }] });
    let call = FakeToolCall::new("toolu_q", "ask_questions", questions);
    let scene = Scene::start(call_then_answer("One question.", call, "Named."), 0).await;
    let run = scene.send("Name it.").await;
    let interaction = scene
        .steer_while_paused(
            &run,
            "WAITING_FOR_QUESTION",
            "pendingQuestion",
            "Keep it short.",
        )
        .await;
    let answered = scene
        .server
        .gql(&scene.token, ANSWER, json!({ "i": interaction }))
        .await;
    assert_eq!(answered["answerQuestion"]["resumed"], true);
    let ended = scene.wait_until_ended(&run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(
        blocks(&scene.fake.requests()[1])[3..],
        [
            block("user", "tool_result", "toolu_q"),
            block(
                "user",
                "text",
                "Answers to your questions:\n- name (What should we call it?): (other) Tether"
            ),
            block("user", "text", "Keep it short."),
        ]
    );
    let (messages, _) = scene.listed().await;
    assert_eq!(
        as_read(&messages),
        [
            said("USER", "Name it."),
            said("ASSISTANT", "One question."),
            said("USER", "Keep it short."),
            said("ASSISTANT", "Named."),
        ]
    );
}

/// With no active run, `STEER` queues a run for the message, as `QUEUE`.
#[tokio::test]
async fn steering_an_idle_conversation_queues_a_run() {
    let scene = Scene::start([Reply::sse(anthropic_sse(&["Hello."], 10, 5), 64)], 0).await;
    let (message, run) = scene.send_with("Hi.", "STEER", None).await;
    let run = run["id"].as_str().unwrap();
    assert_eq!(message["runId"], run);
    let ended = scene.wait_until_ended(run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let types = event_types(&scene.events().await);
    assert_eq!(types[..2], ["message.created", "run.queued"], "{types:?}");
}

/// `INTERRUPT` of a run whose call is in flight, with the API and the
/// worker in separate processes (a cancel reaches that worker only at its
/// next heartbeat on SQLite): the mutation answers at once with the new run
/// queued, and the new run's model is asked only once the old call was
/// given up and the old run ended `INTERRUPTED`.
#[tokio::test]
async fn an_interrupted_run_stops_its_call_before_the_next_run_asks_its_model() {
    let fake = FakeProvider::start(Wire::Anthropic).await;
    let call = FakeToolCall::new("toolu_1", "held", json!({ "text": "a" }));
    fake.script(call_then_answer("Calling.", call, "Instead."));
    let downstream = Downstream::start().await;
    let runtime = "lease_secs = 6\nheartbeat_secs = 2";
    let api = Server::start_with(ServerOptions {
        config: config(&fake, &downstream, runtime, ""),
        env: vec![key_env()],
        role: "api",
    })
    .await;
    let _worker = api.companion("worker").await;
    let token = api.token("acme", "ada");
    let conversation = api.create_conversation(&token).await;
    let (_, old) = api.send(&token, &conversation, "Do it.").await;
    downstream
        .wait_for("the held call", |d| d.requests_to("/held").len() == 1)
        .await;

    let (_, new) = send_with(
        &api,
        &token,
        &conversation,
        "Do this instead.",
        "INTERRUPT",
        None,
    )
    .await;
    assert_eq!(new["status"], "QUEUED");
    let new = new["id"].as_str().unwrap().to_owned();

    let ended = api.wait_until_ended(&token, &old).await;
    assert_eq!(ended["status"], "CANCELLED", "{ended}");
    assert_eq!(ended["endCause"], "INTERRUPTED", "{ended}");
    let calls = tool_calls(&api, &token, &old).await;
    assert_eq!(calls[0]["outcome"], "INTERRUPTED", "{calls:?}");
    let finished = api.wait_until_ended(&token, &new).await;
    assert_eq!(finished["status"], "COMPLETED", "{finished}");

    let closed = downstream.closed_at();
    let asked = fake.arrivals();
    assert_eq!(closed.len(), 1, "the held call was given up once");
    assert_eq!(asked.len(), 2);
    assert!(
        closed[0] < asked[1],
        "the new run asked its model {:?} before the old call was given up",
        closed[0] - asked[1]
    );
    // The new run's model reads the old call with its one result.
    let read = blocks(&fake.requests()[1]);
    assert!(
        read.contains(&block("user", "tool_result", "toolu_1")),
        "{read:?}"
    );
    assert_eq!(
        read.last().unwrap(),
        &block("user", "text", "Do this instead.")
    );
}
