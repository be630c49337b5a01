use sea_orm_migration::{prelude::*, schema::*};

use crate::shape::{add_column, index};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Runs {
    Table,
    ActiveMs,
    ClaimedAt,
}

#[derive(DeriveIden)]
enum Parts {
    Table,
    RunId,
    Abandoned,
}

#[derive(DeriveIden)]
enum RunAudit {
    Table,
    RunId,
    Tenant,
    ConversationId,
    Status,
    EndCause,
    Steps,
    InputTokens,
    OutputTokens,
    CostUsd,
    ActiveMs,
    Recoveries,
    EndedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // Time spent RUNNING before the current claim, for the run's
        // timeout; and when the current claim began.
        add_column(
            manager,
            Runs::Table,
            big_integer(Runs::ActiveMs).default(0).to_owned(),
        )
        .await?;
        add_column(manager, Runs::Table, big_integer_null(Runs::ClaimedAt)).await?;
        // Which run wrote a part, and whether its text was abandoned (an
        // attempt cut off by a crash or a shutdown): shown, never sent to the
        // model again.
        add_column(manager, Parts::Table, uuid_null(Parts::RunId)).await?;
        add_column(
            manager,
            Parts::Table,
            boolean(Parts::Abandoned).default(false).to_owned(),
        )
        .await?;
        manager
            .create_index(index("parts_run", Parts::Table, [Parts::RunId]))
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(RunAudit::Table)
                    .col(uuid(RunAudit::RunId).primary_key())
                    .col(string(RunAudit::Tenant))
                    .col(uuid(RunAudit::ConversationId))
                    .col(string(RunAudit::Status))
                    .col(string(RunAudit::EndCause))
                    .col(integer(RunAudit::Steps))
                    .col(big_integer(RunAudit::InputTokens))
                    .col(big_integer(RunAudit::OutputTokens))
                    .col(double(RunAudit::CostUsd))
                    .col(big_integer(RunAudit::ActiveMs))
                    .col(integer(RunAudit::Recoveries))
                    .col(big_integer(RunAudit::EndedAt))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(RunAudit::Table).to_owned())
            .await?;
        for column in [Parts::Abandoned, Parts::RunId] {
            manager
                .alter_table(
                    Table::alter()
                        .table(Parts::Table)
                        .drop_column(column)
                        .to_owned(),
                )
                .await?;
        }
        for column in [Runs::ClaimedAt, Runs::ActiveMs] {
            manager
                .alter_table(
                    Table::alter()
                        .table(Runs::Table)
                        .drop_column(column)
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }
}
