import type { MessageView, PartView, RunView, ToolCall } from "../tether";

const OUTCOME_WORDS: Record<string, string> = {
  SUCCEEDED: "succeeded",
  FAILED: "failed",
  DENIED: "denied by a person",
  EXPIRED: "expired before anyone decided",
  NOT_STARTED: "never started",
  INTERRUPTED: "stopped before it finished",
  UNKNOWN: "we don't know whether this happened",
};

function ToolCallView({ call }: { call: ToolCall }) {
  return (
    <div className="tool-call" data-testid="tool-call" data-status={call.status} data-outcome={call.outcome ?? ""}>
      <strong>{call.name}</strong> <span className="status">{call.status.toLowerCase()}</span>
      {call.outcome && (
        <span className="outcome" data-testid="tool-outcome">
          {" "}
          — {call.outcome.toLowerCase().replace(/_/g, " ")}
          {(call.outcome === "UNKNOWN" || call.outcome === "INTERRUPTED") && `: ${OUTCOME_WORDS[call.outcome]}`}
        </span>
      )}
      <details>
        <summary>input and output</summary>
        <pre>{JSON.stringify(call.input, null, 2)}</pre>
        {call.output !== null && call.output !== undefined && <pre>{JSON.stringify(call.output, null, 2)}</pre>}
      </details>
    </div>
  );
}

function PartItem({ part }: { part: PartView }) {
  switch (part.kind) {
    case "TEXT":
      return (
        <div className="part-text" data-testid="part-text" data-part-id={part.id} data-state={part.state}>
          {part.text}
          {part.state === "STREAMING" && <span className="cursor">▍</span>}
        </div>
      );
    case "REASONING":
      return (
        <details className="part-reasoning" data-testid="part-reasoning">
          <summary>Reasoning{part.state === "STREAMING" ? " (thinking…)" : ""}</summary>
          <div>{part.text}</div>
        </details>
      );
    case "NOTICE":
      return (
        <div className="part-notice" data-testid="part-notice">
          {part.text}
        </div>
      );
    case "ERROR":
      return (
        <div className="part-error error" data-testid="part-error">
          {part.text}
        </div>
      );
    case "TOOL_CALL":
      return part.toolCall ? <ToolCallView call={part.toolCall} /> : <div className="tool-call">tool call…</div>;
    case "QUESTION":
      return (
        <div className="part-interaction" data-testid="part-question" data-status={part.question?.status ?? ""}>
          Question: {part.question?.questions.map((q) => q.prompt).join(" / ")} — {part.question?.status.toLowerCase()}
          {part.question?.answers && (
            <ul>
              {part.question.answers.map((a) => (
                <li key={a.key}>
                  {a.key}: {[...a.values, ...(a.other ? [a.other] : [])].join(", ")}
                </li>
              ))}
            </ul>
          )}
        </div>
      );
    case "APPROVAL":
      return (
        <div className="part-interaction" data-testid="part-approval" data-status={part.approval?.status ?? ""}>
          Approval for {part.approval?.toolName}: {part.approval?.summary} — {part.approval?.status.toLowerCase()}
          {part.approval?.decision && ` (${part.approval.decision.toLowerCase().replace(/_/g, " ")})`}
        </div>
      );
    case "CONNECTION":
      return (
        <div className="part-interaction" data-testid="part-connection" data-status={part.connection?.status ?? ""}>
          Connection to {part.connection?.provider} — {part.connection?.status.toLowerCase()}
        </div>
      );
    default:
      return null;
  }
}

export function MessageItem({
  message,
  run,
  activeRunId,
}: {
  message: MessageView;
  run: RunView | undefined;
  activeRunId: string | null;
}) {
  const queued = message.role === "USER" && run?.status === "QUEUED" && activeRunId !== null && activeRunId !== run.id;
  return (
    <li className={`message message-${message.role.toLowerCase()}`} data-testid="message" data-role={message.role} data-message-id={message.id}>
      <div className="meta">
        {message.role === "USER" ? "You" : "Assistant"}
        {queued && (
          <span className="badge" data-testid="queued-badge">
            queued: runs after the current one
          </span>
        )}
        {message.steering && (
          <span className="badge" data-testid="steering-badge">
            steering: read at the run's next step
          </span>
        )}
        {message.role === "ASSISTANT" && run && (
          <span className="badge" data-testid="message-run-status" data-status={run.status}>
            {run.status.toLowerCase().replace(/_/g, " ")}
            {run.endReason ? `: ${run.endReason}` : ""}
            {run.error ? ` (${run.error.code}: ${run.error.message})` : ""}
          </span>
        )}
      </div>
      {message.parts.map((p) => (
        <PartItem key={p.id} part={p} />
      ))}
    </li>
  );
}
