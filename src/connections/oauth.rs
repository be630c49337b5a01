//! The OAuth 2.0 client side of a connection: the authorization request
//! (PKCE S256, state) and the token endpoint (code exchange, refresh).
