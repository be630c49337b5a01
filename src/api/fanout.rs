//! Where an event fans out to WebSocket subscribers: each event is resolved
//! and serialized once per distinct subscription document, and the bytes are
//! shared by every subscriber that sent that document.
//!
//! A `conversationEvents` or `runEvents` subscription arriving on a socket is
//! served here rather than by async-graphql's per-operation executor:
//! - **Admission.** The request runs through the schema once, as any other
//!   would: parsing, validation, limits, and the resolver's checks (the
//!   viewer's access, the cursor, `api.max_subscriptions`). The resolver
//!   hands its feed back instead of following it (`Admission`).
//! - **Following.** Each subscriber follows the feed on its own
//!   (`api::feed::follow`): its own cursor, catch-up from the log, repair of
//!   lag. What it receives, and in which order, does not change.
//! - **Rendering.** Subscribers whose documents are the same (query,
//!   operation and variables, less the arguments of the subscription field,
//!   which only choose the feed) share one `Document`. It renders an event
//!   through one long-lived execution of that document (`RenderFeed`), so
//!   the document is parsed and validated once, and caches the bytes of
//!   recent events: the first subscriber to reach an event renders it, the
//!   others wait for and reuse its bytes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use async_graphql::parser::types::{ExecutableDocument, OperationType, Selection};
use async_graphql::{Data, Request, Response, Value, Variables};
use futures_util::stream::{BoxStream, StreamExt};
use tokio::sync::{OnceCell, mpsc};
use uuid::Uuid;

use super::TetherSchema;
use super::admission::DocumentAdmission;
use super::error::ApiResult;
use super::events::TransportEvent;
use super::feed::follow;
use super::subscription::{Admission, RenderFeed};
use crate::domain::event::{Event, EventBody};
use crate::store::Store;

/// Rendered events each document keeps for subscribers still to reach them.
const RENDERS_KEPT: usize = 256;

/// The subscription fields served here.
const FIELDS: [&str; 2] = ["conversationEvents", "runEvents"];

/// The documents being served in this process, by what makes their
/// renderings equal.
#[derive(Default)]
pub struct Fanout {
    documents: Mutex<Documents>,
}

#[derive(Default)]
struct Documents {
    live: HashMap<DocumentKey, Weak<Document>>,
    /// The size at which dead entries are next swept out.
    sweep_at: usize,
}

/// What an event's rendering depends on besides the event.
#[derive(Clone, PartialEq, Eq, Hash)]
struct DocumentKey {
    query: String,
    operation_name: Option<String>,
    /// The variables as canonical JSON, less those bound to the subscription
    /// field's arguments.
    variables: String,
}

/// A subscribe frame this module serves, and how to render it.
pub struct Plan {
    request: Request,
    key: DocumentKey,
    variables: Variables,
}

/// Whether a request is a subscription served here: a subscription
/// operation whose only selection is one of `FIELDS`. Anything else (a
/// query, a mutation, a document admission refuses or does not admit
/// inline, a root with fragments or several fields) is handed back, to go
/// to async-graphql's executor as it is, which admits it again and answers.
pub fn plan(mut request: Request, admission: &DocumentAdmission) -> Result<Plan, Box<Request>> {
    match key_of(&mut request, admission) {
        Some(key) => {
            let variables = request.variables.clone();
            Ok(Plan {
                request,
                key,
                variables,
            })
        }
        None => Err(Box::new(request)),
    }
}

/// What the renderings of a request served here depend on; `None` for a
/// request not served here.
fn key_of(request: &mut Request, admission: &DocumentAdmission) -> Option<DocumentKey> {
    admission.admit_inline(request)?.ok()?;
    let operation = request.operation_name.clone();
    let document = request.parsed_query().ok()?;
    let bound = field_variables(document, operation.as_deref())?;
    let serde_json::Value::Object(mut unbound) = serde_json::to_value(&request.variables).ok()?
    else {
        return None;
    };
    unbound.retain(|name, _| !bound.iter().any(|b| b == name));
    Some(DocumentKey {
        query: request.query.clone(),
        operation_name: request.operation_name.clone(),
        // serde_json's map keeps its keys sorted: equal maps print equally.
        variables: serde_json::Value::Object(unbound).to_string(),
    })
}

/// The variables bound to the arguments of the operation's one field, when
/// that field is one of `FIELDS`.
fn field_variables(document: &ExecutableDocument, operation: Option<&str>) -> Option<Vec<String>> {
    let operation = match operation {
        Some(name) => {
            document
                .operations
                .iter()
                .find(|(n, _)| n.is_some_and(|n| n.as_str() == name))?
                .1
        }
        None => {
            let mut all = document.operations.iter();
            let (_, only) = all.next()?;
            if all.next().is_some() {
                return None;
            }
            only
        }
    };
    if operation.node.ty != OperationType::Subscription {
        return None;
    }
    let [item] = operation.node.selection_set.node.items.as_slice() else {
        return None;
    };
    let Selection::Field(field) = &item.node else {
        return None;
    };
    if !FIELDS.contains(&field.node.name.node.as_str()) || !field.node.directives.is_empty() {
        return None;
    }
    let mut bound = Vec::new();
    for (_, value) in &field.node.arguments {
        // Walks the value, naming each variable in it.
        let _ = value.node.clone().into_const_with(|name| {
            bound.push(name.to_string());
            Ok::<_, std::convert::Infallible>(Value::Null)
        });
    }
    Some(bound)
}

/// What one operation sends: frames, and a last one that ends it.
pub enum Frame {
    Next(String),
    Last(String),
}

/// How a transport wraps the rendered payloads of one served operation.
/// The payload is the GraphQL response of one event (`{"data":…}`), or of
/// a refusal or error (`{"errors":…}`).
pub trait Framing: Send + Sync + 'static {
    /// One payload as the transport sends it.
    fn next(&self, payload: &str) -> String;
    /// What ends the operation.
    fn complete(&self) -> String;
}

/// The frames of one WebSocket operation: the admission's refusal, or the
/// feed's events rendered, then `complete` when the feed ends.
pub fn operation(
    fanout: Arc<Fanout>,
    schema: TetherSchema,
    store: Store,
    session: Arc<Data>,
    legacy: bool,
    id: &str,
    plan: Plan,
) -> BoxStream<'static, Frame> {
    serve(
        fanout,
        schema,
        store,
        session,
        WsFraming::new(id, legacy),
        plan,
    )
}

/// The frames of one served subscription in `framing`: the admission's
/// refusal, or the feed's events rendered, then what ends it.
///
/// An operation waits for events most of its life, so what it keeps while it
/// waits is small: the admission (the request, the schema's execution) is a
/// boxed future gone once it answers, and the served feed is a plain struct.
pub fn serve(
    fanout: Arc<Fanout>,
    schema: TetherSchema,
    store: Store,
    session: Arc<Data>,
    framing: impl Framing,
    plan: Plan,
) -> BoxStream<'static, Frame> {
    let mut framing = Some(framing);
    let admission = Box::pin(admit(fanout, schema, store, session, plan));
    futures_util::stream::once(admission)
        .flat_map(move |admitted| frames(framing.take().expect("one admission"), admitted))
        .boxed()
}

/// The frames of a request not served here (`plan` handed it back), run by
/// async-graphql's executor: each response, then what ends it. For a
/// transport that has no protocol engine of its own (the WebSocket's is
/// async-graphql's).
pub fn execute(
    schema: &TetherSchema,
    session: Arc<Data>,
    framing: impl Framing,
    request: Request,
) -> BoxStream<'static, Frame> {
    let framing = Arc::new(framing);
    let last = framing.clone();
    schema
        .execute_stream_with_session_data(request, session)
        .map(move |response| Frame::Next(framing.next(&payload_of(&response))))
        .chain(futures_util::stream::once(async move {
            Frame::Last(last.complete())
        }))
        .boxed()
}

/// What the admission gave: the refusal's responses, or the feed to serve.
pub enum Admitted {
    Refused(Vec<Response>),
    Served(Served),
}

/// Runs the request through the schema, which checks it and hands the feed
/// back (`Admission`): where every transport's subscription starts.
pub async fn admit(
    fanout: Arc<Fanout>,
    schema: TetherSchema,
    store: Store,
    session: Arc<Data>,
    plan: Plan,
) -> Admitted {
    let Plan {
        request,
        key,
        variables,
    } = plan;
    let admission = Admission::default();
    let refusals: Vec<Response> = schema
        .execute_stream_with_session_data(request.data(admission.clone()), session)
        .collect()
        .await;
    match admission.take() {
        Some((feed, permit)) => Admitted::Served(Served {
            document: fanout.document(key, variables, &schema),
            events: Box::pin(follow(store, feed)),
            permit: Some(permit),
            failed: false,
        }),
        None => Admitted::Refused(refusals),
    }
}

/// A subscription being served: its feed, and the document that renders it.
pub struct Served {
    document: Arc<Document>,
    events: BoxStream<'static, crate::store::Result<Arc<Event>>>,
    /// Held for as long as the feed is served (`api.max_subscriptions`).
    permit: Option<super::quotas::SubscriptionPermit>,
    /// The feed ended with an error, already sent.
    failed: bool,
}

/// The frames of an admitted operation, in `framing`: a refusal's, or the
/// feed's events rendered, then what ends it.
pub fn frames(framing: impl Framing, admitted: Admitted) -> BoxStream<'static, Frame> {
    match admitted {
        Admitted::Refused(refusals) => {
            let mut frames: Vec<Frame> = refusals
                .iter()
                .map(|refusal| Frame::Next(framing.next(&payload_of(refusal))))
                .collect();
            frames.push(Frame::Last(framing.complete()));
            futures_util::stream::iter(frames).boxed()
        }
        Admitted::Served(served) => {
            futures_util::stream::unfold(Some((framing, served)), |state| async move {
                let (framing, mut served) = state?;
                let item = if served.failed {
                    None
                } else {
                    served.events.next().await
                };
                // Renderings are boxed, like the feed's reads: an idle
                // operation does not carry their futures.
                let payload = match item {
                    Some(Ok(event)) => Box::pin(served.document.render(&event)).await,
                    Some(Err(err)) => {
                        served.failed = true;
                        Box::pin(served.document.render_error(err.into())).await
                    }
                    None => {
                        served.permit.take();
                        return Some((Frame::Last(framing.complete()), None));
                    }
                };
                let frame = Frame::Next(framing.next(&payload));
                Some((frame, Some((framing, served))))
            })
            .boxed()
        }
    }
}

/// The WebSocket protocol's frames around a payload, for one operation id.
struct WsFraming {
    /// The id, as a JSON string.
    id: String,
    next: &'static str,
}

impl WsFraming {
    fn new(id: &str, legacy: bool) -> WsFraming {
        WsFraming {
            id: serde_json::Value::from(id).to_string(),
            // async-graphql's own names for them, type first as it writes.
            next: if legacy { "data" } else { "next" },
        }
    }
}

impl Framing for WsFraming {
    fn next(&self, payload: &str) -> String {
        format!(
            r#"{{"type":"{}","id":{},"payload":{payload}}}"#,
            self.next, self.id
        )
    }

    fn complete(&self) -> String {
        format!(r#"{{"type":"complete","id":{}}}"#, self.id)
    }
}

fn payload_of(response: &Response) -> Arc<str> {
    serde_json::to_string(response)
        .unwrap_or_else(|_| r#"{"errors":[{"message":"internal error"}]}"#.to_owned())
        .into()
}

impl Fanout {
    /// The shared document for `key`, made on first use.
    fn document(
        &self,
        key: DocumentKey,
        variables: Variables,
        schema: &TetherSchema,
    ) -> Arc<Document> {
        let mut documents = self
            .documents
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(document) = documents.live.get(&key).and_then(Weak::upgrade) {
            return document;
        }
        if documents.live.len() >= documents.sweep_at {
            documents
                .live
                .retain(|_, document| document.strong_count() > 0);
            documents.sweep_at = (documents.live.len() * 2).max(64);
        }
        let document = Arc::new(Document {
            schema: schema.clone(),
            query: key.query.clone(),
            operation_name: key.operation_name.clone(),
            variables,
            execution: tokio::sync::Mutex::new(None),
            renders: Mutex::default(),
        });
        documents.live.insert(key, Arc::downgrade(&document));
        document
    }

    /// How many documents are being served.
    #[cfg(test)]
    fn documents(&self) -> usize {
        let documents = self
            .documents
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        documents
            .live
            .values()
            .filter(|d| d.strong_count() > 0)
            .count()
    }
}

/// One subscription document, rendered for every subscriber that sent it.
struct Document {
    schema: TetherSchema,
    query: String,
    operation_name: Option<String>,
    variables: Variables,
    /// Started at the first event, so an idle subscriber costs nothing here.
    execution: tokio::sync::Mutex<Option<Execution>>,
    renders: Mutex<Renders>,
}

/// Which event a rendering is of: a persisted event by its cursor, a delta
/// by its part and offset.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct EventKey {
    conversation_id: Uuid,
    cursor: i64,
    delta: Option<(Uuid, i64)>,
}

impl EventKey {
    fn of(event: &Event) -> EventKey {
        let delta = match &event.body {
            EventBody::Delta {
                part_id, offset, ..
            } => Some((*part_id, *offset)),
            _ => None,
        };
        EventKey {
            conversation_id: event.conversation_id,
            cursor: event.cursor.0,
            delta,
        }
    }
}

#[derive(Default)]
struct Renders {
    by_event: HashMap<EventKey, Arc<OnceCell<Arc<str>>>>,
    order: VecDeque<EventKey>,
}

impl Renders {
    fn cell(&mut self, key: EventKey) -> Arc<OnceCell<Arc<str>>> {
        if let Some(cell) = self.by_event.get(&key) {
            return cell.clone();
        }
        if self.order.len() >= RENDERS_KEPT
            && let Some(oldest) = self.order.pop_front()
        {
            self.by_event.remove(&oldest);
        }
        let cell = Arc::new(OnceCell::new());
        self.by_event.insert(key, cell.clone());
        self.order.push_back(key);
        cell
    }
}

impl Document {
    /// The event's payload, rendered once for all of this document's
    /// subscribers.
    async fn render(&self, event: &Event) -> Arc<str> {
        let cell = self
            .renders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .cell(EventKey::of(event));
        cell.get_or_init(|| self.execute(Ok(TransportEvent::from(event))))
            .await
            .clone()
    }

    /// An error's payload (never shared: the subscriber's feed ends with it).
    async fn render_error(&self, err: super::error::ApiError) -> Arc<str> {
        self.execute(Err(err)).await
    }

    async fn execute(&self, item: ApiResult<TransportEvent>) -> Arc<str> {
        let mut execution = self.execution.lock().await;
        let execution = execution.get_or_insert_with(|| self.start());
        match execution.render(item).await {
            Some(response) => payload_of(&response),
            None => {
                tracing::error!("a subscription document's rendering ended");
                payload_of(&Response::from_errors(vec![
                    async_graphql::ServerError::new("internal error", None),
                ]))
            }
        }
    }

    fn start(&self) -> Execution {
        let (events, feed) = mpsc::unbounded_channel();
        let request = Request::new(self.query.clone())
            .variables(self.variables.clone())
            .data(RenderFeed::new(feed));
        let request = match &self.operation_name {
            Some(name) => request.operation_name(name.clone()),
            None => request,
        };
        Execution {
            events,
            responses: self
                .schema
                .execute_stream_with_session_data(request, Arc::new(Data::default())),
            owed: 0,
        }
    }
}

/// One long-lived execution of a document: each event sent in comes out
/// as one response.
struct Execution {
    events: mpsc::UnboundedSender<ApiResult<TransportEvent>>,
    responses: BoxStream<'static, Response>,
    /// Responses to events sent by a rendering that was dropped before it
    /// read them; the next rendering reads past them first.
    owed: usize,
}

impl Execution {
    async fn render(&mut self, item: ApiResult<TransportEvent>) -> Option<Response> {
        while self.owed > 0 {
            self.responses.next().await?;
            self.owed -= 1;
        }
        self.events.send(item).ok()?;
        self.owed += 1;
        let response = self.responses.next().await?;
        self.owed -= 1;
        Some(response)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::api::context::Services;
    use crate::config::FileConfig;
    use crate::connections::Connections;
    use crate::domain::cursor::Cursor;
    use crate::domain::event::EventKind;
    use crate::store::test_support::temp_store;

    const EVENTS: &str = "subscription S($c: ID!, $after: String, $at: Boolean!) { \
        conversationEvents(conversationId: $c, after: $after) { \
        cursor type at @include(if: $at) ... on PartDelta { offset text } } }";

    fn request(payload: serde_json::Value) -> Request {
        serde_json::from_value(payload).expect("a request")
    }

    fn admission() -> Arc<DocumentAdmission> {
        DocumentAdmission::new(&crate::config::ApiConfig::default())
    }

    fn planned(query: &str, variables: serde_json::Value) -> Plan {
        plan(
            request(json!({ "query": query, "variables": variables })),
            &admission(),
        )
        .expect("served here")
    }

    fn delta(conversation_id: Uuid, offset: i64, text: &str) -> Event {
        Event {
            conversation_id,
            cursor: Cursor(7),
            kind: EventKind::PartDelta,
            run_id: None,
            at: 1_000,
            body: EventBody::Delta {
                message_id: Uuid::nil(),
                part_id: Uuid::nil(),
                offset,
                text: text.to_owned(),
            },
        }
    }

    #[tokio::test]
    async fn subscribers_of_one_document_share_each_events_bytes() {
        let (store, dir) = temp_store().await;
        let config = Arc::new(FileConfig::from_toml("").unwrap());
        let connections = Arc::new(Connections::new(&config, None));
        let schema = crate::api::schema(Services::new(store, config, connections));
        let fanout = Fanout::default();
        let document = |plan: Plan| fanout.document(plan.key, plan.variables, &schema);
        let (c1, c2) = (Uuid::now_v7(), Uuid::now_v7());

        // The field's arguments choose the feed, not the rendering.
        let a = document(planned(
            EVENTS,
            json!({ "c": c1, "after": null, "at": false }),
        ));
        let b = document(planned(
            EVENTS,
            json!({ "c": c2, "after": "5", "at": false }),
        ));
        assert!(Arc::ptr_eq(&a, &b), "one document for both");
        // Another variable changes the rendering: another document.
        let with_at = document(planned(EVENTS, json!({ "c": c1, "at": true })));
        assert!(!Arc::ptr_eq(&a, &with_at));

        let first = a.render(&delta(c1, 0, "Hel")).await;
        assert!(
            Arc::ptr_eq(&first, &b.render(&delta(c1, 0, "Hel")).await),
            "rendered once"
        );
        let expected = json!({ "data": { "conversationEvents": {
            "cursor": "0000000000000007", "type": "part.delta", "offset": 0, "text": "Hel" } } });
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&first).unwrap(),
            expected
        );
        // Another delta, or the same one in another conversation, is another event.
        let next = a.render(&delta(c1, 3, "lo")).await;
        assert!(next.contains(r#""text":"lo""#), "{next}");
        assert!(!Arc::ptr_eq(&first, &a.render(&delta(c2, 0, "Hel")).await));
        let timed = with_at.render(&delta(c1, 0, "Hel")).await;
        assert!(timed.contains(r#""at":"#), "{timed}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A real socket: connection_init, its ack, then `subscribe`.
    async fn subscriber(
        addr: std::net::SocketAddr,
        token: &str,
        query: &str,
        variables: serde_json::Value,
    ) -> tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>
    {
        use futures_util::SinkExt;
        use tokio_tungstenite::tungstenite::Message;
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let mut request = format!("ws://{addr}/graphql")
            .into_client_request()
            .unwrap();
        request.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            "graphql-transport-ws".parse().unwrap(),
        );
        let (mut socket, _) = tokio_tungstenite::connect_async(request).await.unwrap();
        let init = json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } });
        socket.send(Message::text(init.to_string())).await.unwrap();
        let ack = next_json(&mut socket).await;
        assert_eq!(ack["type"], "connection_ack");
        let subscribe = json!({ "id": "1", "type": "subscribe", "payload": { "query": query, "variables": variables } });
        socket
            .send(Message::text(subscribe.to_string()))
            .await
            .unwrap();
        socket
    }

    async fn next_json(
        socket: &mut tokio_tungstenite::WebSocketStream<
            tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
        >,
    ) -> serde_json::Value {
        loop {
            let frame = tokio::time::timeout(std::time::Duration::from_secs(10), socket.next())
                .await
                .expect("a frame in time")
                .expect("the socket is open")
                .unwrap();
            if let tokio_tungstenite::tungstenite::Message::Text(text) = frame {
                return serde_json::from_str(&text).unwrap();
            }
        }
    }

    /// Through the server's own router: the event feeds' subscribers of one
    /// document share it here, and a document served by the engine still
    /// streams beside them.
    #[tokio::test]
    async fn a_sockets_event_feed_is_served_here() {
        let (store, dir) = temp_store().await;
        let config = Arc::new(FileConfig::from_toml("").unwrap());
        let connections = Arc::new(Connections::new(&config, None));
        let services = Services::new(store.clone(), config, connections);
        let auth = crate::api::auth::Authenticator::new("fanout-test-secret-of-at-least-32-bytes")
            .unwrap();
        let token = auth
            .mint("acme", "ada", std::time::Duration::from_secs(600))
            .unwrap();
        let state = crate::api::AppState::new(services, auth);
        let fanout = state.fanout.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(axum::serve(listener, crate::api::routes(state)).into_future());
        let conversation = crate::store::test_support::conversation(&store).await;

        let query = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { cursor type } }";
        let from = json!({ "c": conversation.id.to_string(), "a": "0000000000000000" });
        let mut one = subscriber(addr, &token, query, from.clone()).await;
        let mut two = subscriber(addr, &token, query, from.clone()).await;
        let by_engine = "subscription($c: ID!, $a: String) { \
            conversationEvents(conversationId: $c, after: $a) @include(if: true) { cursor type } }";
        let mut three = subscriber(addr, &token, by_engine, from).await;
        crate::store::test_support::send_hi(&store, conversation.id, 1).await;

        let mut frames = Vec::new();
        for socket in [&mut one, &mut two, &mut three] {
            frames.push([next_json(socket).await, next_json(socket).await]);
        }
        assert_eq!(frames[0], frames[1], "the same frames from one document");
        assert_eq!(frames[0], frames[2], "the engine frames them alike");
        assert_eq!(
            frames[0][1]["payload"]["data"]["conversationEvents"]["type"],
            "run.queued"
        );
        assert_eq!(fanout.documents(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn only_a_lone_event_field_of_a_subscription_is_served_here() {
        let admission = admission();
        let served = |query: &str| plan(request(json!({ "query": query })), &admission).is_ok();
        assert!(served(
            "subscription { runEvents(runId: \"r\") { cursor } }"
        ));
        assert!(served(
            "subscription { e: conversationEvents(conversationId: \"c\") { cursor } }"
        ));
        assert!(!served("query { me { tenant } }"));
        assert!(!served(
            "subscription { ...F } fragment F on Subscription { runEvents(runId: \"r\") { cursor } }"
        ));
        assert!(!served(
            "subscription { runEvents(runId: \"r\") @skip(if: false) { cursor } }"
        ));
        assert!(!served(
            "subscription A { runEvents(runId: \"r\") { cursor } } subscription B { runEvents(runId: \"s\") { cursor } }"
        ));
        assert!(plan(request(json!({ "query": "subscription A { runEvents(runId: \"r\") { cursor } } subscription B { runEvents(runId: \"s\") { cursor } }", "operationName": "B" })), &admission).is_ok());
        assert!(!served("subscription { runEvents(runId: "));
        // Refused by admission, or too long to admit inline: the engine
        // admits it and answers.
        let cycle = "subscription { runEvents(runId: \"r\") { ...A } } fragment A on TransportEvent { ...A }";
        assert!(!served(cycle));
        let long = format!(
            "subscription {{ runEvents(runId: \"r\") {{ cursor }} }} #{}",
            " ".repeat(crate::api::admission::INLINE_BYTES)
        );
        assert!(!served(&long));
    }
}
