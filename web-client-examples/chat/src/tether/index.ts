export { TetherProvider, useTether, defaultEndpoint } from "./client";
export * from "./hooks";
export { describeError, type TetherError } from "./errors";
export type { FeedStatus } from "./feed";
export type { ConversationView, MessageView, PartView, RunView, PendingApproval, PendingQuestion, PendingConnection, ToolCall } from "./store";
export { isEnded } from "./store";
