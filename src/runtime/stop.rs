//! The agent's stop conditions (`[agents.stop]`), checked at step end. Each
//! answers with the end cause and a reason naming the condition.

use std::collections::HashMap;

use crate::config::StopConfig;
use crate::domain::run::EndCause;
use crate::domain::tool_call::ToolOutcome;
use crate::store::entities::tool_call;

/// `content_match`: the step's text matches the agent's pattern.
pub fn content_matched(stop: &StopConfig, text: &str) -> Option<(EndCause, String)> {
    let pattern = stop.content_match.as_deref()?;
    // The pattern was checked at start-up; one that fails here never matches.
    let regex = regex::Regex::new(pattern).ok()?;
    regex.is_match(text).then(|| {
        (
            EndCause::Stopped,
            format!("stop condition content_match: the reply matched /{pattern}/"),
        )
    })
}

/// Whether any condition looks at the run's tool calls (else a step end
/// need not read them).
pub fn looks_at_calls(stop: &StopConfig) -> bool {
    !stop.on_tools.is_empty()
        || stop.repeated_calls.is_some()
        || stop.consecutive_tool_errors.is_some()
}

/// The conditions that look at tool calls, after step `step`'s batch, over
/// every call of the run (`calls`, in order), then `content_match`.
pub fn after_tools(
    stop: &StopConfig,
    calls: &[tool_call::Model],
    step: i32,
    text: &str,
) -> Option<(EndCause, String)> {
    let succeeded =
        |call: &tool_call::Model| call.outcome.as_deref() == Some(ToolOutcome::Succeeded.as_str());
    if let Some(call) = calls
        .iter()
        .find(|c| c.step == step && succeeded(c) && stop.on_tools.contains(&c.name))
    {
        return Some((
            EndCause::Stopped,
            format!("stop condition on_tools: {} succeeded", call.name),
        ));
    }
    if let Some(found) = content_matched(stop, text) {
        return Some(found);
    }
    if let Some(limit) = stop.repeated_calls {
        let mut seen: HashMap<(String, String), u32> = HashMap::new();
        for call in calls {
            let input = call.input.as_ref().unwrap_or(&call.model_input).to_string();
            let count = seen.entry((call.name.clone(), input)).or_default();
            *count += 1;
            if *count >= limit {
                return Some((
                    EndCause::LoopDetected,
                    format!(
                        "stop condition repeated_calls: {} was called {count} times with the same input",
                        call.name
                    ),
                ));
            }
        }
    }
    if let Some(limit) = stop.consecutive_tool_errors {
        let failing = calls.iter().rev().take_while(|c| !succeeded(c)).count();
        if failing as u32 >= limit {
            return Some((
                EndCause::TooManyErrors,
                format!(
                    "stop condition consecutive_tool_errors: the last {failing} tool calls failed"
                ),
            ));
        }
    }
    None
}
