use sea_orm_migration::{prelude::*, schema::*};

use crate::shape::{index, unique_index};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Conversations {
    Table,
    Id,
    Tenant,
    Principal,
    Agent,
    Title,
    CreatedAt,
    EventSeq,
}

#[derive(DeriveIden)]
enum Messages {
    Table,
    Id,
    ConversationId,
    Tenant,
    Role,
    RunId,
    ClientMessageId,
    CreatedAt,
}

#[derive(DeriveIden)]
enum Parts {
    Table,
    Id,
    MessageId,
    ConversationId,
    Tenant,
    Idx,
    Kind,
    State,
    Text,
    Data,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum Runs {
    Table,
    Id,
    ConversationId,
    Tenant,
    Principal,
    Agent,
    TriggerMessageId,
    Status,
    EndCause,
    Error,
    CancelRequested,
    Attempt,
    MaxAttempts,
    NextAttemptAt,
    Steps,
    InputTokens,
    OutputTokens,
    CostUsd,
    CreatedAt,
    StartedAt,
    EndedAt,
    LeaseOwner,
    LeaseEpoch,
    LeaseExpiresAt,
    Recoveries,
}

#[derive(DeriveIden)]
enum Events {
    Table,
    ConversationId,
    Seq,
    Tenant,
    RunId,
    Kind,
    Payload,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Conversations::Table)
                    .col(uuid(Conversations::Id).primary_key())
                    .col(string(Conversations::Tenant))
                    .col(string(Conversations::Principal))
                    .col(string(Conversations::Agent))
                    .col(text_null(Conversations::Title))
                    .col(big_integer(Conversations::CreatedAt))
                    .col(big_integer(Conversations::EventSeq).default(0))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "conversations_tenant_id",
                Conversations::Table,
                [Conversations::Tenant, Conversations::Id],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Messages::Table)
                    .col(uuid(Messages::Id).primary_key())
                    .col(uuid(Messages::ConversationId))
                    .col(string(Messages::Tenant))
                    .col(string(Messages::Role))
                    .col(uuid_null(Messages::RunId))
                    .col(string_null(Messages::ClientMessageId))
                    .col(big_integer(Messages::CreatedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .from(Messages::Table, Messages::ConversationId)
                            .to(Conversations::Table, Conversations::Id),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "messages_conversation_id",
                Messages::Table,
                [Messages::ConversationId, Messages::Id],
            ))
            .await?;
        manager
            .create_index(unique_index(
                "messages_client_message_id",
                Messages::Table,
                [Messages::ConversationId, Messages::ClientMessageId],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Parts::Table)
                    .col(uuid(Parts::Id).primary_key())
                    .col(uuid(Parts::MessageId))
                    .col(uuid(Parts::ConversationId))
                    .col(string(Parts::Tenant))
                    .col(integer(Parts::Idx))
                    .col(string(Parts::Kind))
                    .col(string(Parts::State))
                    .col(text_null(Parts::Text))
                    .col(json_null(Parts::Data))
                    .col(big_integer(Parts::CreatedAt))
                    .col(big_integer(Parts::UpdatedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .from(Parts::Table, Parts::MessageId)
                            .to(Messages::Table, Messages::Id),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "parts_message_idx",
                Parts::Table,
                [Parts::MessageId, Parts::Idx],
            ))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Runs::Table)
                    .col(uuid(Runs::Id).primary_key())
                    .col(uuid(Runs::ConversationId))
                    .col(string(Runs::Tenant))
                    .col(string(Runs::Principal))
                    .col(string(Runs::Agent))
                    .col(uuid(Runs::TriggerMessageId))
                    .col(string(Runs::Status))
                    .col(string_null(Runs::EndCause))
                    .col(json_null(Runs::Error))
                    .col(boolean(Runs::CancelRequested).default(false))
                    .col(integer(Runs::Attempt).default(0))
                    .col(integer(Runs::MaxAttempts))
                    .col(big_integer_null(Runs::NextAttemptAt))
                    .col(integer(Runs::Steps).default(0))
                    .col(big_integer(Runs::InputTokens).default(0))
                    .col(big_integer(Runs::OutputTokens).default(0))
                    .col(double(Runs::CostUsd).default(0.0))
                    .col(big_integer(Runs::CreatedAt))
                    .col(big_integer_null(Runs::StartedAt))
                    .col(big_integer_null(Runs::EndedAt))
                    .col(string_null(Runs::LeaseOwner))
                    .col(big_integer(Runs::LeaseEpoch).default(0))
                    .col(big_integer_null(Runs::LeaseExpiresAt))
                    .col(integer(Runs::Recoveries).default(0))
                    .foreign_key(
                        ForeignKey::create()
                            .from(Runs::Table, Runs::ConversationId)
                            .to(Conversations::Table, Conversations::Id),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "runs_conversation_created",
                Runs::Table,
                [Runs::ConversationId, Runs::Id],
            ))
            .await?;
        manager
            .create_index(index("runs_status", Runs::Table, [Runs::Status]))
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Events::Table)
                    .col(uuid(Events::ConversationId))
                    .col(big_integer(Events::Seq))
                    .col(string(Events::Tenant))
                    .col(uuid_null(Events::RunId))
                    .col(string(Events::Kind))
                    .col(json(Events::Payload))
                    .col(big_integer(Events::CreatedAt))
                    .primary_key(Index::create().col(Events::ConversationId).col(Events::Seq))
                    .foreign_key(
                        ForeignKey::create()
                            .from(Events::Table, Events::ConversationId)
                            .to(Conversations::Table, Conversations::Id),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "events_run",
                Events::Table,
                [Events::RunId, Events::Seq],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            Events::Table.into_iden(),
            Runs::Table.into_iden(),
            Parts::Table.into_iden(),
            Messages::Table.into_iden(),
            Conversations::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).to_owned())
                .await?;
        }
        Ok(())
    }
}
