use sea_orm_migration::{prelude::*, schema::*};

use crate::shape::{index, unique_index};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// A principal's account at another service, one per tenant, principal and
/// provider. Tokens are sealed (AES-256-GCM, bound to the row's tenant,
/// principal and provider); `KeyId` names the key that sealed them.
#[derive(DeriveIden)]
enum Connections {
    Table,
    Id,
    Tenant,
    Principal,
    Provider,
    /// Granted scopes, a JSON array.
    Scopes,
    AccessToken,
    RefreshToken,
    KeyId,
    /// When the access token stops working; null when the server did not
    /// say.
    ExpiresAt,
    CreatedAt,
    UpdatedAt,
}

/// An OAuth authorization request on its way: the random `state` the
/// person's browser carries back, bound to the tenant, principal and
/// interaction, and the sealed PKCE verifier that never leaves the server.
#[derive(DeriveIden)]
enum Consents {
    Table,
    State,
    InteractionId,
    Tenant,
    Principal,
    Provider,
    Verifier,
    KeyId,
    CreatedAt,
}

#[derive(DeriveIden)]
enum Interactions {
    Table,
    ToolCallId,
    Kind,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Connections::Table)
                    .col(uuid(Connections::Id).primary_key())
                    .col(string(Connections::Tenant))
                    .col(string(Connections::Principal))
                    .col(string(Connections::Provider))
                    .col(json(Connections::Scopes))
                    .col(text(Connections::AccessToken))
                    .col(text_null(Connections::RefreshToken))
                    .col(string(Connections::KeyId))
                    .col(big_integer_null(Connections::ExpiresAt))
                    .col(big_integer(Connections::CreatedAt))
                    .col(big_integer(Connections::UpdatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "connections_owner",
                Connections::Table,
                [
                    Connections::Tenant,
                    Connections::Principal,
                    Connections::Provider,
                ],
            ))
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Consents::Table)
                    .col(string(Consents::State).primary_key())
                    .col(uuid(Consents::InteractionId))
                    .col(string(Consents::Tenant))
                    .col(string(Consents::Principal))
                    .col(string(Consents::Provider))
                    .col(text(Consents::Verifier))
                    .col(string(Consents::KeyId))
                    .col(big_integer(Consents::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(index(
                "consents_interaction",
                Consents::Table,
                [Consents::InteractionId],
            ))
            .await?;
        // A call gated by an approval may also wait for a connection: one
        // interaction per call and kind.
        manager
            .drop_index(
                Index::drop()
                    .name("interactions_tool_call")
                    .table(Interactions::Table)
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "interactions_tool_call_kind",
                Interactions::Table,
                [Interactions::ToolCallId, Interactions::Kind],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name("interactions_tool_call_kind")
                    .table(Interactions::Table)
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(unique_index(
                "interactions_tool_call",
                Interactions::Table,
                [Interactions::ToolCallId],
            ))
            .await?;
        manager
            .drop_table(Table::drop().table(Consents::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(Connections::Table).to_owned())
            .await
    }
}
