// The few GraphQL operations the page needs besides the AI SDK stream, as
// plain fetch calls (POST BASE/graphql, Authorization: Bearer …). Names and
// inputs are those of CONTRACT.md section 3.
import { BASE } from "./config";

/** A GraphQL error, with its `extensions.code` (UNAUTHENTICATED, NOT_FOUND, BAD_USER_INPUT, CONFLICT, …). */
export class TetherError extends Error {
  constructor(
    message: string,
    readonly code: string,
    readonly extensions: Record<string, unknown> = {},
  ) {
    super(message);
    this.name = "TetherError";
  }
}

export async function gql<T>(token: string, query: string, variables: Record<string, unknown> = {}): Promise<T> {
  const response = await fetch(`${BASE}/graphql`, {
    method: "POST",
    headers: { "content-type": "application/json", accept: "application/graphql-response+json, application/json", authorization: `Bearer ${token}` },
    body: JSON.stringify({ query, variables }),
  });
  let payload: { data?: T | null; errors?: { message: string; extensions?: Record<string, unknown> }[] };
  try {
    payload = await response.json();
  } catch {
    throw new TetherError(`HTTP ${response.status} from ${BASE}/graphql`, response.status === 401 ? "UNAUTHENTICATED" : "INTERNAL");
  }
  const first = payload.errors?.[0];
  if (first) {
    const extensions = first.extensions ?? {};
    throw new TetherError(first.message, String(extensions.code ?? "INTERNAL"), extensions);
  }
  if (payload.data == null) throw new TetherError(`no data from ${BASE}/graphql`, "INTERNAL");
  return payload.data;
}

// ---- documents -----------------------------------------------------------

export const CREATE_CONVERSATION = /* GraphQL */ `
  mutation CreateConversation($input: CreateConversationInput!) {
    createConversation(input: $input) { id title }
  }
`;

const PART_FIELDS = /* GraphQL */ `
  id index kind state text data interactionId
  toolCall { id name input status outcome output }
  question {
    status
    questions { key prompt multiple allowOther options { value label description } }
    answers { key values other }
  }
  approval { toolName summary input decision status }
  connection { provider gap status }
`;

export const CONVERSATION = /* GraphQL */ `
  query Conversation($id: ID!) {
    me { tenant principal }
    conversation(id: $id) {
      id title
      activeRun { id status }
      runs { id status }
      messages(last: 100) { id role runId parts { ${PART_FIELDS} } }
    }
  }
`;

export const ACTIVE_RUN = /* GraphQL */ `
  query ActiveRun($id: ID!) {
    conversation(id: $id) { id activeRun { id status cancelRequested } }
  }
`;

export const CANCEL_RUN = /* GraphQL */ `
  mutation CancelRun($runId: ID!) {
    cancelRun(runId: $runId) { id status cancelRequested }
  }
`;

export const ANSWER_QUESTION = /* GraphQL */ `
  mutation AnswerQuestion($input: AnswerQuestionInput!) {
    answerQuestion(input: $input) { resumed run { id status } }
  }
`;

export const COMPLETE_CONNECTION = /* GraphQL */ `
  mutation CompleteConnection($input: CompleteConnectionInput!) {
    completeConnection(input: $input) { resumed run { id status } }
  }
`;

// ---- shapes --------------------------------------------------------------

export type RunStatus =
  | "QUEUED"
  | "RUNNING"
  | "RETRY_PENDING"
  | "WAITING_FOR_QUESTION"
  | "WAITING_FOR_APPROVAL"
  | "WAITING_FOR_CONNECTION"
  | "COMPLETED"
  | "FAILED"
  | "CANCELLED";
export type InteractionStatus = "PENDING" | "RESOLVED" | "EXPIRED" | "CANCELLED";

export interface QuestionOption {
  value: string;
  label: string;
  description?: string | null;
}
export interface QuestionSpec {
  key: string;
  prompt: string;
  options: QuestionOption[];
  multiple: boolean;
  allowOther: boolean;
}
export interface QuestionAnswer {
  key: string;
  values: string[];
  other?: string | null;
}

export interface GqlPart {
  id: string;
  index: number;
  kind: "TEXT" | "REASONING" | "TOOL_CALL" | "QUESTION" | "APPROVAL" | "CONNECTION" | "ERROR" | "NOTICE" | "FILE";
  state: "STREAMING" | "DONE";
  text: string | null;
  data: unknown;
  interactionId: string | null;
  toolCall: {
    id: string;
    name: string;
    input: unknown;
    status: "REQUESTED" | "EXECUTING" | "AWAITING" | "COMPLETED" | "INDETERMINATE";
    outcome: "SUCCEEDED" | "FAILED" | "DENIED" | "EXPIRED" | "INTERRUPTED" | "NOT_STARTED" | "UNKNOWN" | null;
    output: unknown;
  } | null;
  question: { status: InteractionStatus; questions: QuestionSpec[]; answers: QuestionAnswer[] | null } | null;
  approval: { toolName: string; summary: string; input: unknown; decision: string | null; status: InteractionStatus } | null;
  connection: { provider: string; gap: string; status: InteractionStatus } | null;
}

export interface GqlMessage {
  id: string;
  role: "USER" | "ASSISTANT";
  runId: string | null;
  parts: GqlPart[];
}

export interface ConversationData {
  me: { tenant: string; principal: string };
  conversation: {
    id: string;
    title: string | null;
    activeRun: { id: string; status: RunStatus } | null;
    runs: { id: string; status: RunStatus }[];
    messages: GqlMessage[];
  } | null;
}
