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

impl RunError {
    /// The error of a run that a limit or a condition of Tether's own ended.
    pub fn of_cause(cause: EndCause, message: String) -> RunError {
        RunError {
            code: cause.as_str().to_owned(),
            message,
            http_status: None,
            retryable: false,
        }
    }
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

/// What a person is being waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    Question,
    Approval,
    Connection,
}

/// Everything that moves a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunInput {
    /// A worker takes a queued run, or one whose retry is due.
    Claim,
    /// The worker parks the run until a person answers.
    Park(Waiting),
    /// A person answered: the run goes back to the queue.
    Resume,
    /// A model request failed transiently; the worker waits for the retry.
    ScheduleRetry,
    /// The worker gives the run back (shutdown), or its lease expired and
    /// the reaper re-queues it.
    Requeue,
    /// The run ends for this cause.
    End(EndCause),
    /// An operator queues again a run that failed because its recoveries
    /// ran out (the store checks the cause): the one way an ended run
    /// moves again.
    Reopen,
}

impl RunInput {
    fn describe(self) -> &'static str {
        match self {
            RunInput::Claim => "be claimed",
            RunInput::Park(_) => "park",
            RunInput::Resume => "resume",
            RunInput::ScheduleRetry => "wait for a retry",
            RunInput::Requeue => "be re-queued",
            RunInput::End(_) => "end",
            RunInput::Reopen => "be queued again",
        }
    }
}

/// The run's next status, or a refusal. Ended runs never move again, but
/// for an operator's `Reopen` of a failed run; only a
/// claim makes a run `RUNNING`, and only from `QUEUED` or `RETRY_PENDING`.
pub fn transition(from: RunStatus, input: RunInput) -> Result<RunStatus, IllegalTransition> {
    use RunStatus::*;
    let to = match (from, input) {
        (Queued | RetryPending, RunInput::Claim) => Running,
        (Running, RunInput::Park(Waiting::Question)) => WaitingForQuestion,
        (Running, RunInput::Park(Waiting::Approval)) => WaitingForApproval,
        (Running, RunInput::Park(Waiting::Connection)) => WaitingForConnection,
        (WaitingForQuestion | WaitingForApproval | WaitingForConnection, RunInput::Resume) => {
            Queued
        }
        (Running, RunInput::ScheduleRetry) => RetryPending,
        (Running, RunInput::Requeue) => Queued,
        (Running, RunInput::End(cause)) => cause.final_status(),
        (Failed, RunInput::Reopen) => Queued,
        (from, RunInput::End(cause)) if from.is_parked() && cause.ends_parked() => {
            cause.final_status()
        }
        _ => {
            return Err(IllegalTransition {
                from,
                action: input.describe(),
            });
        }
    };
    Ok(to)
}

impl EndCause {
    /// Causes that can end a run no worker holds: a person or the API
    /// cancels it, a pause expires, recovery gives up, its time runs out.
    fn ends_parked(self) -> bool {
        matches!(
            self,
            EndCause::Cancelled
                | EndCause::Interrupted
                | EndCause::ConsentExpired
                | EndCause::RecoveryLimit
                | EndCause::Timeout
                | EndCause::Error
        )
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

    fn inputs() -> Vec<RunInput> {
        let mut all = vec![
            RunInput::Claim,
            RunInput::Park(Waiting::Question),
            RunInput::Park(Waiting::Approval),
            RunInput::Park(Waiting::Connection),
            RunInput::Resume,
            RunInput::ScheduleRetry,
            RunInput::Requeue,
        ];
        all.extend(EndCause::ALL.iter().map(|c| RunInput::End(*c)));
        all
    }

    #[test]
    fn every_legal_transition_and_no_other() {
        use RunStatus::*;
        for from in RunStatus::ALL {
            for input in inputs() {
                let expected = match (*from, input) {
                    (Queued | RetryPending, RunInput::Claim) => Some(Running),
                    (Running, RunInput::Park(Waiting::Question)) => Some(WaitingForQuestion),
                    (Running, RunInput::Park(Waiting::Approval)) => Some(WaitingForApproval),
                    (Running, RunInput::Park(Waiting::Connection)) => Some(WaitingForConnection),
                    (
                        WaitingForQuestion | WaitingForApproval | WaitingForConnection,
                        RunInput::Resume,
                    ) => Some(Queued),
                    (Running, RunInput::ScheduleRetry) => Some(RetryPending),
                    (Running, RunInput::Requeue) => Some(Queued),
                    (Running, RunInput::End(cause)) => Some(cause.final_status()),
                    (
                        Queued | RetryPending | WaitingForQuestion | WaitingForApproval
                        | WaitingForConnection,
                        RunInput::End(
                            cause @ (EndCause::Cancelled
                            | EndCause::Interrupted
                            | EndCause::ConsentExpired
                            | EndCause::RecoveryLimit
                            | EndCause::Timeout
                            | EndCause::Error),
                        ),
                    ) => Some(cause.final_status()),
                    _ => None,
                };
                assert_eq!(transition(*from, input).ok(), expected, "{from} {input:?}");
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn random_sequences_never_leave_an_end_nor_run_twice(
            picks in proptest::collection::vec(0usize..64, 0..60)
        ) {
            let all = inputs();
            let mut status = RunStatus::Queued;
            for pick in picks {
                let input = all[pick % all.len()];
                match transition(status, input) {
                    Ok(next) => {
                        proptest::prop_assert!(!status.is_ended(), "left {status} on {input:?}");
                        if next == RunStatus::Running {
                            proptest::prop_assert_ne!(status, RunStatus::Running);
                            proptest::prop_assert_eq!(input, RunInput::Claim);
                        }
                        status = next;
                    }
                    Err(refused) => proptest::prop_assert_eq!(refused.from, status),
                }
            }
        }
    }
}
