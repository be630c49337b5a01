// The message type the page gives useChat, and the conversion of a
// conversation's stored messages (GraphQL) into it, so that a reload shows
// the history before the resumed stream (if any) replays the active run's
// message over it.
import type { DynamicToolUIPart, UIMessage } from "ai";
import type { ConversationData, GqlMessage, GqlPart, InteractionStatus, QuestionAnswer, QuestionSpec, RunStatus } from "./graphql";

/** `data-question`: a question the run waits on (the part's `id` is the interaction id). */
export interface QuestionData {
  interactionId: string;
  runId?: string;
  status: InteractionStatus;
  questions: QuestionSpec[];
  answers?: QuestionAnswer[] | null;
}

/** `data-connection`: a consent the run waits on (the part's `id` is the interaction id). */
export interface ConnectionData {
  interactionId: string;
  runId?: string;
  provider: string;
  gap: string;
  status: InteractionStatus;
  loginUrl?: string | null;
}

/** `data-notice`: Tether's ERROR and NOTICE parts (a retried attempt, a failure). */
export interface NoticeData {
  kind: "ERROR" | "NOTICE";
  text: string;
}

export type TetherDataParts = {
  question: QuestionData;
  connection: ConnectionData;
  notice: NoticeData;
};

/** What the page keeps beside a message: its run and that run's status, when known. */
export interface TetherMetadata {
  runId?: string;
  runStatus?: RunStatus;
}

export type TetherUIMessage = UIMessage<TetherMetadata, TetherDataParts>;
export type TetherPart = TetherUIMessage["parts"][number];

function toolPart(part: GqlPart): DynamicToolUIPart | null {
  const call = part.toolCall;
  if (!call) return null;
  const base = { type: "dynamic-tool" as const, toolName: call.name, toolCallId: call.id, input: call.input };
  switch (call.outcome) {
    case null:
      return { ...base, state: "input-available" };
    case "SUCCEEDED":
      return { ...base, state: "output-available", output: call.output };
    case "DENIED":
      return { ...base, state: "output-denied", approval: { id: "", approved: false } };
    default:
      return { ...base, state: "output-error", errorText: call.output == null ? call.outcome : `${call.outcome}: ${JSON.stringify(call.output)}` };
  }
}

function convertPart(part: GqlPart): TetherPart | null {
  const streaming = part.state === "STREAMING" ? "streaming" : "done";
  switch (part.kind) {
    case "TEXT":
      return { type: "text", text: part.text ?? "", state: streaming };
    case "REASONING":
      return { type: "reasoning", text: part.text ?? "", state: streaming };
    case "TOOL_CALL":
      return toolPart(part);
    case "QUESTION":
      if (!part.question || !part.interactionId) return null;
      return {
        type: "data-question",
        id: part.interactionId,
        data: { interactionId: part.interactionId, ...part.question },
      };
    case "CONNECTION":
      if (!part.connection || !part.interactionId) return null;
      return {
        type: "data-connection",
        id: part.interactionId,
        data: { interactionId: part.interactionId, ...part.connection },
      };
    case "ERROR":
    case "NOTICE":
      return { type: "data-notice", id: part.id, data: { kind: part.kind, text: part.text ?? "" } };
    // An APPROVAL is shown on its tool call's part; a pending one comes back
    // with the resumed stream as the SDK's tool-approval-request.
    default:
      return null;
  }
}

function convertMessage(message: GqlMessage, runs: Map<string, RunStatus>): TetherUIMessage {
  const parts = message.parts
    .slice()
    .sort((a, b) => a.index - b.index)
    .map(convertPart)
    .filter((p): p is TetherPart => p !== null)
    .filter((p) => message.role === "ASSISTANT" || p.type === "text");
  const metadata: TetherMetadata = {};
  if (message.runId) {
    metadata.runId = message.runId;
    const status = runs.get(message.runId);
    if (status) metadata.runStatus = status;
  }
  return { id: message.id, role: message.role === "USER" ? "user" : "assistant", metadata, parts };
}

/** The stored conversation as useChat's initial messages. */
export function toUIMessages(conversation: NonNullable<ConversationData["conversation"]>): TetherUIMessage[] {
  const runs = new Map(conversation.runs.map((r) => [r.id, r.status] as const));
  return conversation.messages.map((m) => convertMessage(m, runs));
}
