//! Traces over OTLP/HTTP, received by a collector in the test: a claim of a
//! run is one trace, with its steps, model requests and tool calls as
//! children carrying their ids, and the tool's downstream request carries
//! the trace context.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use crate::downstream::Downstream;
use crate::support::{PATIENCE, Server, ServerOptions};
use crate::tools::{config, tool_calls};

/// What the collector received: each span with its service name.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<(String, Span)>>>);

async fn export(State(received): State<Received>, body: Bytes) -> Vec<u8> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf request");
    let mut spans = received.0.lock().unwrap();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| r.attributes.iter())
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| text(kv.value.as_ref()?.value.as_ref()?))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            spans.extend(scope.spans.into_iter().map(|span| (service.clone(), span)));
        }
    }
    ExportTraceServiceResponse::default().encode_to_vec()
}

fn text(value: &any_value::Value) -> Option<String> {
    match value {
        any_value::Value::StringValue(text) => Some(text.clone()),
        any_value::Value::IntValue(n) => Some(n.to_string()),
        _ => None,
    }
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| text(kv.value.as_ref()?.value.as_ref()?))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn a_claim_is_a_trace_of_its_steps_model_requests_and_tool_calls() {
    let received = Received::default();
    let app = Router::new()
        .route("/v1/traces", post(export))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let downstream = Downstream::start().await;
    let server = Server::start_with(ServerOptions {
        config: config(&downstream, "", &[("tools", "")]),
        env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), collector),
            ("OTEL_SERVICE_NAME".into(), "tether-under-test".into()),
            // Spans are sent in batches every 100 ms instead of 5 s.
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
        ],
        role: "all",
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.conversation_with(&token, "tools").await;
    let (_, run) = server
        .send(&token, &conversation, r#"/tool effect {"text": "x"}"#)
        .await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let call_id = tool_calls(&server, &token, &run).await[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // The run's trace: its span, and the last of its children (the second
    // step's model request) once they have all arrived.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let spans = loop {
        let spans: Vec<(String, Span)> = received.0.lock().unwrap().clone();
        let run_span = spans
            .iter()
            .find(|(_, s)| s.name == "run" && attribute(s, "run_id").as_deref() == Some(&run));
        if let Some((_, root)) = run_span {
            let in_trace: Vec<Span> = spans
                .iter()
                .filter(|(_, s)| s.trace_id == root.trace_id)
                .map(|(_, s)| s.clone())
                .collect();
            if in_trace.iter().filter(|s| s.name == "inference").count() == 2 {
                break in_trace;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the run's spans never all arrived: {:?}",
            spans.iter().map(|(_, s)| &s.name).collect::<Vec<_>>()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(
        received
            .0
            .lock()
            .unwrap()
            .iter()
            .all(|(service, _)| service == "tether-under-test")
    );
    let named = |name: &str| -> Vec<&Span> { spans.iter().filter(|s| s.name == name).collect() };
    let runs = named("run");
    assert_eq!(runs.len(), 1, "one trace per claim");
    let root = runs[0];
    assert!(root.parent_span_id.is_empty(), "the run's span is the root");
    assert_eq!(
        attribute(root, "conversation_id").as_deref(),
        Some(conversation.as_str())
    );
    assert_eq!(attribute(root, "tenant").as_deref(), Some("acme"));

    let steps = named("step");
    assert_eq!(steps.len(), 2, "a tool step and the reply");
    assert!(steps.iter().all(|s| s.parent_span_id == root.span_id));
    let step_ids: Vec<&Vec<u8>> = steps.iter().map(|s| &s.span_id).collect();
    let inferences = named("inference");
    assert!(
        inferences
            .iter()
            .all(|s| step_ids.contains(&&s.parent_span_id))
    );
    assert!(
        inferences
            .iter()
            .all(|s| attribute(s, "provider").as_deref() == Some("scripted"))
    );
    let calls = named("tool_call");
    assert_eq!(calls.len(), 1);
    let call = calls[0];
    assert!(step_ids.contains(&&call.parent_span_id));
    assert_eq!(
        attribute(call, "tool_call_id").as_deref(),
        Some(call_id.as_str())
    );
    assert_eq!(attribute(call, "run_id").as_deref(), Some(run.as_str()));
    assert_eq!(attribute(call, "tenant").as_deref(), Some("acme"));

    // The tool's request carried the call's place in the trace.
    let requests = downstream.requests();
    let traceparent = requests[0]
        .traceparent
        .clone()
        .expect("a traceparent header");
    assert_eq!(
        traceparent,
        format!("00-{}-{}-01", hex(&root.trace_id), hex(&call.span_id))
    );
}

#[tokio::test]
async fn json_logs_carry_the_ids_of_the_run_they_are_about() {
    let mut server = Server::start_with(ServerOptions {
        config: crate::support::WORKER_CONFIG.to_owned(),
        env: vec![
            ("TETHER_LOG_FORMAT".into(), "json".into()),
            ("RUST_LOG".into(), "info".into()),
        ],
        role: "all",
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/fail 429").await;
    assert_eq!(
        server.wait_until_ended(&token, &run).await["status"],
        "COMPLETED"
    );
    let logs = server.logs_after_exit().await;
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}")))
        .collect();
    let retrying = lines
        .iter()
        .find(|line| line["fields"]["message"] == "model request failed; retrying")
        .unwrap_or_else(|| panic!("no retry logged: {logs}"));
    assert_eq!(retrying["level"], "INFO");
    let run_span = retrying["spans"]
        .as_array()
        .unwrap()
        .iter()
        .find(|span| span["name"] == "run")
        .unwrap_or_else(|| panic!("no run span: {retrying}"));
    assert_eq!(run_span["run_id"], run.as_str());
    assert_eq!(run_span["conversation_id"], conversation.as_str());
    assert_eq!(run_span["tenant"], "acme");
}
