use sea_orm_migration::{prelude::*, schema::*};

use crate::shape::index;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// What operators did across tenants (`resolveToolCall`, `requeueRun`,
/// `cancelRun`): who, when, to what, with their note. Never updated.
#[derive(DeriveIden)]
enum OperatorActions {
    Table,
    Id,
    /// The operator's principal (`sub`).
    Operator,
    Action,
    Tenant,
    RunId,
    ToolCallId,
    Note,
    /// What the action changed, as it was before and after.
    Detail,
    CreatedAt,
}

/// `tether tool-calls --unknown` and the operators' query find calls by
/// status, however many calls there are.
#[derive(DeriveIden)]
enum ToolCalls {
    Table,
    Status,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(OperatorActions::Table)
                    .col(uuid(OperatorActions::Id).primary_key())
                    .col(string(OperatorActions::Operator))
                    .col(string(OperatorActions::Action))
                    .col(string(OperatorActions::Tenant))
                    .col(uuid_null(OperatorActions::RunId))
                    .col(uuid_null(OperatorActions::ToolCallId))
                    .col(text(OperatorActions::Note))
                    .col(json(OperatorActions::Detail))
                    .col(big_integer(OperatorActions::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "operator_actions_run",
                OperatorActions::Table,
                [OperatorActions::RunId],
            ))
            .await?;
        manager
            .create_index(index(
                "tool_calls_status",
                ToolCalls::Table,
                [ToolCalls::Status],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name("tool_calls_status")
                    .table(ToolCalls::Table)
                    .to_owned(),
            )
            .await?;
        manager
            .drop_table(Table::drop().table(OperatorActions::Table).to_owned())
            .await
    }
}
