// Event and object builders for the unit tests.
import type { MessageFieldsFragment, PartFieldsFragment, RunFieldsFragment } from "../gql/graphql";
import type { TransportEvent } from "./store";

const base = (cursor: string, type: string) => ({
  cursor,
  type,
  conversationId: "c1",
  runId: "r1",
  at: `2026-01-01T00:00:${cursor.padStart(2, "0").slice(-2)}Z`,
});

export const runEvent = (cursor: string, type: string, status: RunFieldsFragment["status"]): TransportEvent => ({
  __typename: "RunEvent",
  ...base(cursor, type),
  status,
});

export const messageCreated = (
  cursor: string,
  messageId: string,
  role: "USER" | "ASSISTANT" = "ASSISTANT",
  runId = "r1",
): TransportEvent => ({
  __typename: "MessageEvent",
  ...base(cursor, "message.created"),
  runId,
  messageId,
  role,
});

export const partEvent = (cursor: string, type: "part.added" | "part.updated", partId: string, textLength: number | null = null): TransportEvent => ({
  __typename: "PartEvent",
  ...base(cursor, type),
  messageId: "m1",
  partId,
  kind: "TEXT",
  textLength,
});

export const delta = (cursor: string, partId: string, offset: number, text: string): TransportEvent => ({
  __typename: "PartDelta",
  ...base(cursor, "part.delta"),
  messageId: "m1",
  partId,
  offset,
  text,
});

export const interaction = (cursor: string, type: string, interactionId: string): TransportEvent => ({
  __typename: "InteractionEvent",
  ...base(cursor, type),
  interactionId,
});

export const retryPending = (cursor: string, attempt: number): TransportEvent => ({
  __typename: "RunRetryPending",
  ...base(cursor, "run.retry-pending"),
  attempt,
  maxAttempts: 3,
  delayMs: 1000,
  nextAttemptAt: "2026-01-01T00:01:00Z",
  error: { code: "rate_limit_error", message: "slow down", httpStatus: 429, retryable: true },
});

export const part = (id: string, text: string, state: "STREAMING" | "DONE" = "STREAMING"): PartFieldsFragment => ({
  id,
  messageId: "m1",
  index: 0,
  kind: "TEXT",
  state,
  text,
  data: null,
  interactionId: null,
  toolCall: null,
  question: null,
  approval: null,
  connection: null,
});

export const message = (
  id: string,
  parts: PartFieldsFragment[],
  role: "USER" | "ASSISTANT" = "ASSISTANT",
  more: Partial<MessageFieldsFragment> = {},
): MessageFieldsFragment => ({
  id,
  conversationId: "c1",
  role,
  runId: "r1",
  createdAt: "2026-01-01T00:00:00Z",
  steering: false,
  parts,
  ...more,
});

export const run = (id: string, status: RunFieldsFragment["status"]): RunFieldsFragment => ({
  id,
  conversationId: "c1",
  status,
  attempt: 1,
  maxAttempts: 3,
  nextAttemptAt: null,
  cancelRequested: false,
  endCause: null,
  endReason: null,
  createdAt: "2026-01-01T00:00:00Z",
  error: null,
  usage: { inputTokens: 0, outputTokens: 0, costUsd: 0 },
  toolCalls: [],
});

/** Cursors that sort as the server's do: fixed width. */
export const cur = (n: number): string => String(n).padStart(6, "0");
