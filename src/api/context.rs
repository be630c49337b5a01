//! What a resolver can reach: the caller, the store, the configuration, and a
//! per-request read snapshot.

use std::ops::Deref;
use std::sync::Arc;

use async_graphql::Context;
use sea_orm::DatabaseTransaction;
use tokio::sync::OnceCell;

use super::auth::Viewer;
use super::error::{ApiError, ApiResult};
use crate::config::FileConfig;
use crate::store::Store;

/// Shared by every request.
#[derive(Clone)]
pub struct Services {
    pub store: Store,
    pub config: Arc<FileConfig>,
}

/// One read-only transaction per request, begun on first use, so that every
/// field of a query reads the same snapshot.
pub struct RequestSnapshot {
    store: Store,
    tx: OnceCell<DatabaseTransaction>,
}

impl RequestSnapshot {
    pub fn new(store: Store) -> RequestSnapshot {
        RequestSnapshot {
            store,
            tx: OnceCell::new(),
        }
    }
}

/// The request's snapshot, or a snapshot of its own where the request has
/// none (operations over WebSocket).
pub enum Snapshot<'a> {
    Shared(&'a DatabaseTransaction),
    Own(DatabaseTransaction),
}

impl Deref for Snapshot<'_> {
    type Target = DatabaseTransaction;
    fn deref(&self) -> &DatabaseTransaction {
        match self {
            Snapshot::Shared(tx) => tx,
            Snapshot::Own(tx) => tx,
        }
    }
}

pub async fn snapshot<'a>(ctx: &Context<'a>) -> ApiResult<Snapshot<'a>> {
    match ctx.data_opt::<RequestSnapshot>() {
        Some(shared) => {
            let tx = shared
                .tx
                .get_or_try_init(|| shared.store.begin_snapshot())
                .await?;
            Ok(Snapshot::Shared(tx))
        }
        None => Ok(Snapshot::Own(services(ctx).store.begin_snapshot().await?)),
    }
}

pub fn viewer<'a>(ctx: &Context<'a>) -> ApiResult<&'a Viewer> {
    ctx.data::<Viewer>().map_err(|_| {
        tracing::error!("resolver reached without an authenticated viewer");
        ApiError::Internal
    })
}

pub fn services<'a>(ctx: &Context<'a>) -> &'a Services {
    ctx.data_unchecked::<Services>()
}
