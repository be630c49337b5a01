// The browser test: a real tether (scripted model, temporary SQLite), the
// built client under `vite preview` (which forwards /graphql to tether), and
// Debian's Chromium driven by playwright-core. Every wait is for a condition.
//
//   TETHER_BIN=/path/to/tether npm run e2e
//
// Env: TETHER_BIN (required), CHROMIUM (default /usr/bin/chromium),
// E2E_HEADED=1 to watch, E2E_VERBOSE=1 for the servers' output, E2E_DIRECT=1
// to build the page with VITE_TETHER_URL pointing straight at tether (another
// origin: needs the server's `[api] cors_origins`, which the test sets).
import { spawn, execFile } from "node:child_process";
import { existsSync, mkdirSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { randomBytes } from "node:crypto";
import { chromium } from "playwright-core";
import { byName, children, freePort, startAndWait, steps, tetherBinary, tetherWorkspace, untilAnswers } from "../../e2e-support.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, "..");
const artifacts = join(here, "artifacts");
mkdirSync(artifacts, { recursive: true });

const tetherBin = tetherBinary();
const chromiumPath = process.env.CHROMIUM ?? "/usr/bin/chromium";
const TIMEOUT = 20_000;

const { work, env } = tetherWorkspace("e2e", {
  TETHER_ENCRYPTION_KEY: randomBytes(32).toString("base64"),
  GITHUB_CLIENT_SECRET: "demo-secret",
});

const config = (previewPort, mockUrl) => `default_agent = "demo"

[runtime]
checkpoint_ms = 250
poll_ms = 200

[policy]
allow_always = true

[[agents]]
name = "demo"
provider = "scripted"
tools = ["ask_questions", "demo_publish", "whoami"]
stream_delay_ms = 40

[agents.retry]
max_attempts = 3
# A wait of 3 to 6 s: long enough to see the indicator on a loaded machine.
initial_delay_ms = 6000
max_delay_ms = 8000

# A tool that needs a "github" connection; the OAuth mock plays GitHub.
[[tools]]
name = "whoami"
description = "Who the connected account is"
input_schema = { type = "object" }
recovery = "idempotent"
http = { method = "GET", url = "${mockUrl}/userinfo" }
connection = { provider = "github", scopes = ["read:user"] }

[[connections]]
provider = "github"
mode = "oauth2"
authorize_url = "${mockUrl}/authorize"
token_url = "${mockUrl}/token"
client_id = "tether-demo"
client_secret_env = "GITHUB_CLIENT_SECRET"
redirect_uri = "http://127.0.0.1:${previewPort}/oauth/callback"
`;


// ---- the steps ---------------------------------------------------------------

const run = steps(artifacts);
const { step } = run;

async function main() {
  if (!existsSync(join(root, "dist", "index.html"))) throw new Error("no dist/: run `npm run build` first");
  const port = await freePort();
  const mockScript = resolve(root, "..", "..", "scripts", "oauth-mock", "server.mjs");
  const [, mockUrl] = await startAndWait(
    process.execPath,
    [mockScript, "0", "--client", "tether-demo:demo-secret"],
    { cwd: dirname(mockScript) },
    /listening (http:\/\/\S+)/,
    "oauth mock",
  );
  // Direct mode: the page calls tether on its own origin, so CORS is
  // exercised (the server must allow the preview's origin).
  const direct = process.env.E2E_DIRECT === "1";
  const base = `http://127.0.0.1:${port}`;
  let text = config(port, mockUrl);
  if (direct) text = text.replace("[policy]", `[api]\ncors_origins = ["${base}"]\n\n[policy]`);
  writeFileSync(env.TETHER_CONFIG, text);
  const startTether = (listen) =>
    startAndWait(tetherBin, ["serve"], { env: { ...env, TETHER_LISTEN: listen }, cwd: work }, /tether listening on (http:\/\/\S+)/, "tether");
  const [, tetherUrl] = await startTether(direct ? `127.0.0.1:${await freePort()}` : "127.0.0.1:0");
  let outDir = "dist";
  if (direct) {
    // VITE_TETHER_URL is read at build time: build a copy that points at tether.
    outDir = join(work, "dist-direct");
    await promisify(execFile)(join(root, "node_modules", ".bin", "vite"), ["build", "--outDir", outDir, "--emptyOutDir"], {
      cwd: root,
      env: { ...process.env, VITE_TETHER_URL: `${tetherUrl}/graphql` },
    });
    console.log(`direct mode: the page at ${base} calls ${tetherUrl}/graphql`);
  }
  const mint = async (ttl = "1h") =>
    (await promisify(execFile)(tetherBin, ["token", "--tenant", "acme", "--sub", "ada", "--ttl", ttl], { env, cwd: work })).stdout.trim();
  const token = await mint();

  const vite = join(root, "node_modules", ".bin", "vite");
  // Vite's banner differs with CI set; wait for the server to answer instead.
  const preview = spawn(vite, ["preview", "--host", "127.0.0.1", "--port", String(port), "--strictPort", "--outDir", outDir], {
    cwd: root,
    env: { ...process.env, TETHER_PROXY_TARGET: tetherUrl },
    stdio: ["pipe", process.env.E2E_VERBOSE ? "inherit" : "ignore", "inherit"],
  });
  children.push(preview);
  await untilAnswers(base, preview);

  const browser = await chromium.launch({
    executablePath: chromiumPath,
    headless: !process.env.E2E_HEADED,
    args: ["--no-sandbox", "--disable-dev-shm-usage"],
  });
  const context = await browser.newContext({ viewport: { width: 1200, height: 900 } });
  context.setDefaultTimeout(TIMEOUT);
  const page = await context.newPage();
  run.page = page;
  page.on("pageerror", (e) => console.log(`  [page error] ${e.message}`));
  // Every subscribe message the page sends, to see which cursor it resumes from.
  const subscribes = [];
  page.on("websocket", (ws) =>
    ws.on("framesent", ({ payload }) => {
      const message = typeof payload === "string" ? JSON.parse(payload) : null;
      if (message?.type === "subscribe") subscribes.push(message.payload.variables);
    }),
  );
  const shot = (name, target = page) => target.screenshot({ path: join(artifacts, `${name}.png`) });
  const byId = (id) => page.getByTestId(id);
  const waitFor = (fn, arg) => page.waitForFunction(fn, arg, { timeout: TIMEOUT });

  const send = async (text) => {
    await byId("composer-input").fill(text);
    await byId("composer-send").click();
    await waitFor(() => document.querySelector('[data-testid="composer-input"]').value === "");
  };
  const lastAssistantText = () =>
    page.evaluate(() => {
      const all = [...document.querySelectorAll('[data-testid="message"][data-role="ASSISTANT"]')];
      const last = all.at(-1);
      return last ? [...last.querySelectorAll('[data-testid="part-text"]')].map((p) => p.textContent.replace("▍", "")).join("") : "";
    });
  const newConversation = async (title) => {
    await byId("new-conversation-title").fill(title);
    const before = page.url();
    await byId("new-conversation").click();
    await page.waitForURL((url) => url.pathname.startsWith("/c/") && url.href !== before);
    const id = new URL(page.url()).pathname.slice(3);
    await page.locator(`[data-testid="conversation"][data-conversation-id="${id}"] [data-testid="feed-status"][data-state="live"]`).waitFor();
  };

  await step("sign in with a pasted token", async () => {
    await page.goto(base);
    await byId("token-input").fill(token);
    await shot("signin");
    await byId("sign-in").click();
    await page.getByText("ada @ acme").waitFor();
  });

  await step("send a message and see the reply stream in", async () => {
    await newConversation("Streaming");
    // Record every length the reply's text takes, as the page renders it.
    await page.evaluate(() => {
      window.__lengths = [];
      new MutationObserver(() => {
        const el = document.querySelector('[data-testid="message"][data-role="ASSISTANT"] [data-testid="part-text"]');
        const n = el ? el.textContent.replace("▍", "").length : 0;
        if (n > 0 && window.__lengths.at(-1) !== n) window.__lengths.push(n);
      }).observe(document.body, { subtree: true, childList: true, characterData: true });
    });
    await send("hello from the browser");
    const part = page.locator('[data-testid="message"][data-role="ASSISTANT"] [data-testid="part-text"]').first();
    await part.waitFor();
    // It grows while streaming: seen partial, then complete.
    await waitFor(() => {
      const el = document.querySelector('[data-testid="message"][data-role="ASSISTANT"] [data-testid="part-text"]');
      return el && el.dataset.state === "STREAMING" && el.textContent.length > 5;
    });
    const partial = await lastAssistantText();
    await page.locator('[data-testid="message"][data-role="ASSISTANT"] [data-testid="part-text"][data-state="DONE"]').first().waitFor();
    const full = await lastAssistantText();
    if (!full.startsWith('You said: "hello from the browser"')) throw new Error(`unexpected reply: ${full}`);
    if (!(partial.length < full.length && full.startsWith(partial))) throw new Error(`no streaming seen: ${partial} / ${full}`);
    const lengths = await page.evaluate(() => window.__lengths);
    if (lengths.length < 10 || lengths.some((n, i) => i > 0 && n <= lengths[i - 1]))
      throw new Error(`the text did not grow chunk by chunk: ${JSON.stringify(lengths)}`);
    await shot("conversation-streamed");
  });

  const assistantTexts = () =>
    page.evaluate(() =>
      [...document.querySelectorAll('[data-testid="message"][data-role="ASSISTANT"]')].map((m) =>
        [...m.querySelectorAll('[data-testid="part-text"]')].map((p) => p.textContent.replace("▍", "")).join(""),
      ),
    );
  const streamingText = () =>
    page.evaluate(() => {
      const el = [...document.querySelectorAll('[data-testid="part-text"]')].at(-1);
      return el ? { text: el.textContent.replace("▍", ""), state: el.dataset.state } : null;
    });
  /** "holding 1… holding 2… …" with every number once, in order: no text lost or doubled. */
  const checkHolding = (text) => {
    const head = text.split("You said:")[0];
    const numbers = [...head.matchAll(/holding (\d+)… /g)].map((m) => Number(m[1]));
    if (head !== numbers.map((n) => `holding ${n}… `).join("")) throw new Error(`garbled stream: ${JSON.stringify(head)}`);
    numbers.forEach((n, i) => {
      if (n !== i + 1) throw new Error(`stream lost or doubled text at ${i}: ${JSON.stringify(head)}`);
    });
    return numbers.length;
  };

  await step("reload mid-stream: nothing lost, the stream continues", async () => {
    await newConversation("Reload");
    await send("/hold 3");
    await waitFor(() => {
      const el = [...document.querySelectorAll('[data-testid="part-text"]')].at(-1);
      return el && el.dataset.state === "STREAMING" && el.textContent.includes("holding 5");
    });
    const before = (await streamingText()).text;
    checkHolding(before);
    await page.reload();
    await page.locator('[data-testid="feed-status"][data-state="live"]').waitFor();
    // Everything seen before the reload is there again, and more arrives live.
    await waitFor((prefix) => {
      const el = [...document.querySelectorAll('[data-testid="part-text"]')].at(-1);
      const text = el ? el.textContent.replace("▍", "") : "";
      return el && el.dataset.state === "STREAMING" && text.startsWith(prefix) && text.length > prefix.length + 16;
    }, before);
    await shot("conversation-after-reload");
    await page.locator('[data-testid="message"][data-role="ASSISTANT"] [data-testid="part-text"][data-state="DONE"]').last().waitFor();
    const after = (await streamingText()).text;
    if (!after.startsWith(before)) throw new Error(`text lost across the reload:\n${before}\n${after}`);
    const ticks = checkHolding(after);
    if (ticks < 20) throw new Error(`expected about 30 holding ticks, saw ${ticks}`);
    if (!after.includes('You said: "/hold 3"')) throw new Error(`reply missing: ${after}`);
  });

  await step("a socket dropped mid-stream: resubscribed from the last cursor, no text lost or doubled", async () => {
    await newConversation("Drop mid-stream");
    await send("/hold 3");
    await waitFor(() => {
      const el = [...document.querySelectorAll('[data-testid="part-text"]')].at(-1);
      return el && el.dataset.state === "STREAMING" && el.textContent.includes("holding 4");
    });
    const before = (await streamingText()).text;
    const conversationId = new URL(page.url()).pathname.slice(3);
    const firstAfter = subscribes.filter((v) => v.conversationId === conversationId).at(-1).after;
    await page.evaluate(() => window.tetherDebug.dropSocket());
    await page.locator('[data-testid="feed-status"][data-state="reconnecting"]').waitFor();
    await page.locator('[data-testid="feed-status"][data-state="live"]').waitFor();
    const resumed = subscribes.filter((v) => v.conversationId === conversationId).at(-1).after;
    // It resumes from the newest cursor it had applied, not from where it started.
    if (!(resumed > firstAfter)) throw new Error(`resubscribed after ${resumed}, first after ${firstAfter}`);
    await page.locator('[data-testid="message"][data-role="ASSISTANT"] [data-testid="part-text"][data-state="DONE"]').last().waitFor();
    const after = (await streamingText()).text;
    if (!after.startsWith(before)) throw new Error(`text lost across the drop:\n${before}\n${after}`);
    checkHolding(after);
    if (!after.includes('You said: "/hold 3"')) throw new Error(`reply missing: ${after}`);
    const messages = await page.locator('[data-testid="message"]').count();
    if (messages !== 2) throw new Error(`expected 2 messages, saw ${messages}`);
  });

  await step("a message sent during a run is queued and runs next", async () => {
    await newConversation("Queue");
    await send("/hold 2");
    await page.locator('[data-testid="run-status"][data-status="RUNNING"]').waitFor();
    await send("the second message");
    await byId("queued-badge").waitFor();
    await shot("conversation-queued");
    await byId("queued-badge").waitFor({ state: "detached", timeout: 30_000 });
    await waitFor(() =>
      [...document.querySelectorAll('[data-testid="message"][data-role="ASSISTANT"] [data-testid="part-text"][data-state="DONE"]')].some(
        (p) => p.textContent.includes('You said: "the second message"'),
      ),
    );
    const texts = await assistantTexts();
    if (texts.length !== 2 || !texts[0].includes('You said: "/hold 2"')) throw new Error(`unexpected order: ${JSON.stringify(texts)}`);
  });

  await step("REJECT while a run is active is a CONFLICT, shown as such; INTERRUPT ends the run", async () => {
    await newConversation("Conflict");
    await send("/hold 30");
    await page.locator('[data-testid="run-status"][data-status="RUNNING"]').waitFor();
    await byId("on-active-run").selectOption("REJECT");
    await byId("composer-input").fill("refused");
    await byId("composer-send").click();
    await page.locator('[data-testid="error-banner"][data-code="CONFLICT"]').waitFor();
    await shot("error-conflict");
    await byId("on-active-run").selectOption("INTERRUPT");
    await send("interrupting");
    await page.locator('[data-testid="message-run-status"][data-status="CANCELLED"]').first().waitFor();
    await waitFor(() =>
      [...document.querySelectorAll('[data-testid="part-text"][data-state="DONE"]')].some((p) =>
        p.textContent.includes('You said: "interrupting"'),
      ),
    );
    const users = await page.locator('[data-testid="message"][data-role="USER"]').count();
    if (users !== 2) throw new Error(`the refused message was stored: ${users} user messages`);
  });

  await step("cancel a run", async () => {
    await newConversation("Cancel");
    await send("/hold 30");
    await page.locator('[data-testid="run-status"][data-status="RUNNING"]').waitFor();
    await waitFor(() => document.querySelector('[data-role="ASSISTANT"] [data-testid="part-text"]')?.textContent.includes("holding 2"));
    await byId("cancel-run").click();
    await page.locator('[data-testid="message-run-status"][data-status="CANCELLED"]').waitFor();
    await byId("run-bar").waitFor({ state: "detached" });
    await shot("conversation-cancelled");
  });

  await step("answer a question: an invalid answer first, then a valid one", async () => {
    await newConversation("Question");
    await send("/ask");
    const card = byId("question-card");
    await card.waitFor();
    await byId("option-color-blue").check();
    await byId("option-days-mon").check();
    await byId("option-days-wed").check();
    await byId("other-name").fill("   ");
    await shot("card-question", card);
    await byId("answer-submit").click();
    const fieldError = byId("question-error-name");
    await fieldError.waitFor();
    // The error sits inside the field it names.
    if ((await byId("question-name").getByTestId("question-error-name").count()) !== 1) throw new Error("error not beside its field");
    await shot("card-question-invalid", card);
    await byId("other-name").fill("Spring banner");
    await byId("answer-submit").click();
    await card.waitFor({ state: "detached" });
    await page.locator('[data-testid="part-question"][data-status="RESOLVED"]').waitFor();
    await page.locator('[data-testid="message-run-status"][data-status="COMPLETED"]').last().waitFor();
    await shot("conversation-question-answered");
  });

  await step("approve one demo_publish and deny another", async () => {
    await newConversation("Approvals");
    await send('/tool demo_publish {"text": "x"}');
    const card = byId("approval-card");
    await card.waitFor();
    if ((await byId("approval-tool").textContent()) !== "demo_publish") throw new Error("wrong tool");
    const input = JSON.parse(await byId("approval-input").textContent());
    if (input.text !== "x") throw new Error(`wrong input shown: ${JSON.stringify(input)}`);
    await byId("decide-ALLOW_ALWAYS").waitFor(); // offered: allow_always = true
    await shot("card-approval", card);
    await byId("decide-ALLOW_ONCE").click();
    await card.waitFor({ state: "detached" });
    await page.locator('[data-testid="tool-call"][data-outcome="SUCCEEDED"]').waitFor();
    await page.locator('[data-testid="message-run-status"][data-status="COMPLETED"]').last().waitFor();

    await send('/tool demo_publish {"text": "y"}');
    await card.waitFor();
    if (JSON.parse(await byId("approval-input").textContent()).text !== "y") throw new Error("second input wrong");
    await byId("decide-DENY").click();
    await card.waitFor({ state: "detached" });
    await page.locator('[data-testid="tool-call"][data-outcome="DENIED"]').waitFor();
    await shot("conversation-approvals");
  });

  await step("a message steered into a run that waits for approval is read after the decision", async () => {
    await newConversation("Steer");
    await send('/tool demo_publish {"text": "z"}');
    const card = byId("approval-card");
    await card.waitFor();
    await byId("on-active-run").selectOption("STEER");
    await send("and give it a title");
    await byId("steering-badge").waitFor();
    await shot("conversation-steering");
    // Still waiting for the decision: the message did not answer it.
    await card.waitFor();
    await byId("decide-ALLOW_ONCE").click();
    await card.waitFor({ state: "detached" });
    await waitFor(() =>
      [...document.querySelectorAll('[data-testid="part-text"][data-state="DONE"]')].some((p) =>
        p.textContent.includes('You said: "and give it a title"'),
      ),
    );
    await page.locator('[data-testid="message-run-status"][data-status="COMPLETED"]').last().waitFor();
    await byId("steering-badge").waitFor({ state: "detached" });
    // The steered message sits where the model read it: after the call, and
    // before the reply that goes on after it.
    const roles = await page.evaluate(() => [...document.querySelectorAll('[data-testid="message"]')].map((m) => m.dataset.role));
    if (JSON.stringify(roles) !== JSON.stringify(["USER", "ASSISTANT", "USER", "ASSISTANT"])) {
      throw new Error(`unexpected order: ${JSON.stringify(roles)}`);
    }
    const texts = await assistantTexts();
    if (!texts[1]?.includes('You said: "and give it a title"')) throw new Error(`the steered message was not read last: ${JSON.stringify(texts)}`);
    await byId("on-active-run").selectOption("QUEUE");
    await shot("conversation-steered");
  });

  await step("a retry indicator for /fail 429", async () => {
    await newConversation("Retry");
    await send("/fail 429");
    const indicator = byId("retry-indicator");
    await indicator.waitFor();
    const text = await indicator.textContent();
    if (!/Attempt 1 of 3 failed/.test(text) || !/429/.test(text)) throw new Error(`indicator says: ${text}`);
    await byId("retry-countdown").waitFor();
    await shot("card-retry", byId("run-bar"));
    await indicator.waitFor({ state: "detached", timeout: 30_000 });
    await page.locator('[data-testid="message-run-status"][data-status="COMPLETED"]').last().waitFor();
    await shot("conversation-retried");
  });

  await step("a connection: declined once, then completed through /oauth/callback", async () => {
    await newConversation("Declined connection");
    await send("/tool whoami {}");
    const card = byId("connection-card");
    await card.waitFor();
    if ((await byId("connection-gap").getAttribute("data-gap")) !== "ABSENT") throw new Error("expected gap ABSENT");
    await shot("card-connection", card);
    // Declining: the provider comes back with error=access_denied.
    const state = new URL(await byId("connect-link").getAttribute("href")).searchParams.get("state");
    const conversationUrl = page.url();
    const conversationId = conversationUrl.split("/c/")[1];
    await page.evaluate((id) => sessionStorage.setItem("tether.oauth.returnTo", id), conversationId);
    await page.goto(`${base}/oauth/callback?error=access_denied&state=${encodeURIComponent(state)}`);
    await page.waitForURL(conversationUrl);
    await page.locator('[data-testid="tool-call"][data-outcome="FAILED"]').waitFor();
    await page.locator('[data-testid="message-run-status"][data-status="COMPLETED"]').last().waitFor();
    if ((await byId("connection-card").count()) !== 0) throw new Error("the declined card is still offered");

    await newConversation("Connection");
    await send("/tool whoami {}");
    await card.waitFor();
    const here = page.url();
    await byId("connect-link").click(); // the mock consents at once and sends us to /oauth/callback
    await page.waitForURL(here, { timeout: TIMEOUT });
    await card.waitFor({ state: "detached" });
    await page.locator('[data-testid="tool-call"][data-outcome="SUCCEEDED"]').waitFor();
    await page.locator('[data-testid="message-run-status"][data-status="COMPLETED"]').last().waitFor();
    await shot("conversation-connected");
  });

  await step("errors are shown as such: NOT_FOUND and UNAUTHENTICATED", async () => {
    await page.goto(`${base}/c/00000000-0000-0000-0000-000000000000`);
    await page.locator('[data-testid="error-banner"][data-code="NOT_FOUND"]').waitFor();
    await page.evaluate(() => localStorage.setItem("tether.token", "not-a-token"));
    await page.goto(`${base}/`);
    await page.locator('[data-testid="error-banner"][data-code="UNAUTHENTICATED"]').first().waitFor();
    await shot("error-unauthenticated");
  });

  await step("a dropped socket is shown, and the feed resubscribes when the server is back", async () => {
    await page.evaluate((t) => localStorage.setItem("tether.token", t), token);
    await page.goto(base);
    await newConversation("Dropped socket");
    await send("before the drop");
    await page.locator('[data-testid="message-run-status"][data-status="COMPLETED"]').last().waitFor();
    const server = byName.tether;
    const exited = new Promise((res) => server.once("exit", res));
    server.kill("SIGKILL");
    await exited;
    await page.locator('[data-testid="feed-status"][data-state="reconnecting"]').waitFor();
    await shot("feed-dropped");
    await startTether(new URL(tetherUrl).host);
    await page.locator('[data-testid="feed-status"][data-state="live"]').waitFor({ timeout: 30_000 });
    await send("after the drop");
    await waitFor(() =>
      [...document.querySelectorAll('[data-testid="part-text"][data-state="DONE"]')].some((p) =>
        p.textContent.includes('You said: "after the drop"'),
      ),
    );
    const texts = await assistantTexts();
    if (texts.length !== 2) throw new Error(`expected two replies, saw ${JSON.stringify(texts)}`);
  });

  await step("a token that expires while the socket is open sends the person back to sign in (4403)", async () => {
    const shortLived = await mint("10s"); // time enough to sign in and subscribe on a loaded machine
    await page.evaluate((t) => localStorage.setItem("tether.token", t), shortLived);
    await page.goto(base);
    await newConversation("Expiring token");
    await byId("signin-reason").waitFor({ timeout: 30_000 });
    if (!(await byId("signin-reason").textContent()).includes("4403")) throw new Error("not the 4403 reason");
    await shot("signin-after-4403");
  });

  await browser.close();
}

run.report(main);
