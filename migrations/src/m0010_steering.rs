use sea_orm_migration::prelude::*;

use crate::shape::{add_column, index};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// Messages sent while a run is active can steer it (`onActiveRun: STEER`):
/// they join the run at its next step boundary, and the run's reply goes on
/// in a new message after them. A message's place among its run's messages
/// is `messages.pos`: the message that started the run 0, its reply 1, then
/// steered messages and replies in the order they joined. A steered
/// message still waiting for its boundary has a place far beyond any joined
/// one (the store's `PENDING_POS` and up), in the order it was sent.
/// `runs.steering` counts the messages waiting to steer a run, so that
/// a step boundary or a run's end looks for them only when there are some;
/// `runs.steered` says some joined it, so that its end looks for those the
/// model never answered.
///
/// A run that a new message interrupts while a worker holds it is asked to
/// stop, not ended under the worker: `runs.cancel_cause` says why a cancel
/// was asked (`INTERRUPTED`; none for `cancelRun`), and the worker ends the
/// run with that cause.
#[derive(DeriveIden)]
enum Messages {
    Table,
    RunId,
    Pos,
}

#[derive(DeriveIden)]
enum Runs {
    Table,
    CancelCause,
    Steering,
    Steered,
}

/// The runs' new columns.
fn run_columns() -> [ColumnDef; 3] {
    [
        ColumnDef::new(Runs::CancelCause).string().null().to_owned(),
        ColumnDef::new(Runs::Steering)
            .integer()
            .not_null()
            .default(0)
            .to_owned(),
        ColumnDef::new(Runs::Steered)
            .boolean()
            .not_null()
            .default(false)
            .to_owned(),
    ]
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        add_column(
            manager,
            Messages::Table,
            ColumnDef::new(Messages::Pos)
                .big_integer()
                .not_null()
                .default(0)
                .to_owned(),
        )
        .await?;
        // Until now every run had one message from a person and one reply.
        let db = manager.get_connection();
        db.execute_unprepared("UPDATE messages SET pos = 1 WHERE role = 'ASSISTANT'")
            .await?;
        for column in run_columns() {
            add_column(manager, Runs::Table, column).await?;
        }
        // A run's messages by place: its reply (the last one), the steered
        // messages waiting for it. Replaces m0007's `(run_id)`.
        manager
            .create_index(index(
                "messages_run_pos",
                Messages::Table,
                [Messages::RunId, Messages::Pos],
            ))
            .await?;
        manager
            .drop_index(
                Index::drop()
                    .name("messages_run")
                    .table(Messages::Table)
                    .to_owned(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_index(index("messages_run", Messages::Table, [Messages::RunId]))
            .await?;
        manager
            .drop_index(
                Index::drop()
                    .name("messages_run_pos")
                    .table(Messages::Table)
                    .to_owned(),
            )
            .await?;
        // One column a statement: SQLite alters one at a time.
        let columns = run_columns().map(|c| (Runs::Table.into_iden(), c.get_column_name()));
        let pos = (Messages::Table.into_iden(), Messages::Pos.to_string());
        for (table, column) in columns.into_iter().chain([pos]) {
            manager
                .alter_table(
                    Table::alter()
                        .table(table)
                        .drop_column(Alias::new(column))
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }
}
