//! Counts per key, each held by a guard and given back when the guard
//! drops: what the shares of `api::quotas` and the long-document turns of
//! `api::admission` are made of.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

/// Counts per key, each up to `limit`.
pub struct Counts<K> {
    held: Mutex<HashMap<K, usize>>,
    limit: usize,
}

/// One held unit of a key's count, given back on drop.
pub struct Held<K: Hash + Eq> {
    counts: Arc<Counts<K>>,
    key: K,
}

impl<K: Hash + Eq> Drop for Held<K> {
    fn drop(&mut self) {
        let mut held = self
            .counts
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

impl<K: Hash + Eq + Clone> Counts<K> {
    pub fn new(limit: usize) -> Arc<Counts<K>> {
        Arc::new(Counts {
            held: Mutex::new(HashMap::new()),
            limit,
        })
    }

    /// How many each key may hold.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// One more for `key`, unless it holds `limit` already.
    pub fn take(self: &Arc<Counts<K>>, key: K) -> Option<Held<K>> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held.entry(key.clone()).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(Held {
            counts: self.clone(),
            key,
        })
    }

    #[cfg(test)]
    pub fn holding(&self, key: &K) -> usize {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(key).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_given_back_when_its_guard_drops() {
        let counts = Counts::new(2);
        let a = counts.take("k").unwrap();
        let _b = counts.take("k").unwrap();
        assert!(counts.take("k").is_none());
        assert!(counts.take("other").is_some());
        drop(a);
        assert_eq!(counts.holding(&"k"), 1);
        assert!(counts.take("k").is_some());
    }
}
