import { useState } from "react";
import {
  describeError,
  useAnswerQuestion,
  useCountdown,
  useDecideApproval,
  type PendingApproval,
  type PendingConnection,
  type PendingQuestion,
} from "../tether";
import { RETURN_KEY } from "./OAuthCallback";

interface Draft {
  values: string[];
  other: string;
}

export function QuestionCard({ question }: { question: PendingQuestion }) {
  const { answer, answering } = useAnswerQuestion();
  const [drafts, setDrafts] = useState<Record<string, Draft>>({});
  const [fieldErrors, setFieldErrors] = useState<Record<string, string>>({});
  const [error, setError] = useState<string | null>(null);
  const [sent, setSent] = useState(false);
  const draft = (key: string): Draft => drafts[key] ?? { values: [], other: "" };
  const update = (key: string, d: Draft) => setDrafts((all) => ({ ...all, [key]: d }));

  return (
    <form
      className="card question-card"
      data-testid="question-card"
      data-interaction-id={question.id}
      onSubmit={async (e) => {
        e.preventDefault();
        const answers = question.questions.map((q) => {
          const d = draft(q.key);
          return { key: q.key, values: d.values, other: d.other.length > 0 ? d.other : null };
        });
        const r = await answer(question.id, answers);
        if (r.ok) {
          setFieldErrors({});
          setError(null);
          setSent(true);
          return;
        }
        if (r.error.code === "BAD_USER_INPUT" && r.error.key) {
          setFieldErrors({ [r.error.key]: r.error.message });
          setError(null);
        } else setError(describeError(r.error));
      }}
    >
      <h3>The assistant asks</h3>
      {question.questions.map((q) => {
        const d = draft(q.key);
        return (
          <fieldset key={q.key} data-testid={`question-${q.key}`}>
            <legend>{q.prompt}</legend>
            {q.options.map((o) => (
              <label key={o.value} className="option">
                <input
                  type={q.multiple ? "checkbox" : "radio"}
                  name={`${question.id}-${q.key}`}
                  value={o.value}
                  checked={d.values.includes(o.value)}
                  data-testid={`option-${q.key}-${o.value}`}
                  onChange={(e) => {
                    const values = q.multiple
                      ? e.target.checked
                        ? [...d.values, o.value]
                        : d.values.filter((v) => v !== o.value)
                      : [o.value];
                    update(q.key, { ...d, values });
                  }}
                />
                {o.label}
                {o.description && <small> — {o.description}</small>}
              </label>
            ))}
            {q.allowOther && (
              <label className="other">
                {q.options.length > 0 ? "Other" : "Answer"}
                <input
                  type="text"
                  value={d.other}
                  data-testid={`other-${q.key}`}
                  onChange={(e) => update(q.key, { ...d, other: e.target.value })}
                />
              </label>
            )}
            {fieldErrors[q.key] && (
              <div className="field-error error" data-testid={`question-error-${q.key}`}>
                {fieldErrors[q.key]}
              </div>
            )}
          </fieldset>
        );
      })}
      {error && <div className="error">{error}</div>}
      <button type="submit" disabled={answering || sent} data-testid="answer-submit">
        {sent ? "Sent" : "Answer"}
      </button>
    </form>
  );
}

const DECISION_LABELS: Record<string, string> = {
  ALLOW_ONCE: "Allow once",
  ALLOW_CONVERSATION: "Allow in this conversation",
  ALLOW_ALWAYS: "Always allow",
  DENY: "Deny",
};

export function ApprovalCard({ approval }: { approval: PendingApproval }) {
  const { decide, deciding } = useDecideApproval();
  const [error, setError] = useState<string | null>(null);
  const [decided, setDecided] = useState(false);
  const left = useCountdown(approval.expiresAt);
  return (
    <div className="card approval-card" data-testid="approval-card" data-interaction-id={approval.id}>
      <h3>
        Allow <code data-testid="approval-tool">{approval.toolName}</code>?
      </h3>
      <p data-testid="approval-summary">{approval.summary}</p>
      <dl>
        <dt>Risk</dt>
        <dd data-testid="approval-risk">{approval.riskCategory}</dd>
        <dt>Estimated cost</dt>
        <dd data-testid="approval-cost">
          {approval.estimatedCostUsd === null || approval.estimatedCostUsd === undefined
            ? "not estimated"
            : `$${approval.estimatedCostUsd.toFixed(4)}`}
        </dd>
        <dt>Expires</dt>
        <dd data-testid="approval-expires">
          {new Date(approval.expiresAt).toLocaleString()}
          {left !== null && left < 3600 ? ` (in ${left} s)` : ""}
        </dd>
      </dl>
      <p>Exactly this runs if you allow it:</p>
      <pre data-testid="approval-input">{JSON.stringify(approval.input, null, 2)}</pre>
      <div className="decisions">
        {approval.allowedDecisions.map((d) => (
          <button
            key={d}
            type="button"
            disabled={deciding || decided}
            data-testid={`decide-${d}`}
            className={d === "DENY" ? "deny" : ""}
            onClick={async () => {
              const r = await decide(approval.id, d);
              if (r.ok) setDecided(true);
              else setError(describeError(r.error));
            }}
          >
            {DECISION_LABELS[d] ?? d}
          </button>
        ))}
      </div>
      {error && <div className="error">{error}</div>}
    </div>
  );
}

const GAP_WORDS: Record<string, string> = {
  ABSENT: "You have not connected this account yet.",
  EXPIRED: "Your connection has expired.",
  INSUFFICIENT_SCOPE: "Your connection is missing a permission this needs.",
};

export function ConnectionCard({ connection, conversationId }: { connection: PendingConnection; conversationId: string }) {
  return (
    <div className="card connection-card" data-testid="connection-card" data-interaction-id={connection.id}>
      <h3>
        Connect <span data-testid="connection-provider">{connection.provider}</span>
      </h3>
      <p data-testid="connection-gap" data-gap={connection.gap}>
        {GAP_WORDS[connection.gap] ?? connection.gap}
      </p>
      {connection.requiredScopes.length > 0 && <p>Permissions needed: {connection.requiredScopes.join(", ")}</p>}
      <p>Expires {new Date(connection.expiresAt).toLocaleString()}.</p>
      <a
        href={connection.loginUrl}
        data-testid="connect-link"
        onClick={() => sessionStorage.setItem(RETURN_KEY, conversationId)}
      >
        Connect {connection.provider}
      </a>
    </div>
  );
}
