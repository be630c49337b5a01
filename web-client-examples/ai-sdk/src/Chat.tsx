// The conversation page: `useChat` from @ai-sdk/react over Tether's
// `/ai/chat` endpoint, with the chat id = the Tether conversation id.
import { useMemo, useRef, useState, type FormEvent } from "react";
import { useChat } from "@ai-sdk/react";
import { DefaultChatTransport, lastAssistantMessageIsCompleteWithApprovalResponses } from "ai";
import { CHAT_API } from "./config";
import { ACTIVE_RUN, ANSWER_QUESTION, CANCEL_RUN, CONVERSATION, gql, type ConversationData, type QuestionAnswer, type RunStatus } from "./graphql";
import { toUIMessages, type TetherUIMessage } from "./messages";
import { Part, type PartActions } from "./Parts";

interface RunView {
  id: string;
  status: RunStatus;
  cancelRequested: boolean;
}

export function ChatView({ token, conversationId, initialMessages }: { token: string; conversationId: string; initialMessages: TetherUIMessage[] }) {
  // The transport is read on every request, so a new token takes effect at once.
  const transport = useMemo(
    () =>
      new DefaultChatTransport<TetherUIMessage>({
        api: CHAT_API,
        headers: { Authorization: `Bearer ${token}` },
        // Tether holds the history and reads only the last message: send
        // that alone, so a long conversation never outgrows the request
        // size limit.
        prepareSendMessagesRequest: ({ id, messages, trigger, messageId }) => ({
          body: { id, messages: messages.slice(-1), trigger, messageId },
        }),
      }),
    [token],
  );
  const [input, setInput] = useState("");
  const [dataLog, setDataLog] = useState<string[]>([]);
  const [cancelled, setCancelled] = useState<RunView | "none" | null>(null);
  const [actionError, setActionError] = useState<string | null>(null);
  // Set when cancelRun was asked of a run whose stream is still open: the
  // stream ends when the run does, and the page then re-reads the stored
  // conversation to show the run's final state.
  const refreshWhenFinished = useRef(false);

  const { messages, setMessages, sendMessage, status, error, clearError, stop, resumeStream, addToolApprovalResponse } = useChat<TetherUIMessage>({
    id: conversationId,
    messages: initialMessages,
    transport,
    // GET /ai/chat/{id}/stream on mount: the active run's message, replayed
    // from its start and followed live, or 204 when no run is active.
    resume: true,
    // After Approve/Deny, POST again at once with the decided part.
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
    // Every data part as it arrives (a transient one only reaches here).
    onData: (part) => setDataLog((log) => [...log.slice(-4), `${part.type}${part.id ? ` ${part.id}` : ""}`]),
    onFinish: () => {
      if (refreshWhenFinished.current) {
        refreshWhenFinished.current = false;
        void refresh();
      }
    },
  });
  const busy = status === "submitted" || status === "streaming";

  async function refresh() {
    try {
      const data = await gql<ConversationData>(token, CONVERSATION, { id: conversationId });
      if (data.conversation) setMessages(toUIMessages(data.conversation));
    } catch (e) {
      setActionError(e instanceof Error ? e.message : String(e));
    }
  }

  const actions: PartActions = {
    decide: (approvalId, approved) => void addToolApprovalResponse({ id: approvalId, approved }),
    answer: async (interactionId: string, answers: QuestionAnswer[]) => {
      await gql(token, ANSWER_QUESTION, { input: { interactionId, answers } });
      // The run is queued again: follow it on a resumed stream.
      void resumeStream();
    },
  };

  const cancel = async () => {
    setActionError(null);
    try {
      const { conversation } = await gql<{ conversation: { activeRun: RunView | null } | null }>(token, ACTIVE_RUN, { id: conversationId });
      const run = conversation?.activeRun;
      if (!run) {
        setCancelled("none");
        return;
      }
      const { cancelRun } = await gql<{ cancelRun: RunView }>(token, CANCEL_RUN, { runId: run.id });
      setCancelled(cancelRun);
      if (busy) refreshWhenFinished.current = true;
      else await refresh();
    } catch (e) {
      setActionError(e instanceof Error ? e.message : String(e));
    }
  };

  const send = (e: FormEvent) => {
    e.preventDefault();
    const text = input.trim();
    if (!text || busy) return;
    setInput("");
    void sendMessage({ text });
  };

  return (
    <div className="chat" data-testid="chat" data-conversation-id={conversationId}>
      <div className="toolbar">
        <span data-testid="chat-status" data-status={status}>
          {status}
        </span>
        <button type="button" data-testid="cancel-run" onClick={() => void cancel()}>
          Cancel run
        </button>
        {busy ? (
          <button type="button" data-testid="stop" onClick={() => void stop()} title="Closes this page's stream; the run goes on">
            Disconnect
          </button>
        ) : (
          <button type="button" data-testid="resume-stream" onClick={() => void resumeStream()} title="GET the active run's stream again">
            Reconnect
          </button>
        )}
        {cancelled && (
          <span data-testid="cancel-result" data-status={cancelled === "none" ? "NONE" : cancelled.status}>
            {cancelled === "none" ? "no active run" : cancelled.cancelRequested && cancelled.status === "RUNNING" ? "cancel requested" : cancelled.status.toLowerCase()}
          </span>
        )}
      </div>
      {error && (
        <div className="error-banner" data-testid="error-banner" role="alert">
          {error.message} <button onClick={clearError}>Dismiss</button>
        </div>
      )}
      {actionError && (
        <div className="error-banner" data-testid="action-error" role="alert">
          {actionError}
        </div>
      )}
      <ol className="messages">
        {messages.map((m) => (
          <li key={m.id} className={`message ${m.role}`} data-testid="message" data-role={m.role} data-message-id={m.id}>
            <div className="message-head">
              {m.role === "user" ? "You" : "Assistant"}
              {m.metadata?.runStatus && (
                <span className="badge" data-testid="message-run-status" data-status={m.metadata.runStatus}>
                  {m.metadata.runStatus.toLowerCase()}
                </span>
              )}
            </div>
            {m.parts.map((part, i) => (
              <Part key={`${m.id}-${i}`} part={part} actions={actions} />
            ))}
          </li>
        ))}
      </ol>
      <form className="composer" onSubmit={send}>
        <textarea
          rows={2}
          value={input}
          placeholder={'Message (try /hold 3, /ask, /tool demo_publish {"text": "x"})'}
          onChange={(e) => setInput(e.target.value)}
          onKeyDown={(e) => {
            if (e.key === "Enter" && !e.shiftKey) send(e);
          }}
          data-testid="composer-input"
        />
        <button type="submit" disabled={busy || !input.trim()} data-testid="composer-send">
          Send
        </button>
      </form>
      {dataLog.length > 0 && (
        <p className="hint" data-testid="data-log">
          onData: {dataLog.join(" · ")}
        </p>
      )}
    </div>
  );
}
