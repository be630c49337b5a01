// Pure text stitching for streamed parts. Offsets are UTF-16 code units,
// which is what JavaScript string indices are, so `slice` is exact.

/** The outcome of laying a `part.delta` onto the text held so far. */
export type DeltaResult =
  | { kind: "applied"; text: string }
  | { kind: "covered" } // everything it carries is already there
  | { kind: "gap" }; // it starts past the end: an earlier delta is missing

export function layDelta(text: string, offset: number, chunk: string): DeltaResult {
  if (offset > text.length) return { kind: "gap" };
  if (offset + chunk.length <= text.length) return { kind: "covered" };
  return { kind: "applied", text: text.slice(0, offset) + chunk };
}

/**
 * The persisted text is the authority for its own length; live text past it
 * (deltas that came after the checkpoint) is kept. Never appends the two, so
 * deltas that overlap a correction never double the text.
 */
export function mergePersisted(local: string, persisted: string, done: boolean): string {
  if (done) return persisted;
  if (local.length > persisted.length) return persisted + local.slice(persisted.length);
  return persisted;
}

/**
 * Deltas that arrived past the end of the text, waiting for the gap before
 * them to be filled (by an earlier delta or by the persisted text).
 */
export class DeltaBuffer {
  private waiting = new Map<number, string>();

  hold(offset: number, chunk: string): void {
    this.waiting.set(offset, chunk);
  }

  get size(): number {
    return this.waiting.size;
  }

  /** Lays every held delta that now fits, in offset order; drops covered ones. */
  drain(text: string): string {
    let current = text;
    let progressed = true;
    while (progressed && this.waiting.size > 0) {
      progressed = false;
      for (const offset of [...this.waiting.keys()].sort((a, b) => a - b)) {
        const chunk = this.waiting.get(offset) ?? "";
        const result = layDelta(current, offset, chunk);
        if (result.kind === "gap") continue;
        this.waiting.delete(offset);
        if (result.kind === "applied") {
          current = result.text;
          progressed = true;
        }
      }
    }
    return current;
  }
}
