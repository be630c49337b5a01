//! Context compaction: before a request whose estimated input would exceed
//! the agent's `context.budget_tokens`, the older turns (all but the last
//! `keep_recent_messages`) are summarized by the agent's own model, and the
//! summary stands in for them from then on.
//!
//! The estimate is documented and deliberately simple: characters / 4,
//! rounded up, over the system prompt and every turn.

use futures_util::StreamExt;
use uuid::Uuid;

use std::collections::HashSet;

use super::history::History;
use crate::config::ContextConfig;
use crate::domain::MessageRole;
use crate::providers::{ModelEvent, ModelRequest, Provider, ProviderError, Turn};

const INSTRUCTION: &str = "Summarize the conversation above for your own later use: keep every \
    fact, decision, name, number and open question that a continuation needs; leave out \
    pleasantries. Answer with the summary only.";

pub fn estimate_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4)
}

pub fn estimate_request(system: Option<&str>, turns: &[Turn]) -> u64 {
    system.map_or(0, estimate_tokens)
        + turns
            .iter()
            .map(|t| estimate_tokens(&t.as_text()))
            .sum::<u64>()
}

/// Which leading turns to summarize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub turns: usize,
    /// The last message the summary covers, in the history's order.
    pub through: Uuid,
    /// How many messages it replaces (an earlier summary not counted).
    pub messages: usize,
}

pub fn plan(history: &History, system: Option<&str>, context: &ContextConfig) -> Option<Plan> {
    if estimate_request(system, &history.turns) <= context.budget_tokens {
        return None;
    }
    let keep = context.keep_recent_messages as usize;
    let mut turns = history.turns.len().checked_sub(keep)?;
    // The cut falls between messages, never inside one: a reply's steps,
    // and a tool call with its result, stay together.
    while turns > 0
        && turns < history.turns.len()
        && history.sources[turns].is_some()
        && history.sources[turns] == history.sources[turns - 1]
    {
        turns -= 1;
    }
    let covered = &history.sources[..turns];
    let through = covered.iter().rev().find_map(|s| *s)?;
    let messages: HashSet<Uuid> = covered.iter().flatten().copied().collect();
    Some(Plan {
        turns,
        through,
        messages: messages.len(),
    })
}

/// The summary's text and its usage (input, output tokens).
pub async fn summarize(
    provider: &dyn Provider,
    model: &str,
    max_tokens: u32,
    turns: &[Turn],
) -> Result<(String, i64, i64), ProviderError> {
    // The summarizer reads tool calls and results as text, so the request
    // needs no tool definitions and cannot break the providers' pairing
    // rules.
    let mut turns: Vec<Turn> = turns
        .iter()
        .map(|turn| Turn::text(turn.role, turn.as_text()))
        .filter(|turn| !turn.plain_text().is_empty())
        .collect();
    turns.push(Turn::text(MessageRole::User, INSTRUCTION));
    let request = ModelRequest {
        model: model.to_owned(),
        system: None,
        turns,
        tools: Vec::new(),
        max_tokens,
        thinking_budget: None,
        attempt: 1,
    };
    let mut stream = provider.stream(request).await?;
    let (mut text, mut input, mut output) = (String::new(), 0, 0);
    while let Some(event) = stream.next().await {
        match event? {
            ModelEvent::Text(chunk) => text.push_str(&chunk),
            ModelEvent::Usage {
                input_tokens,
                output_tokens,
            } => (input, output) = (input_tokens, output_tokens),
            ModelEvent::Finished { .. } => break,
            ModelEvent::Reasoning(_)
            | ModelEvent::ReasoningSignature(_)
            | ModelEvent::RedactedReasoning(_)
            | ModelEvent::ToolCall { .. } => {}
        }
    }
    Ok((text, input, output))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(lengths: &[usize]) -> History {
        let mut history = History::default();
        for (i, len) in lengths.iter().enumerate() {
            let role = if i % 2 == 0 {
                MessageRole::User
            } else {
                MessageRole::Assistant
            };
            history.turns.push(Turn::text(role, "x".repeat(*len)));
            history.sources.push(Some(Uuid::from_u128(i as u128 + 1)));
        }
        history
    }

    #[test]
    fn compacts_older_turns_only_over_budget() {
        let context = ContextConfig {
            budget_tokens: 100,
            keep_recent_messages: 2,
        };
        assert_eq!(plan(&history(&[100, 100, 100]), None, &context), None);
        let plan = plan(&history(&[200, 200, 40, 40]), None, &context).unwrap();
        assert_eq!(plan.turns, 2);
        assert_eq!(plan.messages, 2);
        assert_eq!(plan.through, Uuid::from_u128(2));
        assert_eq!(estimate_tokens("abcde"), 2);
    }

    #[test]
    fn the_cut_never_falls_inside_a_message_so_calls_keep_their_results() {
        let context = ContextConfig {
            budget_tokens: 10,
            keep_recent_messages: 2,
        };
        // A user message, then one reply of three turns (a step with a
        // tool call, its results, the answer), then the next user message.
        let mut history = history(&[400, 400, 400, 400, 400]);
        let reply = Some(Uuid::from_u128(2));
        history.sources = vec![
            Some(Uuid::from_u128(1)),
            reply,
            reply,
            reply,
            Some(Uuid::from_u128(5)),
        ];
        // Keeping two turns would cut between the results and the answer:
        // the whole reply stays instead.
        let plan = plan(&history, None, &context).unwrap();
        assert_eq!(plan.turns, 1);
        assert_eq!(plan.through, Uuid::from_u128(1));
        assert_eq!(plan.messages, 1);
        // Covering the reply too counts its message once, not per turn.
        let wider = ContextConfig {
            budget_tokens: 10,
            keep_recent_messages: 1,
        };
        let plan = super::plan(&history, None, &wider).unwrap();
        assert_eq!((plan.turns, plan.messages), (4, 2));
        assert_eq!(plan.through, Uuid::from_u128(2));
    }

    #[test]
    fn nothing_to_compact_when_every_turn_is_recent() {
        let context = ContextConfig {
            budget_tokens: 10,
            keep_recent_messages: 8,
        };
        assert_eq!(plan(&history(&[400, 400]), None, &context), None);
    }
}
