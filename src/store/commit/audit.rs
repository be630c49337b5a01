//! The record of an operator's action, written in the transaction of the
//! change it made.

use sea_orm::ActiveModelTrait;
use sea_orm::ActiveValue::Set;
use serde_json::Value;
use uuid::Uuid;

use super::WriteTx;
use crate::domain::time::{new_id, now_millis};
use crate::store::Result;
use crate::store::entities::operator_action;

/// Who the operator is: their principal, and who vouches for it.
#[derive(Debug, Clone, Copy)]
pub struct Operator<'a> {
    pub principal: &'a str,
    pub issuer: Option<&'a str>,
}

/// What an operator did, to what, and why.
#[derive(Debug, Clone)]
pub struct OperatorAction<'a> {
    pub operator: Operator<'a>,
    pub action: &'static str,
    pub tenant: &'a str,
    pub run_id: Option<Uuid>,
    pub tool_call_id: Option<Uuid>,
    pub note: &'a str,
    /// The change, as it was before and after.
    pub detail: Value,
}

pub(in crate::store) async fn record(tx: &WriteTx, action: OperatorAction<'_>) -> Result<()> {
    operator_action::ActiveModel {
        id: Set(new_id()),
        operator: Set(action.operator.principal.to_owned()),
        issuer: Set(action.operator.issuer.map(str::to_owned)),
        action: Set(action.action.to_owned()),
        tenant: Set(action.tenant.to_owned()),
        run_id: Set(action.run_id),
        tool_call_id: Set(action.tool_call_id),
        note: Set(action.note.to_owned()),
        detail: Set(action.detail),
        created_at: Set(now_millis()),
    }
    .insert(&**tx)
    .await?;
    Ok(())
}
