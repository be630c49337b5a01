use std::sync::{Arc, Mutex, PoisonError};

use async_graphql::{Context, ID, Subscription};
use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::context::{services, viewer};
use super::error::{ApiError, ApiResult};
use super::events::TransportEvent;
use super::feed::{FeedRequest, follow};
use super::query::parse_cursor;
use super::quotas::SubscriptionPermit;
use super::types::parse_id;
use crate::store::reads;

pub struct Subscription;

type EventStream = std::pin::Pin<Box<dyn Stream<Item = ApiResult<TransportEvent>> + Send>>;

/// In a request's data, asks the resolvers to check the subscription and
/// hand its feed and permit back here instead of following the feed
/// (`api::fanout` follows it and renders what it yields).
#[derive(Clone, Default)]
pub struct Admission(Arc<Mutex<Option<(FeedRequest, SubscriptionPermit)>>>);

impl Admission {
    /// The admitted feed; `None` when the request was refused.
    pub fn take(&self) -> Option<(FeedRequest, SubscriptionPermit)> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// In a request's data, makes the resolvers yield the events sent in here,
/// unchecked: `api::fanout` renders events for subscribers it admitted.
pub struct RenderFeed(Mutex<Option<mpsc::UnboundedReceiver<ApiResult<TransportEvent>>>>);

impl RenderFeed {
    pub fn new(events: mpsc::UnboundedReceiver<ApiResult<TransportEvent>>) -> RenderFeed {
        RenderFeed(Mutex::new(Some(events)))
    }
}

/// The events to render, when the request is a rendering.
fn rendering(ctx: &Context<'_>) -> Option<EventStream> {
    let feed = ctx.data_opt::<RenderFeed>()?;
    let events = feed
        .0
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()?;
    Some(UnboundedReceiverStream::new(events).boxed())
}

/// The admitted feed: followed here, or handed to the fan-out.
fn serve(ctx: &Context<'_>, request: FeedRequest, permit: SubscriptionPermit) -> EventStream {
    match ctx.data_opt::<Admission>() {
        Some(admission) => {
            *admission.0.lock().unwrap_or_else(PoisonError::into_inner) = Some((request, permit));
            futures_util::stream::empty().boxed()
        }
        None => to_transport(follow(services(ctx).store.clone(), request), permit),
    }
}

/// The subscription's permit (`api.max_subscriptions`, and its principal's
/// and tenant's shares), held for as long as it is served.
fn permit(ctx: &Context<'_>) -> ApiResult<SubscriptionPermit> {
    let services = services(ctx);
    let process = services
        .subscriptions
        .clone()
        .try_acquire_owned()
        .map_err(|_| {
            ApiError::Unavailable(
                "the server is serving as many subscriptions as it may; try again later".into(),
            )
        })?;
    let viewer = viewer(ctx)?;
    services
        .quotas
        .subscription(&viewer.tenant, &viewer.principal, process)
}

fn to_transport(
    stream: impl Stream<Item = crate::store::Result<std::sync::Arc<crate::domain::event::Event>>>
    + Send
    + 'static,
    permit: SubscriptionPermit,
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
        if let Some(events) = rendering(ctx) {
            return Ok(events);
        }
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
        Ok(serve(ctx, request, permit))
    }

    /// One run's events; completes after the run's final event.
    async fn run_events(
        &self,
        ctx: &Context<'_>,
        run_id: ID,
        after: Option<String>,
    ) -> Result<EventStream, ApiError> {
        if let Some(events) = rendering(ctx) {
            return Ok(events);
        }
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
        Ok(serve(ctx, request, permit))
    }
}
