//! Tools: the registry built from configuration and the built-in tools.

pub mod registry;
