use async_graphql::{Context, ID, Subscription};
use futures_util::{Stream, StreamExt};
use tokio::sync::OwnedSemaphorePermit;

use super::context::{services, viewer};
use super::error::{ApiError, ApiResult};
use super::events::TransportEvent;
use super::feed::{FeedRequest, follow};
use super::query::parse_cursor;
use super::types::parse_id;
use crate::store::reads;

pub struct Subscription;

type EventStream = std::pin::Pin<Box<dyn Stream<Item = ApiResult<TransportEvent>> + Send>>;

/// The subscription's permit (`api.max_subscriptions`), held for as long as
/// it is served.
fn permit(ctx: &Context<'_>) -> ApiResult<OwnedSemaphorePermit> {
    services(ctx)
        .subscriptions
        .clone()
        .try_acquire_owned()
        .map_err(|_| {
            ApiError::Unavailable(
                "the server is serving as many subscriptions as it may; try again later".into(),
            )
        })
}

fn to_transport(
    stream: impl Stream<Item = crate::store::Result<std::sync::Arc<crate::domain::event::Event>>>
    + Send
    + 'static,
    permit: OwnedSemaphorePermit,
) -> EventStream {
    stream
        .map(move |item| {
            let _held = &permit;
            item.map(|event| TransportEvent::from(&*event))
                .map_err(ApiError::from)
        })
        .boxed()
}

#[Subscription]
impl Subscription {
    /// Every persisted event after `after`, exactly once and in order, then
    /// live events. Without `after`, starts live.
    async fn conversation_events(
        &self,
        ctx: &Context<'_>,
        conversation_id: ID,
        after: Option<String>,
    ) -> Result<EventStream, ApiError> {
        let after = after.as_deref().map(parse_cursor).transpose()?;
        let tenant = viewer(ctx)?.tenant.clone();
        let store = services(ctx).store.clone();
        let conversation_id = parse_id(&conversation_id).ok_or(ApiError::NotFound)?;
        let permit = permit(ctx)?;
        reads::conversation(store.api_reads(), &tenant, conversation_id)
            .await?
            .ok_or(ApiError::NotFound)?;
        let request = FeedRequest {
            tenant,
            conversation_id,
            after,
            run_id: None,
        };
        Ok(to_transport(follow(store, request), permit))
    }

    /// One run's events; completes after the run's final event.
    async fn run_events(
        &self,
        ctx: &Context<'_>,
        run_id: ID,
        after: Option<String>,
    ) -> Result<EventStream, ApiError> {
        let after = after.as_deref().map(parse_cursor).transpose()?;
        let tenant = viewer(ctx)?.tenant.clone();
        let store = services(ctx).store.clone();
        let run_id = parse_id(&run_id).ok_or(ApiError::NotFound)?;
        let permit = permit(ctx)?;
        let run = reads::run(store.api_reads(), &tenant, run_id)
            .await?
            .ok_or(ApiError::NotFound)?;
        let request = FeedRequest {
            tenant,
            conversation_id: run.conversation_id,
            after,
            run_id: Some(run_id),
        };
        Ok(to_transport(follow(store, request), permit))
    }
}
