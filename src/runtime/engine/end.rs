//! Step end and run end: the end states (`ended`, `failed`, `stopped_by`)
//! and their commit, the usage ceilings, a failed model request retried or
//! ending the run, the time limit, and a worker's stop.

use std::time::Duration;

use tokio::time::Instant;

use super::inference::Attempt;
use super::{Next, Steps, Stop};
use crate::config::{AgentConfig, Limits};
use crate::domain::retry::RetryPolicy;
use crate::domain::run::{EndCause, RunError, Usage};
use crate::failpoints;
use crate::providers::ProviderError;
use crate::store::commit::{Ending, Lease};
use crate::store::runs::{self, RetryAfterFailure};
use crate::store::{self, Store};
use crate::telemetry;

impl Steps<'_> {
    /// The worker stops before the run is done.
    pub(super) async fn stop(
        &self,
        stop: Stop,
        attempt: &Attempt,
        step: i32,
    ) -> store::Result<Next> {
        let usage = attempt.usage(self.agent);
        match stop {
            Stop::Cancelled => {
                let ending = ended(EndCause::Cancelled, usage, step);
                over(end(self.store, self.lease, attempt, ending).await)
            }
            Stop::Shutdown => over(runs::release(self.store, self.lease, &attempt.texts()).await),
            Stop::LeaseLost => Err(store::Error::Fenced),
        }
    }

    pub(super) async fn timed_out(&self, attempt: &Attempt, step: i32) -> store::Result<Next> {
        let ending = failed(
            EndCause::Timeout,
            "the run used up its time".into(),
            attempt.usage(self.agent),
            step,
        );
        over(end(self.store, self.lease, attempt, ending).await)
    }

    /// A failed model request: parked for another attempt when the failure
    /// is transient and the budget allows, else the run fails with it.
    pub(super) async fn retry_or_fail(
        &self,
        err: ProviderError,
        attempt: &Attempt,
        usage: Usage,
        step: i32,
    ) -> store::Result<()> {
        let (store, lease) = (self.store, self.lease);
        let error = provider_error(&err);
        let policy = retry_policy(self.agent);
        let failed_attempt = attempt.request_attempt;
        let (provider, class) = (self.agent.provider.as_str(), err.class());
        telemetry::provider_failed(provider, class);
        if !(err.is_transient() && policy.allows_another(failed_attempt as u32)) {
            let ending = Ending {
                cause: EndCause::Error,
                reason: Some(error.message.clone()),
                error: Some(error),
                usage,
                steps: step,
            };
            return end(store, lease, attempt, ending).await;
        }
        let delay = policy.delay(failed_attempt as u32, err.retry_after(), fastrand::f64());
        // Parked, it would hold its conversation for the whole delay only to
        // find no time left.
        if Instant::now()
            .checked_add(delay)
            .is_none_or(|due| due >= self.deadline)
        {
            let message = format!(
                "the next attempt would start after {}s, past the run's time limit; last error: {}",
                delay.as_secs(),
                error.message
            );
            let ending = failed(EndCause::Timeout, message, usage, step);
            return end(store, lease, attempt, ending).await;
        }
        tracing::info!(
            attempt = failed_attempt,
            delay_ms = delay.as_millis() as u64,
            error = %err,
            "model request failed; retrying"
        );
        let retry = RetryAfterFailure {
            failed_attempt,
            max_attempts: policy.max_attempts as i32,
            delay_ms: i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
            error,
            usage,
        };
        match runs::schedule_retry(store, lease, &attempt.texts(), retry).await {
            Ok(_) => telemetry::provider_retried(provider, class),
            Err(store::Error::CancelRequested) => {
                let ending = ended(EndCause::Cancelled, usage, step);
                return end(store, lease, attempt, ending).await;
            }
            Err(err) => return Err(err),
        }
        failpoints::hit("after_retry_scheduled");
        // Any worker claims it when due (polling covers a crash); this one
        // wakes its own process right on time.
        let bus = store.bus().clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            bus.wake_workers();
        });
        Ok(())
    }
}

pub(super) fn over(result: store::Result<()>) -> store::Result<Next> {
    result.map(|()| Next::Over)
}

pub(super) fn ended(cause: EndCause, usage: Usage, steps: i32) -> Ending {
    Ending {
        cause,
        error: None,
        reason: None,
        usage,
        steps,
    }
}

pub(super) fn failed(cause: EndCause, message: String, usage: Usage, steps: i32) -> Ending {
    Ending {
        cause,
        error: Some(RunError::of_cause(cause, message.clone())),
        reason: Some(message),
        usage,
        steps,
    }
}

/// The end a limit or a stop condition calls for: `STOPPED` completes the
/// run with its reason, every other cause fails it.
pub(super) fn stopped_by(cause: EndCause, message: String, usage: Usage, steps: i32) -> Ending {
    if cause == EndCause::Stopped {
        Ending {
            reason: Some(message),
            ..ended(cause, usage, steps)
        }
    } else {
        failed(cause, message, usage, steps)
    }
}

pub(super) async fn end(
    store: &Store,
    lease: &Lease,
    attempt: &Attempt,
    ending: Ending,
) -> store::Result<()> {
    runs::finish(store, lease, &attempt.texts(), ending).await?;
    failpoints::hit("after_finish");
    Ok(())
}

/// The first usage ceiling the run has gone over, if any.
pub(super) fn over_ceiling(limits: &Limits, usage: &Usage) -> Option<(EndCause, String)> {
    if let Some(max) = limits.max_input_tokens
        && usage.input_tokens as u64 > max
    {
        return Some((
            EndCause::TokenLimit,
            format!(
                "the run used {} input tokens; the limit is {max}",
                usage.input_tokens
            ),
        ));
    }
    if let Some(max) = limits.max_output_tokens
        && usage.output_tokens as u64 > max
    {
        return Some((
            EndCause::TokenLimit,
            format!(
                "the run used {} output tokens; the limit is {max}",
                usage.output_tokens
            ),
        ));
    }
    if let Some(max) = limits.max_cost_usd
        && usage.cost_usd > max
    {
        return Some((
            EndCause::CostLimit,
            format!(
                "the run cost ${:.4}; the limit is ${max:.4}",
                usage.cost_usd
            ),
        ));
    }
    None
}

pub(super) fn retry_policy(agent: &AgentConfig) -> RetryPolicy {
    RetryPolicy {
        max_attempts: agent.retry.max_attempts,
        initial_delay: Duration::from_millis(agent.retry.initial_delay_ms),
        max_delay: Duration::from_millis(agent.retry.max_delay_ms),
    }
}

/// The provider's error as the run shows it: its error type as the code.
fn provider_error(err: &ProviderError) -> RunError {
    let retryable = err.is_transient();
    match err {
        ProviderError::Http {
            status,
            code,
            message,
            ..
        } => RunError {
            code: code.clone(),
            message: message.clone(),
            http_status: Some(i32::from(*status)),
            retryable,
        },
        ProviderError::Stream { code, message } | ProviderError::Unusable { code, message } => {
            RunError {
                code: code.clone(),
                message: message.clone(),
                http_status: None,
                retryable,
            }
        }
        other => RunError {
            code: EndCause::Error.as_str().to_owned(),
            message: other.to_string(),
            http_status: None,
            retryable,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_name_their_cause() {
        let limits = Limits {
            max_input_tokens: Some(100),
            max_output_tokens: Some(10),
            max_cost_usd: Some(0.5),
            ..Limits::default()
        };
        let usage = |i, o, c| Usage {
            input_tokens: i,
            output_tokens: o,
            cost_usd: c,
        };
        assert_eq!(over_ceiling(&limits, &usage(100, 10, 0.5)), None);
        assert_eq!(
            over_ceiling(&limits, &usage(101, 0, 0.0)).unwrap().0,
            EndCause::TokenLimit
        );
        assert_eq!(
            over_ceiling(&limits, &usage(0, 11, 0.0)).unwrap().0,
            EndCause::TokenLimit
        );
        assert_eq!(
            over_ceiling(&limits, &usage(0, 0, 0.51)).unwrap().0,
            EndCause::CostLimit
        );
    }
}
