import { useState } from "react";
import { useParams } from "react-router-dom";
import {
  describeError,
  isEnded,
  useCancelRun,
  useConversation,
  useConversationEvents,
  usePendingApproval,
  usePendingConnection,
  usePendingQuestion,
  useSendMessage,
  type FeedStatus,
  type RunView,
  type TetherError,
} from "../tether";
import type { ActiveRunStrategy } from "../gql/graphql";
import { ApprovalCard, ConnectionCard, QuestionCard } from "./Cards";
import { MessageItem } from "./Messages";
import { RetryIndicator } from "./RetryIndicator";

export function ConversationPage() {
  const { id } = useParams();
  if (!id) return null;
  return <Conversation key={id} id={id} />;
}

function FeedBadge({ status, onRetry }: { status: FeedStatus; onRetry(): void }) {
  const text =
    status.state === "live"
      ? "live"
      : status.state === "connecting"
        ? "connecting…"
        : status.state === "reconnecting"
          ? `connection dropped: ${status.reason}; reconnecting`
          : status.state === "failed"
            ? `events stopped: ${status.code ?? ""} ${status.reason}`
            : status.state === "unauthorized"
              ? "signed out"
              : "stopped";
  return (
    <span className={`feed feed-${status.state}`} data-testid="feed-status" data-state={status.state}>
      {text}
      {(status.state === "reconnecting" || status.state === "failed") && (
        <button type="button" className="link" onClick={onRetry}>
          reconnect now
        </button>
      )}
    </span>
  );
}

function Conversation({ id }: { id: string }) {
  const conversation = useConversation(id);
  const events = useConversationEvents(id);
  const question = usePendingQuestion(id);
  const approvals = usePendingApproval(id);
  const connection = usePendingConnection(id);
  const { send, sending } = useSendMessage(id);
  const { cancel, cancelling } = useCancelRun(id);
  const [draft, setDraft] = useState("");
  const [strategy, setStrategy] = useState<ActiveRunStrategy>("QUEUE");
  const [error, setError] = useState<TetherError | null>(null);

  if (conversation.notFound)
    return (
      <div className="error" data-testid="error-banner" data-code="NOT_FOUND">
        Not found: this conversation does not exist, or it is not yours.
      </div>
    );
  if (conversation.error)
    return (
      <div className="error" data-testid="error-banner" data-code={conversation.error.code}>
        {describeError(conversation.error)}{" "}
        <button type="button" onClick={conversation.reload}>
          Try again
        </button>
      </div>
    );
  if (conversation.loading) return <p data-testid="loading">Loading…</p>;

  const runs = new Map<string, RunView>(conversation.runs.map((r) => [r.id, r]));
  const active = conversation.activeRun;

  return (
    <div className="conversation" data-testid="conversation" data-conversation-id={id}>
      <header className="conversation-header">
        <h2>{conversation.title ?? "Untitled"}</h2>
        <FeedBadge status={events.status} onRetry={events.reconnect} />
      </header>
      {error && (
        <div className="error" data-testid="error-banner" data-code={error.code}>
          {describeError(error)}
          <button type="button" className="link" onClick={() => setError(null)}>
            dismiss
          </button>
        </div>
      )}
      <ol className="messages" data-testid="messages">
        {conversation.messages.map((m) => (
          <MessageItem key={m.id} message={m} run={m.runId ? runs.get(m.runId) : undefined} activeRunId={active?.id ?? null} />
        ))}
      </ol>
      {active && (
        <div className="run-bar" data-testid="run-bar" data-run-id={active.id}>
          <span data-testid="run-status" data-status={active.status}>
            Run {active.status.toLowerCase().replace(/_/g, " ")}
            {active.cancelRequested ? " (cancelling…)" : ""}
          </span>
          {!isEnded(active.status) && (
            <button
              type="button"
              data-testid="cancel-run"
              disabled={cancelling}
              onClick={async () => {
                const r = await cancel(active.id);
                setError(r.ok ? null : r.error);
              }}
            >
              Cancel
            </button>
          )}
          {active.status === "RETRY_PENDING" && active.retry && <RetryIndicator retry={active.retry} />}
        </div>
      )}
      <section className="cards">
        {question && <QuestionCard key={question.id} question={question} />}
        {approvals.map((a) => (
          <ApprovalCard key={a.id} approval={a} />
        ))}
        {connection && <ConnectionCard key={connection.id} connection={connection} conversationId={id} />}
      </section>
      <form
        className="composer"
        onSubmit={async (e) => {
          e.preventDefault();
          const text = draft;
          if (!text.trim()) return;
          const r = await send(text, { onActiveRun: strategy });
          if (r.ok) {
            setDraft("");
            setError(null);
          } else setError(r.error);
        }}
      >
        <textarea
          rows={2}
          value={draft}
          onChange={(e) => setDraft(e.target.value)}
          placeholder="Message (try /ask, /hold 3, /fail 429, /tool demo_publish {&quot;text&quot;: &quot;x&quot;})"
          data-testid="composer-input"
          onKeyDown={(e) => {
            if (e.key === "Enter" && !e.shiftKey) {
              e.preventDefault();
              e.currentTarget.form?.requestSubmit();
            }
          }}
        />
        <label className="strategy">
          While a run is active
          <select
            value={strategy}
            onChange={(e) => setStrategy(e.target.value as ActiveRunStrategy)}
            data-testid="on-active-run"
          >
            <option value="QUEUE">queue after it</option>
            <option value="STEER">steer it (read at its next step)</option>
            <option value="INTERRUPT">interrupt it</option>
            <option value="REJECT">refuse to send</option>
          </select>
        </label>
        <button type="submit" disabled={sending} data-testid="composer-send">
          {active && strategy === "QUEUE" ? "Queue" : "Send"}
        </button>
      </form>
    </div>
  );
}
