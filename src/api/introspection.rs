//! With `[api] playground = false` the schema is built without
//! introspection, where async-graphql answers `__schema` and `__type` with
//! `null` and no error. This extension refuses such a request instead,
//! before it runs, so a client is told why it got nothing.

use std::sync::Arc;

use async_graphql::extensions::{Extension, ExtensionContext, ExtensionFactory, NextParseQuery};
use async_graphql::parser::types::{ExecutableDocument, Selection, SelectionSet};
use async_graphql::{ServerResult, Variables};

use super::error::bad_request;

/// The introspection fields. `__typename` is not one of them: clients ask
/// for it to tell union and interface members apart.
const INTROSPECTION_FIELDS: [&str; 2] = ["__schema", "__type"];

pub struct RefuseIntrospection;

impl ExtensionFactory for RefuseIntrospection {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(RefuseIntrospection)
    }
}

#[async_trait::async_trait]
impl Extension for RefuseIntrospection {
    async fn parse_query(
        &self,
        ctx: &ExtensionContext<'_>,
        query: &str,
        variables: &Variables,
        next: NextParseQuery<'_>,
    ) -> ServerResult<ExecutableDocument> {
        let document = next.run(ctx, query, variables).await?;
        if selects_introspection(&document) {
            return Err(bad_request("introspection is disabled on this server"));
        }
        Ok(document)
    }
}

/// Whether any operation or fragment of the document selects an
/// introspection field, at any depth.
fn selects_introspection(document: &ExecutableDocument) -> bool {
    let mut pending: Vec<&SelectionSet> = document
        .operations
        .iter()
        .map(|(_, op)| &op.node.selection_set.node)
        .chain(
            document
                .fragments
                .values()
                .map(|fragment| &fragment.node.selection_set.node),
        )
        .collect();
    while let Some(set) = pending.pop() {
        for item in &set.items {
            match &item.node {
                Selection::Field(field) => {
                    if INTROSPECTION_FIELDS.contains(&field.node.name.node.as_str()) {
                        return true;
                    }
                    pending.push(&field.node.selection_set.node);
                }
                Selection::InlineFragment(fragment) => {
                    pending.push(&fragment.node.selection_set.node);
                }
                Selection::FragmentSpread(_) => {}
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use async_graphql::parser::parse_query;

    use super::*;

    #[test]
    fn introspection_is_found_in_operations_fragments_and_aliases() {
        for query in [
            "{ __schema { types { name } } }",
            "{ a: __type(name: \"Run\") { name } }",
            "query A { me { tenant } } query B { ... on Query { __schema { queryType { name } } } }",
            "{ ...F } fragment F on Query { __schema { types { name } } }",
        ] {
            assert!(
                selects_introspection(&parse_query(query).unwrap()),
                "{query}"
            );
        }
        for query in [
            "{ me { tenant __typename } }",
            "{ agents { name } }",
            "subscription { conversationEvents(conversationId: \"x\") { __typename type } }",
        ] {
            assert!(
                !selects_introspection(&parse_query(query).unwrap()),
                "{query}"
            );
        }
    }
}
