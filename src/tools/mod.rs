//! Tools: the registry built from configuration, and running a call's
//! effect.

pub mod invoke;
pub mod registry;
