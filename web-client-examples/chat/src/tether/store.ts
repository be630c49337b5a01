// The state of one conversation as the page shows it, built from a snapshot
// (`conversation { messages runs lastCursor }`) and the events after it.
// Plain TypeScript with no React, so the dedupe and stitch rules are unit
// tested on their own. `apply` returns the reads an event asks for (events
// are thin; the state comes from queries), which the hooks carry out and
// feed back through the `receive*` methods.
import type {
  ConversationEventsSubscription,
  MessageFieldsFragment,
  PartFieldsFragment,
  PendingApprovalsQuery,
  PendingConnectionQuery,
  PendingQuestionQuery,
  RunFieldsFragment,
  RunStateFieldsFragment,
  RunStatus,
  ToolCallFieldsFragment,
} from "../gql/graphql";
import possibleTypes from "../gql/possibleTypes";
import { DeltaBuffer, layDelta, mergePersisted } from "./stitch";

export type TransportEvent = ConversationEventsSubscription["conversationEvents"];
export type PendingQuestion = NonNullable<PendingQuestionQuery["pendingQuestion"]>;
export type PendingApproval = PendingApprovalsQuery["pendingApprovals"][number];
export type PendingConnection = NonNullable<PendingConnectionQuery["pendingConnection"]>;
export type ToolCall = ToolCallFieldsFragment;

/** The event types the generated schema knows (the TransportEvent interface's possible types). */
const KNOWN_EVENTS: ReadonlySet<string> = new Set(possibleTypes.possibleTypes.TransportEvent);

export interface RetryInfo {
  attempt: number;
  maxAttempts: number;
  delayMs: number;
  nextAttemptAt: string;
  error: { code: string; message: string; httpStatus?: number | null };
}

export type RunView = RunStateFieldsFragment & { retry: RetryInfo | null };
export type PartView = Omit<PartFieldsFragment, "toolCall"> & { toolCall: ToolCall | null };
export interface MessageView {
  id: string;
  role: MessageFieldsFragment["role"];
  runId: string | null;
  createdAt: string;
  /** Sent with `STEER` and not read by its run yet. */
  steering: boolean;
  parts: PartView[];
}

export interface ConversationView {
  conversationId: string;
  seeded: boolean;
  /** The cursor of the newest persisted event applied (or of the snapshot). */
  lastCursor: string | null;
  messages: MessageView[];
  runs: RunView[];
  /** The oldest run that has not ended. */
  activeRun: RunView | null;
  questions: PendingQuestion[];
  approvals: PendingApproval[];
  connections: PendingConnection[];
}

export type Effect =
  | { kind: "message"; id: string }
  | { kind: "part"; id: string }
  | { kind: "run"; id: string }
  | { kind: "question"; runId: string }
  | { kind: "approvals"; runId: string }
  | { kind: "connection"; runId: string };

export const effectKey = (e: Effect): string =>
  `${e.kind}:${"id" in e ? e.id : e.runId}`;

const ENDED: ReadonlySet<RunStatus> = new Set(["COMPLETED", "FAILED", "CANCELLED"]);
export const isEnded = (status: RunStatus): boolean => ENDED.has(status);
const TEXT_KINDS = new Set(["TEXT", "REASONING", "ERROR", "NOTICE"]);

interface MessageRecord {
  id: string;
  role: MessageFieldsFragment["role"];
  runId: string | null;
  createdAt: string;
  steering: boolean;
  partIds: string[];
}

export interface SeedConversation {
  lastCursor: string;
  messages: MessageFieldsFragment[];
  runs: RunStateFieldsFragment[];
}

function stubRun(id: string, conversationId: string, status: RunStatus, at: string): RunView {
  return {
    id,
    conversationId,
    status,
    attempt: 0,
    maxAttempts: 0,
    nextAttemptAt: null,
    cancelRequested: false,
    endCause: null,
    endReason: null,
    createdAt: at,
    error: null,
    usage: { inputTokens: 0, outputTokens: 0, costUsd: 0 },
    retry: null,
  };
}

export class ConversationStore {
  readonly conversationId: string;
  private seeded = false;
  private cursor: string | null = null;
  private seenCursors = new Set<string>();
  private seenDeltas = new Set<string>();
  private buffers = new Map<string, DeltaBuffer>();
  private order: string[] = [];
  private messages = new Map<string, MessageRecord>();
  private parts = new Map<string, PartView>();
  private runs = new Map<string, RunView>();
  private runOrder: string[] = [];
  private toolCalls = new Map<string, ToolCall>();
  private questions = new Map<string, PendingQuestion>();
  private approvals = new Map<string, PendingApproval>();
  private connections = new Map<string, PendingConnection>();
  private resolved = new Set<string>();
  /** Steered messages whose run read them, or ended: a read made earlier does not say they still wait. */
  private settled = new Set<string>();
  /** Runs whose `run.steered` came last: the reply message it makes goes after the messages that joined. */
  private justSteered = new Set<string>();
  /** The cursor of the newest event applied to each run. */
  private runCursors = new Map<string, string>();
  private listeners = new Set<() => void>();
  private snapshot: ConversationView;

  constructor(conversationId: string) {
    this.conversationId = conversationId;
    this.snapshot = this.build();
  }

  // ---- React's external store protocol --------------------------------

  subscribe = (listener: () => void): (() => void) => {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  };

  getSnapshot = (): ConversationView => this.snapshot;

  get lastCursor(): string | null {
    return this.cursor;
  }

  private changed(): void {
    this.snapshot = this.build();
    for (const listener of this.listeners) listener();
  }

  // ---- The snapshot -----------------------------------------------------

  /** Lays a `conversation` query's result in; returns the reads it needs. */
  seed(conversation: SeedConversation): Effect[] {
    const effects: Effect[] = [];
    if (this.cursor === null || conversation.lastCursor > this.cursor) {
      this.cursor = conversation.lastCursor;
    }
    const serverOrder = conversation.messages.map((m) => m.id);
    for (const message of conversation.messages) this.upsertMessage(message);
    const rest = this.order.filter((id) => !serverOrder.includes(id));
    this.order = [...serverOrder, ...rest];
    for (const run of conversation.runs) {
      // A snapshot older than an event already applied to the run (a reload
      // while the feed is live) does not set its state back.
      const applied = this.runCursors.get(run.id);
      if (applied === undefined || applied <= conversation.lastCursor) this.upsertRun(run);
      if (run.status.startsWith("WAITING_")) {
        effects.push({ kind: "question", runId: run.id });
        effects.push({ kind: "approvals", runId: run.id });
        effects.push({ kind: "connection", runId: run.id });
      }
    }
    this.seeded = true;
    this.changed();
    return effects;
  }

  // ---- Events -------------------------------------------------------------

  /**
   * Applies one event. Persisted events are applied once, by cursor (a
   * replay after a reconnect, or an event the snapshot already covers, is
   * skipped); deltas once, by (partId, offset).
   */
  apply(event: TransportEvent): Effect[] {
    if (!KNOWN_EVENTS.has(event.__typename)) return [];
    if (event.__typename === "PartDelta") return this.applyDelta(event.partId, event.offset, event.text);
    if (this.seenCursors.has(event.cursor)) return [];
    if (this.cursor !== null && event.cursor <= this.cursor) return [];
    this.seenCursors.add(event.cursor);
    this.cursor = event.cursor;
    const effects = this.applyPersisted(event);
    this.changed();
    return effects;
  }

  private applyPersisted(event: TransportEvent): Effect[] {
    const runId = event.runId ?? null;
    if (runId) this.runCursors.set(runId, event.cursor);
    switch (event.__typename) {
      case "RunEvent": {
        if (!runId) return [];
        const run = this.runs.get(runId) ?? stubRun(runId, event.conversationId, event.status, event.at);
        this.putRun({ ...run, status: event.status, retry: event.status === "RETRY_PENDING" ? run.retry : null });
        return [{ kind: "run", id: runId }, ...this.settleSteering(runId, event.type, event.status)];
      }
      case "RunRetryPending": {
        if (!runId) return [];
        const run = this.runs.get(runId) ?? stubRun(runId, event.conversationId, "RETRY_PENDING", event.at);
        this.putRun({
          ...run,
          status: "RETRY_PENDING",
          attempt: event.attempt,
          maxAttempts: event.maxAttempts,
          nextAttemptAt: event.nextAttemptAt,
          retry: {
            attempt: event.attempt,
            maxAttempts: event.maxAttempts,
            delayMs: event.delayMs,
            nextAttemptAt: event.nextAttemptAt,
            error: event.error,
          },
        });
        // A read asked for now is made after any still in flight (which
        // could say RUNNING), and only its answer is laid in (effects.ts).
        return [{ kind: "run", id: runId }];
      }
      case "MessageEvent": {
        if (!this.messages.has(event.messageId)) {
          this.messages.set(event.messageId, {
            id: event.messageId,
            role: event.role,
            runId,
            createdAt: event.at,
            steering: false,
            partIds: [],
          });
          this.place(event.messageId);
        }
        return [{ kind: "message", id: event.messageId }];
      }
      case "PartEvent": {
        if (!this.parts.has(event.partId)) {
          const message = this.messages.get(event.messageId);
          this.putPart({
            id: event.partId,
            messageId: event.messageId,
            index: message ? message.partIds.length : 0,
            kind: event.kind,
            state: "STREAMING",
            text: TEXT_KINDS.has(event.kind) ? "" : null,
            data: null,
            interactionId: null,
            toolCall: null,
            question: null,
            approval: null,
            connection: null,
          });
        }
        return [{ kind: "part", id: event.partId }];
      }
      case "ToolEvent":
        return runId ? [{ kind: "run", id: runId }] : [];
      case "InteractionEvent":
        return this.applyInteraction(event.type, event.interactionId, runId);
      case "UsageUpdated": {
        const run = runId ? this.runs.get(runId) : undefined;
        if (run) this.putRun({ ...run, usage: event.usage });
        return [];
      }
      default:
        return [];
    }
  }

  private applyInteraction(type: string, interactionId: string, runId: string | null): Effect[] {
    if (type.endsWith(".requested")) {
      if (!runId) return [];
      if (type.startsWith("question")) return [{ kind: "question", runId }];
      if (type.startsWith("approval")) return [{ kind: "approvals", runId }];
      if (type.startsWith("connection")) return [{ kind: "connection", runId }];
      return [];
    }
    // question.answered, approval.decided, connection.completed: the card goes.
    this.resolved.add(interactionId);
    this.questions.delete(interactionId);
    this.approvals.delete(interactionId);
    this.connections.delete(interactionId);
    const effects: Effect[] = [];
    for (const part of this.parts.values()) {
      if (part.interactionId === interactionId) effects.push({ kind: "part", id: part.id });
    }
    if (runId) effects.push({ kind: "run", id: runId });
    return effects;
  }

  private applyDelta(partId: string, offset: number, chunk: string): Effect[] {
    const key = `${partId}:${offset}`;
    if (this.seenDeltas.has(key)) return [];
    this.seenDeltas.add(key);
    const part = this.parts.get(partId);
    if (!part || part.state === "DONE") return [];
    const text = part.text ?? "";
    const result = layDelta(text, offset, chunk);
    if (result.kind === "covered") return [];
    if (result.kind === "gap") {
      this.buffer(partId).hold(offset, chunk);
      return [];
    }
    this.putPart({ ...part, text: this.buffer(partId).drain(result.text) });
    this.changed();
    return [];
  }

  private buffer(partId: string): DeltaBuffer {
    let buffer = this.buffers.get(partId);
    if (!buffer) {
      buffer = new DeltaBuffer();
      this.buffers.set(partId, buffer);
    }
    return buffer;
  }

  // ---- Results of reads ---------------------------------------------------

  receiveMessage(message: MessageFieldsFragment): void {
    this.upsertMessage(message);
    this.place(message.id);
    this.changed();
  }

  /**
   * Puts a message that arrived live where `Conversation.messages` would
   * list it: a run's first reply right after the message that started the
   * run (the reply is made when the run starts, after any message queued
   * meanwhile, and before messages still waiting to steer it); the reply
   * that `run.steered` makes, a later reply, and a message steered into a
   * run, after the run's last message; any other message at the end.
   */
  private place(id: string): void {
    if (this.order.includes(id)) return;
    const record = this.messages.get(id);
    const runId = record?.runId;
    if (record && runId) {
      const ofRun = this.order.filter((other) => this.messages.get(other)?.runId === runId);
      const replied = ofRun.some((other) => this.messages.get(other)?.role === "ASSISTANT");
      const steered = record.role === "ASSISTANT" && this.justSteered.delete(runId);
      const after = record.role === "ASSISTANT" && !replied && !steered ? ofRun[0] : ofRun[ofRun.length - 1];
      if (after !== undefined) {
        this.order.splice(this.order.indexOf(after) + 1, 0, id);
        return;
      }
    }
    this.order.push(id);
  }

  receivePart(part: PartFieldsFragment): void {
    this.upsertPart(part);
    this.changed();
  }

  receiveRun(run: RunFieldsFragment): void {
    this.upsertRun(run);
    this.changed();
  }

  /**
   * The run a mutation returned (`sendMessage`, `cancelRun`): its state as of
   * that write. The feed can deliver the run's later events before the
   * mutation's response arrives (a run that fails at once is already
   * RETRY_PENDING), so once an event of the run is applied, the write sets
   * only what it adds (a cancel request), never the state back.
   */
  receiveWrittenRun(run: RunFieldsFragment): void {
    const known = this.runs.get(run.id);
    if (known && this.runCursors.has(run.id)) {
      this.putRun({ ...known, cancelRequested: known.cancelRequested || run.cancelRequested });
    } else {
      this.upsertRun(run);
    }
    this.changed();
  }

  receiveQuestion(runId: string, question: PendingQuestion | null): void {
    for (const [id, q] of this.questions) if (q.runId === runId) this.questions.delete(id);
    if (question && !this.resolved.has(question.id)) this.questions.set(question.id, question);
    this.changed();
  }

  receiveApprovals(runId: string, approvals: PendingApproval[]): void {
    for (const [id, a] of this.approvals) if (a.runId === runId) this.approvals.delete(id);
    for (const a of approvals) if (!this.resolved.has(a.id)) this.approvals.set(a.id, a);
    this.changed();
  }

  receiveConnection(runId: string, connection: PendingConnection | null): void {
    for (const [id, c] of this.connections) if (c.runId === runId) this.connections.delete(id);
    if (connection && !this.resolved.has(connection.id)) this.connections.set(connection.id, connection);
    this.changed();
  }

  // ---- Merging ------------------------------------------------------------

  private upsertMessage(message: MessageFieldsFragment): void {
    const known = this.messages.get(message.id);
    const partIds = message.parts.map((p) => p.id);
    for (const extra of known?.partIds ?? []) if (!partIds.includes(extra)) partIds.push(extra);
    const runId = message.runId ?? null;
    this.messages.set(message.id, {
      id: message.id,
      role: message.role,
      runId,
      createdAt: message.createdAt,
      steering: message.steering && !this.settled.has(message.id),
      partIds,
    });
    for (const part of message.parts) this.upsertPart(part);
    // A steered message whose run ended without answering it has a run of
    // its own now. The message stays where it stood, and what of its new
    // run arrived before this read (its reply) goes right after it.
    if (known && known.runId !== runId && runId && this.order.includes(message.id)) {
      const moved = this.order.filter((id) => id !== message.id && this.messages.get(id)?.runId === runId);
      this.order = this.order.filter((id) => !moved.includes(id));
      this.order.splice(this.order.indexOf(message.id) + 1, 0, ...moved);
    }
  }

  /**
   * `run.steered` says the run read every message steered into it. When a
   * run ends, a steered message it did not answer has a run of its own (or,
   * after an interrupt, stays unanswered where it is): its messages after
   * the one that started it are read again, to learn which.
   */
  private settleSteering(runId: string, type: string, status: RunStatus): Effect[] {
    const steered = type === "run.steered";
    if (steered) this.justSteered.add(runId);
    if (!steered && !isEnded(status)) return [];
    const effects: Effect[] = [];
    const ofRun = this.order.filter((id) => this.messages.get(id)?.runId === runId);
    // Every message of the run after the one that started it was steered
    // into it before this event (a read of it still on its way included).
    for (const [at, id] of ofRun.entries()) {
      const record = this.messages.get(id);
      if (!record || record.role !== "USER" || at === 0) continue;
      this.settled.add(id);
      record.steering = false;
      if (!steered) effects.push({ kind: "message", id });
    }
    return effects;
  }

  private upsertPart(part: PartFieldsFragment): void {
    const known = this.parts.get(part.id);
    const done = part.state === "DONE" || known?.state === "DONE";
    let text = part.text ?? null;
    if (text !== null && known?.text && known.state !== "DONE") {
      text = mergePersisted(known.text, text, part.state === "DONE");
    } else if (known?.state === "DONE" && part.state !== "DONE") {
      text = known.text; // an older read than one already laid in
    }
    if (text !== null && !done) text = this.buffer(part.id).drain(text);
    if (part.toolCall) this.toolCalls.set(part.toolCall.id, part.toolCall);
    this.putPart({ ...part, state: done ? "DONE" : part.state, text });
  }

  private putPart(part: PartView): void {
    this.parts.set(part.id, part);
    const message = this.messages.get(part.messageId);
    if (message && !message.partIds.includes(part.id)) message.partIds.push(part.id);
  }

  private upsertRun(run: RunStateFieldsFragment & { toolCalls?: ToolCall[] }): void {
    const { toolCalls = [], ...rest } = run;
    for (const call of toolCalls) this.toolCalls.set(call.id, call);
    const known = this.runs.get(run.id);
    // An ended run stays ended, whatever an older read says.
    const status = known && isEnded(known.status) && !isEnded(run.status) ? known.status : run.status;
    let retry: RetryInfo | null = null;
    if (status === "RETRY_PENDING") {
      // After a reload there was no event: the run itself says when the next attempt is.
      retry =
        known?.retry ??
        (run.nextAttemptAt
          ? {
              attempt: Math.max(1, run.attempt - 1), // Run.attempt is already the next one
              maxAttempts: run.maxAttempts,
              delayMs: 0,
              nextAttemptAt: run.nextAttemptAt,
              error: run.error ?? { code: "unknown", message: "the model request failed" },
            }
          : null);
    }
    this.putRun({ ...rest, status, retry });
  }

  private putRun(run: RunView): void {
    if (!this.runs.has(run.id)) this.runOrder.push(run.id);
    this.runs.set(run.id, run);
  }

  private build(): ConversationView {
    const messages: MessageView[] = [];
    for (const id of this.order) {
      const record = this.messages.get(id);
      if (!record) continue;
      const parts = record.partIds
        .map((pid) => this.parts.get(pid))
        .filter((p): p is PartView => p !== undefined)
        .map((p) => (p.toolCall ? { ...p, toolCall: this.toolCalls.get(p.toolCall.id) ?? p.toolCall } : p))
        .sort((a, b) => a.index - b.index);
      messages.push({ id, role: record.role, runId: record.runId, createdAt: record.createdAt, steering: record.steering, parts });
    }
    const runs = this.runOrder.map((id) => this.runs.get(id)).filter((r): r is RunView => r !== undefined);
    const byCreated = (a: { createdAt: string }, b: { createdAt: string }) => a.createdAt.localeCompare(b.createdAt);
    return {
      conversationId: this.conversationId,
      seeded: this.seeded,
      lastCursor: this.cursor,
      messages,
      runs,
      activeRun: [...runs].sort(byCreated).find((r) => !isEnded(r.status)) ?? null,
      questions: [...this.questions.values()].sort(byCreated),
      approvals: [...this.approvals.values()].sort((a, b) => a.expiresAt.localeCompare(b.expiresAt)),
      connections: [...this.connections.values()].sort(byCreated),
    };
  }
}
