use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// A conversation grant (`ALLOW_CONVERSATION`) covers the calls of the
/// principal whose run asked, not everyone's in the conversation: the ones
/// made before carried no principal, and take their run's.
#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared(
                "UPDATE grants SET principal = (\
                   SELECT runs.principal FROM interactions \
                   JOIN runs ON runs.id = interactions.run_id \
                   WHERE interactions.id = grants.interaction_id) \
                 WHERE scope = 'CONVERSATION' AND principal IS NULL",
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared("UPDATE grants SET principal = NULL WHERE scope = 'CONVERSATION'")
            .await?;
        Ok(())
    }
}
