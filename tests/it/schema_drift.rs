//! `schema.graphql` is the exported SDL; it must not drift from the code.

#[test]
fn schema_graphql_matches_the_code() {
    let committed = include_str!("../../schema.graphql");
    let current = tether::api::sdl();
    assert!(
        committed == current,
        "schema.graphql is out of date: regenerate it with\n\n    cargo run -- schema > schema.graphql\n"
    );
}
