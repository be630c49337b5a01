import { describe, expect, it } from "vitest";
import { EventFeed, type FeedStatus, type Sink } from "./feed";
import { ConversationStore, type TransportEvent } from "./store";
import { cur, delta, messageCreated, partEvent, runEvent } from "./testing";

/** A fake server: every persisted event in order, each subscription starting after `after`. */
function harness() {
  const store = new ConversationStore("c1");
  store.seed({ lastCursor: cur(0), messages: [], runs: [] });
  const log: TransportEvent[] = [
    runEvent(cur(1), "run.started", "RUNNING"),
    messageCreated(cur(2), "m1"),
    partEvent(cur(3), "part.added", "p1"),
    runEvent(cur(4), "run.checkpointed", "RUNNING"),
    runEvent(cur(5), "run.completed", "COMPLETED"),
  ];
  const subscriptions: { after: string | null; sink: Sink<TransportEvent> }[] = [];
  const timers: (() => void)[] = [];
  const statuses: FeedStatus[] = [];
  const applied: string[] = [];
  const feed = new EventFeed<TransportEvent>({
    subscribe: (after, sink) => {
      subscriptions.push({ after, sink });
      return () => {};
    },
    cursor: () => store.lastCursor,
    onEvent: (event) => {
      if (store.apply(event).length > 0 || event.__typename === "PartDelta") applied.push(event.cursor + event.type);
    },
    onStatus: (s) => statuses.push(s),
    setTimer: (fn) => timers.push(fn),
    clearTimer: () => {},
  });
  return { store, log, subscriptions, timers, statuses, applied, feed };
}

describe("EventFeed", () => {
  it("resubscribes from the newest cursor seen after a drop, and applies replayed events once", () => {
    const h = harness();
    h.feed.start();
    expect(h.subscriptions[0]?.after).toBe(cur(0));
    const first = h.subscriptions[0]!.sink;
    first.next(h.log[0]!);
    first.next(h.log[1]!);
    first.next(h.log[2]!);
    first.error({ code: 1006, reason: "" }); // the socket drops
    expect(h.statuses.at(-1)).toMatchObject({ state: "reconnecting" });
    // Events from the dropped subscription that arrive late are ignored.
    first.next(h.log[3]!);
    h.timers.shift()!();
    expect(h.subscriptions[1]?.after).toBe(cur(3));
    // A server (or a proxy) that replays from an earlier cursor changes nothing.
    const second = h.subscriptions[1]!.sink;
    for (const e of h.log.slice(1)) second.next(e);
    expect(h.applied).toEqual([
      `${cur(1)}run.started`,
      `${cur(2)}message.created`,
      `${cur(3)}part.added`,
      `${cur(4)}run.checkpointed`,
      `${cur(5)}run.completed`,
    ]);
    expect(h.store.getSnapshot().messages).toHaveLength(1);
    expect(h.store.getSnapshot().activeRun).toBeNull();
  });

  it("keeps deltas across a reconnect without doubling them", () => {
    const h = harness();
    h.feed.start();
    const first = h.subscriptions[0]!.sink;
    first.next(h.log[1]!);
    first.next(h.log[2]!);
    first.next(delta(cur(3), "p1", 0, "Hel"));
    first.error(new Error("network"));
    h.timers.shift()!();
    const second = h.subscriptions[1]!.sink;
    second.next(delta(cur(3), "p1", 0, "Hel"));
    second.next(delta(cur(3), "p1", 3, "lo"));
    const text = h.store.getSnapshot().messages[0]?.parts[0]?.text;
    expect(text).toBe("Hello");
  });

  it("sends the person to sign in on 4403 and stops", () => {
    const h = harness();
    h.feed.start();
    h.subscriptions[0]!.sink.error({ code: 4403, reason: "Forbidden" });
    expect(h.statuses.at(-1)).toMatchObject({ state: "unauthorized" });
    expect(h.timers).toHaveLength(0);
  });

  it("stops on a GraphQL error instead of retrying it", () => {
    const h = harness();
    h.feed.start();
    h.subscriptions[0]!.sink.error([{ message: "not found", extensions: { code: "NOT_FOUND" } }]);
    expect(h.statuses.at(-1)).toEqual({ state: "failed", reason: "not found", code: "NOT_FOUND" });
    expect(h.timers).toHaveLength(0);
  });

  it("resubscribes when the server completes the subscription", () => {
    const h = harness();
    h.feed.start();
    h.subscriptions[0]!.sink.next(h.log[0]!);
    h.subscriptions[0]!.sink.complete();
    h.timers.shift()!();
    expect(h.subscriptions[1]?.after).toBe(cur(1));
  });
});
