//! What a request may cost: list fields counted once per item they may
//! return, and a time limit on queries. What its document may be (its
//! length, nesting, fragments and aliases) is `api::admission`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_graphql::extensions::{
    Extension, ExtensionContext, ExtensionFactory, NextExecute, NextParseQuery,
};
use async_graphql::parser::types::{ExecutableDocument, OperationType};
use async_graphql::{Response, ServerError, ServerResult, Variables};

use super::error::{ApiError, ApiResult};

/// The page sizes of the list fields when their argument is absent or
/// `null`: the complexity count and the resolver both use them, so that a
/// list costs what it may return.
pub const CONVERSATIONS_PAGE: i32 = 20;
pub const EVENTS_PAGE: i32 = 500;
pub const MESSAGES_PAGE: i32 = 100;
pub const RUNS_PAGE: i32 = 100;
pub const PARTS_PAGE: i32 = 100;
pub const TOOL_CALLS_PAGE: i32 = 100;

/// The largest page each kind of list field gives.
pub const MAX_CONVERSATIONS_PAGE: i32 = 100;
pub const MAX_EVENTS_PAGE: i32 = 1000;
pub const MAX_PAGE: i32 = 500;

/// A list argument read: `null` or absent is `default`; outside
/// `0..=max` it is refused, naming the argument.
pub fn page(name: &str, value: Option<i32>, default: i32, max: i32) -> ApiResult<usize> {
    let value = value.unwrap_or(default);
    match usize::try_from(value) {
        Ok(size) if value <= max => Ok(size),
        _ => Err(ApiError::bad_key(
            name,
            format!("{name} must be between 0 and {max}"),
        )),
    }
}

/// `ToolCall.fullOutput` may carry a mebibyte where another field carries a
/// few bytes: it counts one unit per 16 KiB of the default cap, so that a
/// query cannot gather thousands of them under the complexity limit.
pub const FULL_OUTPUT: usize = 64;

/// No single field counts more than this, so that sums of counts cannot
/// overflow however the document nests.
const MAX_FIELD_COST: usize = u32::MAX as usize;

/// The complexity of a list field that returns up to `items` items, each
/// costing `child_complexity`.
pub fn list(items: i32, child_complexity: usize) -> usize {
    usize::try_from(items)
        .unwrap_or(0)
        .saturating_mul(child_complexity)
        .saturating_add(1)
        .min(MAX_FIELD_COST)
}

/// `text` whole when it fits in `cap` bytes, else its first bytes up to a
/// character boundary and a marker that says how much was cut.
pub fn capped(text: &str, cap: usize) -> String {
    if text.len() <= cap {
        return text.to_owned();
    }
    let end = text.floor_char_boundary(cap);
    format!(
        "{}\n[truncated by the server: {} of {} bytes shown]",
        &text[..end],
        end,
        text.len()
    )
}

/// Answers queries that run past the time limit with a `TIMEOUT` error.
pub struct QueryCost {
    pub timeout: Duration,
}

impl ExtensionFactory for QueryCost {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(RequestCost {
            timeout: self.timeout,
            only_queries: AtomicBool::new(false),
        })
    }
}

struct RequestCost {
    timeout: Duration,
    /// Whether the document holds queries only. Mutations are not cut off:
    /// one that committed must not be answered as if it had not.
    only_queries: AtomicBool,
}

#[async_trait::async_trait]
impl Extension for RequestCost {
    async fn parse_query(
        &self,
        ctx: &ExtensionContext<'_>,
        query: &str,
        variables: &Variables,
        next: NextParseQuery<'_>,
    ) -> ServerResult<ExecutableDocument> {
        let document = next.run(ctx, query, variables).await?;
        let only_queries = document
            .operations
            .iter()
            .all(|(_, op)| op.node.ty == OperationType::Query);
        self.only_queries.store(only_queries, Ordering::Relaxed);
        Ok(document)
    }

    async fn execute(
        &self,
        ctx: &ExtensionContext<'_>,
        operation_name: Option<&str>,
        next: NextExecute<'_>,
    ) -> Response {
        if !self.only_queries.load(Ordering::Relaxed) {
            return next.run(ctx, operation_name).await;
        }
        match tokio::time::timeout(self.timeout, next.run(ctx, operation_name)).await {
            Ok(response) => response,
            Err(_) => Response::from_errors(vec![timed_out(self.timeout)]),
        }
    }
}

fn timed_out(limit: Duration) -> ServerError {
    let mut err = ServerError::new(
        format!(
            "the query ran longer than the server's limit of {} s",
            limit.as_secs_f64()
        ),
        None,
    );
    err.extensions
        .get_or_insert_with(Default::default)
        .set("code", "TIMEOUT");
    err
}

#[cfg(test)]
mod tests {
    use async_graphql::{EmptyMutation, EmptySubscription, Object, Schema};

    use super::*;

    struct Slow;

    #[Object]
    impl Slow {
        async fn quick(&self) -> i32 {
            1
        }

        async fn never(&self) -> i32 {
            std::future::pending::<()>().await;
            0
        }
    }

    fn schema(timeout: Duration) -> Schema<Slow, EmptyMutation, EmptySubscription> {
        Schema::build(Slow, EmptyMutation, EmptySubscription)
            .extension(QueryCost { timeout })
            .finish()
    }

    fn code(response: &Response) -> Option<String> {
        let err = response.errors.first()?;
        match err.extensions.as_ref()?.get("code")? {
            async_graphql::Value::String(code) => Some(code.clone()),
            _ => None,
        }
    }

    #[tokio::test]
    async fn a_query_past_the_time_limit_is_answered_with_timeout() {
        let limited = schema(Duration::from_millis(50));
        let query = limited.execute("{ quick never }");
        let response = tokio::time::timeout(Duration::from_secs(20), query)
            .await
            .expect("the limit answers long before the test gives up");
        assert_eq!(code(&response).as_deref(), Some("TIMEOUT"));
        assert!(response.errors[0].message.contains("limit"));
        let response = schema(Duration::from_secs(30)).execute("{ quick }").await;
        assert!(response.errors.is_empty(), "{:?}", response.errors);
    }

    #[test]
    fn capped_text_keeps_whole_characters_and_says_what_was_cut() {
        assert_eq!(capped("short", 10), "short");
        let cut = capped("ééé", 3);
        assert!(cut.starts_with("é\n"), "{cut}");
        assert!(cut.contains("2 of 6 bytes"), "{cut}");
    }

    #[test]
    fn list_cost_multiplies_and_never_overflows() {
        assert_eq!(list(10, 3), 31);
        assert_eq!(list(-5, 3), 1);
        assert_eq!(list(i32::MAX, usize::MAX), MAX_FIELD_COST);
    }
}
