//! What a resolver can reach: the caller, the store, the configuration, and a
//! per-request read snapshot.

use std::collections::HashMap;
use std::sync::Arc;

use async_graphql::dataloader::{DataLoader, Loader};
use async_graphql::extensions::{
    Extension, ExtensionContext, ExtensionFactory, NextPrepareRequest,
};
use async_graphql::parser::types::OperationType;
use async_graphql::{Context, Request, ServerResult};
use futures_util::future::BoxFuture;
use sea_orm::DatabaseTransaction;
use tokio::sync::OnceCell;
use uuid::Uuid;

use super::admission::operation_type;
use super::auth::Viewer;
use super::error::{ApiError, ApiResult};
use crate::config::FileConfig;
use crate::connections::Connections;
use crate::store::entities::{interaction, tool_call};
use crate::store::{self, Store, reads};

/// Shared by every request.
#[derive(Clone)]
pub struct Services {
    pub store: Store,
    pub config: Arc<FileConfig>,
    pub connections: Arc<Connections>,
    /// One permit per subscription being served (`api.max_subscriptions`).
    pub subscriptions: Arc<tokio::sync::Semaphore>,
    /// Set when the process starts draining (SIGTERM): `/readyz` answers
    /// not-ready from then on.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    /// How often each principal and tenant may start work.
    pub rates: Arc<super::rates::Rates>,
    /// What each principal and tenant may hold at once.
    pub quotas: Arc<super::quotas::Quotas>,
}

impl Services {
    pub fn new(store: Store, config: Arc<FileConfig>, connections: Arc<Connections>) -> Services {
        let subscriptions = Arc::new(tokio::sync::Semaphore::new(config.api.max_subscriptions));
        Services {
            rates: Arc::new(super::rates::Rates::new(&config.api)),
            quotas: Arc::new(super::quotas::Quotas::new(&config.api)),
            store,
            config,
            connections,
            subscriptions,
            draining: Arc::default(),
        }
    }
}

/// One read-only transaction per request, begun on first use, so that every
/// field of a query reads the same snapshot; the request's batched look-ups
/// read through it too.
pub struct RequestSnapshot {
    shared: Arc<SharedSnapshot>,
    by_part: DataLoader<PartLoader>,
    /// Bytes of `ToolCall.fullOutput` the response may still carry.
    full_output_left: std::sync::atomic::AtomicUsize,
}

struct SharedSnapshot {
    store: Store,
    tx: OnceCell<DatabaseTransaction>,
}

impl SharedSnapshot {
    async fn tx(&self) -> ApiResult<&DatabaseTransaction> {
        Ok(self
            .tx
            .get_or_try_init(|| self.store.begin_snapshot())
            .await?)
    }
}

impl RequestSnapshot {
    pub fn new(store: Store, full_output_bytes: usize) -> RequestSnapshot {
        let shared = Arc::new(SharedSnapshot {
            store,
            tx: OnceCell::new(),
        });
        RequestSnapshot {
            by_part: DataLoader::new(
                PartLoader {
                    snapshot: shared.clone(),
                },
                tokio::spawn,
            ),
            shared,
            full_output_left: full_output_bytes.into(),
        }
    }

    /// Takes up to `wanted` bytes of the response's `fullOutput` budget;
    /// returns how many it got.
    fn take_full_output(&self, wanted: usize) -> usize {
        use std::sync::atomic::Ordering;
        let taken =
            self.full_output_left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                    Some(left.saturating_sub(wanted))
                });
        let left = taken.unwrap_or_default();
        left.min(wanted)
    }
}

/// How much of a `fullOutput` of `wanted` bytes this response may carry:
/// all of it while the response's budget (`api.max_full_output_bytes_per_response`)
/// lasts, then less, then nothing.
pub fn full_output_allowance(ctx: &Context<'_>, wanted: usize) -> ApiResult<usize> {
    Ok(request_snapshot(ctx)?.take_full_output(wanted))
}

/// What a part shows, read for every part of a request at once.
pub trait ShownByPart: Default + Clone + Eq + std::hash::Hash + Send + Sync + 'static {
    type Row: Clone + Send + Sync + 'static;
    fn read<'a>(
        db: &'a DatabaseTransaction,
        tenant: &'a str,
        parts: &'a [Uuid],
    ) -> BoxFuture<'a, store::Result<HashMap<Uuid, Self::Row>>>;
}

/// A marker for what a part shows, with `$read` as its batched read.
macro_rules! part_marker {
    ($(#[$doc:meta])* $name:ident: $row:ty = $read:path) => {
        $(#[$doc])*
        #[derive(Default, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name;

        impl ShownByPart for $name {
            type Row = $row;
            fn read<'a>(
                db: &'a DatabaseTransaction,
                tenant: &'a str,
                parts: &'a [Uuid],
            ) -> BoxFuture<'a, store::Result<HashMap<Uuid, $row>>> {
                Box::pin($read(db, tenant, parts))
            }
        }
    };
}

part_marker!(
    /// The tool call of a `TOOL_CALL` part.
    ToolCallOfPart: tool_call::Model = reads::tool_calls_of_parts
);
part_marker!(
    /// The interaction of a `QUESTION` or `APPROVAL` part.
    InteractionOfPart: interaction::Model = reads::interactions_of_parts
);

/// A part of a tenant: the tenant travels with the key, so a batch reads
/// each tenant's rows only for that tenant.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PartKey<S> {
    tenant: Arc<str>,
    part: Uuid,
    shown: S,
}

pub struct PartLoader {
    snapshot: Arc<SharedSnapshot>,
}

impl<S: ShownByPart> Loader<PartKey<S>> for PartLoader {
    type Value = S::Row;
    type Error = ApiError;

    async fn load(&self, keys: &[PartKey<S>]) -> ApiResult<HashMap<PartKey<S>, S::Row>> {
        let db = self.snapshot.tx().await?;
        let mut by_tenant: HashMap<&Arc<str>, Vec<Uuid>> = HashMap::new();
        for key in keys {
            by_tenant.entry(&key.tenant).or_default().push(key.part);
        }
        let mut found = HashMap::with_capacity(keys.len());
        for (tenant, parts) in by_tenant {
            for (part, row) in S::read(db, tenant, &parts).await? {
                let key = PartKey {
                    tenant: tenant.clone(),
                    part,
                    shown: S::default(),
                };
                found.insert(key, row);
            }
        }
        Ok(found)
    }
}

/// What a part shows, batched with the request's other parts.
pub async fn shown_by_part<S: ShownByPart>(
    ctx: &Context<'_>,
    shown: S,
    part: Uuid,
) -> ApiResult<Option<S::Row>> {
    let key = PartKey {
        tenant: Arc::from(viewer(ctx)?.tenant.as_str()),
        part,
        shown,
    };
    request_snapshot(ctx)?.by_part.load_one(key).await
}

/// Gives every query and mutation its one snapshot, whichever transport
/// carries it, so that `lastCursor` is never older than the messages read
/// beside it. Subscriptions live long and read a snapshot per event instead.
/// The second field is the response's `fullOutput` budget, in bytes.
pub struct Snapshots(pub Store, pub usize);

impl ExtensionFactory for Snapshots {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(Snapshots(self.0.clone(), self.1))
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
            request = request.data(RequestSnapshot::new(self.0.clone(), self.1));
        }
        next.run(ctx, request).await
    }
}

/// The request's snapshot. Every query and mutation has one (`Snapshots`);
/// a resolver reached without it (a subscription reading the database) is
/// refused rather than served from a second, unrelated snapshot.
pub async fn snapshot<'a>(ctx: &Context<'a>) -> ApiResult<&'a DatabaseTransaction> {
    request_snapshot(ctx)?.shared.tx().await
}

fn request_snapshot<'a>(ctx: &Context<'a>) -> ApiResult<&'a RequestSnapshot> {
    ctx.data::<RequestSnapshot>().map_err(|_| {
        tracing::error!("resolver reached without a request snapshot");
        ApiError::Internal
    })
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
