//! The HTTP listener's limits: slow and idle connections are closed on
//! time, connections over the cap wait their turn, and an oversized body is
//! always answered with its 413.

use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{PATIENCE, Server};

/// Reads until the server closes the connection; returns what it sent.
async fn read_to_close(tcp: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    tokio::time::timeout(PATIENCE, tcp.read_to_end(&mut received))
        .await
        .expect("the server closes the connection in time")
        .ok();
    received
}

const HEALTH: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: tether\r\n\r\n";

#[tokio::test]
async fn a_client_that_sends_half_a_header_is_disconnected_on_time() {
    let server = Server::with_api("header_read_timeout_secs = 1").await;
    let mut tcp = TcpStream::connect(&server.addr).await.unwrap();
    tcp.write_all(b"POST /graphql HTTP/1.1\r\nHost: tether\r\nContent-Ty")
        .await
        .unwrap();
    let started = Instant::now();
    read_to_close(&mut tcp).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "closed after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_body_that_trickles_in_is_answered_408_on_time() {
    let server = Server::with_api("request_timeout_secs = 1").await;
    let token = server.token("acme", "ada");
    let mut tcp = TcpStream::connect(&server.addr).await.unwrap();
    let head = format!(
        "POST /graphql HTTP/1.1\r\nHost: tether\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"query\":"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let received = String::from_utf8(read_to_close(&mut tcp).await).unwrap();
    assert!(received.starts_with("HTTP/1.1 408"), "{received}");
    assert!(received.contains("BAD_USER_INPUT"), "{received}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "answered after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn an_idle_keepalive_connection_is_closed_on_time() {
    let server = Server::with_api("header_read_timeout_secs = 60\nkeepalive_idle_secs = 1").await;
    let mut tcp = TcpStream::connect(&server.addr).await.unwrap();
    tcp.write_all(HEALTH).await.unwrap();
    let started = Instant::now();
    let received = String::from_utf8(read_to_close(&mut tcp).await).unwrap();
    assert!(received.starts_with("HTTP/1.1 200"), "{received}");
    assert!(received.ends_with("ok"), "{received}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "closed after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn connections_over_the_cap_wait_for_a_free_slot() {
    let server = Server::with_api("max_connections = 2").await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut tcp = TcpStream::connect(&server.addr).await.unwrap();
        // A served request proves the connection holds a slot.
        tcp.write_all(HEALTH).await.unwrap();
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(PATIENCE, tcp.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(tcp);
    }
    let mut third = TcpStream::connect(&server.addr).await.unwrap();
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: tether\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let waiting = tokio::time::timeout(Duration::from_millis(1500), third.read(&mut buf)).await;
    assert!(waiting.is_err(), "a third connection was served at once");
    drop(held.pop());
    let received = String::from_utf8(read_to_close(&mut third).await).unwrap();
    assert!(received.starts_with("HTTP/1.1 200"), "{received}");
}

/// 8 clients each post a 2 MiB body 5 times; every answer must arrive, with
/// this status and error code.
async fn oversized_bodies_from_8_clients(
    server: &Server,
    token: Option<String>,
    status: u16,
    code: &str,
) {
    let body = format!(
        r#"{{"query":"{{ me {{ tenant }} }}","variables":{{"pad":"{}"}}}}"#,
        "x".repeat(2 * 1024 * 1024)
    );
    let mut clients = Vec::new();
    for _ in 0..8 {
        let http = server.http().clone();
        let url = format!("{}/graphql", server.base);
        let (token, body, code) = (token.clone(), body.clone(), code.to_owned());
        clients.push(tokio::spawn(async move {
            for _ in 0..5 {
                let mut request = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body.clone());
                if let Some(token) = &token {
                    request = request.bearer_auth(token);
                }
                let response = request
                    .send()
                    .await
                    .expect("the server answers instead of resetting");
                assert_eq!(response.status(), status);
                let answer: Value = response.json().await.unwrap();
                assert_eq!(
                    answer["errors"][0]["extensions"]["code"],
                    code.as_str(),
                    "{answer}"
                );
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
}

#[tokio::test]
async fn an_oversized_body_is_always_answered_with_its_413_under_load() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    oversized_bodies_from_8_clients(&server, Some(token), 413, "BAD_USER_INPUT").await;
}

#[tokio::test]
async fn an_unauthenticated_large_body_is_always_answered_with_its_401() {
    let server = Server::start().await;
    oversized_bodies_from_8_clients(&server, None, 401, "UNAUTHENTICATED").await;
}
