// Server errors in the terms the page shows them.
import type { CombinedError } from "urql";

export type ErrorCode =
  | "UNAUTHENTICATED"
  | "NOT_FOUND"
  | "CONFLICT"
  | "BAD_USER_INPUT"
  | "FORBIDDEN"
  | "INTERNAL"
  | "TIMEOUT"
  | "UNAVAILABLE"
  | "NETWORK"
  | "UNKNOWN";

export interface TetherError {
  code: ErrorCode;
  message: string;
  /** `extensions.key`: the field a BAD_USER_INPUT names (a question's key). */
  key: string | null;
}

const KNOWN: ReadonlySet<string> = new Set([
  "UNAUTHENTICATED",
  "NOT_FOUND",
  "CONFLICT",
  "BAD_USER_INPUT",
  "FORBIDDEN",
  "INTERNAL",
  "TIMEOUT",
  "UNAVAILABLE",
]);

export function toTetherError(error: CombinedError): TetherError {
  const first = error.graphQLErrors[0];
  if (first) {
    const raw = first.extensions?.code;
    const code = typeof raw === "string" && KNOWN.has(raw) ? (raw as ErrorCode) : "UNKNOWN";
    const key = typeof first.extensions?.key === "string" ? first.extensions.key : null;
    return { code, message: first.message, key };
  }
  const status = (error.response as { status?: number } | undefined)?.status;
  if (status === 401) return { code: "UNAUTHENTICATED", message: "the server refused the token", key: null };
  return { code: "NETWORK", message: error.networkError?.message ?? error.message, key: null };
}

export function describeError(error: TetherError): string {
  switch (error.code) {
    case "UNAUTHENTICATED":
      return "Not signed in: the server refused the token.";
    case "NOT_FOUND":
      return "Not found: it does not exist, or it is not yours.";
    case "CONFLICT":
      return `Conflict: ${error.message}`;
    case "NETWORK":
      return `The server cannot be reached: ${error.message}`;
    case "UNAVAILABLE":
      return `Try again later: ${error.message}`;
    default:
      return `${error.code}: ${error.message}`;
  }
}
