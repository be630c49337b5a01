use sea_orm_migration::prelude::*;

use crate::shape::index;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// Indexes for reads that otherwise scan: every step and every commit of a
/// run finds its assistant message by run; a model's history and the API's
/// `Part.question` / `approval` / `connection` find interactions by part;
/// a claim (a run waits for the earlier unended runs of its conversation)
/// and `Conversation.activeRun` look for unended runs of one conversation,
/// however many ended runs it has.
#[derive(DeriveIden)]
enum Messages {
    Table,
    RunId,
}

#[derive(DeriveIden)]
enum Interactions {
    Table,
    PartId,
}

#[derive(DeriveIden)]
enum Runs {
    Table,
    ConversationId,
    Status,
    Id,
}

const INDEXES: [&str; 3] = [
    "messages_run",
    "interactions_part",
    "runs_conversation_status",
];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_index(index("messages_run", Messages::Table, [Messages::RunId]))
            .await?;
        manager
            .create_index(index(
                "interactions_part",
                Interactions::Table,
                [Interactions::PartId],
            ))
            .await?;
        manager
            .create_index(index(
                "runs_conversation_status",
                Runs::Table,
                [Runs::ConversationId, Runs::Status, Runs::Id],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let tables = [
            Messages::Table.into_iden(),
            Interactions::Table.into_iden(),
            Runs::Table.into_iden(),
        ];
        for (name, table) in INDEXES.into_iter().zip(tables) {
            manager
                .drop_index(Index::drop().name(name).table(table).to_owned())
                .await?;
        }
        Ok(())
    }
}
