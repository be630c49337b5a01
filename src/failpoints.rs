//! Fault injection, switchable at run time so crash tests use the normal
//! build: `TETHER_FAILPOINTS=after_begin=abort,after_checkpoint=abort` makes
//! the process abort right after those commits.

use std::collections::HashSet;
use std::sync::OnceLock;

fn configured() -> &'static HashSet<String> {
    static POINTS: OnceLock<HashSet<String>> = OnceLock::new();
    POINTS.get_or_init(|| {
        std::env::var("TETHER_FAILPOINTS")
            .unwrap_or_default()
            .split(',')
            .filter_map(|item| item.trim().strip_suffix("=abort"))
            .map(str::to_owned)
            .collect()
    })
}

/// Aborts the process here if `name` is switched on.
pub fn hit(name: &str) {
    if configured().contains(name) {
        eprintln!("tether: failpoint {name}: aborting");
        std::process::abort();
    }
}
