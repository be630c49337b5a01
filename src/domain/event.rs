//! Transport events: thin facts about committed state, in a conversation's log.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::cursor::Cursor;
use super::run::{RunError, RunStatus, Usage};
use super::time::Millis;
use super::{MessageRole, PartKind};

macro_rules! event_kinds {
    ($($variant:ident => $text:literal),+ $(,)?) => {
        /// The stable wire name of an event (`type` in the API).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum EventKind { $($variant),+ }

        impl EventKind {
            pub const ALL: &'static [EventKind] = &[$(EventKind::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $(EventKind::$variant => $text),+ }
            }

            pub fn parse(text: &str) -> Option<EventKind> {
                match text { $($text => Some(EventKind::$variant),)+ _ => None }
            }
        }
    };
}

event_kinds! {
    RunQueued => "run.queued",
    RunStarted => "run.started",
    RunCheckpointed => "run.checkpointed",
    RunSteered => "run.steered",
    RunCompleted => "run.completed",
    RunFailed => "run.failed",
    RunCancelled => "run.cancelled",
    RunRetryPending => "run.retry-pending",
    MessageCreated => "message.created",
    PartAdded => "part.added",
    PartUpdated => "part.updated",
    PartDelta => "part.delta",
    ToolStarted => "tool.started",
    ToolCompleted => "tool.completed",
    ToolFailed => "tool.failed",
    QuestionRequested => "question.requested",
    QuestionAnswered => "question.answered",
    ApprovalRequested => "approval.requested",
    ApprovalDecided => "approval.decided",
    ConnectionRequested => "connection.requested",
    ConnectionCompleted => "connection.completed",
    UsageUpdated => "usage.updated",
    ContextCompacted => "context.compacted",
}

impl EventKind {
    /// `part.delta` lives on the bus only; every other kind is in the log.
    pub fn is_persisted(self) -> bool {
        self != EventKind::PartDelta
    }

    /// The events after which a run has nothing more to say.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            EventKind::RunCompleted | EventKind::RunFailed | EventKind::RunCancelled
        )
    }

    /// The event that reports a run entering `status`, where there is one.
    pub fn for_run_status(status: RunStatus) -> Option<EventKind> {
        match status {
            RunStatus::Queued => Some(EventKind::RunQueued),
            RunStatus::Running => Some(EventKind::RunStarted),
            RunStatus::Completed => Some(EventKind::RunCompleted),
            RunStatus::Failed => Some(EventKind::RunFailed),
            RunStatus::Cancelled => Some(EventKind::RunCancelled),
            _ => None,
        }
    }
}

/// The small fields an event carries besides its identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "shape",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum EventBody {
    Run {
        status: RunStatus,
    },
    RetryPending {
        attempt: i32,
        max_attempts: i32,
        delay_ms: i64,
        next_attempt_at: Millis,
        error: RunError,
    },
    Message {
        message_id: Uuid,
        role: MessageRole,
    },
    Part {
        message_id: Uuid,
        part_id: Uuid,
        kind: PartKind,
        text_length: Option<i64>,
    },
    Delta {
        message_id: Uuid,
        part_id: Uuid,
        offset: i64,
        text: String,
    },
    Tool {
        tool_call_id: Uuid,
        tool_name: String,
    },
    Interaction {
        interaction_id: Uuid,
    },
    Usage {
        usage: Usage,
    },
    ContextCompacted {
        messages_compacted: i64,
    },
}

/// An event about to be appended to a conversation's log.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub kind: EventKind,
    pub run_id: Option<Uuid>,
    pub body: EventBody,
}

impl NewEvent {
    /// The run moved to `status`; `None` for statuses without their own event.
    pub fn run_status(run_id: Uuid, status: RunStatus) -> Option<NewEvent> {
        EventKind::for_run_status(status).map(|kind| NewEvent {
            kind,
            run_id: Some(run_id),
            body: EventBody::Run { status },
        })
    }

    /// Messages steered into the running run joined it at a step boundary.
    pub fn run_steered(run_id: Uuid) -> NewEvent {
        NewEvent {
            kind: EventKind::RunSteered,
            run_id: Some(run_id),
            body: EventBody::Run {
                status: RunStatus::Running,
            },
        }
    }

    pub fn message_created(message_id: Uuid, role: MessageRole, run_id: Option<Uuid>) -> NewEvent {
        NewEvent {
            kind: EventKind::MessageCreated,
            run_id,
            body: EventBody::Message { message_id, role },
        }
    }
}

/// An event as subscribers see it. Persisted events have their own cursor;
/// a live `part.delta` carries the cursor of the newest persisted event
/// before it.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub conversation_id: Uuid,
    pub cursor: Cursor,
    pub kind: EventKind,
    pub run_id: Option<Uuid>,
    pub at: Millis,
    pub body: EventBody,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_are_unique_and_parse_back() {
        let mut seen = std::collections::HashSet::new();
        for kind in EventKind::ALL {
            assert!(seen.insert(kind.as_str()), "{} twice", kind.as_str());
            assert_eq!(EventKind::parse(kind.as_str()), Some(*kind));
        }
        assert_eq!(EventKind::parse("run.exploded"), None);
    }

    #[test]
    fn only_deltas_are_live_only() {
        let live: Vec<_> = EventKind::ALL
            .iter()
            .filter(|k| !k.is_persisted())
            .collect();
        assert_eq!(live, vec![&EventKind::PartDelta]);
    }

    #[test]
    fn bodies_round_trip_through_json() {
        let body = EventBody::Part {
            message_id: Uuid::nil(),
            part_id: Uuid::max(),
            kind: PartKind::Text,
            text_length: Some(12),
        };
        let json = serde_json::to_value(&body).unwrap();
        assert_eq!(json["shape"], "part");
        assert_eq!(json["textLength"], 12);
        assert_eq!(serde_json::from_value::<EventBody>(json).unwrap(), body);
    }
}
