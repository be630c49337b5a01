// The reference server of `cargo bench --bench subscriptions`: the
// `graphql-ws` server on graphql-js, over `ws`, in memory, persisting
// nothing. Its schema is the subset of Tether's that the bench drives:
// `createConversation`, `sendMessage` over HTTP POST /graphql, and the
// `conversationEvents` subscription over WebSocket (graphql-transport-ws),
// yielding events of the same JSON shape as Tether's.
//
// `sendMessage` publishes `message.created` and `run.queued`, as Tether's
// `--role api` commits. With REFERENCE_STREAM_DELAY_MS set, it also plays a
// run the way Tether's scripted model does: `run.started`, the reply in
// 8-character `part.delta`s one every REFERENCE_STREAM_DELAY_MS, then
// `run.completed`; runs of one conversation play one after another.
// `after` is accepted and ignored: nothing is kept to replay.
//
// Listens on PORT (0: any) on 127.0.0.1 and prints
// `reference listening on http://127.0.0.1:PORT` as its first line.

import { createServer } from 'node:http';
import { randomUUID } from 'node:crypto';
import { buildSchema, graphql } from 'graphql';
import { WebSocketServer } from 'ws';
import { useServer } from 'graphql-ws/use/ws';

const schema = buildSchema(`
  scalar DateTime
  enum MessageRole { ASSISTANT USER }
  enum RunStatus { CANCELLED COMPLETED FAILED QUEUED RUNNING }
  interface TransportEvent {
    at: DateTime!
    conversationId: ID!
    cursor: String!
    runId: ID
    type: String!
  }
  type MessageEvent implements TransportEvent {
    at: DateTime!
    conversationId: ID!
    cursor: String!
    messageId: ID!
    role: MessageRole!
    runId: ID
    type: String!
  }
  type RunEvent implements TransportEvent {
    at: DateTime!
    conversationId: ID!
    cursor: String!
    runId: ID
    status: RunStatus!
    type: String!
  }
  type PartDelta implements TransportEvent {
    at: DateTime!
    conversationId: ID!
    cursor: String!
    messageId: ID!
    offset: Int!
    partId: ID!
    runId: ID
    text: String!
    type: String!
  }
  type Conversation { id: ID! }
  type Message { id: ID! }
  type Run { id: ID! }
  type SendMessagePayload { message: Message! run: Run! }
  input CreateConversationInput { agent: String title: String }
  input SendMessageInput { clientMessageId: String conversationId: ID! text: String! }
  type Query { health: String! }
  type Mutation {
    createConversation(input: CreateConversationInput!): Conversation!
    sendMessage(input: SendMessageInput!): SendMessagePayload!
  }
  type Subscription {
    conversationEvents(after: String, conversationId: ID!): TransportEvent!
  }
`);

const streamDelayMs = Number(process.env.REFERENCE_STREAM_DELAY_MS || 0);
const subscribers = new Map(); // conversationId -> Set of push functions
const runsPlaying = new Map(); // conversationId -> promise of the last run
const messageCounts = new Map(); // conversationId -> messages so far
let sequence = 0;

function publish(conversationId, typename, fields) {
  sequence += 1;
  const event = {
    __typename: typename,
    cursor: String(sequence).padStart(16, '0'),
    conversationId,
    at: new Date().toISOString(),
    runId: null,
    ...fields,
  };
  const set = subscribers.get(conversationId);
  if (set) for (const push of set) push(event);
}

// One subscriber's events: an unbounded queue, as a pubsub iterator is.
function listen(conversationId) {
  const queue = [];
  let wake = null;
  let done = false;
  const push = (event) => {
    queue.push(event);
    if (wake) {
      wake();
      wake = null;
    }
  };
  let set = subscribers.get(conversationId);
  if (!set) subscribers.set(conversationId, (set = new Set()));
  set.add(push);
  const stop = () => {
    done = true;
    set.delete(push);
    if (set.size === 0) subscribers.delete(conversationId);
    if (wake) wake();
  };
  return {
    [Symbol.asyncIterator]() {
      return this;
    },
    async next() {
      while (queue.length === 0 && !done) await new Promise((r) => (wake = r));
      if (done) return { value: undefined, done: true };
      return { value: queue.shift(), done: false };
    },
    async return() {
      stop();
      return { value: undefined, done: true };
    },
  };
}

function reply(text, earlier) {
  const quote = [...text].slice(0, 120).join('');
  return `You said: "${quote}". This is Tether's scripted model, streaming its reply in small chunks so that you can watch the message grow; it sees ${earlier} earlier messages in this conversation.`;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function play(conversationId, runId, text, earlier) {
  publish(conversationId, 'RunEvent', { type: 'run.started', runId, status: 'RUNNING' });
  const messageId = randomUUID();
  const partId = randomUUID();
  const chars = [...reply(text, earlier)];
  for (let offset = 0; offset < chars.length; offset += 8) {
    await sleep(streamDelayMs);
    publish(conversationId, 'PartDelta', {
      type: 'part.delta',
      runId,
      messageId,
      partId,
      offset,
      text: chars.slice(offset, offset + 8).join(''),
    });
  }
  publish(conversationId, 'RunEvent', { type: 'run.completed', runId, status: 'COMPLETED' });
}

const fields = (type) => schema.getType(type).getFields();
fields('Mutation').createConversation.resolve = () => ({ id: randomUUID() });
fields('Mutation').sendMessage.resolve = (_, { input }) => {
  const { conversationId, text } = input;
  const messageId = randomUUID();
  const runId = randomUUID();
  const earlier = messageCounts.get(conversationId) || 0;
  messageCounts.set(conversationId, earlier + 1);
  publish(conversationId, 'MessageEvent', {
    type: 'message.created',
    messageId,
    role: 'USER',
    runId,
  });
  publish(conversationId, 'RunEvent', { type: 'run.queued', runId, status: 'QUEUED' });
  if (streamDelayMs > 0) {
    const previous = runsPlaying.get(conversationId) || Promise.resolve();
    const next = previous.then(() => play(conversationId, runId, text, earlier * 2));
    runsPlaying.set(conversationId, next);
  }
  return { message: { id: messageId }, run: { id: runId } };
};
fields('Query').health.resolve = () => 'ok';
const events = fields('Subscription').conversationEvents;
events.subscribe = (_, { conversationId }) => listen(conversationId);
events.resolve = (event) => event;

const server = createServer((req, res) => {
  if (req.method !== 'POST' || !req.url.startsWith('/graphql')) {
    res.writeHead(404).end();
    return;
  }
  const chunks = [];
  req.on('data', (c) => chunks.push(c));
  req.on('end', async () => {
    let body;
    try {
      body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    } catch {
      res.writeHead(400).end();
      return;
    }
    const result = await graphql({
      schema,
      source: body.query,
      variableValues: body.variables,
    });
    res.writeHead(200, { 'content-type': 'application/json' });
    res.end(JSON.stringify(result));
  });
});

const wss = new WebSocketServer({ server, path: '/graphql' });
useServer({ schema }, wss);

server.listen(Number(process.env.PORT || 0), '127.0.0.1', () => {
  console.log(`reference listening on http://127.0.0.1:${server.address().port}`);
});
