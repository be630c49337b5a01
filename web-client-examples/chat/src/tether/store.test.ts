import { describe, expect, it } from "vitest";
import { ConversationStore } from "./store";
import { cur, delta, interaction, message, messageCreated, part, partEvent, retryPending, run, runEvent } from "./testing";

const seeded = () => {
  const store = new ConversationStore("c1");
  store.seed({ lastCursor: cur(0), messages: [], runs: [] });
  return store;
};
const textOf = (store: ConversationStore, partId = "p1") =>
  store.getSnapshot().messages.flatMap((m) => m.parts).find((p) => p.id === partId)?.text;

describe("ConversationStore: persisted events", () => {
  it("applies an event replayed across a reconnect once", () => {
    const store = seeded();
    const events = [runEvent(cur(1), "run.started", "RUNNING"), messageCreated(cur(2), "m1"), partEvent(cur(3), "part.added", "p1")];
    const first = events.flatMap((e) => store.apply(e));
    // The replay after a reconnect repeats the same events.
    const replay = events.flatMap((e) => store.apply(e));
    expect(first.map((e) => e.kind)).toEqual(["run", "message", "part"]);
    expect(replay).toEqual([]);
    expect(store.getSnapshot().messages).toHaveLength(1);
    expect(store.getSnapshot().messages[0]?.parts).toHaveLength(1);
    expect(store.lastCursor).toBe(cur(3));
  });

  it("places a reply after the message that started its run, as the server lists them", () => {
    const store = seeded();
    // U1 starts run r1; U2 and U3 queue behind it; r2's reply is made when
    // r2 starts, after both.
    store.apply(messageCreated(cur(1), "u1", "USER", "r1"));
    store.apply(messageCreated(cur(2), "a1", "ASSISTANT", "r1"));
    store.apply(messageCreated(cur(3), "u2", "USER", "r2"));
    store.apply(messageCreated(cur(4), "u3", "USER", "r3"));
    store.apply(messageCreated(cur(5), "a2", "ASSISTANT", "r2"));
    expect(store.getSnapshot().messages.map((m) => m.id)).toEqual(["u1", "a1", "u2", "a2", "u3"]);
  });

  it("places steered messages, and the reply that goes on after them, as the server lists them", () => {
    const store = seeded();
    // S1 steers r1 while it is still queued, U2 queues r2, r1 starts, S2
    // steers it; at r1's next step boundary S1 and S2 join and its reply
    // goes on in a message after them.
    store.apply(messageCreated(cur(1), "u1", "USER", "r1"));
    store.apply(messageCreated(cur(2), "s1", "USER", "r1"));
    store.apply(messageCreated(cur(3), "u2", "USER", "r2"));
    store.apply(messageCreated(cur(4), "a1", "ASSISTANT", "r1"));
    store.apply(messageCreated(cur(5), "s2", "USER", "r1"));
    store.apply(runEvent(cur(6), "run.steered", "RUNNING"));
    store.apply(messageCreated(cur(7), "a1b", "ASSISTANT", "r1"));
    expect(store.getSnapshot().messages.map((m) => m.id)).toEqual(["u1", "a1", "s1", "s2", "a1b", "u2"]);
  });

  it("places the first reply of a run steered while queued after the messages that joined it", () => {
    const store = seeded();
    store.apply(messageCreated(cur(1), "u1", "USER", "r1"));
    store.apply(messageCreated(cur(2), "s1", "USER", "r1"));
    // Its first start: s1 joins, and the reply is made after it.
    store.apply(runEvent(cur(3), "run.steered", "RUNNING"));
    store.apply(messageCreated(cur(4), "a1", "ASSISTANT", "r1"));
    expect(store.getSnapshot().messages.map((m) => m.id)).toEqual(["u1", "s1", "a1"]);
  });

  it("shows a steered message as waiting until its run reads it, whatever an older read says", () => {
    const store = seeded();
    store.apply(messageCreated(cur(1), "u1", "USER", "r1"));
    store.apply(messageCreated(cur(2), "s1", "USER", "r1"));
    store.receiveMessage(message("s1", [], "USER", { steering: true }));
    const steering = () => store.getSnapshot().messages.find((m) => m.id === "s1")?.steering;
    expect(steering()).toBe(true);
    expect(store.apply(runEvent(cur(3), "run.steered", "RUNNING"))).toEqual([{ kind: "run", id: "r1" }]);
    expect(steering()).toBe(false);
    // A read made before run.steered arrives late.
    store.receiveMessage(message("s1", [], "USER", { steering: true }));
    expect(steering()).toBe(false);
    // Also when run.steered came before the first read.
    store.apply(messageCreated(cur(4), "s2", "USER", "r1"));
    store.apply(runEvent(cur(5), "run.steered", "RUNNING"));
    store.receiveMessage(message("s2", [], "USER", { steering: true }));
    expect(store.getSnapshot().messages.find((m) => m.id === "s2")?.steering).toBe(false);
  });

  it("reads a steered message again when its run ends without reading it, and lists it with its own run", () => {
    const store = seeded();
    store.apply(messageCreated(cur(1), "u1", "USER", "r1"));
    store.apply(messageCreated(cur(2), "a1", "ASSISTANT", "r1"));
    store.apply(messageCreated(cur(3), "s1", "USER", "r1"));
    store.receiveMessage(message("s1", [], "USER", { steering: true }));
    store.apply(messageCreated(cur(4), "u2", "USER", "r2"));
    const effects = store.apply(runEvent(cur(5), "run.completed", "COMPLETED"));
    expect(effects).toContainEqual({ kind: "message", id: "s1" });
    // Its own run, r3, queued with r1's end right after r1, starts and
    // replies before the read of s1 comes back.
    store.apply(messageCreated(cur(6), "a3", "ASSISTANT", "r3"));
    store.receiveMessage(message("s1", [], "USER", { runId: "r3" }));
    const view = store.getSnapshot().messages;
    expect(view.map((m) => m.id)).toEqual(["u1", "a1", "s1", "a3", "u2"]);
    expect(view.find((m) => m.id === "s1")).toMatchObject({ runId: "r3", steering: false });
  });

  it("skips events the snapshot already covers", () => {
    const store = new ConversationStore("c1");
    store.seed({ lastCursor: cur(5), messages: [message("m1", [part("p1", "Hi", "DONE")])], runs: [run("r1", "COMPLETED")] });
    expect(store.apply(messageCreated(cur(4), "m1"))).toEqual([]);
    expect(store.apply(runEvent(cur(5), "run.completed", "COMPLETED"))).toEqual([]);
    expect(store.apply(runEvent(cur(6), "run.queued", "QUEUED"))).toHaveLength(1);
  });

  it("keeps an ended run ended whatever an older read says", () => {
    const store = seeded();
    store.apply(runEvent(cur(1), "run.cancelled", "CANCELLED"));
    store.receiveRun(run("r1", "RUNNING"));
    expect(store.getSnapshot().runs[0]?.status).toBe("CANCELLED");
    expect(store.getSnapshot().activeRun).toBeNull();
  });

  it("shows a retry from run.retry-pending and drops it when the run goes on", () => {
    const store = seeded();
    store.apply(runEvent(cur(1), "run.started", "RUNNING"));
    expect(store.apply(retryPending(cur(2), 1))).toEqual([{ kind: "run", id: "r1" }]);
    expect(store.getSnapshot().activeRun?.retry).toMatchObject({ attempt: 1, maxAttempts: 3 });
    store.receiveRun({ ...run("r1", "RETRY_PENDING"), nextAttemptAt: "2026-01-01T00:01:00Z" });
    expect(store.getSnapshot().activeRun?.retry).toMatchObject({ attempt: 1 });
    store.apply(runEvent(cur(3), "run.started", "RUNNING"));
    expect(store.getSnapshot().activeRun?.retry).toBeNull();
  });
  it("keeps a retry when sendMessage's response arrives after the run already failed once", () => {
    const store = seeded();
    // The feed is faster than the mutation's HTTP response.
    store.apply(runEvent(cur(1), "run.queued", "QUEUED"));
    store.apply(runEvent(cur(2), "run.started", "RUNNING"));
    store.apply(retryPending(cur(3), 1));
    store.receiveWrittenRun(run("r1", "QUEUED"));
    expect(store.getSnapshot().activeRun?.status).toBe("RETRY_PENDING");
    expect(store.getSnapshot().activeRun?.retry).toMatchObject({ attempt: 1 });
    // A cancel's response adds its request without setting the state back.
    store.receiveWrittenRun({ ...run("r1", "RUNNING"), cancelRequested: true });
    expect(store.getSnapshot().activeRun).toMatchObject({ status: "RETRY_PENDING", cancelRequested: true });
  });

  it("lays in a written run that no event has touched yet", () => {
    const store = seeded();
    store.receiveWrittenRun(run("r2", "QUEUED"));
    expect(store.getSnapshot().activeRun).toMatchObject({ id: "r2", status: "QUEUED" });
  });

  it("does not let a reload's older snapshot set a run back", () => {
    const store = seeded();
    store.apply(runEvent(cur(1), "run.started", "RUNNING"));
    store.apply(retryPending(cur(2), 1));
    // The snapshot was read before run.retry-pending committed.
    store.seed({ lastCursor: cur(1), messages: [], runs: [run("r1", "RUNNING")] });
    expect(store.getSnapshot().activeRun?.status).toBe("RETRY_PENDING");
    store.seed({ lastCursor: cur(2), messages: [], runs: [{ ...run("r1", "RETRY_PENDING"), nextAttemptAt: "2026-01-01T00:01:00Z" }] });
    expect(store.getSnapshot().activeRun?.retry).toMatchObject({ attempt: 1 });
  });
});

describe("ConversationStore: deltas", () => {
  const streaming = () => {
    const store = seeded();
    store.apply(messageCreated(cur(1), "m1"));
    store.apply(partEvent(cur(2), "part.added", "p1"));
    return store;
  };

  it("stitches deltas by offset and dedupes them by (partId, offset)", () => {
    const store = streaming();
    store.apply(delta(cur(2), "p1", 0, "Hello"));
    store.apply(delta(cur(2), "p1", 5, ", wor"));
    store.apply(delta(cur(2), "p1", 5, ", wor")); // the same delta again
    store.apply(delta(cur(2), "p1", 10, "ld"));
    expect(textOf(store)).toBe("Hello, world");
  });

  it("does not double the text when deltas overlap a part.updated", () => {
    const store = streaming();
    store.apply(delta(cur(2), "p1", 0, "Hello"));
    store.apply(delta(cur(2), "p1", 5, ", wor"));
    // part.updated: the persisted text is re-read; it covers what was streamed.
    expect(store.apply(partEvent(cur(3), "part.updated", "p1", 10))).toEqual([{ kind: "part", id: "p1" }]);
    store.receivePart(part("p1", "Hello, wor"));
    expect(textOf(store)).toBe("Hello, wor");
    // Deltas that overlap the persisted text, and one already seen, add nothing twice.
    store.apply(delta(cur(3), "p1", 5, ", wor"));
    store.apply(delta(cur(3), "p1", 8, "orld"));
    expect(textOf(store)).toBe("Hello, world");
    // A later, longer read keeps the streamed tail it confirms.
    store.receivePart(part("p1", "Hello, world"));
    expect(textOf(store)).toBe("Hello, world");
  });

  it("applies part.updated as a correction of the text", () => {
    const store = streaming();
    store.apply(delta(cur(2), "p1", 0, "Helo, "));
    store.apply(delta(cur(2), "p1", 6, "world"));
    store.apply(partEvent(cur(3), "part.updated", "p1", 6));
    store.receivePart(part("p1", "Hello,"));
    // The persisted six code units replace ours; the live tail after them stays.
    expect(textOf(store)).toBe("Hello,world");
    store.receivePart(part("p1", "Hello, world", "DONE"));
    expect(textOf(store)).toBe("Hello, world");
    // Nothing moves a done part.
    store.apply(delta(cur(3), "p1", 12, "!!"));
    store.receivePart(part("p1", "Hello,", "STREAMING"));
    expect(textOf(store)).toBe("Hello, world");
  });

  it("after a reload, holds live deltas past the snapshot until the gap is filled", () => {
    const store = new ConversationStore("c1");
    store.seed({ lastCursor: cur(3), messages: [message("m1", [part("p1", "Hello")])], runs: [run("r1", "RUNNING")] });
    store.apply(delta(cur(3), "p1", 12, "!")); // deltas since the snapshot's checkpoint were missed
    expect(textOf(store)).toBe("Hello");
    store.apply(partEvent(cur(4), "part.updated", "p1", 12));
    store.receivePart(part("p1", "Hello, world"));
    expect(textOf(store)).toBe("Hello, world!");
  });
});

describe("ConversationStore: pending interactions", () => {
  const approval = (id: string) => ({
    __typename: "PendingApproval" as const,
    id,
    interactionId: id,
    runId: "r1",
    toolCallId: `call-${id}`,
    toolName: "demo_publish",
    summary: "Publish",
    riskCategory: "publish",
    estimatedCostUsd: null,
    input: { text: "x" },
    expiresAt: "2026-01-02T00:00:00Z",
    allowedDecisions: ["ALLOW_ONCE" as const, "DENY" as const],
  });

  it("caches approvals by id and drops one when its decision arrives", () => {
    const store = seeded();
    expect(store.apply(interaction(cur(1), "approval.requested", "a1"))).toEqual([{ kind: "approvals", runId: "r1" }]);
    store.receiveApprovals("r1", [approval("a1"), approval("a2")]);
    store.receiveApprovals("r1", [approval("a1"), approval("a2")]); // read twice: still two cards
    expect(store.getSnapshot().approvals.map((a) => a.id)).toEqual(["a1", "a2"]);
    store.apply(interaction(cur(2), "approval.decided", "a1"));
    expect(store.getSnapshot().approvals.map((a) => a.id)).toEqual(["a2"]);
  });

  it("never offers a decided approval again, even from a read that started before the decision", () => {
    const store = seeded();
    store.apply(interaction(cur(1), "approval.requested", "a1"));
    store.apply(interaction(cur(2), "approval.decided", "a1"));
    store.receiveApprovals("r1", [approval("a1")]); // a stale read answers late
    expect(store.getSnapshot().approvals).toEqual([]);
  });
});
