//! The GraphiQL playground at `/graphiql`, served wholly from the binary:
//! its script and stylesheet are built by `scripts/graphiql` from pinned
//! npm packages and committed in `graphiql/`, so the page loads nothing
//! from outside the server and works offline.

use std::sync::LazyLock;

use axum::extract::{Path, Query};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Where the assets are served; relative to the page, so that a server
/// behind a proxy under a path prefix still finds them.
const ASSETS_PATH: &str = "graphiql/assets/";

/// What the page may load and where it may connect: its own server only.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self' 'unsafe-inline'; font-src 'self' data:; img-src 'self' data:; \
     connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// A built asset, named after a digest of its bytes so that it can be
/// cached for good: another build is another name.
struct Asset {
    name: String,
    content_type: &'static str,
    bytes: &'static [u8],
}

impl Asset {
    fn new(stem: &str, extension: &str, content_type: &'static str, bytes: &'static [u8]) -> Self {
        let digest = Sha256::digest(bytes);
        let short: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        Asset {
            name: format!("{stem}.{short}.{extension}"),
            content_type,
            bytes,
        }
    }
}

static SCRIPT: LazyLock<Asset> = LazyLock::new(|| {
    Asset::new(
        "graphiql",
        "js",
        "text/javascript; charset=utf-8",
        include_bytes!("graphiql/graphiql.js"),
    )
});

static STYLE: LazyLock<Asset> = LazyLock::new(|| {
    Asset::new(
        "graphiql",
        "css",
        "text/css; charset=utf-8",
        include_bytes!("graphiql/graphiql.css"),
    )
});

#[derive(Deserialize)]
pub struct PageParams {
    token: Option<String>,
}

/// The page. With `?token=JWT` the token goes into the header editor and
/// the WebSocket's `connection_init`; anything that is not base64url
/// segments and dots is ignored rather than embedded.
pub async fn page(Query(params): Query<PageParams>) -> Response {
    let token = params.token.filter(|t| is_jwt_shaped(t));
    let settings = serde_json::json!({ "endpoint": "graphql", "token": token });
    let html = format!(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>Tether GraphiQL</title>\n\
         <link rel=\"stylesheet\" href=\"{ASSETS_PATH}{style}\">\n</head>\n<body>\n\
         <div id=\"graphiql\"></div>\n\
         <script type=\"application/json\" id=\"tether-graphiql-config\">{settings}</script>\n\
         <script src=\"{ASSETS_PATH}{script}\"></script>\n</body>\n</html>\n",
        style = STYLE.name,
        script = SCRIPT.name,
        settings = json_for_script(&settings),
    );
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // The page may carry a token: keep it out of caches and out of
            // the `Referer` of what it loads.
            (header::CACHE_CONTROL, "no-store"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        html,
    )
        .into_response()
}

/// `/graphiql/assets/{name}`: the script or the stylesheet under its
/// current name, cached for a year; any other name is 404.
pub async fn asset(Path(name): Path<String>) -> Response {
    let Some(asset) = [&*SCRIPT, &*STYLE].into_iter().find(|a| a.name == name) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    (
        [
            (header::CONTENT_TYPE, asset.content_type),
            (header::CACHE_CONTROL, "public, max-age=31536000, immutable"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        asset.bytes,
    )
        .into_response()
}

/// A JWT is base64url segments and dots; nothing else reaches the page.
fn is_jwt_shaped(token: &str) -> bool {
    !token.is_empty()
        && token.len() < 4096
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// JSON that can sit inside a `<script>` element: no `<`, `>` or `&` that
/// could close it or start markup, whatever the values hold.
fn json_for_script(value: &serde_json::Value) -> String {
    value
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_for_a_script_element_cannot_close_it() {
        let value = serde_json::json!({ "token": "</script><script>alert(1)</script>&\u{2028}" });
        let text = json_for_script(&value);
        assert!(!text.contains('<') && !text.contains('>') && !text.contains('&'));
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&text).unwrap(),
            value
        );
    }

    #[test]
    fn only_jwt_shaped_tokens_are_kept() {
        assert!(is_jwt_shaped("eyJh.eyJz-_.c2ln"));
        for bad in [
            "",
            "a b",
            "a\"b",
            "a<b",
            "a'b",
            "a\\b",
            "ä",
            &"a".repeat(4096),
        ] {
            assert!(!is_jwt_shaped(bad), "{bad}");
        }
    }

    #[test]
    fn asset_names_follow_their_bytes() {
        let a = Asset::new("graphiql", "js", "text/javascript", b"one");
        let b = Asset::new("graphiql", "js", "text/javascript", b"two");
        assert_ne!(a.name, b.name);
        assert!(a.name.starts_with("graphiql.") && a.name.ends_with(".js"));
        assert_eq!(a.name.len(), "graphiql..js".len() + 16);
    }
}
