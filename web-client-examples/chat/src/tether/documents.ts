// Every GraphQL document the hooks use. GraphQL Code Generator reads them
// (with the repository's schema.graphql) and types them in src/gql/.
import { graphql } from "../gql";

export const ToolCallFields = graphql(`
  fragment ToolCallFields on ToolCall {
    id
    runId
    name
    status
    outcome
    input
    output
    attempt
    startedAt
    endedAt
  }
`);

export const PartFields = graphql(`
  fragment PartFields on Part {
    id
    messageId
    index
    kind
    state
    text
    data
    interactionId
    toolCall {
      ...ToolCallFields
    }
    question {
      status
      questions {
        key
        prompt
      }
      answers {
        key
        values
        other
      }
    }
    approval {
      status
      toolName
      summary
      decision
      decidedBy
    }
    connection {
      provider
      gap
      status
    }
  }
`);

export const MessageFields = graphql(`
  fragment MessageFields on Message {
    id
    conversationId
    role
    runId
    createdAt
    steering
    parts {
      ...PartFields
    }
  }
`);

// What a run is, without its tool calls: a conversation's reload reads
// those through its messages' parts, so that a hundred runs do not count
// a hundred tool-call lists against the query's complexity.
export const RunStateFields = graphql(`
  fragment RunStateFields on Run {
    id
    conversationId
    status
    attempt
    maxAttempts
    nextAttemptAt
    cancelRequested
    endCause
    endReason
    createdAt
    error {
      code
      message
      httpStatus
      retryable
    }
    usage {
      inputTokens
      outputTokens
      costUsd
    }
  }
`);

export const RunFields = graphql(`
  fragment RunFields on Run {
    ...RunStateFields
    toolCalls {
      ...ToolCallFields
    }
  }
`);

export const ConversationQuery = graphql(`
  query Conversation($id: ID!) {
    conversation(id: $id) {
      id
      title
      agent
      createdAt
      lastCursor
      messages(last: 100) {
        ...MessageFields
      }
      runs(last: 100) {
        ...RunStateFields
      }
    }
  }
`);

export const ConversationsQuery = graphql(`
  query Conversations($first: Int!) {
    conversations(first: $first) {
      nodes {
        id
        title
        agent
        createdAt
      }
      hasMore
      endCursor
    }
  }
`);

export const MeQuery = graphql(`
  query Me {
    me {
      tenant
      principal
    }
  }
`);

export const MessageQuery = graphql(`
  query Message($id: ID!) {
    message(id: $id) {
      ...MessageFields
    }
  }
`);

export const PartQuery = graphql(`
  query Part($id: ID!) {
    part(id: $id) {
      ...PartFields
    }
  }
`);

export const RunQuery = graphql(`
  query Run($id: ID!) {
    run(id: $id) {
      ...RunFields
    }
  }
`);

export const PendingQuestionQuery = graphql(`
  query PendingQuestion($runId: ID!) {
    pendingQuestion(runId: $runId) {
      id
      interactionId
      runId
      createdAt
      expiresAt
      questions {
        key
        prompt
        multiple
        allowOther
        options {
          value
          label
          description
        }
      }
    }
  }
`);

export const PendingApprovalsQuery = graphql(`
  query PendingApprovals($runId: ID!) {
    pendingApprovals(runId: $runId) {
      id
      interactionId
      runId
      toolCallId
      toolName
      summary
      riskCategory
      estimatedCostUsd
      input
      expiresAt
      allowedDecisions
    }
  }
`);

export const PendingConnectionQuery = graphql(`
  query PendingConnection($runId: ID!) {
    pendingConnection(runId: $runId) {
      id
      interactionId
      runId
      toolCallId
      provider
      gap
      requiredScopes
      loginUrl
      createdAt
      expiresAt
    }
  }
`);

export const CreateConversationMutation = graphql(`
  mutation CreateConversation($input: CreateConversationInput!) {
    createConversation(input: $input) {
      id
      title
      agent
      createdAt
    }
  }
`);

export const SendMessageMutation = graphql(`
  mutation SendMessage($input: SendMessageInput!) {
    sendMessage(input: $input) {
      message {
        ...MessageFields
      }
      run {
        ...RunFields
      }
    }
  }
`);

export const CancelRunMutation = graphql(`
  mutation CancelRun($runId: ID!) {
    cancelRun(runId: $runId) {
      ...RunFields
    }
  }
`);

export const AnswerQuestionMutation = graphql(`
  mutation AnswerQuestion($input: AnswerQuestionInput!) {
    answerQuestion(input: $input) {
      resumed
      run {
        ...RunFields
      }
    }
  }
`);

export const DecideApprovalMutation = graphql(`
  mutation DecideApproval($input: DecideApprovalInput!) {
    decideApproval(input: $input) {
      resumed
      run {
        ...RunFields
      }
    }
  }
`);

export const CompleteConnectionMutation = graphql(`
  mutation CompleteConnection($input: CompleteConnectionInput!) {
    completeConnection(input: $input) {
      resumed
      run {
        ...RunFields
      }
    }
  }
`);

export const ConversationEventsSubscription = graphql(`
  subscription ConversationEvents($conversationId: ID!, $after: String) {
    conversationEvents(conversationId: $conversationId, after: $after) {
      __typename
      cursor
      type
      conversationId
      runId
      at
      ... on RunEvent {
        status
      }
      ... on RunRetryPending {
        attempt
        maxAttempts
        delayMs
        nextAttemptAt
        error {
          code
          message
          httpStatus
          retryable
        }
      }
      ... on MessageEvent {
        messageId
        role
      }
      ... on PartEvent {
        messageId
        partId
        kind
        textLength
      }
      ... on PartDelta {
        messageId
        partId
        offset
        text
      }
      ... on ToolEvent {
        toolCallId
        toolName
      }
      ... on InteractionEvent {
        interactionId
      }
      ... on UsageUpdated {
        usage {
          inputTokens
          outputTokens
          costUsd
        }
      }
      ... on ContextCompacted {
        messagesCompacted
      }
    }
  }
`);
