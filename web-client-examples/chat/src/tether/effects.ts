// Carries out the reads a store asks for, and lays their results in.
import type { Client } from "urql";
import {
  MessageQuery,
  PartQuery,
  PendingApprovalsQuery,
  PendingConnectionQuery,
  PendingQuestionQuery,
  RunQuery,
} from "./documents";
import { effectKey, type ConversationStore, type Effect } from "./store";

const fresh = { requestPolicy: "network-only" } as const;

/** A read in flight, and whether an event asked for another since it began. */
interface Flight {
  again: boolean;
}
const flights = new WeakMap<ConversationStore, Map<string, Flight>>();

/**
 * Reads what the effects name, at most one read in flight per key. An
 * effect that comes while its key is being read makes the read go again once
 * it returns, and only that last result is laid in: it began after the event
 * that asked for it, so it is never older. (Two reads of one key in flight at
 * once would not do: urql shares one result between identical operations in
 * flight, so the newer read could resolve with the older one's answer.)
 */
export function runEffects(client: Client, store: ConversationStore, effects: Effect[]): void {
  let inFlight = flights.get(store);
  if (!inFlight) flights.set(store, (inFlight = new Map()));
  const unique = new Map(effects.map((e) => [effectKey(e), e]));
  for (const [key, effect] of unique) {
    const flight = inFlight.get(key);
    if (flight) {
      flight.again = true;
      continue;
    }
    const started: Flight = { again: false };
    inFlight.set(key, started);
    void (async () => {
      try {
        let layIn: () => void;
        do {
          started.again = false;
          layIn = await read(client, store, effect);
        } while (started.again);
        layIn();
      } finally {
        inFlight.delete(key);
      }
    })();
  }
}

const nothing = () => {};

/** Reads one effect; returns what lays its result in. */
async function read(client: Client, store: ConversationStore, effect: Effect): Promise<() => void> {
  switch (effect.kind) {
    case "message": {
      const r = await client.query(MessageQuery, { id: effect.id }, fresh).toPromise();
      const message = r.data?.message;
      return message ? () => store.receiveMessage(message) : nothing;
    }
    case "part": {
      const r = await client.query(PartQuery, { id: effect.id }, fresh).toPromise();
      const part = r.data?.part;
      return part ? () => store.receivePart(part) : nothing;
    }
    case "run": {
      const r = await client.query(RunQuery, { id: effect.id }, fresh).toPromise();
      const run = r.data?.run;
      return run ? () => store.receiveRun(run) : nothing;
    }
    case "question": {
      const r = await client.query(PendingQuestionQuery, { runId: effect.runId }, fresh).toPromise();
      const data = r.data;
      return data ? () => store.receiveQuestion(effect.runId, data.pendingQuestion ?? null) : nothing;
    }
    case "approvals": {
      const r = await client.query(PendingApprovalsQuery, { runId: effect.runId }, fresh).toPromise();
      const data = r.data;
      return data ? () => store.receiveApprovals(effect.runId, data.pendingApprovals) : nothing;
    }
    case "connection": {
      const r = await client.query(PendingConnectionQuery, { runId: effect.runId }, fresh).toPromise();
      const data = r.data;
      return data ? () => store.receiveConnection(effect.runId, data.pendingConnection ?? null) : nothing;
    }
  }
}
