use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// An operator's action records who vouched for the operator (the token's
/// `iss`) beside its principal: a `sub` alone names no one across identity
/// providers.
#[derive(DeriveIden)]
enum OperatorActions {
    Table,
    Issuer,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(OperatorActions::Table)
                    .add_column(string_null(OperatorActions::Issuer))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(OperatorActions::Table)
                    .drop_column(OperatorActions::Issuer)
                    .to_owned(),
            )
            .await
    }
}
