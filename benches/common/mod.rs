//! What the benches share: the scratch PostgreSQL database and how
//! figures are printed.

use std::time::Duration;

use sea_orm::{ConnectionTrait, Database, DatabaseBackend, Statement};

/// Creates the bench database when missing, and empties it: its `public`
/// schema is dropped and made again, so every run starts from nothing, as
/// on SQLite's fresh file.
pub async fn prepare_postgres(url: &str) {
    let (base, rest) = url
        .rsplit_once('/')
        .expect("TETHER_BENCH_DATABASE_URL is postgres://user@host:port/database");
    let (name, query) = rest.split_once('?').unwrap_or((rest, ""));
    assert!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
        "the bench database's name is letters, digits and _ only: {name:?}"
    );
    let query = if query.is_empty() {
        String::new()
    } else {
        format!("?{query}")
    };
    let admin = Database::connect(format!("{base}/postgres{query}"))
        .await
        .expect("cannot connect to the server's `postgres` database");
    let exists = admin
        .query_one_raw(Statement::from_sql_and_values(
            DatabaseBackend::Postgres,
            "SELECT 1 FROM pg_database WHERE datname = $1",
            [name.into()],
        ))
        .await
        .unwrap()
        .is_some();
    if !exists {
        eprintln!("PostgreSQL: creating database {name}");
        admin
            .execute_unprepared(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap();
    }
    admin.close().await.unwrap();
    let db = Database::connect(url).await.unwrap();
    db.execute_unprepared("DROP SCHEMA public CASCADE; CREATE SCHEMA public;")
        .await
        .unwrap();
    db.close().await.unwrap();
}

pub fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() * p).div_ceil(100)).saturating_sub(1);
    sorted[index.min(sorted.len() - 1)]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub fn millis(d: Duration) -> String {
    let v = ms(d);
    if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

pub fn p50_p99(sorted: &[Duration]) -> String {
    format!(
        "{} / {} ms",
        millis(percentile(sorted, 50)),
        millis(percentile(sorted, 99))
    )
}

/// An integer with thousands separators.
pub fn count(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
