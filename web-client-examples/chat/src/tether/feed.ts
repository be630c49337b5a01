// Keeps one conversation's event subscription alive: subscribes after the
// newest cursor the store has applied and, after a drop, subscribes again
// from the newest cursor it has seen since. Plain TypeScript; the transport
// (graphql-ws in the app, a fake in the tests) is passed in.
import { backoffMs, classifyDrop, type DropAction } from "./reconnect";

export interface Sink<T> {
  next(value: T): void;
  error(error: unknown): void;
  complete(): void;
}

export type FeedStatus =
  | { state: "connecting" }
  | { state: "live" }
  | { state: "reconnecting"; reason: string; attempt: number }
  | { state: "failed"; reason: string; code: string | null }
  | { state: "unauthorized"; reason: string }
  | { state: "stopped" };

export interface FeedOptions<T> {
  /** Starts a subscription after `after`; returns how to stop it. */
  subscribe(after: string | null, sink: Sink<T>): () => void;
  /** The newest persisted cursor applied so far. */
  cursor(): string | null;
  onEvent(event: T): void;
  onStatus(status: FeedStatus): void;
  setTimer?: (fn: () => void, ms: number) => unknown;
  clearTimer?: (handle: unknown) => void;
}

export class EventFeed<T> {
  private stopSubscription: (() => void) | null = null;
  private timer: unknown = null;
  private attempt = 0;
  private stopped = false;
  private generation = 0;
  private readonly setTimer: (fn: () => void, ms: number) => unknown;
  private readonly clearTimer: (handle: unknown) => void;

  constructor(private readonly options: FeedOptions<T>) {
    this.setTimer = options.setTimer ?? ((fn, ms) => setTimeout(fn, ms));
    this.clearTimer = options.clearTimer ?? ((h) => clearTimeout(h as ReturnType<typeof setTimeout>));
  }

  start(): void {
    this.stopped = false;
    this.connect();
  }

  stop(): void {
    this.stopped = true;
    this.generation += 1;
    if (this.timer !== null) this.clearTimer(this.timer);
    this.timer = null;
    this.stopSubscription?.();
    this.stopSubscription = null;
    this.options.onStatus({ state: "stopped" });
  }

  /** Subscribes again now (from the newest cursor), e.g. after a "retry" click. */
  reconnectNow(): void {
    if (this.stopped) return;
    this.generation += 1;
    this.stopSubscription?.();
    if (this.timer !== null) this.clearTimer(this.timer);
    this.timer = null;
    this.connect();
  }

  private connect(): void {
    const generation = ++this.generation;
    const current = () => generation === this.generation && !this.stopped;
    this.options.onStatus(this.attempt === 0 ? { state: "connecting" } : this.reconnecting("resubscribing"));
    let sawEvent = false;
    this.stopSubscription = this.options.subscribe(this.options.cursor(), {
      next: (event) => {
        if (!current()) return;
        if (!sawEvent) {
          sawEvent = true;
          this.attempt = 0;
        }
        this.options.onEvent(event);
      },
      error: (error) => {
        if (current()) this.dropped(classifyDrop(error));
      },
      complete: () => {
        if (current()) this.dropped(classifyDrop(undefined));
      },
    });
    // graphql-ws has no acknowledgement of a subscribe; the socket being up
    // is reported by the transport through `markLive`.
  }

  /** The transport says the socket is up (graphql-ws `connected`). */
  markLive(): void {
    if (!this.stopped) this.options.onStatus({ state: "live" });
  }

  private reconnecting(reason: string): FeedStatus {
    return { state: "reconnecting", reason, attempt: this.attempt };
  }

  private dropped(action: DropAction): void {
    this.generation += 1; // whatever the dropped subscription still sends is ignored
    this.stopSubscription = null;
    if (action.kind === "signin") {
      this.stopped = true;
      this.options.onStatus({ state: "unauthorized", reason: action.reason });
      return;
    }
    if (action.kind === "fatal") {
      this.stopped = true;
      this.options.onStatus({ state: "failed", reason: action.reason, code: action.code });
      return;
    }
    this.attempt += 1;
    this.options.onStatus(this.reconnecting(action.reason));
    this.timer = this.setTimer(() => {
      this.timer = null;
      if (!this.stopped) this.connect();
    }, backoffMs(this.attempt - 1));
  }
}
