//! Event streams served outside hyper. A `GET` that asks for
//! `text/event-stream` and whose head arrives whole with the connection's
//! first bytes is read here, answered by the same router, and its answer
//! written here: the head, then the body's frames as HTTP/1.1 chunks, for
//! as long as the stream goes, then the connection closes.
//!
//! Why: hyper keeps a read buffer and a write buffer of 8 KiB each for a
//! connection with a response in flight, for as long as it is in flight,
//! and offers no setting to shrink them on a server. A WebSocket gives
//! them up at its upgrade; an SSE stream, which is one long response,
//! would keep them for its whole life, doubling what an idle follower
//! costs. Here a stream keeps only its socket and what its body needs.
//!
//! Anything else (another method, a head in several pieces, a body, an
//! upgrade, HTTP/1.0) goes to hyper as before, so this is an economy, never
//! a path a request depends on.

use std::io::Write as _;

use axum::Router;
use axum::body::{Body, HttpBody as _};
use axum::extract::ConnectInfo;
use axum::http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version, header};
use http_body_util::BodyExt;
use hyper::service::Service;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

use super::LocalAddr;

/// The most of a connection's first bytes looked at for a head.
const HEAD_BYTES: usize = 8 * 1024;

/// The most header lines such a head may have; a longer one goes to hyper.
const HEADERS: usize = 64;

/// An event-stream request read from a connection's first bytes: how long
/// its head is, and the request.
pub struct EventStreamRequest {
    head_len: usize,
    request: Request<Body>,
}

/// The event-stream request at the start of `tcp`'s bytes, if there is one
/// whole; nothing is read from the socket.
pub async fn peek(tcp: &TcpStream) -> Option<EventStreamRequest> {
    let mut bytes = vec![0u8; HEAD_BYTES];
    let seen = tcp.peek(&mut bytes).await.ok()?;
    parse(&bytes[..seen])
}

fn parse(bytes: &[u8]) -> Option<EventStreamRequest> {
    if !bytes.starts_with(b"GET ") {
        return None;
    }
    let mut headers = [httparse::EMPTY_HEADER; HEADERS];
    let mut head = httparse::Request::new(&mut headers);
    let httparse::Status::Complete(head_len) = head.parse(bytes).ok()? else {
        return None;
    };
    if head.version != Some(1) {
        return None;
    }
    let mut request = Request::builder()
        .method(Method::GET)
        .uri(head.path?)
        .version(Version::HTTP_11);
    let mut wants_stream = false;
    for line in head.headers.iter() {
        let name = HeaderName::from_bytes(line.name.as_bytes()).ok()?;
        // A request with a body, or one that asks for another protocol,
        // is hyper's to read.
        if [
            header::CONTENT_LENGTH,
            header::TRANSFER_ENCODING,
            header::UPGRADE,
            header::EXPECT,
        ]
        .contains(&name)
        {
            return None;
        }
        let value = HeaderValue::from_bytes(line.value).ok()?;
        // Hop by hop: this connection closes after its one answer.
        if name == header::CONNECTION {
            if value
                .to_str()
                .map_or(true, |v| v.to_ascii_lowercase().contains("upgrade"))
            {
                return None;
            }
            continue;
        }
        if name == header::ACCEPT {
            wants_stream |= value
                .to_str()
                .is_ok_and(|accept| accept.contains("text/event-stream"));
        }
        request = request.header(name, value);
    }
    if !wants_stream {
        return None;
    }
    let request = request.body(Body::empty()).ok()?;
    Some(EventStreamRequest { head_len, request })
}

/// Reads the request's head off `tcp`, answers it with `app`, and writes
/// the answer until its body ends, the client goes, or the server stops.
pub async fn serve(
    mut tcp: TcpStream,
    stream: EventStreamRequest,
    local: Option<LocalAddr>,
    _permit: OwnedSemaphorePermit,
    app: Router,
    stopping: CancellationToken,
) {
    let EventStreamRequest {
        head_len,
        mut request,
    } = stream;
    let mut head = vec![0u8; head_len];
    if tcp.read_exact(&mut head).await.is_err() {
        return;
    }
    drop(head);
    if let Ok(peer) = tcp.peer_addr() {
        request.extensions_mut().insert(ConnectInfo(peer));
    }
    if let Some(local) = local {
        request.extensions_mut().insert(local);
    }
    let Ok(response) = TowerToHyperService::new(app).call(request).await;
    let (parts, mut body) = response.into_parts();
    let bodiless = matches!(
        parts.status,
        StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED
    );
    let length = body.size_hint().exact();
    let chunked = !bodiless && length.is_none();
    if tcp
        .write_all(&response_head(
            &Response::from_parts(parts, ()),
            bodiless,
            length,
        ))
        .await
        .is_err()
    {
        return;
    }
    if bodiless {
        return;
    }
    let mut ended = false;
    loop {
        tokio::select! {
            frame = body.frame() => match frame {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else { continue };
                    if data.is_empty() {
                        continue;
                    }
                    let written = if chunked {
                        let mut chunk = Vec::with_capacity(data.len() + 16);
                        let _ = write!(chunk, "{:x}\r\n", data.len());
                        chunk.extend_from_slice(&data);
                        chunk.extend_from_slice(b"\r\n");
                        tcp.write_all(&chunk).await
                    } else {
                        tcp.write_all(&data).await
                    };
                    if written.is_err() {
                        return;
                    }
                }
                Some(Err(_)) => return,
                None => {
                    ended = true;
                    break;
                }
            },
            () = gone(&tcp) => return,
            () = stopping.cancelled() => break,
        }
    }
    if ended && chunked {
        let _ = tcp.write_all(b"0\r\n\r\n").await;
    }
    let _ = tcp.shutdown().await;
}

/// The status line and headers, with the framing this module writes and
/// `connection: close`.
fn response_head(response: &Response<()>, bodiless: bool, length: Option<u64>) -> Vec<u8> {
    let status = response.status();
    let mut head = Vec::with_capacity(512);
    let _ = write!(
        head,
        "HTTP/1.1 {} {}\r\n",
        status.as_str(),
        status.canonical_reason().unwrap_or("")
    );
    for (name, value) in response.headers() {
        if [
            header::CONTENT_LENGTH,
            header::TRANSFER_ENCODING,
            header::CONNECTION,
        ]
        .contains(name)
        {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    match (bodiless, length) {
        (true, _) => {}
        (false, Some(length)) => {
            let _ = write!(head, "content-length: {length}\r\n");
        }
        (false, None) => head.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    head.extend_from_slice(b"connection: close\r\n\r\n");
    head
}

/// Resolves when the client has closed its side (or the socket failed);
/// anything it sends meanwhile is read and dropped.
async fn gone(tcp: &TcpStream) {
    let mut sink = [0u8; 64];
    loop {
        if tcp.readable().await.is_err() {
            return;
        }
        match tcp.try_read(&mut sink) {
            Ok(0) => return,
            Ok(_) => {}
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_whole_bodiless_get_for_an_event_stream_is_taken() {
        let head = "GET /runs/r/events?after=1 HTTP/1.1\r\nHost: h\r\nAccept: text/event-stream\r\nAuthorization: Bearer t\r\n\r\n";
        let taken = parse(head.as_bytes()).expect("taken");
        let keep_alive = head.replace("Host: h\r\n", "Host: h\r\nConnection: keep-alive\r\n");
        assert!(
            parse(keep_alive.as_bytes()).is_some(),
            "a browser's keep-alive"
        );
        assert_eq!(taken.head_len, head.len());
        assert_eq!(taken.request.uri(), "/runs/r/events?after=1");
        assert_eq!(taken.request.headers()["authorization"], "Bearer t");

        for (other, why) in [
            (&head[..head.len() - 2], "a head not yet whole"),
            (
                "GET /x HTTP/1.1\r\nAccept: */*\r\n\r\n",
                "no event stream asked",
            ),
            (
                "POST /x HTTP/1.1\r\nAccept: text/event-stream\r\n\r\n",
                "not a GET",
            ),
            (
                "GET /x HTTP/1.0\r\nAccept: text/event-stream\r\n\r\n",
                "HTTP/1.0",
            ),
            (
                "GET /x HTTP/1.1\r\nAccept: text/event-stream\r\nConnection: Upgrade\r\n\r\n",
                "an upgrade asked in Connection",
            ),
            (
                "GET /x HTTP/1.1\r\nAccept: text/event-stream\r\nContent-Length: 3\r\n\r\nabc",
                "a body",
            ),
            (
                "GET /x HTTP/1.1\r\nAccept: text/event-stream\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
                "an upgrade",
            ),
        ] {
            assert!(parse(other.as_bytes()).is_none(), "{why}");
        }
    }

    #[test]
    fn a_stream_is_chunked_and_closes_and_a_204_has_no_body_headers() {
        let response = Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .header("content-length", "9")
            .body(())
            .unwrap();
        let head = String::from_utf8(response_head(&response, false, None)).unwrap();
        assert_eq!(
            head,
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        );
        let empty = Response::builder().status(204).body(()).unwrap();
        let head = String::from_utf8(response_head(&empty, true, Some(0))).unwrap();
        assert_eq!(head, "HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n");
    }
}
