//! A run's assistant message as the AI SDK's UI message stream chunks: what
//! the message holds now (a snapshot read through the schema) compared
//! with what the client was sent, and the live deltas between snapshots.
//! Pure: it reads JSON and writes chunks, and keeps what it sent.
//!
//! | Tether | chunk |
//! |---|---|
//! | the assistant message | `start` (`messageId`, `messageMetadata.runId`), `start-step` |
//! | a `TEXT` part (`REASONING`) | `text-start` (`reasoning-start`), `text-delta`s from `part.delta`s and the persisted text, `text-end` when done or when something follows |
//! | a `TOOL_CALL` part | `tool-input-start`, `tool-input-available` (`dynamic: true`); its outcome: `SUCCEEDED` `tool-output-available`, `DENIED` `tool-output-denied`, any other `tool-output-error` |
//! | a text part after a tool call | `finish-step`, `start-step` |
//! | a pending approval | `tool-approval-request` (`approvalId` the interaction, `toolCallId`) |
//! | a `QUESTION` part | `data-question` (`id` the interaction), again when it changes |
//! | a `CONNECTION` part | `data-connection` (`id` the interaction, `loginUrl` while pending), again when it changes |
//! | an `ERROR` or `NOTICE` part | `data-notice` (`id` the part) |
//! | the run parked on a pause | `finish` (`finishReason: "tool-calls"`) |
//! | the run ended | `finish` (`stop` when completed, `other` when cancelled); `error` when failed |

use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

/// What the client was sent of one message.
#[derive(Default)]
pub struct Projector {
    run_id: String,
    step_open: bool,
    /// A tool call was sent in the open step: the next text starts a step.
    step_has_tools: bool,
    texts: HashMap<String, Text>,
    /// Tool calls sent, and whether their outcome was.
    tools: HashMap<String, bool>,
    approvals: HashSet<String>,
    /// The data of each data part sent, by its id.
    data: HashMap<String, Value>,
    /// Calls decided by the request this stream answers: the run parked
    /// on another pause does not end the stream before their outcomes,
    /// or the client would send the same decisions again.
    awaiting: HashSet<String>,
}

/// A text or reasoning part sent.
struct Text {
    kind: &'static str,
    /// How much of its text was sent, in UTF-16 code units, as deltas
    /// count.
    sent_units: usize,
    open: bool,
}

/// How a run stands, read beside its message.
#[derive(PartialEq, Eq, Debug)]
pub enum Standing {
    Going,
    /// Parked on a pause (an approval, a question, a connection).
    Parked,
    Ended,
}

impl Projector {
    pub fn new(run_id: &str) -> Projector {
        Projector {
            run_id: run_id.to_owned(),
            ..Projector::default()
        }
    }

    /// The chunks that open the message's stream.
    pub fn start(&mut self, message_id: &str, out: &mut Vec<Value>) {
        out.push(json!({
            "type": "start",
            "messageId": message_id,
            "messageMetadata": { "runId": self.run_id },
        }));
    }

    /// Whether the part was sent (open or done): a delta of a part not
    /// yet sent needs the part first.
    pub fn knows(&self, part_id: &str) -> bool {
        self.texts.contains_key(part_id)
    }

    /// Calls whose outcome the stream waits for even while the run is
    /// parked (see `awaiting`).
    pub fn await_outcomes(&mut self, calls: impl IntoIterator<Item = String>) {
        self.awaiting.extend(calls);
    }

    /// A live delta: the text at `offset` (UTF-16 code units) of the part;
    /// what overlaps what was sent is dropped, and a delta past it (one
    /// was missed) waits for the persisted text.
    pub fn delta(&mut self, part_id: &str, offset: usize, delta: &str, out: &mut Vec<Value>) {
        let Some(text) = self.texts.get_mut(part_id).filter(|text| text.open) else {
            return;
        };
        if offset > text.sent_units {
            return;
        }
        let Some(new) = from_unit(delta, text.sent_units - offset) else {
            return;
        };
        if new.is_empty() {
            return;
        }
        text.sent_units += units(new);
        out.push(json!({ "type": format!("{}-delta", text.kind), "id": part_id, "delta": new }));
    }

    /// Brings the client to `snapshot` (the data of `SNAPSHOT`): every part
    /// in order, then the pending approvals. Returns how the run stands.
    pub fn sync(&mut self, snapshot: &Value, out: &mut Vec<Value>) -> Standing {
        if !self.step_open {
            out.push(json!({ "type": "start-step" }));
            self.step_open = true;
        }
        let parts = snapshot["message"]["parts"].as_array();
        for part in parts.into_iter().flatten() {
            self.part(part, snapshot, out);
        }
        for pending in snapshot["pendingApprovals"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let (Some(approval), Some(call)) = (
                pending["interactionId"].as_str(),
                pending["toolCallId"].as_str(),
            ) else {
                continue;
            };
            if self.tools.contains_key(call) && self.approvals.insert(approval.to_owned()) {
                out.push(json!({
                    "type": "tool-approval-request",
                    "approvalId": approval,
                    "toolCallId": call,
                }));
            }
        }
        let decided = self
            .awaiting
            .iter()
            .all(|call| self.tools.get(call) == Some(&true));
        match snapshot["run"]["status"].as_str() {
            Some("COMPLETED" | "FAILED" | "CANCELLED") => Standing::Ended,
            Some(status) if status.starts_with("WAITING_FOR_") && decided => Standing::Parked,
            _ => Standing::Going,
        }
    }

    fn part(&mut self, part: &Value, snapshot: &Value, out: &mut Vec<Value>) {
        let Some(id) = part["id"].as_str() else {
            return;
        };
        match part["kind"].as_str() {
            Some(kind @ ("TEXT" | "REASONING")) => {
                let kind = if kind == "TEXT" { "text" } else { "reasoning" };
                self.text(id, kind, part, out);
            }
            Some("TOOL_CALL") => self.tool_call(&part["toolCall"], out),
            Some("QUESTION") => {
                let question = &part["question"];
                let data = json!({
                    "interactionId": part["interactionId"],
                    "runId": self.run_id,
                    "status": question["status"],
                    "questions": question["questions"],
                    "answers": question["answers"],
                });
                self.data_part("data-question", &part["interactionId"], data, out);
            }
            Some("CONNECTION") => {
                let connection = &part["connection"];
                let pending = &snapshot["pendingConnection"];
                let login_url = if pending["interactionId"] == part["interactionId"] {
                    pending["loginUrl"].clone()
                } else {
                    Value::Null
                };
                let data = json!({
                    "interactionId": part["interactionId"],
                    "runId": self.run_id,
                    "provider": connection["provider"],
                    "gap": connection["gap"],
                    "status": connection["status"],
                    "loginUrl": login_url,
                });
                self.data_part("data-connection", &part["interactionId"], data, out);
            }
            Some(kind @ ("ERROR" | "NOTICE")) => {
                let data = json!({ "kind": kind, "text": part["text"] });
                self.data_part("data-notice", &part["id"], data, out);
            }
            // The tool part shows its approval.
            _ => {}
        }
    }

    fn text(&mut self, id: &str, kind: &'static str, part: &Value, out: &mut Vec<Value>) {
        if !self.texts.contains_key(id) {
            // Text after the step's tool calls is the next step's.
            if self.step_has_tools {
                self.end_step(out);
                out.push(json!({ "type": "start-step" }));
                self.step_open = true;
            }
            self.close_texts(out);
            out.push(json!({ "type": format!("{kind}-start"), "id": id }));
            self.texts.insert(
                id.to_owned(),
                Text {
                    kind,
                    sent_units: 0,
                    open: true,
                },
            );
        }
        let text = self.texts.get_mut(id).expect("inserted above");
        if !text.open {
            return;
        }
        let persisted = part["text"].as_str().unwrap_or_default();
        // Deltas may have gone further than the last checkpoint.
        if let Some(new) = from_unit(persisted, text.sent_units).filter(|new| !new.is_empty()) {
            text.sent_units += units(new);
            out.push(json!({ "type": format!("{kind}-delta"), "id": id, "delta": new }));
        }
        if part["state"] == "DONE" {
            text.open = false;
            out.push(json!({ "type": format!("{kind}-end"), "id": id }));
        }
    }

    fn tool_call(&mut self, call: &Value, out: &mut Vec<Value>) {
        let Some(id) = call["id"].as_str() else {
            return;
        };
        if !self.tools.contains_key(id) {
            self.close_texts(out);
            out.push(json!({
                "type": "tool-input-start",
                "toolCallId": id,
                "toolName": call["name"],
                "dynamic": true,
            }));
            out.push(json!({
                "type": "tool-input-available",
                "toolCallId": id,
                "toolName": call["name"],
                "input": call["input"],
                "dynamic": true,
            }));
            self.tools.insert(id.to_owned(), false);
            self.step_has_tools = true;
        }
        let Some(outcome) = call["outcome"].as_str() else {
            return;
        };
        let sent = self.tools.get_mut(id).expect("inserted above");
        if *sent {
            return;
        }
        *sent = true;
        out.push(match outcome {
            "SUCCEEDED" => json!({ "type": "tool-output-available", "toolCallId": id, "output": call["output"], "dynamic": true }),
            "DENIED" => json!({ "type": "tool-output-denied", "toolCallId": id }),
            other => {
                let error_text = match &call["output"] {
                    Value::Null => format!("the call ended {other}"),
                    output => format!("the call ended {other}: {output}"),
                };
                json!({ "type": "tool-output-error", "toolCallId": id, "errorText": error_text, "dynamic": true })
            }
        });
    }

    /// A data part, sent again whenever its data changes.
    fn data_part(&mut self, kind: &str, id: &Value, data: Value, out: &mut Vec<Value>) {
        let Some(id) = id.as_str() else {
            return;
        };
        if self.data.get(id) == Some(&data) {
            return;
        }
        self.data.insert(id.to_owned(), data.clone());
        out.push(json!({ "type": kind, "id": id, "data": data }));
    }

    fn close_texts(&mut self, out: &mut Vec<Value>) {
        let mut open: Vec<(&String, &mut Text)> =
            self.texts.iter_mut().filter(|(_, t)| t.open).collect();
        open.sort_by(|a, b| a.0.cmp(b.0));
        for (id, text) in open {
            text.open = false;
            out.push(json!({ "type": format!("{}-end", text.kind), "id": id }));
        }
    }

    fn end_step(&mut self, out: &mut Vec<Value>) {
        self.close_texts(out);
        if self.step_open {
            out.push(json!({ "type": "finish-step" }));
        }
        self.step_open = false;
        self.step_has_tools = false;
    }

    /// The chunks that end the response: the run parked or ended, as
    /// `snapshot` shows it.
    pub fn finish(&mut self, snapshot: &Value, out: &mut Vec<Value>) {
        self.end_step(out);
        let run = &snapshot["run"];
        self.finish_as(
            run["status"].as_str().unwrap_or_default(),
            run["error"]["message"].as_str(),
            out,
        );
    }

    /// The response of a run that ended before it had a message (cancelled
    /// while queued, say): a message with nothing but its end.
    pub fn ended_without_message(&mut self, status: &str, out: &mut Vec<Value>) {
        out.push(json!({ "type": "start", "messageMetadata": { "runId": self.run_id } }));
        self.finish_as(status, None, out);
    }

    fn finish_as(&self, status: &str, error: Option<&str>, out: &mut Vec<Value>) {
        if status == "FAILED" {
            let error = error.unwrap_or("the run failed");
            out.push(json!({ "type": "error", "errorText": error }));
            return;
        }
        let reason = match status {
            "COMPLETED" => "stop",
            "CANCELLED" => "other",
            _ => "tool-calls",
        };
        out.push(json!({
            "type": "finish",
            "finishReason": reason,
            "messageMetadata": { "runId": self.run_id, "runStatus": status },
        }));
    }
}

/// `text` from its `unit`-th UTF-16 code unit; `None` when that falls
/// inside a character or past the end.
fn from_unit(text: &str, unit: usize) -> Option<&str> {
    let mut seen = 0;
    for (at, c) in text.char_indices() {
        if seen == unit {
            return Some(&text[at..]);
        }
        if seen > unit {
            return None;
        }
        seen += c.len_utf16();
    }
    (seen == unit).then_some("")
}

fn units(text: &str) -> usize {
    text.encode_utf16().count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(out: &[Value]) -> Vec<&str> {
        out.iter().map(|c| c["type"].as_str().unwrap()).collect()
    }

    fn snapshot(parts: Value, status: &str, pending: Value) -> Value {
        json!({
            "message": { "parts": parts },
            "run": { "status": status },
            "pendingApprovals": pending,
            "pendingConnection": null,
        })
    }

    #[test]
    fn utf16_offsets_split_on_characters_only() {
        assert_eq!(from_unit("a😀b", 0), Some("a😀b"));
        assert_eq!(from_unit("a😀b", 1), Some("😀b"));
        assert_eq!(from_unit("a😀b", 2), None, "inside the surrogate pair");
        assert_eq!(from_unit("a😀b", 3), Some("b"));
        assert_eq!(from_unit("a😀b", 4), Some(""));
        assert_eq!(from_unit("a😀b", 5), None);
    }

    #[test]
    fn deltas_and_checkpoints_send_each_character_once() {
        let mut projector = Projector::new("r");
        let mut out = Vec::new();
        let text = |t: &str, state: &str| json!([{ "id": "p", "kind": "TEXT", "state": state, "text": t }]);
        projector.sync(
            &snapshot(text("", "STREAMING"), "RUNNING", json!([])),
            &mut out,
        );
        projector.delta("p", 0, "Hel", &mut out);
        // A checkpoint behind the deltas, then one ahead of them.
        projector.sync(
            &snapshot(text("He", "STREAMING"), "RUNNING", json!([])),
            &mut out,
        );
        projector.sync(
            &snapshot(text("Hello", "STREAMING"), "RUNNING", json!([])),
            &mut out,
        );
        // A delta that overlaps, and one past a gap.
        projector.delta("p", 3, "lo, w", &mut out);
        projector.delta("p", 20, "zzz", &mut out);
        projector.sync(
            &snapshot(text("Hello, world", "DONE"), "COMPLETED", json!([])),
            &mut out,
        );
        let sent: String = out
            .iter()
            .filter(|c| c["type"] == "text-delta")
            .map(|c| c["delta"].as_str().unwrap())
            .collect();
        assert_eq!(sent, "Hello, world");
        assert_eq!(types(&out).first(), Some(&"start-step"));
        assert_eq!(types(&out).last(), Some(&"text-end"));
    }

    #[test]
    fn a_tool_call_awaiting_approval_then_decided_then_the_next_step() {
        let mut projector = Projector::new("r");
        let mut out = Vec::new();
        let call = |outcome: Value| {
            json!([
                { "id": "t1", "kind": "TEXT", "state": "DONE", "text": "Calling." },
                { "id": "p2", "kind": "TOOL_CALL", "toolCall": { "id": "c", "name": "publish", "input": { "x": 1 }, "outcome": outcome, "output": { "ok": true } } },
            ])
        };
        let pending = json!([{ "interactionId": "i", "toolCallId": "c" }]);
        let standing = projector.sync(
            &snapshot(call(Value::Null), "WAITING_FOR_APPROVAL", pending.clone()),
            &mut out,
        );
        assert_eq!(standing, Standing::Parked);
        projector.finish(
            &snapshot(Value::Null, "WAITING_FOR_APPROVAL", json!([])),
            &mut out,
        );
        assert_eq!(
            types(&out),
            [
                "start-step",
                "text-start",
                "text-delta",
                "text-end",
                "tool-input-start",
                "tool-input-available",
                "tool-approval-request",
                "finish-step",
                "finish",
            ]
        );
        assert_eq!(out.last().unwrap()["finishReason"], "tool-calls");

        // The re-POST's projector starts from what the client has (a sync
        // whose chunks are not sent), then sends only what is new.
        let mut projector = Projector::new("r");
        let mut more = Vec::new();
        projector.sync(
            &snapshot(call(Value::Null), "WAITING_FOR_APPROVAL", pending),
            &mut Vec::new(),
        );
        let mut parts = call(json!("SUCCEEDED"));
        parts
            .as_array_mut()
            .unwrap()
            .push(json!({ "id": "t3", "kind": "TEXT", "state": "DONE", "text": "Done." }));
        projector.sync(&snapshot(parts, "COMPLETED", json!([])), &mut more);
        projector.finish(&snapshot(Value::Null, "COMPLETED", json!([])), &mut more);
        assert_eq!(
            types(&more),
            [
                "tool-output-available",
                "finish-step",
                "start-step",
                "text-start",
                "text-delta",
                "text-end",
                "finish-step",
                "finish",
            ]
        );
    }

    #[test]
    fn a_decided_call_keeps_the_stream_open_while_the_run_waits_on_another_pause() {
        let mut projector = Projector::new("r");
        let call = |outcome: Value| json!([{ "id": "p", "kind": "TOOL_CALL", "toolCall": { "id": "c", "name": "publish", "input": {}, "outcome": outcome, "output": null } }]);
        projector.sync(
            &snapshot(call(Value::Null), "WAITING_FOR_APPROVAL", json!([])),
            &mut Vec::new(),
        );
        projector.await_outcomes(["c".to_owned()]);
        let mut out = Vec::new();
        let waiting = snapshot(call(Value::Null), "WAITING_FOR_QUESTION", json!([]));
        assert_eq!(projector.sync(&waiting, &mut out), Standing::Going);
        let decided = snapshot(call(json!("SUCCEEDED")), "WAITING_FOR_QUESTION", json!([]));
        assert_eq!(projector.sync(&decided, &mut out), Standing::Parked);
        assert_eq!(types(&out), ["tool-output-available"]);
    }

    #[test]
    fn a_question_is_sent_again_when_it_changes() {
        let mut projector = Projector::new("r");
        let question = |status: &str| json!([{ "id": "q", "kind": "QUESTION", "interactionId": "i", "question": { "status": status, "questions": [], "answers": null } }]);
        let mut out = Vec::new();
        projector.sync(
            &snapshot(question("PENDING"), "WAITING_FOR_QUESTION", json!([])),
            &mut out,
        );
        projector.sync(
            &snapshot(question("PENDING"), "WAITING_FOR_QUESTION", json!([])),
            &mut out,
        );
        projector.sync(
            &snapshot(question("RESOLVED"), "RUNNING", json!([])),
            &mut out,
        );
        let questions: Vec<&Value> = out
            .iter()
            .filter(|c| c["type"] == "data-question")
            .collect();
        assert_eq!(questions.len(), 2);
        assert_eq!(questions[0]["id"], "i");
        assert_eq!(questions[1]["data"]["status"], "RESOLVED");
    }
}
