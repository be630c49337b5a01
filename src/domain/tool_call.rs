//! A tool call's life: the state machine the tools issue builds on.
//!
//! REQUESTED → EXECUTING{attempt} → COMPLETED (with an outcome), or
//! AWAITING a person first, or INDETERMINATE when a call that must not be
//! replayed was cut off mid-flight. Recovery never turns EXECUTING back
//! into REQUESTED, and nothing a worker does moves a terminal call again;
//! only an operator, told by the downstream system how an INDETERMINATE
//! call came out, moves it to COMPLETED (`ToolInput::Resolve`).

use serde_json::{Value, json};

use super::stored_enum;

stored_enum!(
    /// Where a tool call is.
    ToolCallStatus {
        Requested => "REQUESTED",
        Executing => "EXECUTING",
        Awaiting => "AWAITING",
        Completed => "COMPLETED",
        Indeterminate => "INDETERMINATE",
    }
);

stored_enum!(
    /// How a finished tool call came out.
    ToolOutcome {
        Succeeded => "SUCCEEDED",
        Failed => "FAILED",
        Denied => "DENIED",
        Expired => "EXPIRED",
        Interrupted => "INTERRUPTED",
        NotStarted => "NOT_STARTED",
        Unknown => "UNKNOWN",
    }
);

/// A tool call's state: its status, how many times its effect was started,
/// and its outcome once it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolCallState {
    pub status: ToolCallStatus,
    /// EXECUTING commits so far; 0 = never started.
    pub attempt: u32,
    pub outcome: Option<ToolOutcome>,
}

/// Everything that moves a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolInput {
    /// Its effect is about to start (committed before it does).
    Start,
    /// It cannot run at all (its tool is gone, its input unusable, the
    /// consent it waited for was declined): it fails without starting.
    Reject,
    /// The effect answered: success or a failure the model can read.
    Finish { succeeded: bool },
    /// It needs a person (approval, question, connection) first.
    Await,
    /// The person allowed it: it may start.
    Allow,
    /// The person refused, or the wait expired.
    Refuse { expired: bool },
    /// The run was cancelled around it.
    Cancel,
    /// Its worker died; `replayable` for tools declared idempotent.
    Recover { replayable: bool },
    /// An operator learned from the downstream system how a call of unknown
    /// outcome came out.
    Resolve { succeeded: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a {from} tool call cannot take {input:?}")]
pub struct IllegalToolTransition {
    pub from: ToolCallStatus,
    pub input: ToolInput,
}

impl ToolCallState {
    pub const REQUESTED: ToolCallState = ToolCallState {
        status: ToolCallStatus::Requested,
        attempt: 0,
        outcome: None,
    };

    pub fn is_terminal(self) -> bool {
        matches!(
            self.status,
            ToolCallStatus::Completed | ToolCallStatus::Indeterminate
        )
    }

    fn completed(self, outcome: ToolOutcome) -> ToolCallState {
        ToolCallState {
            status: ToolCallStatus::Completed,
            outcome: Some(outcome),
            ..self
        }
    }

    fn executing(self) -> ToolCallState {
        ToolCallState {
            status: ToolCallStatus::Executing,
            attempt: self.attempt + 1,
            outcome: None,
        }
    }

    pub fn apply(self, input: ToolInput) -> Result<ToolCallState, IllegalToolTransition> {
        use ToolCallStatus::*;
        let next = match (self.status, input) {
            (Requested, ToolInput::Start) => self.executing(),
            (Requested | Awaiting, ToolInput::Reject) => self.completed(ToolOutcome::Failed),
            (Executing, ToolInput::Finish { succeeded: true }) => {
                self.completed(ToolOutcome::Succeeded)
            }
            (Executing, ToolInput::Finish { succeeded: false }) => {
                self.completed(ToolOutcome::Failed)
            }
            (Requested, ToolInput::Await) => ToolCallState {
                status: Awaiting,
                ..self
            },
            (Awaiting, ToolInput::Allow) => ToolCallState {
                status: Requested,
                ..self
            },
            (Awaiting, ToolInput::Refuse { expired: false }) => self.completed(ToolOutcome::Denied),
            (Awaiting, ToolInput::Refuse { expired: true }) => self.completed(ToolOutcome::Expired),
            (Requested | Awaiting, ToolInput::Cancel) => self.completed(ToolOutcome::NotStarted),
            (Executing, ToolInput::Cancel) => self.completed(ToolOutcome::Interrupted),
            // Not started yet: it simply runs later.
            (Requested | Awaiting, ToolInput::Recover { .. }) => self,
            // Replayed with the same idempotency key, counted as an attempt.
            (Executing, ToolInput::Recover { replayable: true }) => self.executing(),
            // May or may not have happened: said once, never repeated.
            (Executing, ToolInput::Recover { replayable: false }) => ToolCallState {
                status: Indeterminate,
                outcome: Some(ToolOutcome::Unknown),
                ..self
            },
            (Indeterminate, ToolInput::Resolve { succeeded }) => self.completed(if succeeded {
                ToolOutcome::Succeeded
            } else {
                ToolOutcome::Failed
            }),
            (from, input) => return Err(IllegalToolTransition { from, input }),
        };
        Ok(next)
    }
}

/// What a tool call's output looks like inline (in `ToolCall.output` and in
/// the model's history): whole when it fits, else its JSON text cut on a
/// character boundary with a note saying how much was cut; the whole output
/// is kept beside it.
#[derive(Debug, Clone, PartialEq)]
pub struct InlineOutput {
    pub inline: Value,
    pub full: Option<String>,
    pub truncated: bool,
}

pub fn inline_output(output: &Value, max_bytes: usize) -> InlineOutput {
    let text = output.to_string();
    if text.len() <= max_bytes {
        return InlineOutput {
            inline: output.clone(),
            full: None,
            truncated: false,
        };
    }
    let cut = text.floor_char_boundary(max_bytes);
    let note = format!(
        "[output truncated: {} of {} bytes cut]",
        text.len() - cut,
        text.len()
    );
    InlineOutput {
        inline: Value::String(format!("{}…\n{note}", &text[..cut])),
        full: Some(text),
        truncated: true,
    }
}

/// The result a call gets when Tether, not the tool, decides its outcome.
pub fn closing_output(outcome: ToolOutcome) -> Value {
    let error = match outcome {
        ToolOutcome::NotStarted => "not started: the run ended before this call ran",
        ToolOutcome::Interrupted => {
            "interrupted: the run was cancelled while this call was running; it may or may not \
             have taken effect"
        }
        ToolOutcome::Unknown => {
            "unknown outcome: the server stopped while this call was running and the tool must \
             not be called twice, so it may or may not have taken effect; check before repeating it"
        }
        ToolOutcome::Denied => "denied: a person refused this call",
        ToolOutcome::Expired => "expired: nobody answered in time",
        ToolOutcome::Succeeded | ToolOutcome::Failed => "no result was recorded",
    };
    json!({ "error": error, "outcome": outcome.as_str() })
}

/// The text a model reads as a call's result: a string output as it is,
/// anything else as JSON.
pub fn result_text(output: Option<&Value>) -> String {
    match output {
        Some(Value::String(text)) => text.clone(),
        Some(other) => other.to_string(),
        None => closing_output(ToolOutcome::Failed).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn inputs() -> Vec<ToolInput> {
        vec![
            ToolInput::Start,
            ToolInput::Reject,
            ToolInput::Finish { succeeded: true },
            ToolInput::Finish { succeeded: false },
            ToolInput::Await,
            ToolInput::Allow,
            ToolInput::Refuse { expired: false },
            ToolInput::Refuse { expired: true },
            ToolInput::Cancel,
            ToolInput::Recover { replayable: true },
            ToolInput::Recover { replayable: false },
        ]
    }

    #[test]
    fn the_happy_path_and_the_honest_ones() {
        let done = ToolCallState::REQUESTED
            .apply(ToolInput::Start)
            .and_then(|s| s.apply(ToolInput::Finish { succeeded: true }))
            .unwrap();
        assert_eq!(done.outcome, Some(ToolOutcome::Succeeded));
        assert_eq!(done.attempt, 1);

        let executing = ToolCallState::REQUESTED.apply(ToolInput::Start).unwrap();
        let replayed = executing
            .apply(ToolInput::Recover { replayable: true })
            .unwrap();
        assert_eq!(
            (replayed.status, replayed.attempt),
            (ToolCallStatus::Executing, 2)
        );
        let unknown = executing
            .apply(ToolInput::Recover { replayable: false })
            .unwrap();
        assert_eq!(unknown.status, ToolCallStatus::Indeterminate);
        assert_eq!(unknown.outcome, Some(ToolOutcome::Unknown));
        assert!(
            unknown
                .apply(ToolInput::Recover { replayable: false })
                .is_err()
        );

        let cancelled = executing.apply(ToolInput::Cancel).unwrap();
        assert_eq!(cancelled.outcome, Some(ToolOutcome::Interrupted));
        let not_started = ToolCallState::REQUESTED.apply(ToolInput::Cancel).unwrap();
        assert_eq!(not_started.outcome, Some(ToolOutcome::NotStarted));
    }

    #[test]
    fn large_outputs_are_cut_on_a_character_boundary_with_a_note() {
        let small = json!({ "ok": true });
        assert_eq!(inline_output(&small, 100).inline, small);
        assert!(!inline_output(&small, 100).truncated);
        let big = json!({ "text": "é".repeat(100) });
        let text = big.to_string();
        let cut = inline_output(&big, 20);
        assert!(cut.truncated);
        assert_eq!(cut.full.as_deref(), Some(text.as_str()));
        let inline = cut.inline.as_str().unwrap();
        assert!(inline.starts_with("{\"text\":\"é"), "{inline}");
        // 20 bytes fall inside an "é": the cut moves back to 19.
        assert!(
            inline.ends_with(&format!(
                "[output truncated: {} of {} bytes cut]",
                text.len() - 19,
                text.len()
            )),
            "{inline}"
        );
    }

    #[test]
    fn terminal_calls_refuse_everything() {
        let finished = [
            ToolCallState::REQUESTED.apply(ToolInput::Cancel).unwrap(),
            ToolCallState::REQUESTED
                .apply(ToolInput::Start)
                .and_then(|s| s.apply(ToolInput::Recover { replayable: false }))
                .unwrap(),
        ];
        for state in finished {
            assert!(state.is_terminal());
            for input in inputs() {
                assert!(state.apply(input).is_err(), "{state:?} {input:?}");
            }
        }
    }

    #[test]
    fn an_operator_resolves_only_a_call_of_unknown_outcome() {
        let unknown = ToolCallState::REQUESTED
            .apply(ToolInput::Start)
            .and_then(|s| s.apply(ToolInput::Recover { replayable: false }))
            .unwrap();
        for (succeeded, outcome) in [(true, ToolOutcome::Succeeded), (false, ToolOutcome::Failed)] {
            let resolved = unknown.apply(ToolInput::Resolve { succeeded }).unwrap();
            assert_eq!(resolved.status, ToolCallStatus::Completed);
            assert_eq!(resolved.outcome, Some(outcome));
            assert_eq!(resolved.attempt, unknown.attempt);
            assert!(
                resolved.apply(ToolInput::Resolve { succeeded }).is_err(),
                "resolved once"
            );
        }
        let others = [
            ToolCallState::REQUESTED,
            ToolCallState::REQUESTED.apply(ToolInput::Start).unwrap(),
            ToolCallState::REQUESTED.apply(ToolInput::Cancel).unwrap(),
        ];
        for state in others {
            assert!(
                state.apply(ToolInput::Resolve { succeeded: true }).is_err(),
                "{state:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn random_inputs_keep_the_invariants(picks in proptest::collection::vec(0usize..11, 0..40)) {
            let all = inputs();
            let mut state = ToolCallState::REQUESTED;
            for pick in picks {
                let input = all[pick];
                let Ok(next) = state.apply(input) else { continue };
                prop_assert!(!state.is_terminal(), "left a terminal state");
                prop_assert!(next.attempt >= state.attempt, "attempts never go back");
                prop_assert!(
                    !(state.status == ToolCallStatus::Executing && next.status == ToolCallStatus::Requested),
                    "EXECUTING never turns back into REQUESTED"
                );
                prop_assert_eq!(next.is_terminal(), next.outcome.is_some());
                if next.status == ToolCallStatus::Executing {
                    prop_assert!(next.attempt >= 1);
                }
                state = next;
            }
        }
    }
}
