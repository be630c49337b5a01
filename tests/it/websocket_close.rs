//! A client that closes cleanly gets the close handshake answered: its code
//! comes back in the server's Close frame before the connection ends, so
//! the client sees 1000 rather than an abnormal 1006.

use serde_json::json;
use tokio_tungstenite::tungstenite::Message as WsFrame;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::support::{Ending, Server, WsClient};

#[tokio::test]
async fn a_clean_close_is_answered_with_1000_before_and_after_connection_init() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    for protocol in ["graphql-transport-ws", "graphql-ws"] {
        for initialised in [false, true] {
            let case = format!("{protocol}, initialised: {initialised}");
            let mut client = WsClient::open(&server, protocol).await;
            if initialised {
                client.init_with(&token).await;
                // An operation running on the socket when it closes.
                client.subscribe("me", "{ me { tenant } }", json!({})).await;
                assert_eq!(
                    client.next_event("me").await["data"]["me"]["tenant"],
                    "acme",
                    "{case}"
                );
            }
            let close = CloseFrame {
                code: CloseCode::Normal,
                reason: "bye".into(),
            };
            client
                .send_frame(WsFrame::Close(Some(close)))
                .await
                .unwrap();
            // `ending` returns at the server's Close frame; a connection
            // that ends without one reads as `Dropped`.
            match client.ending().await {
                Ending::Closed(code, _) => assert_eq!(code, 1000, "{case}"),
                Ending::Dropped => panic!("{case}: the connection ended without a Close frame"),
            }
            // Then the connection ends.
            assert!(client.next_frame().await.is_none(), "{case}");
        }
    }
}
