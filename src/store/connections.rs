//! Stored connections: one row per tenant, principal and provider, with the
//! granted scopes, the sealed tokens and their expiry. Sealing and opening
//! happen in `crate::connections`; this module only keeps the rows.

use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::OnConflict;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseBackend, DatabaseTransaction, EntityTrait, QueryFilter,
    QueryOrder, Statement, TransactionTrait,
};

use super::entities::connection;
use super::{Error, Result, Store};
use crate::domain::time::{new_id, now_millis};

/// Whose connection, to which provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner<'a> {
    pub tenant: &'a str,
    pub principal: &'a str,
    pub provider: &'a str,
}

/// What a token endpoint granted, sealed for its owner.
#[derive(Clone)]
pub struct Sealed {
    pub scopes: Vec<String>,
    pub access_token: String,
    pub refresh_token: Option<String>,
    pub key_id: String,
    pub expires_at: Option<i64>,
}

/// A connection's refresh, held against every other process's: on
/// PostgreSQL a transaction that holds an advisory lock on the owner until
/// `release`, so that another process's refresh of the same connection
/// waits and then finds the refreshed row (a provider that lets each
/// refresh token be used once would refuse the second). It locks no row:
/// a `disconnect` meanwhile still wins (`save_refreshed`). On SQLite one
/// process owns the database, and the in-process flight is enough.
pub struct RefreshHold(Option<DatabaseTransaction>);

impl RefreshHold {
    pub async fn take(store: &Store, owner: Owner<'_>) -> Result<RefreshHold> {
        let db = store.db();
        if db.get_database_backend() != DatabaseBackend::Postgres {
            return Ok(RefreshHold(None));
        }
        let tx = db.begin().await?;
        // JSON keeps the parts apart and carries no NUL, which text refuses.
        let key = serde_json::json!(["refresh", owner.tenant, owner.principal, owner.provider]);
        let key = key.to_string();
        tx.execute_raw(Statement::from_sql_and_values(
            DatabaseBackend::Postgres,
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
            [key.into()],
        ))
        .await?;
        Ok(RefreshHold(Some(tx)))
    }

    /// Lets the next refresh in. Called on every path: a transaction
    /// dropped instead keeps its lock until its connection is next used.
    pub async fn release(self) {
        if let Some(tx) = self.0
            && let Err(err) = tx.rollback().await
        {
            tracing::warn!(error = %err, "releasing a refresh's lock failed");
        }
    }
}

pub fn scopes_of(row: &connection::Model) -> Result<Vec<String>> {
    serde_json::from_value(row.scopes.clone()).map_err(|e| Error::Corrupt(e.to_string()))
}

pub async fn find<C: ConnectionTrait>(
    db: &C,
    owner: Owner<'_>,
) -> Result<Option<connection::Model>> {
    Ok(connection::Entity::find()
        .filter(connection::Column::Tenant.eq(owner.tenant))
        .filter(connection::Column::Principal.eq(owner.principal))
        .filter(connection::Column::Provider.eq(owner.provider))
        .one(db)
        .await?)
}

/// A principal's connections, by provider name.
pub async fn of_principal<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    principal: &str,
) -> Result<Vec<connection::Model>> {
    Ok(connection::Entity::find()
        .filter(connection::Column::Tenant.eq(tenant))
        .filter(connection::Column::Principal.eq(principal))
        .order_by_asc(connection::Column::Provider)
        .all(db)
        .await?)
}

/// Stores the owner's connection, replacing the one it had.
pub async fn save_in<C: ConnectionTrait>(db: &C, owner: Owner<'_>, sealed: Sealed) -> Result<()> {
    let now = now_millis();
    let scopes = serde_json::to_value(&sealed.scopes).map_err(|e| Error::Corrupt(e.to_string()))?;
    connection::Entity::insert(connection::ActiveModel {
        id: Set(new_id()),
        tenant: Set(owner.tenant.to_owned()),
        principal: Set(owner.principal.to_owned()),
        provider: Set(owner.provider.to_owned()),
        scopes: Set(scopes),
        access_token: Set(sealed.access_token),
        refresh_token: Set(sealed.refresh_token),
        key_id: Set(sealed.key_id),
        expires_at: Set(sealed.expires_at),
        created_at: Set(now),
        updated_at: Set(now),
    })
    .on_conflict(
        OnConflict::columns([
            connection::Column::Tenant,
            connection::Column::Principal,
            connection::Column::Provider,
        ])
        .update_columns([
            connection::Column::Scopes,
            connection::Column::AccessToken,
            connection::Column::RefreshToken,
            connection::Column::KeyId,
            connection::Column::ExpiresAt,
            connection::Column::UpdatedAt,
        ])
        .to_owned(),
    )
    .exec(db)
    .await?;
    Ok(())
}

/// Replaces the tokens of `row` with refreshed ones, only if `row` is still
/// what is stored: a `disconnect` (or a new consent) committed while the
/// refresh was at the provider wins, and the refreshed tokens are dropped.
/// The sealed access token is the row's version: each sealing has a nonce
/// of its own. Returns whether the row was still there to update.
pub async fn save_refreshed(
    store: &Store,
    row: &connection::Model,
    sealed: Sealed,
) -> Result<bool> {
    let scopes = serde_json::to_value(&sealed.scopes).map_err(|e| Error::Corrupt(e.to_string()))?;
    let tx = store.begin_write().await?;
    let updated = connection::Entity::update_many()
        .set(connection::ActiveModel {
            scopes: Set(scopes),
            access_token: Set(sealed.access_token),
            refresh_token: Set(sealed.refresh_token),
            key_id: Set(sealed.key_id),
            expires_at: Set(sealed.expires_at),
            updated_at: Set(now_millis()),
            ..Default::default()
        })
        .filter(connection::Column::Id.eq(row.id))
        .filter(connection::Column::AccessToken.eq(row.access_token.as_str()))
        .exec(&*tx)
        .await?;
    store.commit(tx).await?;
    Ok(updated.rows_affected > 0)
}

/// Deletes the owner's connection; false when there was none.
pub async fn delete(store: &Store, owner: Owner<'_>) -> Result<bool> {
    let tx = store.begin_write().await?;
    let deleted = connection::Entity::delete_many()
        .filter(connection::Column::Tenant.eq(owner.tenant))
        .filter(connection::Column::Principal.eq(owner.principal))
        .filter(connection::Column::Provider.eq(owner.provider))
        .exec(&*tx)
        .await?;
    store.commit(tx).await?;
    Ok(deleted.rows_affected > 0)
}
