use sea_orm_migration::{prelude::*, schema::*};

use crate::shape::index;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// Summaries that stand in for older messages in the model's history (the
/// messages themselves stay).
#[derive(DeriveIden)]
enum Summaries {
    Table,
    Id,
    ConversationId,
    Tenant,
    RunId,
    ThroughMessageId,
    MessagesCompacted,
    Text,
    InputTokens,
    OutputTokens,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Summaries::Table)
                    .col(uuid(Summaries::Id).primary_key())
                    .col(uuid(Summaries::ConversationId))
                    .col(string(Summaries::Tenant))
                    .col(uuid(Summaries::RunId))
                    .col(uuid(Summaries::ThroughMessageId))
                    .col(integer(Summaries::MessagesCompacted))
                    .col(text(Summaries::Text))
                    .col(big_integer(Summaries::InputTokens))
                    .col(big_integer(Summaries::OutputTokens))
                    .col(big_integer(Summaries::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "summaries_conversation",
                Summaries::Table,
                [Summaries::ConversationId, Summaries::Id],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Summaries::Table).to_owned())
            .await
    }
}
