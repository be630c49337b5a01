import { describe, expect, it } from "vitest";
import { CombinedError } from "urql";
import { GraphQLError } from "graphql";
import { describeError, toTetherError } from "./errors";

describe("toTetherError", () => {
  it("reads extensions.code and extensions.key", () => {
    const error = new CombinedError({
      graphQLErrors: [new GraphQLError("`other` is empty", { extensions: { code: "BAD_USER_INPUT", key: "name" } })],
    });
    expect(toTetherError(error)).toEqual({ code: "BAD_USER_INPUT", message: "`other` is empty", key: "name" });
  });
  it("names CONFLICT and NOT_FOUND as such", () => {
    const conflict = toTetherError(new CombinedError({ graphQLErrors: [new GraphQLError("a run is active", { extensions: { code: "CONFLICT" } })] }));
    expect(describeError(conflict)).toBe("Conflict: a run is active");
    const missing = toTetherError(new CombinedError({ graphQLErrors: [new GraphQLError("not found", { extensions: { code: "NOT_FOUND" } })] }));
    expect(missing.code).toBe("NOT_FOUND");
  });
  it("reads UNAVAILABLE, and an unknown code as UNKNOWN", () => {
    const down = toTetherError(new CombinedError({ graphQLErrors: [new GraphQLError("the authorization server could not be reached", { extensions: { code: "UNAVAILABLE" } })] }));
    expect(describeError(down)).toBe("Try again later: the authorization server could not be reached");
    const odd = toTetherError(new CombinedError({ graphQLErrors: [new GraphQLError("?", { extensions: { code: "SOMETHING_NEW" } })] }));
    expect(odd.code).toBe("UNKNOWN");
  });
  it("tells a network failure from a server answer", () => {
    expect(toTetherError(new CombinedError({ networkError: new Error("Failed to fetch") })).code).toBe("NETWORK");
  });
});
