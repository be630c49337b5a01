//! Enum values written as strings in a document are refused, as the
//! GraphQL specification requires: `decision: "ALLOW_ONCE"` is a String
//! literal, not the enum value `ALLOW_ONCE`. async-graphql coerces both
//! alike and has no switch for it, so this extension checks the document's
//! literals against the schema before validation. Variables are not
//! concerned: in JSON an enum value can only be a string.

use std::sync::Arc;

use async_graphql::extensions::{Extension, ExtensionContext, ExtensionFactory, NextParseQuery};
use async_graphql::parser::types::{ExecutableDocument, Selection, SelectionSet};
use async_graphql::registry::{MetaType, MetaTypeName, Registry};
use async_graphql::{ServerResult, Value, Variables};

use super::error::bad_request;

pub struct EnumLiterals;

impl ExtensionFactory for EnumLiterals {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(EnumLiterals)
    }
}

#[async_trait::async_trait]
impl Extension for EnumLiterals {
    async fn parse_query(
        &self,
        ctx: &ExtensionContext<'_>,
        query: &str,
        variables: &Variables,
        next: NextParseQuery<'_>,
    ) -> ServerResult<ExecutableDocument> {
        let document = next.run(ctx, query, variables).await?;
        match quoted_enum(&ctx.schema_env.registry, &document) {
            Some(found) => Err(bad_request(found)),
            None => Ok(document),
        }
    }
}

/// The first enum value written as a string in the document, described.
/// Fields and types the schema does not have are left to validation.
fn quoted_enum(registry: &Registry, document: &ExecutableDocument) -> Option<String> {
    for (_, operation) in document.operations.iter() {
        let operation = &operation.node;
        for variable in &operation.variable_definitions {
            let variable = &variable.node;
            if let Some(default) = &variable.default_value {
                let ty = variable.var_type.node.to_string();
                let path = format!("${}", variable.name.node);
                if let Some(found) = in_value(registry, &ty, &default.node, &path) {
                    return Some(found);
                }
            }
        }
        let root = match operation.ty {
            async_graphql::parser::types::OperationType::Query => Some(&registry.query_type),
            async_graphql::parser::types::OperationType::Mutation => {
                registry.mutation_type.as_ref()
            }
            async_graphql::parser::types::OperationType::Subscription => {
                registry.subscription_type.as_ref()
            }
        };
        if let Some(root) = root
            && let Some(found) = in_selections(registry, root, &operation.selection_set.node)
        {
            return Some(found);
        }
    }
    // Each fragment once, on its own type condition: a spread is not
    // followed, so a cycle (refused by validation later) cannot loop here.
    document.fragments.values().find_map(|fragment| {
        let fragment = &fragment.node;
        in_selections(
            registry,
            &fragment.type_condition.node.on.node,
            &fragment.selection_set.node,
        )
    })
}

fn in_selections(registry: &Registry, parent: &str, selections: &SelectionSet) -> Option<String> {
    selections
        .items
        .iter()
        .find_map(|selection| match &selection.node {
            Selection::Field(field) => {
                let field = &field.node;
                let meta = registry
                    .concrete_type_by_name(parent)?
                    .field_by_name(&field.name.node)?;
                for (name, value) in &field.arguments {
                    let Some(argument) = meta.args.get(name.node.as_str()) else {
                        continue;
                    };
                    let path = format!("{}.{}", field.name.node, name.node);
                    // Variables stand for JSON values, where an enum value is a
                    // string: they are not looked into.
                    let literal = value
                        .node
                        .clone()
                        .into_const_with(|_| Ok::<_, ()>(Value::Null))
                        .ok()?;
                    if let Some(found) = in_value(registry, &argument.ty, &literal, &path) {
                        return Some(found);
                    }
                }
                let child = MetaTypeName::concrete_typename(&meta.ty);
                in_selections(registry, child, &field.selection_set.node)
            }
            Selection::InlineFragment(fragment) => {
                let fragment = &fragment.node;
                let on = fragment
                    .type_condition
                    .as_ref()
                    .map_or(parent, |condition| condition.node.on.node.as_str());
                in_selections(registry, on, &fragment.selection_set.node)
            }
            Selection::FragmentSpread(_) => None,
        })
}

/// A string where `ty` (a type as the schema writes it: `[Kind!]!`)
/// expects an enum, at any depth of lists and input objects.
fn in_value(registry: &Registry, ty: &str, value: &Value, path: &str) -> Option<String> {
    let named = MetaTypeName::concrete_typename(ty);
    match (registry.concrete_type_by_name(named)?, value) {
        (_, Value::List(items)) => items
            .iter()
            .find_map(|item| in_value(registry, named, item, path)),
        (
            MetaType::Enum {
                name, enum_values, ..
            },
            Value::String(text),
        ) => Some(if enum_values.contains_key(text.as_str()) {
            format!("{path}: {name} is an enum: write {text} without quotes, not \"{text}\"")
        } else {
            format!("{path}: expected a value of the enum {name}, written without quotes")
        }),
        (MetaType::InputObject { input_fields, .. }, Value::Object(fields)) => {
            fields.iter().find_map(|(key, value)| {
                let field = input_fields.get(key.as_str())?;
                in_value(registry, &field.ty, value, &format!("{path}.{key}"))
            })
        }
        _ => None,
    }
}
