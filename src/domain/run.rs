//! The run's status and how it ends.

use super::stored_enum;

stored_enum!(
    /// Where a run is in its life.
    RunStatus {
        Queued => "QUEUED",
        Running => "RUNNING",
        RetryPending => "RETRY_PENDING",
        WaitingForQuestion => "WAITING_FOR_QUESTION",
        WaitingForApproval => "WAITING_FOR_APPROVAL",
        WaitingForConnection => "WAITING_FOR_CONNECTION",
        Completed => "COMPLETED",
        Failed => "FAILED",
        Cancelled => "CANCELLED",
    }
);

stored_enum!(
    /// Why a run ended.
    EndCause {
        Natural => "NATURAL",
        Stopped => "STOPPED",
        StepLimit => "STEP_LIMIT",
        ToolCallLimit => "TOOL_CALL_LIMIT",
        Timeout => "TIMEOUT",
        TokenLimit => "TOKEN_LIMIT",
        CostLimit => "COST_LIMIT",
        LoopDetected => "LOOP_DETECTED",
        TooManyErrors => "TOO_MANY_ERRORS",
        Error => "ERROR",
        ConsentExpired => "CONSENT_EXPIRED",
        RecoveryLimit => "RECOVERY_LIMIT",
        Cancelled => "CANCELLED",
        Interrupted => "INTERRUPTED",
    }
);

impl RunStatus {
    pub fn is_ended(self) -> bool {
        matches!(
            self,
            RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled
        )
    }

    /// Statuses a person or the API may end at once, without a worker.
    pub fn is_parked(self) -> bool {
        matches!(
            self,
            RunStatus::Queued
                | RunStatus::RetryPending
                | RunStatus::WaitingForQuestion
                | RunStatus::WaitingForApproval
                | RunStatus::WaitingForConnection
        )
    }

    /// The statuses that have not ended, for queries that look for them.
    pub fn not_ended() -> impl Iterator<Item = RunStatus> {
        RunStatus::ALL.iter().copied().filter(|s| !s.is_ended())
    }
}

impl EndCause {
    /// The final status a run takes when it ends for this cause.
    pub fn final_status(self) -> RunStatus {
        match self {
            EndCause::Natural | EndCause::Stopped => RunStatus::Completed,
            EndCause::Cancelled | EndCause::Interrupted => RunStatus::Cancelled,
            _ => RunStatus::Failed,
        }
    }
}

/// Why a run failed, as the API shows it.
#[derive(
    Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, async_graphql::SimpleObject,
)]
#[serde(rename_all = "camelCase")]
pub struct RunError {
    pub code: String,
    pub message: String,
    pub http_status: Option<i32>,
    pub retryable: bool,
}

/// Tokens and cost summed over a run.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    async_graphql::SimpleObject,
)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cost_usd: f64,
}

/// A refused transition: the run is not in a status that allows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a {from} run cannot {action}")]
pub struct IllegalTransition {
    pub from: RunStatus,
    pub action: &'static str,
}

/// Ends a run that no worker holds (queued, waiting, or between retries).
pub fn end_parked(from: RunStatus, cause: EndCause) -> Result<RunStatus, IllegalTransition> {
    if from.is_parked() {
        Ok(cause.final_status())
    } else {
        Err(IllegalTransition {
            from,
            action: "be ended without its worker",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cause_maps_to_an_ended_status() {
        for cause in EndCause::ALL {
            assert!(cause.final_status().is_ended(), "{cause}");
        }
        assert_eq!(EndCause::Stopped.final_status(), RunStatus::Completed);
        assert_eq!(EndCause::Interrupted.final_status(), RunStatus::Cancelled);
        assert_eq!(EndCause::RecoveryLimit.final_status(), RunStatus::Failed);
    }

    #[test]
    fn only_parked_runs_end_without_a_worker() {
        for status in RunStatus::ALL {
            let result = end_parked(*status, EndCause::Cancelled);
            if status.is_parked() {
                assert_eq!(result, Ok(RunStatus::Cancelled));
            } else {
                assert!(result.is_err(), "{status}");
            }
        }
    }
}
