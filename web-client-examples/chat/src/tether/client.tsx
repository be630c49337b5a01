// The provider every hook needs: an urql client for queries and mutations,
// a graphql-ws client for subscriptions, both carrying the token.
import { createContext, useContext, useEffect, useMemo, useRef, type ReactNode } from "react";
import { Client, Provider, cacheExchange, fetchExchange } from "urql";
import { createClient as createWsClient, type Client as WsClient } from "graphql-ws";
import { ConversationStore } from "./store";

export interface TetherContextValue {
  client: Client;
  ws: WsClient;
  store(conversationId: string): ConversationStore;
  /** Called when the server refuses the token (WebSocket close 4403). */
  onAuthFailure(reason: string): void;
  /** Registers a listener for the socket being up; returns how to remove it. */
  onConnected(listener: () => void): () => void;
  /** Whether the socket is up now (a new subscription on it is live at once). */
  isConnected(): boolean;
}

const TetherContext = createContext<TetherContextValue | null>(null);

/** `VITE_TETHER_URL`, or this page's own origin's `/graphql`. */
export function defaultEndpoint(): string {
  const configured = import.meta.env.VITE_TETHER_URL as string | undefined;
  return new URL(configured && configured.length > 0 ? configured : "/graphql", window.location.href).toString();
}

export function wsEndpoint(httpUrl: string): string {
  const url = new URL(httpUrl);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return url.toString();
}

export interface TetherProviderProps {
  token: string;
  url?: string;
  onAuthFailure(reason: string): void;
  children: ReactNode;
}

export function TetherProvider({ token, url, onAuthFailure, children }: TetherProviderProps) {
  const endpoint = url ?? defaultEndpoint();
  const authFailure = useRef(onAuthFailure);
  useEffect(() => {
    authFailure.current = onAuthFailure;
  }, [onAuthFailure]);

  const value = useMemo<TetherContextValue>(() => {
    const client = new Client({
      url: endpoint,
      exchanges: [cacheExchange, fetchExchange],
      fetchOptions: () => ({ headers: { Authorization: `Bearer ${token}` } }),
    });
    const connected = new Set<() => void>();
    let up = false;
    const ws = createWsClient({
      url: wsEndpoint(endpoint),
      connectionParams: { Authorization: `Bearer ${token}` },
      // The event feed resubscribes itself, from the newest cursor it saw.
      retryAttempts: 0,
      on: {
        connected: () => {
          up = true;
          connected.forEach((l) => l());
        },
        closed: (event) => {
          up = false;
          const code = (event as { code?: number } | undefined)?.code;
          if (code === 4403) authFailure.current("the server refused the token (4403)");
        },
      },
    });
    const stores = new Map<string, ConversationStore>();
    return {
      client,
      ws,
      store(conversationId) {
        let store = stores.get(conversationId);
        if (!store) {
          store = new ConversationStore(conversationId);
          stores.set(conversationId, store);
        }
        return store;
      },
      onAuthFailure: (reason) => authFailure.current(reason),
      isConnected: () => up,
      onConnected(listener) {
        connected.add(listener);
        return () => connected.delete(listener);
      },
    };
  }, [endpoint, token]);

  useEffect(() => () => void value.ws.dispose(), [value]);

  return (
    <TetherContext.Provider value={value}>
      <Provider value={value.client}>{children}</Provider>
    </TetherContext.Provider>
  );
}

export function useTether(): TetherContextValue {
  const value = useContext(TetherContext);
  if (!value) throw new Error("useTether needs a <TetherProvider>");
  return value;
}
