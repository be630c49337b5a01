//! Interactions: a person's part in a run. Questions (`ask_questions`),
//! approvals of gated tool calls and consents to connect an account; each
//! is PENDING until resolved once, expired or cancelled. Answers are
//! validated here, purely.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::stored_enum;

stored_enum!(
    /// What a person is asked for.
    InteractionKind {
        Question => "QUESTION",
        Approval => "APPROVAL",
        Connection => "CONNECTION",
    }
);

stored_enum!(
    /// Where an interaction is.
    InteractionStatus {
        Pending => "PENDING",
        Resolved => "RESOLVED",
        Expired => "EXPIRED",
        Cancelled => "CANCELLED",
    }
);

stored_enum!(
    /// Why a call that needs a connection cannot have its token.
    ConnectionGap {
        Absent => "ABSENT",
        Expired => "EXPIRED",
        InsufficientScope => "INSUFFICIENT_SCOPE",
    }
);

stored_enum!(
    /// A person's decision on a gated tool call.
    ApprovalDecision {
        AllowOnce => "ALLOW_ONCE",
        AllowConversation => "ALLOW_CONVERSATION",
        AllowAlways => "ALLOW_ALWAYS",
        Deny => "DENY",
    }
);

/// One option of a question, with its label resolved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, async_graphql::SimpleObject)]
pub struct QuestionOption {
    pub value: String,
    pub label: String,
    pub description: Option<String>,
}

/// One question, every optional field resolved as the contract says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, async_graphql::SimpleObject)]
#[serde(rename_all = "camelCase")]
pub struct QuestionSpec {
    pub key: String,
    pub prompt: String,
    pub options: Vec<QuestionOption>,
    pub multiple: bool,
    pub allow_other: bool,
}

/// One answer as a person gives it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, async_graphql::SimpleObject)]
#[graphql(name = "QuestionAnswer")]
pub struct Answer {
    pub key: String,
    pub values: Vec<String>,
    pub other: Option<String>,
}

/// Why answers were refused, naming the question when there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AnswerError {
    pub key: Option<String>,
    pub message: String,
}

fn refuse(key: &str, message: impl Into<String>) -> AnswerError {
    AnswerError {
        key: Some(key.to_owned()),
        message: message.into(),
    }
}

/// The questions of an `ask_questions` input (already checked against the
/// tool's schema), with defaults resolved: `label` is `value`, `multiple`
/// false, `allowOther` true exactly when there are no options unless set.
/// Duplicate keys are refused.
pub fn questions(input: &Value) -> Result<Vec<QuestionSpec>, String> {
    let mut specs = Vec::new();
    let mut keys = HashSet::new();
    for question in input["questions"].as_array().into_iter().flatten() {
        let key = question["key"].as_str().unwrap_or_default().to_owned();
        if !keys.insert(key.clone()) {
            return Err(format!("the question key {key:?} is used twice"));
        }
        let options: Vec<QuestionOption> = question["options"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|option| {
                let value = option["value"].as_str().unwrap_or_default().to_owned();
                QuestionOption {
                    label: option["label"].as_str().unwrap_or(&value).to_owned(),
                    description: option["description"].as_str().map(str::to_owned),
                    value,
                }
            })
            .collect();
        let mut values = HashSet::new();
        if let Some(dup) = options.iter().find(|o| !values.insert(o.value.as_str())) {
            return Err(format!(
                "question {key:?} offers the option {:?} twice",
                dup.value
            ));
        }
        specs.push(QuestionSpec {
            prompt: question["prompt"].as_str().unwrap_or_default().to_owned(),
            multiple: question["multiple"].as_bool().unwrap_or(false),
            allow_other: question["allowOther"]
                .as_bool()
                .unwrap_or(options.is_empty()),
            options,
            key,
        });
    }
    if specs.is_empty() {
        return Err("there are no questions".into());
    }
    Ok(specs)
}

/// Checks answers against the questions: each key exactly once; `values`
/// distinct option values; `other` (trimmed, not empty) only where
/// `allowOther`; at least one of them, exactly one unless `multiple`.
/// Returns the answers in question order, `other` trimmed.
pub fn validate_answers(
    specs: &[QuestionSpec],
    answers: &[Answer],
) -> Result<Vec<Answer>, AnswerError> {
    let mut seen = HashSet::new();
    for answer in answers {
        if !specs.iter().any(|s| s.key == answer.key) {
            return Err(refuse(&answer.key, "there is no question with this key"));
        }
        if !seen.insert(answer.key.as_str()) {
            return Err(refuse(&answer.key, "this question is answered twice"));
        }
    }
    let mut valid = Vec::with_capacity(specs.len());
    for spec in specs {
        let Some(answer) = answers.iter().find(|a| a.key == spec.key) else {
            return Err(refuse(&spec.key, "this question has no answer"));
        };
        let mut values = HashSet::new();
        for value in &answer.values {
            if !spec.options.iter().any(|o| &o.value == value) {
                return Err(refuse(
                    &spec.key,
                    format!("{value:?} is not one of the options"),
                ));
            }
            if !values.insert(value.as_str()) {
                return Err(refuse(&spec.key, format!("{value:?} is given twice")));
            }
        }
        let other = match answer.other.as_deref().map(str::trim) {
            None => None,
            Some("") => return Err(refuse(&spec.key, "`other` is empty")),
            Some(_) if !spec.allow_other => {
                return Err(refuse(&spec.key, "this question takes no other answer"));
            }
            Some(text) => Some(text.to_owned()),
        };
        let given = answer.values.len() + usize::from(other.is_some());
        if given == 0 {
            return Err(refuse(&spec.key, "the answer is empty"));
        }
        if given > 1 && !spec.multiple {
            return Err(refuse(&spec.key, "this question takes exactly one answer"));
        }
        valid.push(Answer {
            key: spec.key.clone(),
            values: answer.values.clone(),
            other,
        });
    }
    Ok(valid)
}

/// The answers as the model reads them, in a user turn.
pub fn answers_text(specs: &[QuestionSpec], answers: &[Answer]) -> String {
    let mut text = String::from("Answers to your questions:");
    for answer in answers {
        let prompt = specs
            .iter()
            .find(|s| s.key == answer.key)
            .map_or("", |s| s.prompt.as_str());
        let mut given: Vec<String> = answer.values.clone();
        given.extend(answer.other.iter().map(|o| format!("(other) {o}")));
        text.push_str(&format!(
            "\n- {} ({prompt}): {}",
            answer.key,
            given.join(", ")
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn specs() -> Vec<QuestionSpec> {
        questions(&json!({ "questions": [
            { "key": "color", "prompt": "Which color?", "options": [
                { "value": "red" }, { "value": "blue", "label": "Blue", "description": "calm" } ] },
            { "key": "days", "prompt": "Which days?", "multiple": true, "options": [
                { "value": "mon" }, { "value": "tue" } ] },
            { "key": "name", "prompt": "Your name?" }
        ] }))
        .unwrap()
    }

    fn answer(key: &str, values: &[&str], other: Option<&str>) -> Answer {
        Answer {
            key: key.into(),
            values: values.iter().map(|v| (*v).to_owned()).collect(),
            other: other.map(str::to_owned),
        }
    }

    #[test]
    fn optional_fields_resolve_as_the_contract_says() {
        let specs = specs();
        assert_eq!(specs[0].options[0].label, "red");
        assert_eq!(specs[0].options[1].label, "Blue");
        assert!(!specs[0].multiple && !specs[0].allow_other);
        assert!(specs[1].multiple);
        assert!(specs[2].options.is_empty() && specs[2].allow_other);
        assert!(
            questions(&json!({ "questions": [
            { "key": "a", "prompt": "?" }, { "key": "a", "prompt": "?" } ] }))
            .is_err()
        );
    }

    #[test]
    fn valid_answers_are_kept_in_question_order_with_other_trimmed() {
        let answers = [
            answer("name", &[], Some("  Ada ")),
            answer("days", &["mon", "tue"], None),
            answer("color", &["blue"], None),
        ];
        let valid = validate_answers(&specs(), &answers).unwrap();
        assert_eq!(valid[0].key, "color");
        assert_eq!(valid[2].other.as_deref(), Some("Ada"));
        let text = answers_text(&specs(), &valid);
        assert!(text.contains("- days (Which days?): mon, tue"), "{text}");
        assert!(text.contains("(other) Ada"), "{text}");
    }

    #[test]
    fn each_refusal_names_its_key() {
        let ok = |k: &str| match k {
            "color" => answer("color", &["red"], None),
            "days" => answer("days", &["mon"], None),
            _ => answer("name", &[], Some("Ada")),
        };
        let cases: Vec<(Vec<Answer>, &str)> = vec![
            (vec![ok("color"), ok("days")], "name"),
            (
                vec![ok("color"), ok("days"), ok("name"), ok("name")],
                "name",
            ),
            (
                vec![
                    ok("color"),
                    ok("days"),
                    ok("name"),
                    answer("x", &["a"], None),
                ],
                "x",
            ),
            (
                vec![answer("color", &["green"], None), ok("days"), ok("name")],
                "color",
            ),
            (
                vec![
                    answer("color", &["red", "blue"], None),
                    ok("days"),
                    ok("name"),
                ],
                "color",
            ),
            (
                vec![
                    answer("color", &["red"], Some("pink")),
                    ok("days"),
                    ok("name"),
                ],
                "color",
            ),
            (
                vec![
                    ok("color"),
                    answer("days", &["mon", "mon"], None),
                    ok("name"),
                ],
                "days",
            ),
            (
                vec![ok("color"), answer("days", &[], None), ok("name")],
                "days",
            ),
            (
                vec![ok("color"), ok("days"), answer("name", &[], Some("   "))],
                "name",
            ),
        ];
        for (answers, key) in cases {
            let err = validate_answers(&specs(), &answers).unwrap_err();
            assert_eq!(err.key.as_deref(), Some(key), "{err} for {answers:?}");
        }
    }
}
