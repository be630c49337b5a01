//! Transport events as GraphQL types: an interface with one object per shape.

use async_graphql::{ID, Interface, SimpleObject};

use super::types::{DateTime, to_id};
use crate::domain::event::{Event, EventBody};
use crate::domain::run::{RunError, RunStatus, Usage};
use crate::domain::{MessageRole, PartKind};

macro_rules! transport_event {
    ($(#[$meta:meta])* $name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[derive(SimpleObject)]
        pub struct $name {
            pub cursor: String,
            pub r#type: String,
            pub conversation_id: ID,
            pub run_id: Option<ID>,
            pub at: DateTime,
            $(pub $field: $ty,)*
        }
    };
}

transport_event!(
    /// `run.queued`, `run.started`, `run.checkpointed`, `run.steered` and the
    /// final run events.
    RunEvent { status: RunStatus }
);
transport_event!(
    /// A model request failed transiently and will be tried again.
    RunRetryPending {
        attempt: i32,
        max_attempts: i32,
        delay_ms: i64,
        next_attempt_at: DateTime,
        error: RunError,
    }
);
transport_event!(MessageEvent {
    message_id: ID,
    role: MessageRole
});
transport_event!(PartEvent {
    message_id: ID,
    part_id: ID,
    kind: PartKind,
    text_length: Option<i64>,
});
transport_event!(
    /// Live only: `text` starts at `offset` UTF-16 code units into the part.
    PartDelta {
        message_id: ID,
        part_id: ID,
        offset: i64,
        text: String,
    }
);
transport_event!(ToolEvent {
    tool_call_id: ID,
    tool_name: String
});
transport_event!(InteractionEvent { interaction_id: ID });
transport_event!(UsageUpdated { usage: Usage });
transport_event!(ContextCompacted {
    messages_compacted: i64
});

// The `ty` values repeat by nature; clippy reads them as duplicate attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(Interface)]
#[graphql(
    field(name = "cursor", ty = "&String"),
    field(name = "type", ty = "&String"),
    field(name = "conversation_id", ty = "&ID"),
    field(name = "run_id", ty = "&Option<ID>"),
    field(name = "at", ty = "&DateTime")
)]
pub enum TransportEvent {
    RunEvent(RunEvent),
    RunRetryPending(RunRetryPending),
    MessageEvent(MessageEvent),
    PartEvent(PartEvent),
    PartDelta(PartDelta),
    ToolEvent(ToolEvent),
    InteractionEvent(InteractionEvent),
    UsageUpdated(UsageUpdated),
    ContextCompacted(ContextCompacted),
}

impl From<&Event> for TransportEvent {
    fn from(event: &Event) -> TransportEvent {
        let cursor = event.cursor.to_string();
        let r#type = event.kind.as_str().to_owned();
        let conversation_id = to_id(event.conversation_id);
        let run_id = event.run_id.map(to_id);
        let at = DateTime(event.at);
        macro_rules! build {
            ($variant:ident { $($field:ident : $value:expr),* $(,)? }) => {
                TransportEvent::$variant($variant {
                    cursor,
                    r#type,
                    conversation_id,
                    run_id,
                    at,
                    $($field: $value,)*
                })
            };
        }
        match &event.body {
            EventBody::Run { status } => build!(RunEvent { status: *status }),
            EventBody::RetryPending {
                attempt,
                max_attempts,
                delay_ms,
                next_attempt_at,
                error,
            } => build!(RunRetryPending {
                attempt: *attempt,
                max_attempts: *max_attempts,
                delay_ms: *delay_ms,
                next_attempt_at: DateTime(*next_attempt_at),
                error: error.clone(),
            }),
            EventBody::Message { message_id, role } => build!(MessageEvent {
                message_id: to_id(*message_id),
                role: *role,
            }),
            EventBody::Part {
                message_id,
                part_id,
                kind,
                text_length,
            } => build!(PartEvent {
                message_id: to_id(*message_id),
                part_id: to_id(*part_id),
                kind: *kind,
                text_length: *text_length,
            }),
            EventBody::Delta {
                message_id,
                part_id,
                offset,
                text,
            } => build!(PartDelta {
                message_id: to_id(*message_id),
                part_id: to_id(*part_id),
                offset: *offset,
                text: text.clone(),
            }),
            EventBody::Tool {
                tool_call_id,
                tool_name,
            } => build!(ToolEvent {
                tool_call_id: to_id(*tool_call_id),
                tool_name: tool_name.clone(),
            }),
            EventBody::Interaction { interaction_id } => build!(InteractionEvent {
                interaction_id: to_id(*interaction_id),
            }),
            EventBody::Usage { usage } => build!(UsageUpdated { usage: *usage }),
            EventBody::ContextCompacted { messages_compacted } => build!(ContextCompacted {
                messages_compacted: *messages_compacted,
            }),
        }
    }
}

#[derive(SimpleObject)]
pub struct EventPage {
    pub events: Vec<TransportEvent>,
    pub end_cursor: Option<String>,
    pub has_more: bool,
}
