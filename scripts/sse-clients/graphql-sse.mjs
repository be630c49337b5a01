// Runs GraphQL operations against a running Tether with graphql-sse's own
// client, unchanged, in either of its modes, and prints what each operation
// receives as JSON lines on stdout: {"op": i, "result": ...} for each
// result, then {"op": i, "end": "complete" | "taken" | "error", ...}.
//
// Usage: node graphql-sse.mjs '{"url", "token", "singleConnection",
//   "operations": [{"query", "variables", "take", "resume"}]}'
// - take: stop the operation (dispose it) after this many results;
// - resume: set variables.after to the cursor of the last persisted event
//   the previous operation received (the `events` field of its results),
//   as a client reconnecting mid-run does.
import { createClient } from 'graphql-sse';

const { url, token, singleConnection, operations } = JSON.parse(process.argv[2]);

const client = createClient({
  url,
  singleConnection,
  headers: { Authorization: `Bearer ${token}` },
  // A refusal is reported, not retried.
  retryAttempts: 0,
});

const emit = (line) => process.stdout.write(`${JSON.stringify(line)}\n`);

let lastCursor = null;
for (const [op, operation] of operations.entries()) {
  const variables = { ...(operation.variables ?? {}) };
  if (operation.resume) variables.after = lastCursor;
  let seen = 0;
  let end = 'complete';
  try {
    for await (const result of client.iterate({ query: operation.query, variables })) {
      emit({ op, result });
      const event = result.data?.events;
      if (event && event.type !== 'part.delta') lastCursor = event.cursor;
      seen += 1;
      if (operation.take && seen >= operation.take) {
        end = 'taken';
        break;
      }
    }
    emit({ op, end });
  } catch (err) {
    emit({ op, end: 'error', message: String(err?.message ?? err) });
  }
}
client.dispose();
