//! Pending interactions (questions, approvals, consents) closed inside a
//! caller's transaction, each announced with its kind's resolving event.

use sea_orm::{ColumnTrait, EntityTrait, QueryFilter};
use uuid::Uuid;

use super::WriteTx;
use crate::domain::event::{EventBody, EventKind, NewEvent};
use crate::domain::interaction::{InteractionKind, InteractionStatus};
use crate::domain::time::now_millis;
use crate::store::entities::{interaction, run};
use crate::store::{Result, parse_stored};

pub(in crate::store) fn interaction_event(
    kind: EventKind,
    run_id: Uuid,
    interaction_id: Uuid,
) -> NewEvent {
    NewEvent {
        kind,
        run_id: Some(run_id),
        body: EventBody::Interaction { interaction_id },
    }
}

pub fn kind_of(row: &interaction::Model) -> Result<InteractionKind> {
    parse_stored(&row.kind, "interaction kind")
}

/// Closes the pending interactions of an ending run (`CANCELLED`), each
/// announced with its kind's resolving event, so a client drops its card.
pub(in crate::store) async fn cancel_pending(
    tx: &WriteTx,
    row: &run::Model,
) -> Result<Vec<NewEvent>> {
    cancel_where(tx, interaction::Column::RunId.eq(row.id)).await
}

/// The pending interactions `which` selects.
pub(in crate::store) fn pending_where(
    which: sea_orm::sea_query::SimpleExpr,
) -> sea_orm::Select<interaction::Entity> {
    interaction::Entity::find()
        .filter(which)
        .filter(interaction::Column::Status.eq(InteractionStatus::Pending.as_str()))
}

/// Cancels the pending interactions `which` selects, with their events.
/// The caller holds their conversation's lock, so none is resolved
/// meanwhile.
pub(in crate::store) async fn cancel_where(
    tx: &WriteTx,
    which: sea_orm::sea_query::SimpleExpr,
) -> Result<Vec<NewEvent>> {
    let pending = pending_where(which).all(&**tx).await?;
    if pending.is_empty() {
        return Ok(Vec::new());
    }
    close_pending(
        tx,
        interaction::Column::Id.is_in(pending.iter().map(|row| row.id)),
        InteractionStatus::Cancelled,
    )
    .await?;
    pending
        .iter()
        .map(|row| {
            Ok(interaction_event(
                resolving_event(kind_of(row)?),
                row.run_id,
                row.id,
            ))
        })
        .collect()
}

/// Moves the pending interactions `which` selects to `to`; returns how many
/// moved.
pub(in crate::store) async fn close_pending(
    tx: &WriteTx,
    which: sea_orm::sea_query::SimpleExpr,
    to: InteractionStatus,
) -> Result<u64> {
    let closed = interaction::Entity::update_many()
        .col_expr(
            interaction::Column::Status,
            sea_orm::sea_query::Expr::value(to.as_str()),
        )
        .col_expr(
            interaction::Column::ResolvedAt,
            sea_orm::sea_query::Expr::value(now_millis()),
        )
        .filter(which)
        .filter(interaction::Column::Status.eq(InteractionStatus::Pending.as_str()))
        .exec(&**tx)
        .await?;
    Ok(closed.rows_affected)
}

pub(in crate::store) fn resolving_event(kind: InteractionKind) -> EventKind {
    match kind {
        InteractionKind::Question => EventKind::QuestionAnswered,
        InteractionKind::Approval => EventKind::ApprovalDecided,
        InteractionKind::Connection => EventKind::ConnectionCompleted,
    }
}
