//! Logs and traces: one subscriber for the process, writing text (or JSON
//! lines) to stderr, and exporting spans over OTLP/HTTP when an endpoint is
//! configured. A claim of a run is a trace: the `run` span, with a `step`
//! span per step, an `inference` span per model request and a `tool_call`
//! span per call (the downstream request carries its `traceparent`).

use std::io::IsTerminal;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::{LogFormat, TelemetryConfig};

/// Flushes the spans not yet exported when dropped.
#[must_use = "dropping it stops the trace export"]
pub struct Guard(Option<SdkTracerProvider>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take()
            && let Err(err) = provider.shutdown()
        {
            eprintln!("tether: exporting the last spans failed: {err}");
        }
    }
}

/// Sets the process's subscriber: `RUST_LOG` (default `info`) filters the
/// logs; spans at `info` and above are exported when `otlp_endpoint` is
/// set, whatever `RUST_LOG` says.
pub fn init(config: &TelemetryConfig) -> anyhow::Result<Guard> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::stderr().is_terminal();
    let logs = match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    }
    .with_filter(filter);
    let provider = match &config.otlp_endpoint {
        Some(endpoint) => Some(tracer_provider(endpoint, &config.service_name)?),
        None => None,
    };
    // Two subscribers rather than an `Option` layer: an absent layer still
    // says it is interested in every callsite, which would enable every
    // span and event of every crate for the logs' filter to throw away.
    match &provider {
        Some(provider) => {
            let spans = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("tether"))
                .with_filter(LevelFilter::INFO);
            tracing_subscriber::registry()
                .with(logs)
                .with(spans)
                .try_init()?;
        }
        None => tracing_subscriber::registry().with(logs).try_init()?,
    }
    if let Some(endpoint) = &config.otlp_endpoint {
        tracing::info!(endpoint = %crate::redact::origin(endpoint), "exporting traces over OTLP");
    }
    Ok(Guard(provider))
}

fn tracer_provider(endpoint: &str, service: &str) -> anyhow::Result<SdkTracerProvider> {
    // The exporter builds its HTTP client with the process's TLS backend.
    crate::providers::http::install_tls();
    let endpoint = endpoint.trim_end_matches('/');
    let url = if endpoint.ends_with("/v1/traces") {
        endpoint.to_owned()
    } else {
        format!("{endpoint}/v1/traces")
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .build()?;
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(service.to_owned())
                .build(),
        )
        .build())
}

/// The W3C trace context of the current span, as headers for an outgoing
/// request (`traceparent`, `tracestate`); none when no trace is exported.
pub fn trace_headers() -> Vec<(String, String)> {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let context = tracing::Span::current().context();
    let mut headers = std::collections::HashMap::new();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut headers);
    });
    headers.into_iter().collect()
}
