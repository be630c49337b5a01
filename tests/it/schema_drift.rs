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

/// Every name the contract gives connections is in the live schema.
#[test]
fn the_schema_has_the_contracts_connection_names() {
    let sdl = tether::api::sdl();
    for name in [
        "pendingConnection(runId: ID!): PendingConnection\n",
        "connections: [Connection!]!\n",
        "completeConnection(input: CompleteConnectionInput!): ResumePayload!\n",
        "disconnect(provider: String!): Boolean!\n",
        "input CompleteConnectionInput {",
        "type Connection {",
        "enum ConnectionStatus {",
        "type PendingConnection {",
        "loginUrl: String!",
        "requiredScopes: [String!]!",
        "type ConnectionPart {",
        "connection: ConnectionPart\n",
        "enum ConnectionGap {",
        "INSUFFICIENT_SCOPE",
        "WAITING_FOR_CONNECTION",
        "CONSENT_EXPIRED",
    ] {
        assert!(sdl.contains(name), "the schema lacks {name:?}");
    }
    let gap = &sdl[sdl.find("enum ConnectionGap {").unwrap()..];
    let gap = &gap[..gap.find('}').unwrap()];
    for value in ["ABSENT", "EXPIRED", "INSUFFICIENT_SCOPE"] {
        assert!(gap.contains(value), "ConnectionGap lacks {value}");
    }
}
