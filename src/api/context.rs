//! What a resolver can reach: the caller, the store, the configuration, and a
//! per-request read snapshot.

use std::ops::Deref;
use std::sync::Arc;

use async_graphql::extensions::{
    Extension, ExtensionContext, ExtensionFactory, NextPrepareRequest,
};
use async_graphql::parser::types::OperationType;
use async_graphql::{Context, Request, ServerResult};
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

/// Gives every query and mutation its one snapshot, whichever transport
/// carries it, so that `lastCursor` is never older than the messages read
/// beside it. Subscriptions live long and read a snapshot per event instead.
pub struct Snapshots(pub Store);

impl ExtensionFactory for Snapshots {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(Snapshots(self.0.clone()))
    }
}

#[async_trait::async_trait]
impl Extension for Snapshots {
    async fn prepare_request(
        &self,
        ctx: &ExtensionContext<'_>,
        mut request: Request,
        next: NextPrepareRequest<'_>,
    ) -> ServerResult<Request> {
        if operation_type(&mut request) != Some(OperationType::Subscription) {
            request = request.data(RequestSnapshot::new(self.0.clone()));
        }
        next.run(ctx, request).await
    }
}

/// The type of the operation a request would run; `None` when it does not
/// parse or names no operation it has (the executor refuses those).
pub fn operation_type(request: &mut Request) -> Option<OperationType> {
    let name = request.operation_name.clone();
    let document = request.parsed_query().ok()?;
    document
        .operations
        .iter()
        .find(|(op_name, _)| match &name {
            Some(name) => op_name.is_some_and(|n| n.as_str() == name),
            None => true,
        })
        .map(|(_, op)| op.node.ty)
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
