//! How often a principal, and a tenant, may start work: `sendMessage` (each
//! one may cost money at a model provider) and `createConversation`. GCRA
//! per key (the `governor` crate): `n` per minute, up to `n` at once. Each
//! process keeps its own counts, so with several API instances behind a
//! load balancer a principal gets up to the rate at each. A rate of 0 is
//! no limit.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};

use super::error::ApiError;
use crate::config::ApiConfig;

/// Keys past this many make a limiter forget the ones whose counts have
/// refilled, so that the state stays bounded by recent callers.
const RETAIN_AFTER_KEYS: usize = 10_000;

/// What is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    SendMessage,
    CreateConversation,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::SendMessage => "messages",
            Action::CreateConversation => "conversations",
        }
    }
}

/// One action's limits: per principal of a tenant, and per tenant; `None`
/// where there is none.
struct Limits {
    principal: Option<DefaultKeyedRateLimiter<(String, String)>>,
    per_principal: u32,
    tenant: Option<DefaultKeyedRateLimiter<String>>,
    per_tenant: u32,
}

impl Limits {
    fn new(per_principal: u32, per_tenant: u32) -> Limits {
        let quota = |n: u32| NonZeroU32::new(n).map(Quota::per_minute);
        Limits {
            principal: quota(per_principal).map(DefaultKeyedRateLimiter::keyed),
            per_principal,
            tenant: quota(per_tenant).map(DefaultKeyedRateLimiter::keyed),
            per_tenant,
        }
    }
}

pub struct Rates {
    messages: Limits,
    conversations: Limits,
    clock: DefaultClock,
}

impl Rates {
    pub fn new(api: &ApiConfig) -> Rates {
        Rates {
            messages: Limits::new(api.messages_per_minute, api.tenant_messages_per_minute),
            conversations: Limits::new(
                api.conversations_per_minute,
                api.tenant_conversations_per_minute,
            ),
            clock: DefaultClock::default(),
        }
    }

    /// Counts one `action` of `principal` in `tenant`; `RATE_LIMITED`, with
    /// when to try again, when it is one too many.
    pub fn check(&self, action: Action, tenant: &str, principal: &str) -> Result<(), ApiError> {
        let limits = match action {
            Action::SendMessage => &self.messages,
            Action::CreateConversation => &self.conversations,
        };
        let refused = |wait: Duration, whose: &str, per_minute: u32| ApiError::RateLimited {
            message: format!(
                "too many {}: {whose} may start {per_minute} a minute",
                action.name()
            ),
            retry_after_secs: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
        };
        if let Some(limiter) = &limits.principal {
            if limiter.len() > RETAIN_AFTER_KEYS {
                limiter.retain_recent();
            }
            limiter
                .check_key(&(tenant.to_owned(), principal.to_owned()))
                .map_err(|no| {
                    refused(
                        no.wait_time_from(self.clock.now()),
                        "one person",
                        limits.per_principal,
                    )
                })?;
        }
        if let Some(limiter) = &limits.tenant {
            if limiter.len() > RETAIN_AFTER_KEYS {
                limiter.retain_recent();
            }
            limiter.check_key(&tenant.to_owned()).map_err(|no| {
                refused(
                    no.wait_time_from(self.clock.now()),
                    "one tenant",
                    limits.per_tenant,
                )
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(per_principal: u32, per_tenant: u32) -> Rates {
        Rates::new(&ApiConfig {
            messages_per_minute: per_principal,
            tenant_messages_per_minute: per_tenant,
            ..ApiConfig::default()
        })
    }

    #[test]
    fn a_principal_is_held_to_its_rate_and_told_when_to_come_back() {
        let rates = rates(3, 100);
        for _ in 0..3 {
            rates.check(Action::SendMessage, "acme", "ada").unwrap();
        }
        let Err(ApiError::RateLimited {
            message,
            retry_after_secs,
        }) = rates.check(Action::SendMessage, "acme", "ada")
        else {
            panic!("the fourth in a minute is refused");
        };
        assert!(message.contains("3 a minute"), "{message}");
        // One comes back every 20 s.
        assert!((1..=20).contains(&retry_after_secs), "{retry_after_secs}");
        // Others, and other actions, are counted apart.
        rates.check(Action::SendMessage, "acme", "bob").unwrap();
        rates
            .check(Action::CreateConversation, "acme", "ada")
            .unwrap();
    }

    #[test]
    fn a_tenant_is_held_to_its_rate_over_its_principals() {
        let rates = rates(100, 2);
        rates.check(Action::SendMessage, "acme", "ada").unwrap();
        rates.check(Action::SendMessage, "acme", "bob").unwrap();
        let refused = rates.check(Action::SendMessage, "acme", "cy");
        assert!(
            matches!(&refused, Err(ApiError::RateLimited { message, .. }) if message.contains("one tenant")),
            "{refused:?}"
        );
        rates.check(Action::SendMessage, "globex", "ada").unwrap();
    }

    #[test]
    fn a_rate_of_zero_is_no_limit() {
        let rates = rates(0, 0);
        for _ in 0..1_000 {
            rates.check(Action::SendMessage, "acme", "ada").unwrap();
        }
    }
}
