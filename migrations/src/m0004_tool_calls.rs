use sea_orm_migration::{prelude::*, schema::*};

use crate::shape::{add_column, index, unique_index};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// Tool calls: each one a durable fact from the moment the model asks for
/// it, and the idempotency record of its effect (unique key, recorded
/// result).
#[derive(DeriveIden)]
enum ToolCalls {
    Table,
    Id,
    Tenant,
    ConversationId,
    RunId,
    PartId,
    Step,
    Idx,
    /// The model's own id for the call (`toolu_…`, `call_…`).
    ProviderCallId,
    Name,
    /// The input as the model sent it (what its history shows).
    ModelInput,
    /// The validated, normalized input (what runs); absent when invalid.
    Input,
    Status,
    Outcome,
    Attempt,
    /// The output as the model and clients see it (truncated when large).
    Output,
    /// The whole output, kept when `Output` was truncated.
    FullOutput,
    OutputTruncated,
    IdempotencyKey,
    CreatedAt,
    StartedAt,
    EndedAt,
}

#[derive(DeriveIden)]
enum Parts {
    Table,
    /// Which step of its run wrote the part.
    Step,
}

#[derive(DeriveIden)]
enum Runs {
    Table,
    /// Which limit or stop condition ended the run, in words.
    EndReason,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ToolCalls::Table)
                    .col(uuid(ToolCalls::Id).primary_key())
                    .col(string(ToolCalls::Tenant))
                    .col(uuid(ToolCalls::ConversationId))
                    .col(uuid(ToolCalls::RunId))
                    .col(uuid(ToolCalls::PartId))
                    .col(integer(ToolCalls::Step))
                    .col(integer(ToolCalls::Idx))
                    .col(string(ToolCalls::ProviderCallId))
                    .col(string(ToolCalls::Name))
                    .col(json(ToolCalls::ModelInput))
                    .col(json_null(ToolCalls::Input))
                    .col(string(ToolCalls::Status))
                    .col(string_null(ToolCalls::Outcome))
                    .col(integer(ToolCalls::Attempt))
                    .col(json_null(ToolCalls::Output))
                    .col(text_null(ToolCalls::FullOutput))
                    .col(boolean(ToolCalls::OutputTruncated))
                    .col(string(ToolCalls::IdempotencyKey))
                    .col(big_integer(ToolCalls::CreatedAt))
                    .col(big_integer_null(ToolCalls::StartedAt))
                    .col(big_integer_null(ToolCalls::EndedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "tool_calls_run",
                ToolCalls::Table,
                [ToolCalls::RunId, ToolCalls::Step, ToolCalls::Idx],
            ))
            .await?;
        manager
            .create_index(unique_index(
                "tool_calls_idempotency_key",
                ToolCalls::Table,
                [ToolCalls::IdempotencyKey],
            ))
            .await?;
        manager
            .create_index(unique_index(
                "tool_calls_part",
                ToolCalls::Table,
                [ToolCalls::PartId],
            ))
            .await?;
        add_column(
            manager,
            Parts::Table,
            integer(Parts::Step).default(0).to_owned(),
        )
        .await?;
        add_column(manager, Runs::Table, text_null(Runs::EndReason)).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ToolCalls::Table).to_owned())
            .await
    }
}
