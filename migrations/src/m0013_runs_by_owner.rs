use sea_orm_migration::prelude::*;

use crate::shape::index;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// A principal's runs by status: the runs of a principal waiting to run
/// (`sendMessage`'s cap) and whose run a pause belongs to, without scanning
/// every tenant's runs of that status. Led by the principal, so that no
/// query without one (a conversation's active run) is planned on it.
#[derive(DeriveIden)]
enum Runs {
    Table,
    Tenant,
    Principal,
    Status,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_index(index(
                "runs_owner_status",
                Runs::Table,
                [Runs::Principal, Runs::Status, Runs::Tenant],
            ))
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name("runs_owner_status")
                    .table(Runs::Table)
                    .to_owned(),
            )
            .await
    }
}
