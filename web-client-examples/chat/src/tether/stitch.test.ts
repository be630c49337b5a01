import { describe, expect, it } from "vitest";
import { DeltaBuffer, layDelta, mergePersisted } from "./stitch";

describe("layDelta", () => {
  it("appends at the end", () => {
    expect(layDelta("Hello", 5, ", world")).toEqual({ kind: "applied", text: "Hello, world" });
  });
  it("ignores a delta the text already covers", () => {
    expect(layDelta("Hello, world", 5, ", wo")).toEqual({ kind: "covered" });
  });
  it("lays an overlapping delta once", () => {
    expect(layDelta("Hello, wo", 5, ", world")).toEqual({ kind: "applied", text: "Hello, world" });
  });
  it("reports a gap past the end", () => {
    expect(layDelta("Hel", 5, "xx")).toEqual({ kind: "gap" });
  });
  it("counts offsets in UTF-16 code units", () => {
    const text = "🙂 é"; // the emoji is two code units
    expect(text.length).toBe(4);
    expect(layDelta(text, 4, "!")).toEqual({ kind: "applied", text: "🙂 é!" });
  });
});

describe("mergePersisted", () => {
  it("keeps live text past the persisted length", () => {
    expect(mergePersisted("Hello, world", "Hello", false)).toBe("Hello, world");
  });
  it("takes the persisted text as the correction of its own length", () => {
    expect(mergePersisted("Helo, world", "Hello", false)).toBe("Hello world");
  });
  it("takes the persisted text whole once the part is done", () => {
    expect(mergePersisted("Hello, world and more", "Hello, world", true)).toBe("Hello, world");
  });
});

describe("DeltaBuffer", () => {
  it("lays held deltas once the gap is filled", () => {
    const buffer = new DeltaBuffer();
    buffer.hold(10, "KLM");
    buffer.hold(6, "GHIJ");
    expect(buffer.drain("ABC")).toBe("ABC");
    expect(buffer.drain("ABCDEF")).toBe("ABCDEFGHIJKLM");
    expect(buffer.size).toBe(0);
  });
});
