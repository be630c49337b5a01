// The headless hooks. The page is built only from these; another app can
// copy this folder (with its generated src/gql/) as it is.
import { useCallback, useEffect, useMemo, useState, useSyncExternalStore } from "react";
import { print } from "graphql";
import { useMutation, useQuery } from "urql";
import type { ActiveRunStrategy, ApprovalDecision, QuestionAnswerInput } from "../gql/graphql";
import { useTether } from "./client";
import {
  AnswerQuestionMutation,
  CancelRunMutation,
  CompleteConnectionMutation,
  ConversationEventsSubscription,
  ConversationQuery,
  ConversationsQuery,
  CreateConversationMutation,
  DecideApprovalMutation,
  MeQuery,
  SendMessageMutation,
} from "./documents";
import { runEffects } from "./effects";
import { toTetherError, type TetherError } from "./errors";
import { EventFeed, type FeedStatus } from "./feed";
import type { ConversationView, TransportEvent } from "./store";

export type Outcome<T> = { ok: true; data: T } | { ok: false; error: TetherError };

function useConversationView(conversationId: string): ConversationView {
  const { store } = useTether();
  const s = store(conversationId);
  return useSyncExternalStore(s.subscribe, s.getSnapshot);
}

// ---- Reading ----------------------------------------------------------------

export function useMe() {
  const [result] = useQuery({ query: MeQuery });
  return {
    me: result.data?.me ?? null,
    fetching: result.fetching,
    error: result.error ? toTetherError(result.error) : null,
  };
}

export function useConversations(first = 50) {
  const [result, reexecute] = useQuery({ query: ConversationsQuery, variables: { first } });
  return {
    conversations: result.data?.conversations.nodes ?? [],
    fetching: result.fetching,
    error: result.error ? toTetherError(result.error) : null,
    refresh: useCallback(() => reexecute({ requestPolicy: "network-only" }), [reexecute]),
  };
}

export function useCreateConversation() {
  const [state, create] = useMutation(CreateConversationMutation);
  return {
    creating: state.fetching,
    create: useCallback(
      async (title?: string): Promise<Outcome<{ id: string }>> => {
        const r = await create({ input: { title: title && title.length > 0 ? title : null } });
        if (r.error || !r.data) return { ok: false, error: toTetherError(r.error!) };
        return { ok: true, data: r.data.createConversation };
      },
      [create],
    ),
  };
}

/**
 * The persisted messages (with their parts), runs and `lastCursor` of a
 * conversation, read in one snapshot, then kept current by
 * `useConversationEvents`.
 */
export function useConversation(conversationId: string) {
  const tether = useTether();
  const view = useConversationView(conversationId);
  const [error, setError] = useState<TetherError | null>(null);
  const [notFound, setNotFound] = useState(false);
  const [title, setTitle] = useState<string | null>(null);
  const [nonce, setNonce] = useState(0);

  useEffect(() => {
    let live = true;
    const store = tether.store(conversationId);
    void tether.client
      .query(ConversationQuery, { id: conversationId }, { requestPolicy: "network-only" })
      .toPromise()
      .then((r) => {
        if (!live) return;
        if (r.error) {
          setError(toTetherError(r.error));
          return;
        }
        const conversation = r.data?.conversation;
        if (!conversation) {
          setNotFound(true);
          return;
        }
        setError(null);
        setNotFound(false);
        setTitle(conversation.title ?? null);
        runEffects(tether.client, store, store.seed(conversation));
      });
    return () => {
      live = false;
    };
  }, [tether, conversationId, nonce]);

  return {
    ...view,
    title,
    loading: !view.seeded && !error && !notFound,
    error,
    notFound,
    reload: useCallback(() => setNonce((n) => n + 1), []),
  };
}

/**
 * Subscribes `conversationEvents(after: lastCursor)` once the snapshot is
 * in, and after a drop subscribes again from the newest cursor applied.
 */
export function useConversationEvents(conversationId: string) {
  const tether = useTether();
  const { seeded } = useConversationView(conversationId);
  const [status, setStatus] = useState<FeedStatus>({ state: "connecting" });
  const [feed, setFeed] = useState<EventFeed<TransportEvent> | null>(null);

  useEffect(() => {
    if (!seeded) return;
    const store = tether.store(conversationId);
    const query = print(ConversationEventsSubscription);
    const next = new EventFeed<TransportEvent>({
      cursor: () => store.lastCursor,
      subscribe: (after, sink) => {
        const stop = tether.ws.subscribe<{ conversationEvents: TransportEvent }>(
          { query, variables: { conversationId, after } },
          {
            next: (result) => {
              if (result.errors?.length) sink.error(result.errors);
              else if (result.data) sink.next(result.data.conversationEvents);
            },
            error: (e) => sink.error(e),
            complete: () => sink.complete(),
          },
        );
        // On a socket that is already up the subscription is live at once;
        // otherwise `connected` (below) says so.
        if (tether.isConnected()) queueMicrotask(() => next.markLive());
        return stop;
      },
      onEvent: (event) => runEffects(tether.client, store, store.apply(event)),
      onStatus: (s) => {
        setStatus(s);
        if (s.state === "unauthorized") tether.onAuthFailure(s.reason);
      },
    });
    const off = tether.onConnected(() => next.markLive());
    next.start();
    setFeed(next);
    return () => {
      off();
      next.stop();
    };
  }, [tether, conversationId, seeded]);

  return { status, reconnect: useCallback(() => feed?.reconnectNow(), [feed]) };
}

// ---- Writing ----------------------------------------------------------------

export interface SendOptions {
  onActiveRun?: ActiveRunStrategy;
  /** Reuse to retry a send safely: the server returns the original message. */
  clientMessageId?: string;
}

export function useSendMessage(conversationId: string) {
  const tether = useTether();
  const [state, send] = useMutation(SendMessageMutation);
  const sendMessage = useCallback(
    async (text: string, options: SendOptions = {}): Promise<Outcome<{ messageId: string; runId: string }>> => {
      const clientMessageId = options.clientMessageId ?? crypto.randomUUID();
      const input = { conversationId, text, clientMessageId, onActiveRun: options.onActiveRun ?? "QUEUE" } as const;
      let r = await send({ input });
      if (r.error && r.error.networkError && !r.error.graphQLErrors.length) r = await send({ input }); // same id: no duplicate
      if (r.error || !r.data) return { ok: false, error: toTetherError(r.error!) };
      const store = tether.store(conversationId);
      store.receiveMessage(r.data.sendMessage.message);
      store.receiveWrittenRun(r.data.sendMessage.run);
      return { ok: true, data: { messageId: r.data.sendMessage.message.id, runId: r.data.sendMessage.run.id } };
    },
    [send, conversationId, tether],
  );
  return { send: sendMessage, sending: state.fetching };
}

export function useCancelRun(conversationId: string) {
  const tether = useTether();
  const [state, cancel] = useMutation(CancelRunMutation);
  return {
    cancelling: state.fetching,
    cancel: useCallback(
      async (runId: string): Promise<Outcome<null>> => {
        const r = await cancel({ runId });
        if (r.error || !r.data) return { ok: false, error: toTetherError(r.error!) };
        tether.store(conversationId).receiveWrittenRun(r.data.cancelRun);
        return { ok: true, data: null };
      },
      [cancel, conversationId, tether],
    ),
  };
}

/** The oldest pending question of the conversation; null when none. */
export function usePendingQuestion(conversationId: string) {
  return useConversationView(conversationId).questions[0] ?? null;
}

export function useAnswerQuestion() {
  const [state, answer] = useMutation(AnswerQuestionMutation);
  return {
    answering: state.fetching,
    /** A BAD_USER_INPUT refusal comes back with `error.key`, the question it names. */
    answer: useCallback(
      async (interactionId: string, answers: QuestionAnswerInput[]): Promise<Outcome<{ resumed: boolean }>> => {
        const r = await answer({ input: { interactionId, answers } });
        if (r.error || !r.data) return { ok: false, error: toTetherError(r.error!) };
        return { ok: true, data: { resumed: r.data.answerQuestion.resumed } };
      },
      [answer],
    ),
  };
}

/** Every pending approval of the conversation, each cached by its id. */
export function usePendingApproval(conversationId: string) {
  return useConversationView(conversationId).approvals;
}

export function useDecideApproval() {
  const [state, decide] = useMutation(DecideApprovalMutation);
  return {
    deciding: state.fetching,
    decide: useCallback(
      async (interactionId: string, decision: ApprovalDecision): Promise<Outcome<{ resumed: boolean }>> => {
        const r = await decide({ input: { interactionId, decision } });
        if (r.error || !r.data) return { ok: false, error: toTetherError(r.error!) };
        return { ok: true, data: { resumed: r.data.decideApproval.resumed } };
      },
      [decide],
    ),
  };
}

export function usePendingConnection(conversationId: string) {
  return useConversationView(conversationId).connections[0] ?? null;
}

export function useCompleteConnection() {
  const [state, complete] = useMutation(CompleteConnectionMutation);
  return {
    completing: state.fetching,
    /** `code` when the person consented; `error` (e.g. `access_denied`) when they declined. */
    complete: useCallback(
      async (input: { state: string; code?: string | null; error?: string | null }): Promise<Outcome<{ resumed: boolean }>> => {
        const r = await complete({ input: { state: input.state, code: input.code ?? null, error: input.error ?? null } });
        if (r.error || !r.data) return { ok: false, error: toTetherError(r.error!) };
        return { ok: true, data: { resumed: r.data.completeConnection.resumed } };
      },
      [complete],
    ),
  };
}

/** A countdown to `at`, in whole seconds, updated every 250 ms. */
export function useCountdown(at: string | null): number | null {
  const target = useMemo(() => (at ? Date.parse(at) : null), [at]);
  const [now, setNow] = useState(() => Date.now());
  useEffect(() => {
    if (target === null) return;
    const id = setInterval(() => setNow(Date.now()), 250);
    return () => clearInterval(id);
  }, [target]);
  return target === null ? null : Math.max(0, Math.ceil((target - now) / 1000));
}
