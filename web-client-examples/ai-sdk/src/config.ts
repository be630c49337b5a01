/**
 * Where Tether is: `VITE_TETHER_URL` (build time, e.g. `http://127.0.0.1:8080`),
 * or this page's own origin, whose dev and preview servers forward `/graphql`
 * and `/ai` to Tether (see vite.config.ts).
 */
export const BASE = ((import.meta.env.VITE_TETHER_URL as string | undefined) ?? window.location.origin).replace(/\/+$/, "");

/** `useChat`'s endpoint: POST to send, GET `${CHAT_API}/{id}/stream` to resume. */
export const CHAT_API = `${BASE}/ai/chat`;

export const TOKEN_KEY = "tether.token";

/** The conversation in the address bar (`?c=ID`), so that a reload resumes it. */
export function conversationFromUrl(): string | null {
  return new URLSearchParams(window.location.search).get("c");
}
