// The playground's browser test: a real tether (debug binary, the built-in
// scripted agent, a temporary SQLite file) and Debian's Chromium driven by
// playwright-core, with every request to anywhere but that tether aborted
// and recorded: any such request fails the test, so the page is proven to
// load and work offline. (The page's own Content-Security-Policy refuses
// such loads before they reach the network; the browser logs each refusal
// as a console error, which fails the test as well.) Every wait is for a
// condition.
//
//   TETHER_BIN=/path/to/tether npm run e2e
//
// Env: TETHER_BIN (required), CHROMIUM (default /usr/bin/chromium),
// E2E_HEADED=1 to watch, E2E_VERBOSE=1 for the server's output.
import { execFile, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { EventEmitter } from "node:events";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { chromium } from "playwright-core";

const here = dirname(fileURLToPath(import.meta.url));
const artifacts = join(here, "artifacts");
const tetherBin = process.env.TETHER_BIN;
if (!tetherBin) {
  console.error("TETHER_BIN must name a built tether binary (e.g. $CARGO_TARGET_DIR/debug/tether)");
  process.exit(2);
}
const TIMEOUT = 30_000;

const work = mkdtempSync(join(tmpdir(), "tether-graphiql-e2e-"));
const env = {
  ...process.env,
  TETHER_DATABASE_URL: `sqlite://${join(work, "tether.db")}?mode=rwc`,
  TETHER_JWT_SECRET: randomBytes(32).toString("hex"),
  TETHER_LISTEN: "127.0.0.1:0",
  TETHER_CONFIG: join(work, "tether.toml"),
  RUST_LOG: process.env.RUST_LOG ?? "warn",
};
writeFileSync(
  env.TETHER_CONFIG,
  `default_agent = "demo"

[runtime]
poll_ms = 200

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = 20
`,
);

let tether = null;
function cleanup() {
  if (tether && tether.exitCode === null) tether.kill("SIGTERM");
  rmSync(work, { recursive: true, force: true });
}
process.on("exit", cleanup);
process.on("SIGINT", () => process.exit(130));

/** Starts tether and resolves with the URL it prints once it listens. */
function startTether() {
  return new Promise((resolveUrl, reject) => {
    tether = spawn(tetherBin, ["serve"], { env, cwd: work, stdio: ["ignore", "pipe", "pipe"] });
    let stderr = "";
    tether.stderr.on("data", (d) => {
      stderr += d;
      if (process.env.E2E_VERBOSE) process.stderr.write(d);
    });
    const timer = setTimeout(() => reject(new Error(`tether did not start in time:\n${stderr}`)), 60_000);
    tether.on("exit", (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`tether exited with ${code ?? signal}:\n${stderr}`));
    });
    createInterface({ input: tether.stdout }).on("line", (line) => {
      if (process.env.E2E_VERBOSE) console.log(`[tether] ${line}`);
      const match = line.match(/tether listening on (http:\/\/\S+)/);
      if (match) {
        clearTimeout(timer);
        resolveUrl(match[1]);
      }
    });
  });
}

/** A GraphQL request from the test itself (not through the page). */
async function graphql(base, token, query, variables = {}) {
  const response = await fetch(`${base}/graphql`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${token}` },
    body: JSON.stringify({ query, variables }),
  });
  const body = await response.json();
  if (!response.ok || body.errors) throw new Error(`${query}: ${response.status} ${JSON.stringify(body)}`);
  return body.data;
}

let page = null;
async function step(name, fn) {
  const started = Date.now();
  try {
    await fn();
    console.log(`ok - ${name} (${Date.now() - started} ms)`);
  } catch (error) {
    mkdirSync(artifacts, { recursive: true });
    await page?.screenshot({ path: join(artifacts, "failed.png"), fullPage: true }).catch(() => {});
    console.log(`not ok - ${name}\n  ${String(error?.stack ?? error).split("\n").join("\n  ")}`);
    throw error;
  }
}

/** The text of the CodeMirror editor inside `selector`. */
function editorText(selector) {
  return page.evaluate((s) => document.querySelector(`${s} .CodeMirror`)?.CodeMirror.getValue() ?? null, selector);
}

/** Replaces the query editor's text as a paste would, then presses GraphiQL's run button. */
async function runInGraphiql(query) {
  await page.click(".graphiql-query-editor .CodeMirror");
  await page.keyboard.press("Control+A");
  await page.keyboard.press("Delete");
  await page.keyboard.insertText(query);
  await page.waitForFunction(
    (q) => document.querySelector(".graphiql-query-editor .CodeMirror").CodeMirror.getValue() === q,
    query,
    { timeout: TIMEOUT },
  );
  await page.click(".graphiql-execute-button");
}

async function main() {
  const base = await startTether();
  const server = new URL(base);
  const token = (
    await promisify(execFile)(tetherBin, ["token", "--tenant", "t", "--sub", "s"], { env, cwd: work })
  ).stdout.trim();

  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: !process.env.E2E_HEADED,
    // No component updates, field trials or other calls home of the browser's own.
    args: ["--no-sandbox", "--disable-background-networking", "--disable-component-update"],
  });
  try {
    const context = await browser.newContext();
    // The offline proof: anything addressed elsewhere than the server is
    // aborted and recorded, HTTP and WebSocket alike.
    const outside = [];
    await context.route("**/*", (route) => {
      const url = new URL(route.request().url());
      if (url.host === server.host) return route.continue();
      outside.push(route.request().url());
      return route.abort("internetdisconnected");
    });
    await context.routeWebSocket(
      (url) => url.host !== server.host,
      (ws) => {
        outside.push(ws.url());
        ws.close();
      },
    );
    page = await context.newPage();
    const problems = [];
    page.on("pageerror", (error) => problems.push(`page error: ${error.message}`));
    page.on("console", (message) => {
      if (message.type() === "error") problems.push(`console error: ${message.text()}`);
    });
    // The page's WebSockets and their frames, as the browser sent and received them.
    const sockets = [];
    const frames = new EventEmitter();
    page.on("websocket", (ws) => {
      const socket = { url: ws.url(), sent: [], received: [] };
      sockets.push(socket);
      ws.on("framesent", (frame) => {
        socket.sent.push(JSON.parse(frame.payload));
        frames.emit("frame");
      });
      ws.on("framereceived", (frame) => {
        socket.received.push(JSON.parse(frame.payload));
        frames.emit("frame");
      });
    });
    /** Resolves with `find()`'s first truthy answer, checked at every frame. */
    const untilFrames = (find, what) =>
      new Promise((resolveFound, reject) => {
        const check = () => {
          const found = find();
          if (!found) return;
          clearTimeout(timer);
          frames.off("frame", check);
          resolveFound(found);
        };
        const timer = setTimeout(() => {
          frames.off("frame", check);
          reject(new Error(`${what}; sockets: ${JSON.stringify(sockets)}`));
        }, TIMEOUT);
        frames.on("frame", check);
        check();
      });
    const loaded = [];
    page.on("requestfinished", (request) => loaded.push(request.url()));

    await step("GraphiQL loads from the server alone, its header editor holding the token", async () => {
      const response = await page.goto(`${base}/graphiql?token=${token}`);
      if (response.status() !== 200) throw new Error(`/graphiql answered ${response.status()}`);
      await page.waitForSelector(".graphiql-query-editor .CodeMirror", { timeout: TIMEOUT });
      // The schema arrived (introspection over HTTP with the token).
      await page.waitForSelector(".graphiql-execute-button:not([disabled])", { timeout: TIMEOUT });
      const headers = await editorText(".graphiql-editor-tool .graphiql-editor:not(.hidden)");
      if (JSON.parse(headers ?? "null")?.Authorization !== `Bearer ${token}`) {
        throw new Error(`the header editor holds ${headers}`);
      }
      const assets = loaded.filter((url) => new URL(url).pathname.startsWith("/graphiql/assets/"));
      if (!assets.some((u) => u.endsWith(".js")) || !assets.some((u) => u.endsWith(".css"))) {
        throw new Error(`the page's assets did not come from the server: ${loaded.join(", ")}`);
      }
    });

    await step("a query typed into GraphiQL shows its result", async () => {
      await runInGraphiql("{ agents { name } me { tenant principal } }");
      await page.waitForFunction(
        () => {
          const text = document.querySelector(".graphiql-response .CodeMirror")?.CodeMirror.getValue();
          if (!text) return false;
          const data = JSON.parse(text).data;
          return data?.agents?.[0]?.name === "demo" && data.me.tenant === "t" && data.me.principal === "s";
        },
        null,
        { timeout: TIMEOUT },
      );
    });

    await step("a subscription in GraphiQL receives a run's events over graphql-transport-ws", async () => {
      const { createConversation } = await graphql(
        base,
        token,
        "mutation { createConversation(input: { agent: \"demo\" }) { id lastCursor } }",
      );
      const conversation = createConversation.id;
      // From the conversation's cursor: no event is missed however soon the run starts.
      const after = createConversation.lastCursor;
      // Every text the result pane shows; a subscription replaces it per event.
      await page.evaluate(() => {
        const editor = document.querySelector(".graphiql-response .CodeMirror").CodeMirror;
        window.shownResults = [];
        editor.on("change", () => window.shownResults.push(editor.getValue()));
      });
      await runInGraphiql(
        `subscription { conversationEvents(conversationId: "${conversation}", after: "${after}") { type runId ... on RunEvent { status } } }`,
      );
      // Subscribed: the server acknowledged the socket, which then sent the subscribe.
      const socket = await untilFrames(
        () =>
          sockets.find(
            (s) =>
              s.received.some((m) => m.type === "connection_ack") &&
              s.sent.some((m) => m.type === "subscribe" && m.payload.query.includes(conversation)),
          ),
        "no acknowledged socket carried the subscription",
      );
      const init = socket.sent.find((m) => m.type === "connection_init");
      if (init?.payload?.Authorization !== `Bearer ${token}`) {
        throw new Error(`connection_init carried ${JSON.stringify(init)}`);
      }
      const expected = new URL(base);
      expected.protocol = "ws:";
      expected.pathname = "/graphql";
      if (socket.url !== expected.href) throw new Error(`the socket went to ${socket.url}, not ${expected.href}`);

      const { sendMessage } = await graphql(
        base,
        token,
        "mutation($c: ID!) { sendMessage(input: { conversationId: $c, text: \"hello from GraphiQL\" }) { run { id } } }",
        { c: conversation },
      );
      const run = sendMessage.run.id;
      await page.waitForFunction(
        (runId) =>
          window.shownResults.some((text) => {
            try {
              const event = JSON.parse(text).data?.conversationEvents;
              return event?.type === "run.completed" && event.runId === runId && event.status === "COMPLETED";
            } catch {
              return false;
            }
          }),
        run,
        { timeout: TIMEOUT },
      );
    });

    await step("nothing was requested from outside the server, and the page logged no error", async () => {
      if (outside.length) throw new Error(`requests outside the server: ${outside.join(", ")}`);
      if (problems.length) throw new Error(problems.join("\n"));
    });
  } finally {
    await browser.close();
  }
}

main().then(
  () => process.exit(0),
  (error) => {
    console.error(error?.stack ?? error);
    process.exit(1);
  },
);
