//! A database outage for one process: a TCP relay between a `tether`
//! process and PostgreSQL that the test can cut (every open connection is
//! dropped and new ones are closed at once, as a stopped server's port
//! does) and restore, while other processes reach the database directly.

use std::sync::{Arc, Mutex};

use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

pub struct DbProxy {
    /// The database's URL through the relay.
    pub url: String,
    up: watch::Sender<bool>,
    relays: Arc<Mutex<JoinSet<()>>>,
}

impl DbProxy {
    /// A relay to the PostgreSQL server of `url`.
    pub async fn start(url: &str) -> DbProxy {
        let (upstream, through) = authority_of(url);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let local = listener.local_addr().unwrap().to_string();
        let (up, watching) = watch::channel(true);
        let relays = Arc::new(Mutex::new(JoinSet::new()));
        let accepted = relays.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !*watching.borrow() {
                    drop(client);
                    continue;
                }
                let upstream = upstream.clone();
                accepted.lock().unwrap().spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&upstream).await {
                        let _ = copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        DbProxy {
            url: through.replace("{authority}", &local),
            up,
            relays,
        }
    }

    /// The database goes away for the process behind the relay.
    pub fn cut(&self) {
        self.up.send_replace(false);
        self.relays.lock().unwrap().abort_all();
    }

    /// And comes back.
    pub fn restore(&self) {
        self.up.send_replace(true);
    }
}

/// The `host:port` of a `postgres://user@host:port/db?…` URL, and the URL
/// with `{authority}` in its place.
fn authority_of(url: &str) -> (String, String) {
    let scheme_end = url.find("://").expect("a URL") + 3;
    let rest = &url[scheme_end..];
    let path = rest.find('/').unwrap_or(rest.len());
    let host_start = rest[..path].rfind('@').map_or(0, |at| at + 1);
    let authority = &rest[host_start..path];
    let authority = if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:5432")
    };
    let through = format!(
        "{}{}{{authority}}{}",
        &url[..scheme_end],
        &rest[..host_start],
        &rest[path..]
    );
    (authority, through)
}

#[test]
fn the_authority_is_found_with_or_without_a_user_and_port() {
    assert_eq!(
        authority_of("postgres://postgres@127.0.0.1:5432/t?sslmode=disable"),
        (
            "127.0.0.1:5432".to_owned(),
            "postgres://postgres@{authority}/t?sslmode=disable".to_owned()
        )
    );
    assert_eq!(
        authority_of("postgres://localhost/t"),
        (
            "localhost:5432".to_owned(),
            "postgres://{authority}/t".to_owned()
        )
    );
}
