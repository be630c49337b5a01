use sea_orm_migration::prelude::*;

use crate::shape::{add_column, index, unique_index};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// Runs of a conversation are ordered by a sequence number allocated under
/// the conversation's lock (`conversations.run_seq`), not by their UUID v7
/// ids, which each process makes from its own clock: a process whose clock
/// runs behind could otherwise create a run that sorts before one already
/// claimed. Messages and summaries carry the number of the run they belong
/// to, so that the model's history follows the same order.
///
/// Existing runs are numbered in id order, the order they had until now.
#[derive(DeriveIden)]
enum Conversations {
    Table,
    RunSeq,
}

#[derive(DeriveIden)]
enum Runs {
    Table,
    ConversationId,
    Status,
    Seq,
}

#[derive(DeriveIden)]
enum Messages {
    Table,
    ConversationId,
    RunSeq,
}

#[derive(DeriveIden)]
enum Summaries {
    Table,
    ConversationId,
    RunSeq,
}

fn seq_column<C: IntoIden>(name: C) -> ColumnDef {
    ColumnDef::new(name)
        .big_integer()
        .not_null()
        .default(0)
        .to_owned()
}

/// What the new columns hold for the rows already there.
const BACKFILL: [&str; 4] = [
    "UPDATE runs SET seq = numbered.n FROM (\
       SELECT id, ROW_NUMBER() OVER (PARTITION BY conversation_id ORDER BY id) AS n FROM runs\
     ) AS numbered WHERE runs.id = numbered.id",
    "UPDATE conversations SET run_seq = COALESCE(\
       (SELECT MAX(seq) FROM runs WHERE runs.conversation_id = conversations.id), 0)",
    "UPDATE messages SET run_seq = COALESCE(\
       (SELECT seq FROM runs WHERE runs.id = messages.run_id), 0)",
    "UPDATE summaries SET run_seq = COALESCE(\
       (SELECT seq FROM runs WHERE runs.id = summaries.run_id), 0)",
];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        add_column(
            manager,
            Conversations::Table,
            seq_column(Conversations::RunSeq),
        )
        .await?;
        add_column(manager, Runs::Table, seq_column(Runs::Seq)).await?;
        add_column(manager, Messages::Table, seq_column(Messages::RunSeq)).await?;
        add_column(manager, Summaries::Table, seq_column(Summaries::RunSeq)).await?;
        let db = manager.get_connection();
        for sql in BACKFILL {
            db.execute_unprepared(sql).await?;
        }
        manager
            .create_index(unique_index(
                "runs_conversation_seq",
                Runs::Table,
                [Runs::ConversationId, Runs::Seq],
            ))
            .await?;
        // Replaces m0007's `(conversation_id, status, id)`: a claim and
        // `Conversation.activeRun` now look for unended runs by number.
        manager
            .drop_index(
                Index::drop()
                    .name("runs_conversation_status")
                    .table(Runs::Table)
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "runs_conversation_status_seq",
                Runs::Table,
                [Runs::ConversationId, Runs::Status, Runs::Seq],
            ))
            .await?;
        manager
            .create_index(index(
                "messages_conversation_run_seq",
                Messages::Table,
                [Messages::ConversationId, Messages::RunSeq],
            ))
            .await?;
        manager
            .create_index(index(
                "summaries_conversation_run_seq",
                Summaries::Table,
                [Summaries::ConversationId, Summaries::RunSeq],
            ))
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for (name, table) in [
            (
                "summaries_conversation_run_seq",
                Summaries::Table.into_iden(),
            ),
            ("messages_conversation_run_seq", Messages::Table.into_iden()),
            ("runs_conversation_status_seq", Runs::Table.into_iden()),
            ("runs_conversation_seq", Runs::Table.into_iden()),
        ] {
            manager
                .drop_index(Index::drop().name(name).table(table).to_owned())
                .await?;
        }
        for (table, column) in [
            (Summaries::Table.into_iden(), Summaries::RunSeq.into_iden()),
            (Messages::Table.into_iden(), Messages::RunSeq.into_iden()),
            (Runs::Table.into_iden(), Runs::Seq.into_iden()),
            (
                Conversations::Table.into_iden(),
                Conversations::RunSeq.into_iden(),
            ),
        ] {
            manager
                .alter_table(Table::alter().table(table).drop_column(column).to_owned())
                .await?;
        }
        manager
            .create_index(index(
                "runs_conversation_status",
                Runs::Table,
                [
                    Runs::ConversationId.into_iden(),
                    Runs::Status.into_iden(),
                    Alias::new("id").into_iden(),
                ],
            ))
            .await
    }
}
