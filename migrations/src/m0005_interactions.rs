use sea_orm_migration::{prelude::*, schema::*};

use crate::shape::{index, unique_index};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// What a run asks of a person (questions, approvals), resolved once.
#[derive(DeriveIden)]
enum Interactions {
    Table,
    Id,
    Tenant,
    ConversationId,
    RunId,
    ToolCallId,
    PartId,
    Kind,
    Status,
    /// Question specs, or what an approval would run.
    Request,
    /// Answers, or the decision.
    Resolution,
    /// Who resolved it (the audit of a decision: who, when, what).
    ResolvedBy,
    CreatedAt,
    ExpiresAt,
    ResolvedAt,
    /// When a worker took the resolution into its run (compare-and-set:
    /// a decision is acted on once).
    ClaimedAt,
}

/// Standing permissions to run a gated tool without asking.
#[derive(DeriveIden)]
enum Grants {
    Table,
    Id,
    Tenant,
    /// `CONVERSATION` or `ALWAYS`.
    Scope,
    ConversationId,
    Principal,
    Tool,
    InteractionId,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Interactions::Table)
                    .col(uuid(Interactions::Id).primary_key())
                    .col(string(Interactions::Tenant))
                    .col(uuid(Interactions::ConversationId))
                    .col(uuid(Interactions::RunId))
                    .col(uuid(Interactions::ToolCallId))
                    .col(uuid(Interactions::PartId))
                    .col(string(Interactions::Kind))
                    .col(string(Interactions::Status))
                    .col(json(Interactions::Request))
                    .col(json_null(Interactions::Resolution))
                    .col(string_null(Interactions::ResolvedBy))
                    .col(big_integer(Interactions::CreatedAt))
                    .col(big_integer(Interactions::ExpiresAt))
                    .col(big_integer_null(Interactions::ResolvedAt))
                    .col(big_integer_null(Interactions::ClaimedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "interactions_run",
                Interactions::Table,
                [Interactions::RunId, Interactions::Id],
            ))
            .await?;
        manager
            .create_index(index(
                "interactions_due",
                Interactions::Table,
                [Interactions::Status, Interactions::ExpiresAt],
            ))
            .await?;
        manager
            .create_index(unique_index(
                "interactions_tool_call",
                Interactions::Table,
                [Interactions::ToolCallId],
            ))
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Grants::Table)
                    .col(uuid(Grants::Id).primary_key())
                    .col(string(Grants::Tenant))
                    .col(string(Grants::Scope))
                    .col(uuid_null(Grants::ConversationId))
                    .col(string_null(Grants::Principal))
                    .col(string(Grants::Tool))
                    .col(uuid(Grants::InteractionId))
                    .col(big_integer(Grants::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "grants_tool",
                Grants::Table,
                [Grants::Tenant, Grants::Tool],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Grants::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(Interactions::Table).to_owned())
            .await
    }
}
