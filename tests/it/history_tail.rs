//! The model's history after a summary, read from the summary on: it is the
//! same as the whole history with the summary in place of what it covers,
//! wherever the summary ends (queued messages included), and it reads
//! nothing of what comes before the summary.

use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveModelTrait, ActiveValue::Set, ColumnTrait, ConnectionTrait, DatabaseBackend, EntityTrait,
    IdenStatic, QueryFilter,
};
use serde_json::json;
use tether::bus::Bus;
use tether::domain::ActiveRunStrategy;
use tether::domain::interaction::{InteractionKind, InteractionStatus};
use tether::domain::tool_call::{ToolCallStatus, ToolOutcome};
use tether::domain::{MessageRole, PartKind, PartState};
use tether::providers::Turn;
use tether::runtime::history::{self, Histories, History, SUMMARY_HEADING};
use tether::store::Actor;
use tether::store::commands::{self, MaxAttempts, NewConversation, NewMessage};
use tether::store::commit::PENDING_POS;
use tether::store::entities::{interaction, message, part, run, summary, tool_call};
use tether::store::{Pools, Store};
use uuid::Uuid;

use crate::support::TestDb;

const TENANT: &str = "acme";

fn actor() -> Actor {
    Actor {
        tenant: TENANT.into(),
        principal: "ada".into(),
        delegate: false,
    }
}

/// What an assistant message holds, part by part.
enum Said {
    Text(i32, &'static str),
    /// Text of an attempt that failed: never sent to the model.
    Abandoned(i32, &'static str),
    /// A tool call that succeeded with this output.
    Call(i32, &'static str, &'static str),
    /// `ask_questions`, answered.
    Asked(i32, &'static str),
}

struct Conversation {
    store: Store,
    id: Uuid,
    calls: u32,
}

impl Conversation {
    async fn new(db: &TestDb) -> Conversation {
        let store = Store::open(&db.url, Bus::new(), &Pools::default())
            .await
            .unwrap();
        let new = NewConversation {
            agent: "demo".into(),
            title: None,
        };
        let id = commands::create_conversation(&store, &actor(), new)
            .await
            .unwrap()
            .id;
        Conversation {
            store,
            id,
            calls: 0,
        }
    }

    /// A user message, queued behind any earlier run; its run.
    async fn user(&self, text: &str) -> run::Model {
        let new = NewMessage {
            conversation_id: self.id,
            text: text.into(),
            client_message_id: None,
            on_active_run: ActiveRunStrategy::Queue,
            max_attempts: MaxAttempts::Fixed(1),
        };
        commands::send_message(&self.store, &actor(), new)
            .await
            .unwrap()
            .1
    }

    /// The run's assistant message, made now (as a run's is when it
    /// starts), with these parts in order.
    async fn reply(&mut self, run: &run::Model, said: &[Said]) -> Uuid {
        let store = self.store.clone();
        let db = store.db();
        let id = Uuid::now_v7();
        message::ActiveModel {
            id: Set(id),
            conversation_id: Set(self.id),
            tenant: Set(TENANT.into()),
            role: Set(MessageRole::Assistant.as_str().into()),
            run_id: Set(Some(run.id)),
            client_message_id: Set(None),
            created_at: Set(0),
            run_seq: Set(run.seq),
            pos: Set(1),
        }
        .insert(db)
        .await
        .unwrap();
        let mut idx = 0;
        let mut in_step = std::collections::HashMap::<i32, i32>::new();
        for item in said {
            match *item {
                Said::Text(step, text) => {
                    self.part(id, run, idx, step, PartKind::Text, Some(text), false)
                        .await;
                }
                Said::Abandoned(step, text) => {
                    self.part(id, run, idx, step, PartKind::Text, Some(text), true)
                        .await;
                }
                Said::Call(step, name, output) => {
                    let part = self
                        .part(id, run, idx, step, PartKind::ToolCall, None, false)
                        .await;
                    let batch = in_step.entry(step).or_default();
                    self.call(run, part, step, *batch, name, output).await;
                    *batch += 1;
                }
                Said::Asked(step, answer) => {
                    let part = self
                        .part(id, run, idx, step, PartKind::ToolCall, None, false)
                        .await;
                    let batch = in_step.entry(step).or_default();
                    let call = self
                        .call(run, part, step, *batch, "ask_questions", "answered")
                        .await;
                    *batch += 1;
                    idx += 1;
                    let shown = self
                        .part(id, run, idx, step, PartKind::Question, None, false)
                        .await;
                    interaction::ActiveModel {
                        id: Set(Uuid::now_v7()),
                        tenant: Set(TENANT.into()),
                        conversation_id: Set(self.id),
                        run_id: Set(run.id),
                        tool_call_id: Set(call),
                        part_id: Set(shown),
                        kind: Set(InteractionKind::Question.as_str().into()),
                        status: Set(InteractionStatus::Resolved.as_str().into()),
                        request: Set(json!([{
                            "key": "color", "prompt": "Which colour?",
                            "options": [], "multiple": false, "allowOther": true
                        }])),
                        resolution: Set(Some(json!([{
                            "key": "color", "values": [], "other": answer
                        }]))),
                        resolved_by: Set(Some("ada".into())),
                        created_at: Set(0),
                        expires_at: Set(i64::MAX),
                        resolved_at: Set(Some(0)),
                        claimed_at: Set(Some(0)),
                    }
                    .insert(db)
                    .await
                    .unwrap();
                }
            }
            idx += 1;
        }
        id
    }

    #[allow(clippy::too_many_arguments)]
    async fn part(
        &self,
        message_id: Uuid,
        run: &run::Model,
        idx: i32,
        step: i32,
        kind: PartKind,
        text: Option<&str>,
        abandoned: bool,
    ) -> Uuid {
        let id = Uuid::now_v7();
        part::ActiveModel {
            id: Set(id),
            message_id: Set(message_id),
            conversation_id: Set(self.id),
            tenant: Set(TENANT.into()),
            idx: Set(idx),
            kind: Set(kind.as_str().into()),
            state: Set(PartState::Done.as_str().into()),
            text: Set(text.map(str::to_owned)),
            data: Set(None),
            created_at: Set(0),
            updated_at: Set(0),
            run_id: Set(Some(run.id)),
            abandoned: Set(abandoned),
            step: Set(step),
        }
        .insert(self.store.db())
        .await
        .unwrap();
        id
    }

    async fn call(
        &mut self,
        run: &run::Model,
        part_id: Uuid,
        step: i32,
        idx: i32,
        name: &str,
        output: &str,
    ) -> Uuid {
        self.calls += 1;
        let id = Uuid::now_v7();
        tool_call::ActiveModel {
            id: Set(id),
            tenant: Set(TENANT.into()),
            conversation_id: Set(self.id),
            run_id: Set(run.id),
            part_id: Set(part_id),
            step: Set(step),
            idx: Set(idx),
            provider_call_id: Set(format!("toolu_{}", self.calls)),
            name: Set(name.into()),
            model_input: Set(json!({ "n": self.calls })),
            input: Set(Some(json!({ "n": self.calls }))),
            status: Set(ToolCallStatus::Completed.as_str().into()),
            outcome: Set(Some(ToolOutcome::Succeeded.as_str().into())),
            attempt: Set(1),
            output: Set(Some(json!(output))),
            full_output: Set(None),
            output_truncated: Set(false),
            idempotency_key: Set(id.to_string()),
            created_at: Set(0),
            started_at: Set(Some(0)),
            ended_at: Set(Some(0)),
        }
        .insert(self.store.db())
        .await
        .unwrap();
        id
    }

    /// A summary made by `by`, through `through`: the latest from now on.
    async fn summarize(&self, by: &run::Model, through: Uuid, text: &str) {
        summary::ActiveModel {
            id: Set(Uuid::now_v7()),
            conversation_id: Set(self.id),
            tenant: Set(TENANT.into()),
            run_id: Set(by.id),
            through_message_id: Set(through),
            messages_compacted: Set(1),
            text: Set(text.into()),
            input_tokens: Set(0),
            output_tokens: Set(0),
            created_at: Set(0),
            run_seq: Set(by.seq),
        }
        .insert(self.store.db())
        .await
        .unwrap();
    }

    /// The history read afresh: nothing kept from an earlier load.
    async fn load(&self, run: &run::Model) -> History {
        history::load(&self.store, &Histories::new(0), run)
            .await
            .unwrap()
    }
}

/// Five runs, with the second and third user messages queued while the
/// first reply was being written, so that their replies (made when their
/// runs start) sort after both of them by id; a sixth message queued after
/// the fifth run's; and tool calls, answered questions and an abandoned
/// attempt in the replies. Returns the conversation, the runs in order and
/// every message in the history's order.
async fn queued_conversation(db: &TestDb) -> (Conversation, Vec<run::Model>, Vec<Uuid>) {
    let mut c = Conversation::new(db).await;
    let r1 = c.user("U1: find the report").await;
    let a1 = c
        .reply(
            &r1,
            &[
                Said::Abandoned(0, "cut off"),
                Said::Text(0, "Looking."),
                Said::Call(0, "search", "report.pdf"),
                Said::Asked(0, "blue"),
                Said::Text(1, "Found report.pdf."),
            ],
        )
        .await;
    let r2 = c.user("U2: and the slides?").await;
    let r3 = c.user("U3: and the notes?").await;
    let a2 = c
        .reply(
            &r2,
            &[
                Said::Call(0, "search", "slides.key"),
                Said::Call(0, "search", "slides.pdf"),
                Said::Text(1, "Two slide decks."),
            ],
        )
        .await;
    let a3 = c
        .reply(
            &r3,
            &[Said::Asked(0, "red"), Said::Text(1, "Red notes, then.")],
        )
        .await;
    let r4 = c.user("U4: summarize them").await;
    let a4 = c.reply(&r4, &[Said::Text(0, "They agree.")]).await;
    let r5 = c.user("U5: send them").await;
    let _r6 = c.user("U6: queued behind run 5").await;
    let a5 = c
        .reply(
            &r5,
            &[Said::Text(0, "Sending."), Said::Call(0, "send", "sent")],
        )
        .await;
    let ordered = vec![
        r1.trigger_message_id,
        a1,
        r2.trigger_message_id,
        a2,
        r3.trigger_message_id,
        a3,
        r4.trigger_message_id,
        a4,
        r5.trigger_message_id,
        a5,
    ];
    (c, vec![r1, r2, r3, r4, r5], ordered)
}

/// The whole history with a summary in place of everything up to
/// `through` (every turn of it, in the history's order).
fn summarized(whole: &History, through: Uuid, text: &str) -> History {
    let last = whole
        .sources
        .iter()
        .rposition(|s| *s == Some(through))
        .expect("every message of the history has a turn");
    let mut expected = History::default();
    expected.turns.push(Turn::text(
        MessageRole::User,
        format!("{SUMMARY_HEADING}\n{text}"),
    ));
    expected.sources.push(None);
    expected
        .turns
        .extend(whole.turns[last + 1..].iter().cloned());
    expected
        .sources
        .extend(whole.sources[last + 1..].iter().copied());
    expected
}

fn assert_same(got: &History, expected: &History, what: &str) {
    assert_eq!(got.sources, expected.sources, "{what}: sources");
    assert_eq!(got.turns, expected.turns, "{what}: turns");
}

#[tokio::test]
async fn a_summary_through_any_message_leaves_the_rest_of_the_history_as_it_was() {
    let db = TestDb::new().await;
    let (c, runs, ordered) = queued_conversation(&db).await;
    let (r3, r5) = (&runs[2], &runs[4]);
    let whole5 = c.load(r5).await;
    let whole3 = c.load(r3).await;
    // The replies stay with their questions: A1 after U1 although U2 and U3
    // were queued before it was made, A2 before U3 although it is later.
    let mut order: Vec<Uuid> = whole5.sources.iter().flatten().copied().collect();
    order.dedup();
    assert_eq!(order, ordered);
    assert!(whole5.turns.len() > ordered.len(), "steps and results");

    for (i, through) in ordered.iter().enumerate() {
        let text = format!("all up to message {i}");
        c.summarize(r5, *through, &text).await;
        let got = c.load(r5).await;
        assert_same(&got, &summarized(&whole5, *through, &text), &text);
    }
    // An earlier run's history: summaries by later runs are not its own, and
    // its own stop at its question, whatever came after.
    for (i, through) in ordered[..6].iter().enumerate() {
        let text = format!("run 3's, up to message {i}");
        c.summarize(r3, *through, &text).await;
        let got = c.load(r3).await;
        assert_same(&got, &summarized(&whole3, *through, &text), &text);
    }
}

/// Makes rows unreadable: reading any of them fails. On SQLite a UUID
/// column gets text that is no UUID; on PostgreSQL, whose columns are
/// typed, a required text column is made nullable and set to null.
async fn corrupt<E: EntityTrait>(
    store: &Store,
    table: &str,
    (id, text): (E::Column, E::Column),
    which: sea_orm::Condition,
) {
    let db = store.db();
    let update = match store.backend() {
        DatabaseBackend::Postgres => {
            let column = text.as_str();
            db.execute_unprepared(&format!(
                "ALTER TABLE {table} ALTER COLUMN {column} DROP NOT NULL"
            ))
            .await
            .unwrap();
            E::update_many().col_expr(text, Expr::cust("NULL"))
        }
        _ => E::update_many().col_expr(id, Expr::cust("'unreadable-' || rowid")),
    };
    let changed = update.filter(which).exec(db).await.unwrap();
    assert!(changed.rows_affected > 0, "nothing of {table} to corrupt");
}

/// The parts of `messages` made unreadable.
async fn corrupt_parts(store: &Store, messages: Vec<Uuid>) {
    corrupt::<part::Entity>(
        store,
        "parts",
        (part::Column::Id, part::Column::State),
        sea_orm::Condition::all().add(part::Column::MessageId.is_in(messages)),
    )
    .await;
}

/// The tool calls of `runs` made unreadable.
async fn corrupt_calls(store: &Store, runs: Vec<Uuid>) {
    corrupt::<tool_call::Entity>(
        store,
        "tool_calls",
        (tool_call::Column::Id, tool_call::Column::Name),
        sea_orm::Condition::all().add(tool_call::Column::RunId.is_in(runs)),
    )
    .await;
}

/// The questions of `runs` made unreadable.
async fn corrupt_questions(store: &Store, runs: Vec<Uuid>) {
    corrupt::<interaction::Entity>(
        store,
        "interactions",
        (interaction::Column::Id, interaction::Column::Status),
        sea_orm::Condition::all().add(interaction::Column::RunId.is_in(runs)),
    )
    .await;
}

/// Everything before the summary's pair is corrupt, and so are the parts,
/// tool calls and questions of the messages the summary covers: the
/// history after the summary is read all the same, and is what it was. (A
/// load that reads the whole conversation, as it used to, fails on them.)
#[tokio::test]
async fn a_step_reads_nothing_before_the_latest_summary() {
    let db = TestDb::new().await;
    let (c, runs, ordered) = queued_conversation(&db).await;
    let r5 = &runs[4];
    let whole = c.load(r5).await;
    // Through A2, the reply that sorts after U3: U3 must still be read.
    let through = ordered[3];
    c.summarize(r5, through, "the search so far").await;
    let expected = summarized(&whole, through, "the search so far");
    assert_same(&c.load(r5).await, &expected, "before corruption");

    let store = &c.store;
    let (u1, a1, u2, a2) = (ordered[0], ordered[1], ordered[2], ordered[3]);
    // Messages before the pair the summary ends in: their role is no role.
    let roles = message::Entity::update_many()
        .col_expr(message::Column::Role, Expr::value("CORRUPT"))
        .filter(message::Column::Id.is_in([u1, a1]))
        .exec(store.db())
        .await
        .unwrap();
    assert_eq!(roles.rows_affected, 2);
    assert_same(&c.load(r5).await, &expected, "earlier messages corrupt");
    // Parts of every covered message; tool calls and questions of the runs
    // the summary covers.
    corrupt_parts(store, vec![u1, a1, u2, a2]).await;
    assert_same(&c.load(r5).await, &expected, "covered parts corrupt");
    let covered_runs = vec![runs[0].id, runs[1].id];
    corrupt_calls(store, covered_runs.clone()).await;
    assert_same(&c.load(r5).await, &expected, "covered tool calls corrupt");
    corrupt_questions(store, covered_runs).await;
    assert_same(&c.load(r5).await, &expected, "covered questions corrupt");
}

/// Loads kept between runs: each run's history is the one read afresh,
/// and once a run has loaded, the messages of the runs before it, their
/// parts, tool calls and questions are not read again (corrupt, they would
/// fail a fresh read). A new summary is taken up at once.
#[tokio::test]
async fn the_history_of_ended_runs_is_kept_and_not_read_again() {
    let db = TestDb::new().await;
    let (c, runs, ordered) = queued_conversation(&db).await;
    let mut fresh = Vec::new();
    for run in &runs {
        fresh.push(c.load(run).await);
    }
    let kept = Histories::new(64);
    let load = |run: &run::Model| {
        let (store, kept, run) = (c.store.clone(), &kept, run.clone());
        async move { history::load(&store, kept, &run).await }
    };
    for (run, expected) in runs.iter().zip(&fresh).take(4) {
        let got = load(run).await.unwrap();
        assert_same(&got, expected, &format!("run {}", run.seq));
        // A second step of the same run reads the same.
        assert_same(&load(run).await.unwrap(), expected, "again");
    }

    // Everything of the runs before the fourth, which loaded last.
    let store = &c.store;
    let r4 = &runs[3];
    let earlier: Vec<Uuid> = message::Entity::find()
        .filter(message::Column::ConversationId.eq(c.id))
        .filter(message::Column::RunSeq.lt(r4.seq))
        .all(store.db())
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert!(earlier.len() >= 6, "three runs' questions and replies");
    let roles = message::Entity::update_many()
        .col_expr(message::Column::Role, Expr::value("CORRUPT"))
        .filter(message::Column::Id.is_in(earlier.clone()))
        .exec(store.db())
        .await
        .unwrap();
    assert_eq!(roles.rows_affected, earlier.len() as u64);
    corrupt_parts(store, earlier).await;
    let before: Vec<Uuid> = runs[..3].iter().map(|r| r.id).collect();
    corrupt_calls(store, before.clone()).await;
    corrupt_questions(store, before).await;
    let r5 = &runs[4];
    assert!(
        history::load(store, &Histories::new(0), r5).await.is_err(),
        "a fresh read fails on the corrupt rows"
    );
    // Another step of the fourth run, then the fifth run.
    assert_same(&load(r4).await.unwrap(), &fresh[3], "run 4 again, kept");
    assert_same(&load(r5).await.unwrap(), &fresh[4], "run 5, kept");

    // A summary through the fourth run's reply, made after the history was
    // kept: the next load has it in place of what it covers.
    let through = ordered[ordered.len() - 3];
    c.summarize(r5, through, "up to the fourth reply").await;
    let expected = summarized(&fresh[4], through, "up to the fourth reply");
    assert_same(&load(r5).await.unwrap(), &expected, "after a summary");
    assert_same(&load(r5).await.unwrap(), &expected, "after a summary, kept");
}

/// A call whose outcome is UNKNOWN can be resolved by an operator after its
/// run ended (`resolveToolCall`): its run's turns are not kept until then,
/// and the next load has the resolution, here or in any process.
#[tokio::test]
async fn a_call_whose_outcome_is_unknown_is_read_again_until_it_is_resolved() {
    let db = TestDb::new().await;
    let (c, runs, _) = queued_conversation(&db).await;
    let db_conn = c.store.db();
    let call = tool_call::Entity::find()
        .filter(tool_call::Column::RunId.eq(runs[1].id))
        .one(db_conn)
        .await
        .unwrap()
        .expect("the second run made a call");
    let set = |status: ToolCallStatus, outcome: ToolOutcome, output: &str| {
        tool_call::Entity::update_many()
            .col_expr(tool_call::Column::Status, Expr::value(status.as_str()))
            .col_expr(tool_call::Column::Outcome, Expr::value(outcome.as_str()))
            .col_expr(tool_call::Column::Output, Expr::value(json!(output)))
            .filter(tool_call::Column::Id.eq(call.id))
            .exec(db_conn)
    };
    set(
        ToolCallStatus::Indeterminate,
        ToolOutcome::Unknown,
        "outcome unknown",
    )
    .await
    .unwrap();
    let kept = Histories::new(64);
    let (r4, r5) = (&runs[3], &runs[4]);
    let unknown = history::load(&c.store, &kept, r4).await.unwrap();
    assert_same(&unknown, &c.load(r4).await, "run 4");

    set(
        ToolCallStatus::Completed,
        ToolOutcome::Succeeded,
        "it was sent",
    )
    .await
    .unwrap();
    let resolved = c.load(r5).await;
    let text = |h: &History| format!("{:?}", h.turns);
    assert!(text(&resolved).contains("it was sent"), "a fresh read");
    assert!(!text(&unknown).contains("it was sent"));
    assert_same(
        &history::load(&c.store, &kept, r5).await.unwrap(),
        &resolved,
        "run 5, after the resolution",
    );
}

/// With `runtime.history_cache_mib = 0` nothing is kept; with a budget, one
/// entry per conversation.
#[tokio::test]
async fn a_budget_of_0_keeps_nothing() {
    let db = TestDb::new().await;
    let (c, runs, _) = queued_conversation(&db).await;
    for (budget, entries) in [(0, 0), (1, 1)] {
        let kept = Histories::new(budget);
        for run in &runs {
            history::load(&c.store, &kept, run).await.unwrap();
        }
        assert_eq!(kept.len(), entries, "budget {budget} MiB");
    }
}

/// A summary whose message cannot be found where a summary leaves it (here:
/// it is not in the conversation at all) is handled as it always was: the
/// summary comes first, then the whole history.
#[tokio::test]
async fn a_summary_through_an_unknown_message_is_read_as_before() {
    let db = TestDb::new().await;
    let (c, runs, _) = queued_conversation(&db).await;
    let r5 = &runs[4];
    let whole = c.load(r5).await;
    c.summarize(r5, Uuid::now_v7(), "lost").await;
    let got = c.load(r5).await;
    assert_eq!(got.sources[0], None);
    assert_eq!(got.sources[1..], whole.sources[..]);
    assert_eq!(got.turns[1..], whole.turns[..]);
}

/// On SQLite, whose plans do not depend on statistics, the reads of a step's
/// history, of `Conversation.messages` and `activeRun`, of the event log,
/// and a step's look-up of its assistant message each search an index
/// (these statements are the ones `store::reads` and the commits issue,
/// with literals for parameters). PostgreSQL chooses by its statistics;
/// what it chose is in docs/runs.md, "Reads and their indexes".
#[tokio::test]
async fn the_reads_of_a_step_and_of_a_page_search_indexes() {
    // A step's messages from a run on, joined to their parts.
    const STEP_MESSAGES: &str = "SELECT * FROM messages m LEFT JOIN parts p \
        ON p.message_id = m.id WHERE m.tenant = 'a' AND m.conversation_id = 'c' \
        AND m.run_seq >= 5 ORDER BY m.run_seq ASC, m.pos ASC, m.id ASC, p.idx ASC";
    let db = TestDb::new().await;
    let (c, ..) = queued_conversation(&db).await;
    let store = &c.store;
    if store.backend() != DatabaseBackend::Sqlite {
        return;
    }
    let unended = "('QUEUED','RUNNING','RETRY_PENDING','WAITING_FOR_INPUT',\
                   'WAITING_FOR_APPROVAL','WAITING_FOR_CONNECTION')";
    let reads = [
        (
            "SELECT * FROM summaries WHERE tenant = 'a' AND conversation_id = 'c' \
             AND run_seq <= 5 ORDER BY run_seq DESC, id DESC LIMIT 1",
            "summaries_conversation_run_seq (conversation_id=? AND run_seq<?)",
        ),
        (
            STEP_MESSAGES,
            "messages_conversation_run_seq (conversation_id=? AND run_seq>?)",
        ),
        (STEP_MESSAGES, "parts_message_idx (message_id=?)"),
        (
            "SELECT * FROM messages WHERE tenant = 'a' AND conversation_id = 'c' \
             AND id < 'm' ORDER BY id DESC LIMIT 50",
            "messages_conversation_id (conversation_id=? AND id<?)",
        ),
        (
            "SELECT * FROM parts WHERE tenant = 'a' AND message_id IN ('m', 'n') \
             ORDER BY message_id ASC, idx ASC",
            "parts_message_idx (message_id=?)",
        ),
        (
            "SELECT * FROM tool_calls WHERE tenant = 'a' AND part_id IN ('p', 'q')",
            "tool_calls_part (part_id=?)",
        ),
        (
            "SELECT * FROM interactions WHERE tenant = 'a' AND part_id IN ('p', 'q')",
            "interactions_part (part_id=?)",
        ),
        (
            "SELECT * FROM events WHERE tenant = 'a' AND conversation_id = 'c' \
             AND seq > 5 ORDER BY seq ASC LIMIT 100",
            "(conversation_id=? AND seq>?)",
        ),
        (
            "SELECT * FROM messages WHERE run_id = 'r' AND role = 'ASSISTANT' \
             ORDER BY pos DESC LIMIT 1",
            "messages_run_pos (run_id=?)",
        ),
        (
            &format!("SELECT * FROM messages WHERE run_id = 'r' AND pos >= {PENDING_POS}"),
            "messages_run_pos (run_id=? AND pos>?)",
        ),
        (
            &format!(
                "SELECT * FROM runs WHERE tenant = 'a' AND conversation_id = 'c' \
                 AND status IN {unended}"
            ),
            "runs_conversation_status_seq (conversation_id=? AND status=?)",
        ),
        (
            &format!(
                "SELECT 1 FROM runs r WHERE r.status = 'QUEUED' AND NOT EXISTS \
                 (SELECT 1 FROM runs o WHERE o.conversation_id = r.conversation_id \
                 AND o.seq < r.seq AND o.status IN {unended})"
            ),
            "runs_conversation_status_seq (conversation_id=? AND status=? AND seq<?)",
        ),
        (
            "SELECT p.ended_at FROM runs p WHERE p.conversation_id = 'c' AND p.seq < 5 \
             ORDER BY p.seq DESC LIMIT 1",
            "runs_conversation_seq (conversation_id=? AND seq<?)",
        ),
    ];
    for (sql, index) in reads {
        let plan: Vec<String> = store
            .db()
            .query_all_raw(sea_orm::Statement::from_string(
                DatabaseBackend::Sqlite,
                format!("EXPLAIN QUERY PLAN {sql}"),
            ))
            .await
            .unwrap()
            .iter()
            .map(|row| row.try_get_by_index::<String>(3).unwrap())
            .collect();
        assert!(
            plan.iter().all(|step| !step.starts_with("SCAN")),
            "{sql}: {plan:?}"
        );
        assert!(
            plan.iter().any(|step| step.contains(index)),
            "{sql}: {plan:?}"
        );
    }
}

/// A step of a conversation without tool calls or questions reads its
/// history in two queries, whether the turns of earlier runs are kept or
/// not: the latest summary, then the messages from a run on with their
/// parts.
#[tokio::test]
async fn a_plain_step_reads_its_history_in_two_queries() {
    let db = TestDb::new().await;
    let mut c = Conversation::new(&db).await;
    let first = c.user("Is the harbour open?").await;
    c.reply(&first, &[Said::Text(0, "Yes, until six.")]).await;
    let second = c.user("And tomorrow?").await;
    let kept = Histories::new(64);
    for (histories, what) in [(&Histories::new(0), "nothing kept"), (&kept, "kept")] {
        for _ in 0..2 {
            let before = c.store.statements();
            let read = history::load(&c.store, histories, &second).await.unwrap();
            assert_eq!(c.store.statements() - before, 2, "{what}");
            assert_eq!(read.turns.len(), 3, "{what}: {:?}", read.turns);
        }
    }
}
