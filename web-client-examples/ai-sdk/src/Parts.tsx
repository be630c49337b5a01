// One component per kind of message part. Tether's pauses arrive as parts:
// an approval as the SDK's own tool part in state "approval-requested"; a
// question and a connection as data parts (`data-question`, `data-connection`).
import { useState, type FormEvent } from "react";
import { getToolName, isToolUIPart, type DynamicToolUIPart, type ToolUIPart } from "ai";
import { TetherError, type QuestionAnswer } from "./graphql";
import type { ConnectionData, QuestionData, TetherPart } from "./messages";

export interface PartActions {
  /** `addToolApprovalResponse`: marks the part "approval-responded"; useChat then re-POSTs. */
  decide(approvalId: string, approved: boolean): void;
  /** The GraphQL `answerQuestion` mutation, then a resumed stream. */
  answer(interactionId: string, answers: QuestionAnswer[]): Promise<void>;
}

const json = (value: unknown) => JSON.stringify(value, null, 2);

/** A JSON value, folded when long. */
function Json({ label, value, testId }: { label: string; value: unknown; testId: string }) {
  const text = json(value) ?? "undefined";
  return (
    <details open={text.length < 240}>
      <summary>{label}</summary>
      <pre data-testid={testId}>{text}</pre>
    </details>
  );
}

/**
 * A question as Tether's QuestionSpec, with the defaults CONTRACT.md gives
 * (label = value; allowOther when there are no options) filled in, so a
 * `data-question` that carries the tool's raw input also renders.
 */
function normalize(q: QuestionData["questions"][number]) {
  const options = (q.options ?? []).map((o) => ({ ...o, label: o.label ?? o.value }));
  return { ...q, options, multiple: q.multiple ?? false, allowOther: q.allowOther ?? options.length === 0 };
}

export function Part({ part, actions }: { part: TetherPart; actions: PartActions }) {
  if (isToolUIPart(part)) return <ToolPart part={part} actions={actions} />;
  switch (part.type) {
    case "text":
      return (
        <span className="part-text" data-testid="part-text" data-state={part.state ?? "done"}>
          {part.text}
          {part.state === "streaming" && <span className="cursor">▍</span>}
        </span>
      );
    case "reasoning":
      return (
        <details className="part-reasoning" data-testid="part-reasoning" data-state={part.state ?? "done"}>
          <summary>Reasoning</summary>
          <pre>{part.text}</pre>
        </details>
      );
    case "data-question":
      return <QuestionPart id={part.id} data={part.data} actions={actions} />;
    case "data-connection":
      return <ConnectionPart data={part.data} />;
    case "data-notice":
      return (
        <p className={`part-notice ${part.data.kind === "ERROR" ? "error" : ""}`} data-testid="part-notice" data-kind={part.data.kind}>
          {part.data.text}
        </p>
      );
    case "file":
      return (
        <a data-testid="part-file" href={part.url} target="_blank" rel="noreferrer">
          {part.filename ?? part.mediaType}
        </a>
      );
    case "source-url":
      return (
        <a data-testid="part-source" href={part.url} target="_blank" rel="noreferrer">
          {part.title ?? part.url}
        </a>
      );
    // step-start and source-document: nothing to show.
    default:
      return null;
  }
}

function ToolPart({ part, actions }: { part: ToolUIPart | DynamicToolUIPart; actions: PartActions }) {
  const name = getToolName(part);
  return (
    <div
      className={`part-tool state-${part.state}`}
      data-testid="part-tool"
      data-tool={name}
      data-state={part.state}
      data-dynamic={part.type === "dynamic-tool" ? "true" : "false"}
      data-tool-call-id={part.toolCallId}
    >
      <div className="tool-head">
        <code>{name}</code> <span className="tool-state">{part.state}</span>
      </div>
      {part.input !== undefined && <Json label="input" value={part.input} testId="tool-input" />}
      {part.state === "approval-requested" && (
        <div className="card approval-card" data-testid="approval-card" data-approval-id={part.approval.id}>
          <p>
            Allow <code data-testid="approval-tool">{name}</code> with this input?
          </p>
          <button type="button" data-testid="approve" onClick={() => actions.decide(part.approval.id, true)}>
            Approve
          </button>{" "}
          <button type="button" data-testid="deny" onClick={() => actions.decide(part.approval.id, false)}>
            Deny
          </button>
        </div>
      )}
      {part.state === "approval-responded" && (
        <p className="hint" data-testid="approval-responded" data-approved={String(part.approval.approved)}>
          {part.approval.approved ? "Approved" : "Denied"}; sending the decision…
        </p>
      )}
      {part.state === "output-available" && <Json label="output" value={part.output} testId="tool-output" />}
      {part.state === "output-error" && (
        <p className="error" data-testid="tool-error">
          {part.errorText}
        </p>
      )}
      {part.state === "output-denied" && <p data-testid="tool-denied">Denied</p>}
    </div>
  );
}

function QuestionPart({ id, data, actions }: { id: string | undefined; data: QuestionData; actions: PartActions }) {
  const [chosen, setChosen] = useState<Record<string, string[]>>({});
  const [other, setOther] = useState<Record<string, string>>({});
  const [errors, setErrors] = useState<Record<string, string>>({});
  const [sending, setSending] = useState(false);
  const [sent, setSent] = useState(false);
  const interactionId = data.interactionId ?? id ?? "";
  const questions = (data.questions ?? []).map(normalize);
  const open = data.status === "PENDING" && !sent;

  const toggle = (key: string, value: string, multiple: boolean, on: boolean) =>
    setChosen((c) => {
      const now = c[key] ?? [];
      return { ...c, [key]: multiple ? (on ? [...now, value] : now.filter((v) => v !== value)) : [value] };
    });

  const submit = async (e: FormEvent) => {
    e.preventDefault();
    const answers: QuestionAnswer[] = questions.map((q) => {
      const answer: QuestionAnswer = { key: q.key, values: chosen[q.key] ?? [] };
      const text = other[q.key];
      if (text !== undefined && text !== "") answer.other = text;
      return answer;
    });
    setSending(true);
    setErrors({});
    try {
      await actions.answer(interactionId, answers);
      setSent(true);
    } catch (error) {
      const key = error instanceof TetherError && typeof error.extensions.key === "string" ? error.extensions.key : "";
      setErrors({ [key]: error instanceof Error ? error.message : String(error) });
    } finally {
      setSending(false);
    }
  };

  return (
    <div className="part-question" data-testid="part-question" data-status={data.status} data-interaction-id={interactionId}>
      {!open && (
        <ul className="answered">
          {questions.map((q) => {
            const a = data.answers?.find((x) => x.key === q.key);
            return (
              <li key={q.key}>
                {q.prompt} <b>{a ? [...a.values, ...(a.other ? [a.other] : [])].join(", ") : sent ? "…" : data.status.toLowerCase()}</b>
              </li>
            );
          })}
        </ul>
      )}
      {open && (
        <form className="card question-card" data-testid="question-card" onSubmit={submit}>
          {questions.map((q) => (
            <fieldset key={q.key} data-testid={`question-${q.key}`}>
              <legend>{q.prompt}</legend>
              {q.options.map((o) => (
                <label key={o.value} className="option">
                  <input
                    type={q.multiple ? "checkbox" : "radio"}
                    name={`${interactionId}-${q.key}`}
                    value={o.value}
                    checked={(chosen[q.key] ?? []).includes(o.value)}
                    onChange={(e) => toggle(q.key, o.value, q.multiple, e.target.checked)}
                    data-testid={`option-${q.key}-${o.value}`}
                  />
                  {o.label}
                  {o.description && <span className="hint"> — {o.description}</span>}
                </label>
              ))}
              {q.allowOther && (
                <input
                  type="text"
                  placeholder={q.options.length ? "Other…" : "Your answer"}
                  value={other[q.key] ?? ""}
                  onChange={(e) => setOther((o) => ({ ...o, [q.key]: e.target.value }))}
                  data-testid={`other-${q.key}`}
                />
              )}
              {errors[q.key] && (
                <div className="error" data-testid={`question-error-${q.key}`}>
                  {errors[q.key]}
                </div>
              )}
            </fieldset>
          ))}
          {errors[""] && (
            <div className="error" data-testid="question-error">
              {errors[""]}
            </div>
          )}
          <button type="submit" disabled={sending} data-testid="answer-submit">
            Answer
          </button>
        </form>
      )}
    </div>
  );
}

function ConnectionPart({ data }: { data: ConnectionData }) {
  return (
    <div className="part-connection" data-testid="part-connection" data-status={data.status} data-gap={data.gap}>
      {data.status === "PENDING" && data.loginUrl ? (
        <a
          className="card connection-card"
          data-testid="connect-link"
          href={data.loginUrl}
          onClick={() => sessionStorage.setItem("tether.oauth.returnTo", window.location.search)}
        >
          Connect {data.provider} ({data.gap.toLowerCase().replace(/_/g, " ")})
        </a>
      ) : (
        <span>
          Connection to {data.provider}: {data.status.toLowerCase()}
        </span>
      )}
    </div>
  );
}
