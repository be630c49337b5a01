//! The API's typed errors and their `extensions.code`.

use std::sync::Arc;

use async_graphql::extensions::{
    Extension, ExtensionContext, ExtensionFactory, NextRequest, NextSubscribe,
};
use async_graphql::{ErrorExtensionValues, Response, ServerError};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

use crate::store;

/// Every error a resolver returns. Messages never carry ids, SQL or secrets.
///
/// It deliberately has no `Display`: async-graphql converts anything that
/// displays into an error without a code, and every error here has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiError {
    NotFound,
    BadInput {
        message: String,
        key: Option<String>,
    },
    Conflict(String),
    Forbidden(String),
    /// A service the operation needs did not answer; nothing changed.
    Unavailable(String),
    /// A per-principal or per-tenant limit; nothing changed. Try again in
    /// `retry_after_secs`.
    RateLimited {
        message: String,
        retry_after_secs: u64,
    },
    Internal,
}

impl ApiError {
    pub fn bad_input(message: impl Into<String>) -> ApiError {
        ApiError::BadInput {
            message: message.into(),
            key: None,
        }
    }

    pub fn bad_key(key: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::BadInput {
            message: message.into(),
            key: Some(key.into()),
        }
    }

    pub fn message(&self) -> &str {
        match self {
            ApiError::NotFound => "not found",
            ApiError::BadInput { message, .. } => message,
            ApiError::Conflict(message)
            | ApiError::Forbidden(message)
            | ApiError::Unavailable(message)
            | ApiError::RateLimited { message, .. } => message,
            ApiError::Internal => "internal error",
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ApiError::NotFound => "NOT_FOUND",
            ApiError::BadInput { .. } => "BAD_USER_INPUT",
            ApiError::Conflict(_) => "CONFLICT",
            ApiError::Forbidden(_) => "FORBIDDEN",
            ApiError::Unavailable(_) => "UNAVAILABLE",
            ApiError::RateLimited { .. } => "RATE_LIMITED",
            ApiError::Internal => "INTERNAL",
        }
    }
}

impl From<store::Error> for ApiError {
    fn from(err: store::Error) -> ApiError {
        match err {
            store::Error::NotFound => ApiError::NotFound,
            store::Error::Conflict(message) => ApiError::Conflict(message),
            store::Error::Invalid { key, message } => ApiError::BadInput { key, message },
            store::Error::Forbidden(message) => ApiError::Forbidden(message),
            store::Error::Unavailable(message) => ApiError::Unavailable(message),
            err @ (store::Error::Database(_)
            | store::Error::Connect { .. }
            | store::Error::Corrupt(_)
            | store::Error::WriteFailed(_)
            | store::Error::Fenced
            | store::Error::Lapsed
            | store::Error::CancelRequested) => {
                tracing::error!(error = %err, "store failure");
                ApiError::Internal
            }
        }
    }
}

impl From<ApiError> for async_graphql::Error {
    fn from(err: ApiError) -> async_graphql::Error {
        let mut extensions = ErrorExtensionValues::default();
        extensions.set("code", err.code());
        if let ApiError::BadInput { key: Some(key), .. } = &err {
            extensions.set("key", key.as_str());
        }
        if let ApiError::RateLimited {
            retry_after_secs, ..
        } = &err
        {
            extensions.set("retryAfter", *retry_after_secs);
        }
        async_graphql::Error {
            message: err.message().to_owned(),
            source: None,
            extensions: Some(extensions),
        }
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// A request-level refusal (parse, validation, depth, complexity, size).
pub fn bad_request(message: impl Into<String>) -> ServerError {
    as_bad_request(ServerError::new(message, None))
}

/// `err`, with the code of a request-level refusal.
pub fn as_bad_request(mut err: ServerError) -> ServerError {
    err.extensions
        .get_or_insert_with(Default::default)
        .set("code", "BAD_USER_INPUT");
    err
}

/// Gives every error without a code `BAD_USER_INPUT`: those come from the
/// GraphQL machinery refusing the request itself (parse, validation, depth,
/// complexity, variable coercion), since every resolver error has its code.
pub struct ErrorCodes;

impl ExtensionFactory for ErrorCodes {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(ErrorCodes)
    }
}

#[async_trait::async_trait]
impl Extension for ErrorCodes {
    async fn request(&self, ctx: &ExtensionContext<'_>, next: NextRequest<'_>) -> Response {
        with_codes(next.run(ctx).await)
    }

    fn subscribe<'s>(
        &self,
        ctx: &ExtensionContext<'_>,
        stream: BoxStream<'s, Response>,
        next: NextSubscribe<'_>,
    ) -> BoxStream<'s, Response> {
        next.run(ctx, stream).map(with_codes).boxed()
    }
}

fn with_codes(mut response: Response) -> Response {
    for err in &mut response.errors {
        let extensions = err.extensions.get_or_insert_with(Default::default);
        if extensions.get("code").is_none() {
            extensions.set("code", "BAD_USER_INPUT");
        }
    }
    response
}
