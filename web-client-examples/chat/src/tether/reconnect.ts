// Pure decisions about a dropped event subscription.

/** What to do when the subscription ends with `error` (or completes). */
export type DropAction =
  | { kind: "signin"; reason: string } // the server refused the token (close 4403)
  | { kind: "fatal"; reason: string; code: string | null } // a GraphQL error: retrying will not help
  | { kind: "retry"; reason: string };

interface GraphQLErrorLike {
  message: string;
  extensions?: { code?: unknown };
}

function isCloseLike(error: unknown): error is { code: number; reason?: string } {
  return typeof error === "object" && error !== null && typeof (error as { code?: unknown }).code === "number";
}

export function classifyDrop(error: unknown): DropAction {
  if (error === undefined) return { kind: "retry", reason: "the server ended the subscription" };
  if (isCloseLike(error)) {
    if (error.code === 4403) return { kind: "signin", reason: "the server refused the token (4403)" };
    if (error.code === 4401) return { kind: "signin", reason: "the server refused the connection (4401)" };
    return { kind: "retry", reason: `socket closed (${error.code}${error.reason ? `: ${error.reason}` : ""})` };
  }
  if (Array.isArray(error) && error.length > 0) {
    const first = error[0] as GraphQLErrorLike;
    const code = typeof first.extensions?.code === "string" ? first.extensions.code : null;
    if (code === "UNAUTHENTICATED") return { kind: "signin", reason: first.message };
    return { kind: "fatal", reason: first.message, code };
  }
  if (error instanceof Error) return { kind: "retry", reason: error.message };
  return { kind: "retry", reason: "the connection dropped" };
}

/** Exponential backoff with a cap: 250 ms, 500 ms, 1 s, … 5 s. */
export function backoffMs(attempt: number): number {
  return Math.min(5000, 250 * 2 ** Math.max(0, attempt));
}
