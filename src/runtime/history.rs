//! The history sent to the model, rebuilt from committed facts only.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use lru::LruCache;

use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder};
use uuid::Uuid;

use crate::domain::interaction::{InteractionStatus, answers_text};
use crate::domain::tool_call::{ToolOutcome, result_text};
use crate::domain::{MessageRole, PartKind};
use crate::providers::{Content, Turn};
use crate::store::commit::PENDING_POS;
use crate::store::entities::{interaction, message, part, run, summary, tool_call};
use crate::store::{Result, Store, interactions, parse_stored, reads};

/// What the model reads when its questions expired unanswered.
const QUESTIONS_EXPIRED: &str =
    "Nobody answered your questions before they expired; go on without the answers.";

/// The opening of the turn that stands in for compacted messages.
pub const SUMMARY_HEADING: &str = "Summary of the earlier conversation:";

/// The turns for a run's model request, with the message each came from
/// (`None` for a summary standing in for older ones). One assistant message
/// gives a turn per step, each step that asked for tools followed by a user
/// turn with their results.
#[derive(Debug, Clone, Default)]
pub struct History {
    pub turns: Vec<Turn>,
    pub sources: Vec<Option<Uuid>>,
}

impl History {
    fn push(&mut self, turn: Turn, source: Option<Uuid>) {
        self.turns.push(turn);
        self.sources.push(source);
    }
}

/// Every user message up to the run's own, each followed by its reply, in
/// the order of their runs (`runs.seq`: not by id, for a reply's message is
/// made when its run starts, so a message queued meanwhile has an earlier
/// id, and ids come from the clocks of several processes), with
/// their tool calls and results. The latest summary stands in for every
/// message up to the one it was made through, in that order. (Runs of a
/// conversation execute one at a time in order, so every reply there is
/// belongs to this run or to one before it.) Abandoned attempts, notices
/// and errors are shown to people, never to the model; reasoning goes back
/// only with its signature.
///
/// Only what the request needs is read. The turns of the runs before this
/// one that `histories` kept (under the same latest summary) are not read
/// again: only the messages of this run and of those it has not seen, by
/// index. Otherwise, with a summary, the messages from the question whose
/// pair it ends in (see `after_summary`); without one, every message:
/// compaction, which decides from the whole history whether to summarize
/// and summarizes all but the latest turns, needs all of them. The
/// messages come with their parts (one query), then the tool calls and
/// questions those parts show, each by index.
pub async fn load(store: &Store, histories: &Histories, run: &run::Model) -> Result<History> {
    let db = store.db();
    let latest_summary = summary::Entity::find()
        .filter(summary::Column::Tenant.eq(run.tenant.as_str()))
        .filter(summary::Column::ConversationId.eq(run.conversation_id))
        .filter(summary::Column::RunSeq.lte(run.seq))
        .order_by_desc(summary::Column::RunSeq)
        .order_by_desc(summary::Column::Id)
        .one(db)
        .await?;
    let summary_id = latest_summary.as_ref().map(|s| s.id);
    let (kept, (ordered, parts)) = match histories.get(run, summary_id) {
        Some(kept) => {
            let (messages, parts) =
                reads::messages_from_run(db, &run.tenant, run.conversation_id, kept.before_seq)
                    .await?;
            // The summary's last message is either among those kept (and
            // so not read again) or among these.
            (kept, (after(messages, run, latest_summary.as_ref()), parts))
        }
        None => {
            let kept = Kept::empty(summary_id);
            let tail = match &latest_summary {
                Some(summary) => after_summary(store, run, summary).await?,
                None => None,
            };
            let ordered = match tail {
                Some(tail) => tail,
                None => {
                    // Every message: run numbers start at 1.
                    let (messages, parts) =
                        reads::messages_from_run(db, &run.tenant, run.conversation_id, 0).await?;
                    (after(messages, run, latest_summary.as_ref()), parts)
                }
            };
            (kept, ordered)
        }
    };
    let run_seqs: HashMap<Uuid, i64> = ordered.iter().map(|m| (m.id, m.run_seq)).collect();
    let (read, unsettled) = build(store, run, ordered, parts).await?;
    // Messages of this run may still change (steered ones join it); those
    // of the runs before it, which have all ended, no longer do, except a
    // call whose outcome is UNKNOWN, which an operator may resolve: turns
    // are kept up to the run before the first such call's.
    let keep_before = unsettled.map_or(run.seq, |seq| seq.min(run.seq));
    let split = read
        .sources
        .iter()
        .position(|source| {
            source.is_some_and(|id| run_seqs.get(&id).is_some_and(|seq| *seq >= keep_before))
        })
        .unwrap_or(read.turns.len());
    histories.keep(run, &kept, &read, split, keep_before);

    let mut history = History::default();
    if let Some(summary) = &latest_summary {
        // Everything up to the message it was made through is replaced.
        let text = format!("{SUMMARY_HEADING}\n{}", summary.text);
        history.push(Turn::text(MessageRole::User, text), None);
    }
    history.turns.extend(kept.history.turns.iter().cloned());
    history.sources.extend(kept.history.sources.iter().copied());
    history.turns.extend(read.turns);
    history.sources.extend(read.sources);
    Ok(history)
}

/// The turns of conversations' ended runs that this process keeps between
/// claims, within a memory budget (`runtime.history_cache_mib`), the least
/// recently used dropped first. What they were built from no longer
/// changes: runs of a conversation execute one at a time in order, and an
/// ended run's messages, parts, tool calls and questions are final (its
/// unanswered steered messages are moved to later runs as it ends). Each
/// entry holds for one latest summary; a new summary (a compaction, here or
/// in another process) makes the next step read afresh. Runs that other
/// processes executed meanwhile are read as this run's new messages are.
pub struct Histories {
    budget: usize,
    kept: Mutex<KeptAll>,
}

struct KeptAll {
    entries: LruCache<Key, Arc<Kept>>,
    bytes: usize,
}

/// A conversation: its tenant and id.
type Key = (String, Uuid);

fn key_of(run: &run::Model) -> Key {
    (run.tenant.clone(), run.conversation_id)
}

/// The turns of a conversation's messages, after `summary`, of the runs
/// numbered below `before_seq`.
#[derive(Debug, Clone)]
struct Kept {
    summary: Option<Uuid>,
    before_seq: i64,
    history: History,
    bytes: usize,
}

impl Kept {
    fn empty(summary: Option<Uuid>) -> Arc<Kept> {
        Arc::new(Kept {
            summary,
            before_seq: 0,
            history: History::default(),
            bytes: 0,
        })
    }
}

/// What a kept entry costs beyond its text, roughly.
const ENTRY_OVERHEAD: usize = 256;
const TURN_OVERHEAD: usize = 64;

fn turn_bytes(turn: &Turn) -> usize {
    let content: usize = turn
        .content
        .iter()
        .map(|content| match content {
            Content::Text(text) => text.len(),
            Content::Reasoning { text, signature } => {
                text.len() + signature.as_ref().map_or(0, String::len)
            }
            Content::RedactedReasoning { data } => data.len(),
            // A parsed JSON value takes several times its text.
            Content::ToolUse { id, name, input } => {
                id.len() + name.len() + 4 * input.to_string().len()
            }
            Content::ToolResult {
                tool_use_id,
                output,
                ..
            } => tool_use_id.len() + output.len(),
        })
        .sum();
    TURN_OVERHEAD * (1 + turn.content.len()) + content
}

impl Histories {
    pub fn new(budget_mib: u64) -> Histories {
        Histories::within(usize::try_from(budget_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX))
    }

    fn within(budget: usize) -> Histories {
        Histories {
            budget,
            kept: Mutex::new(KeptAll {
                entries: LruCache::unbounded(),
                bytes: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, KeptAll> {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many conversations have turns kept.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The turns kept for `run`'s conversation, if they were kept under
    /// the same latest summary and end before `run`.
    fn get(&self, run: &run::Model, summary: Option<Uuid>) -> Option<Arc<Kept>> {
        if self.budget == 0 {
            return None;
        }
        self.lock()
            .entries
            .get(&key_of(run))
            .filter(|kept| kept.summary == summary && kept.before_seq <= run.seq)
            .cloned()
    }

    /// Keeps `kept` followed by the first `split` turns of `read` (those
    /// of the runs numbered below `before_seq`) for the conversation's next
    /// run, when there is something new and it fits the budget.
    fn keep(&self, run: &run::Model, kept: &Kept, read: &History, split: usize, before_seq: i64) {
        if self.budget == 0 || (split == 0 && kept.before_seq == before_seq) {
            return;
        }
        let mut grown = kept.clone();
        grown.before_seq = before_seq;
        for (turn, source) in read.turns[..split].iter().zip(&read.sources[..split]) {
            grown.bytes += turn_bytes(turn);
            grown.history.push(turn.clone(), *source);
        }
        self.put(key_of(run), Arc::new(grown));
    }

    /// Keeps `entry` for a conversation in place of what was kept, dropping
    /// the least recently used others to make room; an entry larger than
    /// the whole budget is not kept.
    fn put(&self, key: Key, entry: Arc<Kept>) {
        let size = ENTRY_OVERHEAD + entry.bytes;
        let mut all = self.lock();
        if let Some(old) = all.entries.pop(&key) {
            all.bytes -= ENTRY_OVERHEAD + old.bytes;
        }
        if size > self.budget {
            return;
        }
        while all.bytes + size > self.budget {
            let Some((_, dropped)) = all.entries.pop_lru() else {
                break;
            };
            all.bytes -= ENTRY_OVERHEAD + dropped.bytes;
        }
        all.bytes += size;
        all.entries.put(key, entry);
    }
}

/// The messages up to the run's own, in the reading order the store gives
/// them (`reads::ReadingOrder`, the order people read them in too): each
/// question followed by its reply, and messages steered into a run where
/// they joined it. Messages queued behind the run, and those steered into
/// it that wait for its next step boundary, are not its history yet.
fn in_order(messages: Vec<message::Model>, run: &run::Model) -> Vec<message::Model> {
    messages
        .into_iter()
        .filter(|m| m.run_seq <= run.seq && m.pos < PENDING_POS)
        .collect()
}

/// `in_order`, then without everything up to the summary's message.
fn after(
    messages: Vec<message::Model>,
    run: &run::Model,
    summary: Option<&summary::Model>,
) -> Vec<message::Model> {
    let mut ordered = in_order(messages, run);
    if let Some(summary) = summary {
        drain_through(&mut ordered, summary.through_message_id);
    }
    ordered
}

/// Removes everything up to `through` (included), if it is there; whether
/// it was.
fn drain_through(ordered: &mut Vec<message::Model>, through: Uuid) -> bool {
    match ordered.iter().position(|m| m.id == through) {
        Some(at) => {
            ordered.drain(..=at);
            true
        }
        None => false,
    }
}

/// The messages that follow `summary` in the history's order: those of
/// the run its last message belongs to (a question and its reply share
/// their run's number) and of every later run, read by that number however
/// long the conversation before it. `None` when the summary's message
/// cannot be placed so (it is gone, or not where a summary leaves it): the
/// caller then reads everything.
async fn after_summary(
    store: &Store,
    run: &run::Model,
    summary: &summary::Model,
) -> Result<Option<(Vec<message::Model>, Parts)>> {
    let db = store.db();
    let Some(through) = reads::message(db, &run.tenant, summary.through_message_id).await? else {
        return Ok(None);
    };
    if through.conversation_id != run.conversation_id {
        return Ok(None);
    }
    let (messages, parts) =
        reads::messages_from_run(db, &run.tenant, run.conversation_id, through.run_seq).await?;
    let mut ordered = in_order(messages, run);
    Ok(drain_through(&mut ordered, through.id).then_some((ordered, parts)))
}

/// Messages' parts by message, each message's in order.
type Parts = HashMap<Uuid, Vec<part::Model>>;

/// The turns of `ordered` messages (after the summary, if any), from their
/// `parts` (read with them), reading the tool calls and questions those
/// parts show. Also returns the lowest run number among the messages with
/// a tool call whose outcome is `UNKNOWN`, if any.
async fn build(
    store: &Store,
    run: &run::Model,
    ordered: Vec<message::Model>,
    mut parts: Parts,
) -> Result<(History, Option<i64>)> {
    let db = store.db();
    // What the replies' steps look up: the tool call of a tool call part
    // they keep, the interaction of a question part. A history without
    // either asks for neither.
    let mut shown = Vec::new();
    let mut questions = Vec::new();
    for message in &ordered {
        if message.role != MessageRole::Assistant.as_str() {
            continue;
        }
        for part in parts.get(&message.id).into_iter().flatten() {
            if part.abandoned {
                continue;
            }
            if part.kind == PartKind::ToolCall.as_str() {
                shown.push(part.id);
            }
            if part.kind == PartKind::Question.as_str() {
                questions.push(part.id);
            }
        }
    }
    let mut calls = reads::tool_calls_of_parts(db, &run.tenant, &shown).await?;
    let unknown: HashSet<Uuid> = calls
        .iter()
        .filter(|(_, call)| call.outcome.as_deref() == Some(ToolOutcome::Unknown.as_str()))
        .map(|(part, _)| *part)
        .collect();
    let unsettled = ordered
        .iter()
        .filter(|message| {
            parts
                .get(&message.id)
                .into_iter()
                .flatten()
                .any(|part| unknown.contains(&part.id))
        })
        .map(|message| message.run_seq)
        .min();
    let mut asked = reads::interactions_of_parts(db, &run.tenant, &questions).await?;

    let mut history = History::default();
    for message in ordered {
        let parts = parts.remove(&message.id).unwrap_or_default();
        if parse_stored::<MessageRole>(&message.role, "message role")? == MessageRole::User {
            let text = texts(&parts)?;
            if !text.is_empty() {
                history.push(Turn::text(MessageRole::User, text), Some(message.id));
            }
            continue;
        }
        let mut steps: BTreeMap<i32, Vec<part::Model>> = BTreeMap::new();
        for part in parts.into_iter().filter(|p| !p.abandoned) {
            steps.entry(part.step).or_default().push(part);
        }
        for (_, parts) in steps {
            let (said, results) = step_turns(parts, &mut calls, &mut asked)?;
            if !said.content.is_empty() {
                history.push(said, Some(message.id));
            }
            if !results.content.is_empty() {
                history.push(results, Some(message.id));
            }
        }
    }
    Ok((history, unsettled))
}

fn texts(parts: &[part::Model]) -> Result<String> {
    let mut text = String::new();
    for part in parts {
        let kind: PartKind = parse_stored(&part.kind, "part kind")?;
        if kind == PartKind::Text && !part.abandoned {
            text.push_str(part.text.as_deref().unwrap_or_default());
        }
    }
    Ok(text)
}

/// One step of a reply: what the model said (signed and redacted
/// reasoning, text, tool calls, in the order the model said them) and the one result of each call, followed by the
/// answers to questions the step asked.
fn step_turns(
    parts: Vec<part::Model>,
    calls: &mut HashMap<Uuid, tool_call::Model>,
    asked: &mut HashMap<Uuid, interaction::Model>,
) -> Result<(Turn, Turn)> {
    let mut answers = Vec::new();
    let mut said = Turn {
        role: MessageRole::Assistant,
        content: Vec::new(),
    };
    let mut results = Turn {
        role: MessageRole::User,
        content: Vec::new(),
    };
    // The step's calls in batch order: reasoning the model streamed after
    // some of them goes back after them.
    let mut step_calls: VecDeque<tool_call::Model> = parts
        .iter()
        .filter_map(|part| calls.remove(&part.id))
        .collect();
    step_calls.make_contiguous().sort_by_key(|call| call.idx);
    let call = |said: &mut Turn, results: &mut Turn, call: tool_call::Model| {
        let succeeded = call.outcome.as_deref() == Some(ToolOutcome::Succeeded.as_str());
        said.content.push(Content::ToolUse {
            id: call.provider_call_id.clone(),
            name: call.name.clone(),
            input: call.model_input.clone(),
        });
        results.content.push(Content::ToolResult {
            tool_use_id: call.provider_call_id,
            output: result_text(call.output.as_ref()),
            is_error: !succeeded,
        });
    };
    for part in parts {
        let kind: PartKind = parse_stored(&part.kind, "part kind")?;
        let text = part.text.clone().unwrap_or_default();
        let data = |key: &str| part.data.as_ref().and_then(|d| d.get(key));
        match kind {
            PartKind::Text if !text.is_empty() => said.content.push(Content::Text(text)),
            PartKind::Reasoning => {
                let after = data("afterCalls").and_then(|n| n.as_i64()).unwrap_or(0);
                while let Some(earlier) = step_calls.pop_front_if(|c| i64::from(c.idx) < after) {
                    call(&mut said, &mut results, earlier);
                }
                let signature = data("signature")
                    .and_then(|s| s.as_str())
                    .map(str::to_owned);
                if let Some(data) = data("redactedData").and_then(|d| d.as_str()) {
                    said.content.push(Content::RedactedReasoning {
                        data: data.to_owned(),
                    });
                } else if !text.is_empty() || signature.is_some() {
                    said.content.push(Content::Reasoning { text, signature });
                }
            }
            PartKind::ToolCall => {
                if let Some(next) = step_calls.pop_front_if(|c| c.part_id == part.id) {
                    call(&mut said, &mut results, next);
                }
            }
            PartKind::Question => {
                let Some(question) = asked.remove(&part.id) else {
                    continue;
                };
                match interactions::status_of(&question)? {
                    InteractionStatus::Resolved => {
                        let specs = interactions::questions_of(&question)?;
                        let given = interactions::answers_of(&question)?.unwrap_or_default();
                        answers.push(Content::Text(answers_text(&specs, &given)));
                    }
                    InteractionStatus::Expired => {
                        answers.push(Content::Text(QUESTIONS_EXPIRED.to_owned()));
                    }
                    InteractionStatus::Pending | InteractionStatus::Cancelled => {}
                }
            }
            _ => {}
        }
    }
    // Every call gets its result, whatever the parts' order said (invariant 7).
    for left in step_calls {
        call(&mut said, &mut results, left);
    }
    // Tool results come first in their user turn, as the providers require.
    results.content.extend(answers);
    Ok((said, results))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(text: &str) -> Arc<Kept> {
        let turn = Turn::text(MessageRole::User, text);
        Arc::new(Kept {
            summary: None,
            before_seq: 2,
            bytes: turn_bytes(&turn),
            history: History {
                turns: vec![turn],
                sources: vec![Some(Uuid::now_v7())],
            },
        })
    }

    fn key(n: u128) -> Key {
        ("acme".to_owned(), Uuid::from_u128(n))
    }

    #[test]
    fn the_least_recently_used_go_first_when_the_budget_is_full() {
        let each = ENTRY_OVERHEAD + entry("x".repeat(100).as_str()).bytes;
        let histories = Histories::within(2 * each + each / 2);
        histories.put(key(1), entry(&"a".repeat(100)));
        histories.put(key(2), entry(&"b".repeat(100)));
        assert_eq!(histories.len(), 2);
        // The first is used: the second is now the least recently used.
        assert!(histories.lock().entries.get(&key(1)).is_some());
        histories.put(key(3), entry(&"c".repeat(100)));
        let all = histories.lock();
        assert!(all.entries.contains(&key(1)) && all.entries.contains(&key(3)));
        assert!(!all.entries.contains(&key(2)));
        assert_eq!(all.bytes, 2 * each);
    }

    #[test]
    fn an_entry_beyond_the_whole_budget_is_not_kept_and_its_old_one_goes() {
        let small = entry("a");
        let histories = Histories::within(ENTRY_OVERHEAD + small.bytes + 10);
        histories.put(key(1), small);
        assert_eq!(histories.len(), 1);
        histories.put(key(1), entry(&"b".repeat(1000)));
        assert!(histories.is_empty());
        assert_eq!(histories.lock().bytes, 0);
    }
}
