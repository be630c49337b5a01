//! The operators' command-line listings (`tether runs --stuck`, `tether
//! tool-calls --unknown`): a table for people, or one JSON object a line.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::json;

use crate::config::FileConfig;
use crate::domain::time::{now_millis, to_rfc3339};
use crate::store::entities::tool_call;
use crate::store::operations::{self, StuckRun};
use crate::store::{self, Store};

/// How a listing is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Table,
    JsonLines,
}

/// `tether runs --stuck`.
pub async fn stuck_runs(
    store: &Store,
    queued_longer_than: Duration,
    format: Format,
) -> store::Result<String> {
    let stuck = operations::stuck_runs(store, queued_longer_than).await?;
    Ok(match format {
        Format::JsonLines => lines(stuck.iter().map(|s| {
            json!({
                "runId": s.run.id,
                "tenant": s.run.tenant,
                "conversationId": s.run.conversation_id,
                "status": s.run.status,
                "reason": s.why.as_str(),
                "since": to_rfc3339(s.since),
                "leaseOwner": s.run.lease_owner,
            })
        })),
        Format::Table => {
            if stuck.is_empty() {
                return Ok("no stuck runs\n".to_owned());
            }
            table(
                ["RUN", "TENANT", "STATUS", "REASON", "SINCE"],
                stuck.iter().map(|s: &StuckRun| {
                    [
                        s.run.id.to_string(),
                        s.run.tenant.clone(),
                        s.run.status.clone(),
                        s.why.as_str().to_owned(),
                        since(s.since),
                    ]
                }),
            )
        }
    })
}

/// `tether tool-calls --unknown`.
pub async fn unknown_tool_calls(
    store: &Store,
    config: &FileConfig,
    format: Format,
) -> store::Result<String> {
    let calls = operations::unknown_tool_calls(store).await?;
    let target = |call: &tool_call::Model| config.tool_target(&call.name);
    Ok(match format {
        Format::JsonLines => lines(calls.iter().map(|c| {
            json!({
                "toolCallId": c.id,
                "tenant": c.tenant,
                "conversationId": c.conversation_id,
                "runId": c.run_id,
                "tool": c.name,
                "idempotencyKey": c.idempotency_key,
                "target": target(c),
                "startedAt": c.started_at.and_then(to_rfc3339),
            })
        })),
        Format::Table => {
            if calls.is_empty() {
                return Ok("no tool calls of unknown outcome\n".to_owned());
            }
            table(
                [
                    "TOOL CALL",
                    "TENANT",
                    "TOOL",
                    "IDEMPOTENCY KEY",
                    "TARGET",
                    "STARTED",
                ],
                calls.iter().map(|c| {
                    [
                        c.id.to_string(),
                        c.tenant.clone(),
                        c.name.clone(),
                        c.idempotency_key.clone(),
                        target(c).unwrap_or_else(|| "-".to_owned()),
                        c.started_at.map_or_else(|| "-".to_owned(), since),
                    ]
                }),
            )
        }
    })
}

fn lines(rows: impl Iterator<Item = serde_json::Value>) -> String {
    rows.map(|row| format!("{row}\n")).collect()
}

/// A time, and how long ago it was.
fn since(at: i64) -> String {
    let ago = Duration::from_secs(((now_millis() - at).max(0) / 1000) as u64);
    format!(
        "{} ({} ago)",
        to_rfc3339(at).unwrap_or_default(),
        humantime::format_duration(ago)
    )
}

/// Columns padded to their widest cell.
fn table<const N: usize>(header: [&str; N], rows: impl Iterator<Item = [String; N]>) -> String {
    let rows: Vec<[String; N]> = rows.collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:width$}"))
            .collect();
        let _ = writeln!(out, "{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::table;

    #[test]
    fn a_table_pads_each_column_to_its_widest_cell() {
        let out = table(
            ["A", "LONG HEADER"],
            [
                ["wide cell".to_owned(), "x".to_owned()],
                ["y".to_owned(), "z".to_owned()],
            ]
            .into_iter(),
        );
        assert_eq!(out, "A          LONG HEADER\nwide cell  x\ny          z\n");
    }
}
