//! Connections: a principal's accounts at other services (OAuth 2.0 or a
//! static token), the tokens tools call them with, and the consent that
//! opens one.

pub mod oauth;
