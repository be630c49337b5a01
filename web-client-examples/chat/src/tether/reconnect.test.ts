import { describe, expect, it } from "vitest";
import { backoffMs, classifyDrop } from "./reconnect";

describe("classifyDrop", () => {
  it("sends the person to sign in on 4403", () => {
    expect(classifyDrop({ code: 4403, reason: "Forbidden" }).kind).toBe("signin");
  });
  it("retries other closes and network errors", () => {
    expect(classifyDrop({ code: 1006 }).kind).toBe("retry");
    expect(classifyDrop(new Error("socket hang up")).kind).toBe("retry");
    expect(classifyDrop(undefined).kind).toBe("retry");
  });
  it("stops on GraphQL errors, with their code", () => {
    expect(classifyDrop([{ message: "not found", extensions: { code: "NOT_FOUND" } }])).toEqual({
      kind: "fatal",
      reason: "not found",
      code: "NOT_FOUND",
    });
    expect(classifyDrop([{ message: "no", extensions: { code: "UNAUTHENTICATED" } }]).kind).toBe("signin");
  });
});

describe("backoffMs", () => {
  it("grows and is capped", () => {
    expect(backoffMs(0)).toBe(250);
    expect(backoffMs(1)).toBe(500);
    expect(backoffMs(20)).toBe(5000);
  });
});
