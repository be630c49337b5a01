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

export function runEffects(client: Client, store: ConversationStore, effects: Effect[]): void {
  const unique = new Map(effects.map((e) => [effectKey(e), e]));
  for (const [key, effect] of unique) {
    const seq = store.beginRead(key);
    const latest = () => store.isLatestRead(key, seq);
    void read(client, store, effect, latest);
  }
}

async function read(client: Client, store: ConversationStore, effect: Effect, latest: () => boolean) {
  switch (effect.kind) {
    case "message": {
      const r = await client.query(MessageQuery, { id: effect.id }, fresh).toPromise();
      if (latest() && r.data?.message) store.receiveMessage(r.data.message);
      return;
    }
    case "part": {
      const r = await client.query(PartQuery, { id: effect.id }, fresh).toPromise();
      if (latest() && r.data?.part) store.receivePart(r.data.part);
      return;
    }
    case "run": {
      const r = await client.query(RunQuery, { id: effect.id }, fresh).toPromise();
      if (latest() && r.data?.run) store.receiveRun(r.data.run);
      return;
    }
    case "question": {
      const r = await client.query(PendingQuestionQuery, { runId: effect.runId }, fresh).toPromise();
      if (latest() && r.data) store.receiveQuestion(effect.runId, r.data.pendingQuestion ?? null);
      return;
    }
    case "approvals": {
      const r = await client.query(PendingApprovalsQuery, { runId: effect.runId }, fresh).toPromise();
      if (latest() && r.data) store.receiveApprovals(effect.runId, r.data.pendingApprovals);
      return;
    }
    case "connection": {
      const r = await client.query(PendingConnectionQuery, { runId: effect.runId }, fresh).toPromise();
      if (latest() && r.data) store.receiveConnection(effect.runId, r.data.pendingConnection ?? null);
      return;
    }
  }
}
