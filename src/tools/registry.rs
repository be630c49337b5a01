//! The tool registry: every tool a model may be offered, its JSON Schema
//! (compiled once), and the validation and normalization of a model's input
//! before anything runs.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{Map, Value, json};

use crate::config::{AgentConfig, FileConfig, HttpTarget, Recovery, ToolConfig, ToolConnection};
use crate::connections::Connections;

/// How a tool runs.
#[derive(Debug, Clone)]
pub enum Runner {
    /// Pauses the run with questions for a person.
    AskQuestions,
    /// Records its input and returns it (the default configuration's gated
    /// tool, so the approval card works with no other service).
    DemoPublish,
    Http(HttpTarget),
}

#[derive(Debug)]
pub struct Tool {
    pub name: String,
    pub description: String,
    pub input_schema: Value,
    validator: jsonschema::Validator,
    /// Any risk category makes the tool need approval.
    pub risk: Option<String>,
    pub summary: String,
    pub estimated_cost_usd: Option<f64>,
    pub recovery: Recovery,
    pub connection: Option<ToolConnection>,
    pub runner: Runner,
}

/// A model's input that the tool's schema refuses; the model gets this back
/// as a failed result it can correct.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid input for {tool}: {problems}")]
pub struct InvalidInput {
    pub tool: String,
    pub problems: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("tool {0:?}: its input_schema is not a valid JSON Schema: {1}")]
    Schema(String, String),
}

#[derive(Debug, Default)]
pub struct Registry {
    tools: HashMap<String, Arc<Tool>>,
    /// Where tools that declare a connection get their tokens.
    pub connections: Arc<Connections>,
}

impl Registry {
    pub fn from_config(config: &FileConfig) -> Result<Registry, RegistryError> {
        let mut tools = HashMap::new();
        for tool in builtins()
            .into_iter()
            .chain(config.tools.iter().map(configured))
        {
            let tool = tool?;
            tools.insert(tool.name.clone(), Arc::new(tool));
        }
        Ok(Registry {
            tools,
            connections: Arc::new(Connections::new(config, None)),
        })
    }

    /// The same tools, with tokens from `connections` (which holds the key).
    pub fn with_connections(self, connections: Arc<Connections>) -> Registry {
        Registry {
            connections,
            ..self
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Tool>> {
        self.tools.get(name)
    }

    /// The tools an agent offers its model, in the agent's order.
    pub fn for_agent(&self, agent: &AgentConfig) -> Vec<Arc<Tool>> {
        agent
            .tools
            .iter()
            .filter_map(|name| self.tools.get(name).cloned())
            .collect()
    }
}

impl Tool {
    /// Checks a model's input against the schema and normalizes it: the
    /// schema's top-level `default`s filled in, keys in a canonical order.
    /// What is stored, approved and executed is this normalized input.
    pub fn normalize(&self, input: &Value) -> Result<Value, InvalidInput> {
        let mut input = input.clone();
        if let (Some(object), Some(properties)) = (
            input.as_object_mut(),
            self.input_schema
                .get("properties")
                .and_then(Value::as_object),
        ) {
            for (key, property) in properties {
                if let Some(default) = property.get("default")
                    && !object.contains_key(key)
                {
                    object.insert(key.clone(), default.clone());
                }
            }
        }
        let problems: Vec<String> = self
            .validator
            .iter_errors(&input)
            .map(|error| {
                let at = error.instance_path().to_string();
                if at.is_empty() {
                    error.to_string()
                } else {
                    format!("{at}: {error}")
                }
            })
            .collect();
        if problems.is_empty() {
            Ok(canonical(input))
        } else {
            Err(InvalidInput {
                tool: self.name.clone(),
                problems: problems.join("; "),
            })
        }
    }
}

/// The same value with every object's keys sorted, so that equal inputs
/// compare and serialize equal.
pub fn canonical(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            let mut sorted = Map::new();
            for (key, value) in entries {
                sorted.insert(key, canonical(value));
            }
            Value::Object(sorted)
        }
        Value::Array(items) => Value::Array(items.into_iter().map(canonical).collect()),
        other => other,
    }
}

fn compile(name: &str, schema: &Value) -> Result<jsonschema::Validator, RegistryError> {
    jsonschema::validator_for(schema)
        .map_err(|e| RegistryError::Schema(name.to_owned(), e.to_string()))
}

fn configured(config: &ToolConfig) -> Result<Tool, RegistryError> {
    let runner = match &config.http {
        Some(http) => Runner::Http(http.clone()),
        None => Runner::DemoPublish,
    };
    Ok(Tool {
        name: config.name.clone(),
        description: config.description.clone(),
        validator: compile(&config.name, &config.input_schema)?,
        input_schema: config.input_schema.clone(),
        risk: config.risk.clone(),
        summary: config
            .summary
            .clone()
            .unwrap_or_else(|| config.description.clone()),
        estimated_cost_usd: config.estimated_cost_usd,
        recovery: config.recovery,
        connection: config.connection.clone(),
        runner,
    })
}

fn builtins() -> Vec<Result<Tool, RegistryError>> {
    let ask_schema = json!({
        "type": "object",
        "properties": {
            "questions": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "key": { "type": "string", "minLength": 1 },
                        "prompt": { "type": "string", "minLength": 1 },
                        "options": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "value": { "type": "string", "minLength": 1 },
                                    "label": { "type": "string" },
                                    "description": { "type": "string" }
                                },
                                "required": ["value"],
                                "additionalProperties": false
                            }
                        },
                        "multiple": { "type": "boolean" },
                        "allowOther": { "type": "boolean" }
                    },
                    "required": ["key", "prompt"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["questions"],
        "additionalProperties": false
    });
    let publish_schema = json!({
        "type": "object",
        "properties": { "text": { "type": "string", "minLength": 1 } },
        "required": ["text"],
        "additionalProperties": false
    });
    vec![
        compile("ask_questions", &ask_schema).map(|validator| Tool {
            name: "ask_questions".into(),
            description: "Ask the person one or more questions and wait for the answers.".into(),
            input_schema: ask_schema.clone(),
            validator,
            risk: None,
            summary: "Ask questions".into(),
            estimated_cost_usd: None,
            recovery: Recovery::Idempotent,
            connection: None,
            runner: Runner::AskQuestions,
        }),
        compile("demo_publish", &publish_schema).map(|validator| Tool {
            name: "demo_publish".into(),
            description: "Publish a post (a demonstration: it records the post and returns it)."
                .into(),
            input_schema: publish_schema.clone(),
            validator,
            risk: Some("publish".into()),
            summary: "Publish a post".into(),
            estimated_cost_usd: Some(0.0),
            recovery: Recovery::Idempotent,
            connection: None,
            runner: Runner::DemoPublish,
        }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry(extra: &str) -> Registry {
        let text = format!(
            "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\ntools = [\"ask_questions\", \"demo_publish\"]\n{extra}"
        );
        let config = FileConfig::from_toml(&text).unwrap();
        Registry::from_config(&config).unwrap()
    }

    #[test]
    fn built_ins_are_always_there_and_agents_pick_theirs() {
        let registry = registry("");
        let config = FileConfig::from_toml(
            "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\ntools = [\"demo_publish\"]\n",
        )
        .unwrap();
        let offered: Vec<String> = registry
            .for_agent(&config.agents[0])
            .iter()
            .map(|t| t.name.clone())
            .collect();
        assert_eq!(offered, ["demo_publish"]);
        assert_eq!(
            registry.get("demo_publish").unwrap().risk.as_deref(),
            Some("publish")
        );
    }

    #[test]
    fn input_is_validated_and_normalized() {
        let registry = registry(
            r#"
[[tools]]
name = "post"
description = "Post"
input_schema = { type = "object", properties = { text = { type = "string" }, channel = { type = "string", default = "general" } }, required = ["text"], additionalProperties = false }
http = { url = "http://127.0.0.1:9/post" }
"#,
        );
        let tool = registry.get("post").unwrap();
        let normalized = tool.normalize(&json!({ "text": "hi" })).unwrap();
        assert_eq!(normalized, json!({ "channel": "general", "text": "hi" }));
        assert_eq!(
            serde_json::to_string(&normalized).unwrap(),
            r#"{"channel":"general","text":"hi"}"#
        );
        let refused = tool
            .normalize(&json!({ "text": 5, "extra": true }))
            .unwrap_err();
        assert!(refused.problems.contains("/text"), "{refused}");
        assert!(refused.problems.contains("extra"), "{refused}");
        let ask = registry.get("ask_questions").unwrap();
        assert!(ask.normalize(&json!({ "questions": [] })).is_err());
        assert!(
            ask.normalize(&json!({ "questions": [{ "key": "k", "prompt": "Which?" }] }))
                .is_ok()
        );
    }

    #[test]
    fn canonical_order_is_recursive() {
        let value = canonical(json!({ "b": { "z": 1, "a": [ { "y": 2, "x": 1 } ] }, "a": 0 }));
        assert_eq!(
            serde_json::to_string(&value).unwrap(),
            r#"{"a":0,"b":{"a":[{"x":1,"y":2}],"z":1}}"#
        );
    }
}
