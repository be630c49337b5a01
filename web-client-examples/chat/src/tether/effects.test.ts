import type { Client } from "urql";
import { describe, expect, it } from "vitest";
import { runEffects } from "./effects";
import { ConversationStore } from "./store";
import { cur, retryPending, run, runEvent } from "./testing";

/**
 * A client that answers `run` reads by hand and, like urql, hands an
 * identical operation still in flight the same answer as the first.
 */
function fakeClient() {
  const pending: { resolve: (status: string) => void }[] = [];
  let shared: Promise<string> | null = null;
  const client = {
    query: () => ({
      toPromise: async () => {
        if (!shared) {
          let resolve!: (status: string) => void;
          const promise = new Promise<string>((r) => (resolve = r));
          pending.push({ resolve });
          shared = promise.finally(() => (shared = null));
        }
        const status = await shared;
        return { data: { run: { ...run("r1", status as never), nextAttemptAt: "2026-01-01T00:01:00Z" } } };
      },
    }),
  };
  return { client: client as unknown as Client, pending };
}

const settle = () => new Promise((r) => setTimeout(r, 0));

describe("runEffects", () => {
  it("never lays in a read that began before the event that asked for a newer one", async () => {
    const store = new ConversationStore("c1");
    store.seed({ lastCursor: cur(0), messages: [], runs: [] });
    const { client, pending } = fakeClient();

    runEffects(client, store, store.apply(runEvent(cur(1), "run.started", "RUNNING")));
    // The run fails while its first read is in flight; that read says RUNNING.
    runEffects(client, store, store.apply(retryPending(cur(2), 1)));
    expect(pending).toHaveLength(1); // no second identical read in flight
    pending[0]!.resolve("RUNNING");
    await settle();
    expect(store.getSnapshot().activeRun?.status).toBe("RETRY_PENDING");

    // The read goes again, and its answer is the one laid in.
    expect(pending).toHaveLength(2);
    pending[1]!.resolve("RETRY_PENDING");
    await settle();
    expect(store.getSnapshot().activeRun).toMatchObject({ status: "RETRY_PENDING", retry: { attempt: 1 } });
  });

  it("lays in a single read's answer", async () => {
    const store = new ConversationStore("c1");
    store.seed({ lastCursor: cur(0), messages: [], runs: [] });
    const { client, pending } = fakeClient();
    runEffects(client, store, store.apply(runEvent(cur(1), "run.started", "RUNNING")));
    pending[0]!.resolve("RUNNING");
    await settle();
    expect(pending).toHaveLength(1);
    expect(store.getSnapshot().activeRun?.status).toBe("RUNNING");
  });
});
