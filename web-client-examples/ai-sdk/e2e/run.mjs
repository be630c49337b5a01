// The browser test for the AI SDK example: a real tether (scripted model,
// temporary SQLite), the built page under `vite preview` (which forwards
// /graphql and /ai to tether), and Debian's Chromium driven by
// playwright-core. Every wait is for a condition.
//
//   npm run build && TETHER_BIN=/path/to/tether npm run e2e
//
// Env: TETHER_BIN (required), CHROMIUM (default /usr/bin/chromium),
// E2E_HEADED=1 to watch, E2E_VERBOSE=1 for the servers' output.
import { spawn, execFile } from "node:child_process";
import { existsSync, mkdirSync, writeFileSync } from "node:fs";
import { join, resolve, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { randomUUID } from "node:crypto";
import { chromium } from "playwright-core";
import { children, freePort, startAndWait, steps, tetherBinary, tetherWorkspace, untilAnswers } from "../../e2e-support.mjs";
// The client's own parser and schema: what DefaultChatTransport runs on every response.
import { parseJsonEventStream, readUIMessageStream, uiMessageChunkSchema } from "ai";

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, "..");
const artifacts = join(here, "artifacts");
mkdirSync(artifacts, { recursive: true });

const tetherBin = tetherBinary();
const chromiumPath = process.env.CHROMIUM ?? "/usr/bin/chromium";
const TIMEOUT = 20_000;

const { work, env } = tetherWorkspace("ai-sdk-e2e");

// The scripted model (CONTRACT.md section 7): `/hold N` streams slowly for N
// seconds, `/ask` asks three questions, `/tool demo_publish {…}` calls the
// built-in tool that needs approval.
const config = `default_agent = "demo"

[runtime]
checkpoint_ms = 250
poll_ms = 200

[policy]
allow_always = true

[[agents]]
name = "demo"
provider = "scripted"
tools = ["ask_questions", "demo_publish"]
stream_delay_ms = 40
`;


const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function check(condition, message) {
  if (!condition) throw new Error(message);
}

/** Polls `fn` until it returns a truthy value (every 200 ms, `ms` at most). */
async function eventually(fn, what, ms = TIMEOUT) {
  const deadline = Date.now() + ms;
  let last;
  while (Date.now() < deadline) {
    last = await fn();
    if (last) return last;
    await sleep(200);
  }
  throw new Error(`timed out waiting for ${what} (last: ${JSON.stringify(last)})`);
}

// ---- the steps ---------------------------------------------------------------

const run = steps(artifacts);
const { step } = run;

async function main() {
  if (!existsSync(join(root, "dist", "index.html"))) throw new Error("no dist/: run `npm run build` first");
  writeFileSync(env.TETHER_CONFIG, config);
  const [, tetherUrl] = await startAndWait(tetherBin, ["serve"], { env, cwd: work }, /tether listening on (http:\/\/\S+)/, "tether");
  const token = (await promisify(execFile)(tetherBin, ["token", "--tenant", "acme", "--sub", "ada", "--ttl", "1h"], { env, cwd: work })).stdout.trim();
  const auth = { authorization: `Bearer ${token}` };

  /** GraphQL from the test itself, to check what the page did. */
  const gql = async (query, variables = {}) => {
    const response = await fetch(`${tetherUrl}/graphql`, {
      method: "POST",
      headers: { "content-type": "application/json", ...auth },
      body: JSON.stringify({ query, variables }),
    });
    const payload = await response.json();
    if (payload.errors?.length) throw new Error(`GraphQL: ${JSON.stringify(payload.errors)}`);
    return payload.data;
  };
  const runsOf = async (id) =>
    (await gql(`query($id: ID!) { conversation(id: $id) { activeRun { id status cancelRequested } runs { id status toolCalls { name outcome } } messages { id role runId } } }`, { id }))
      .conversation;

  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const vite = join(root, "node_modules", ".bin", "vite");
  // Vite's banner differs with CI set; wait for the server to answer instead.
  const preview = spawn(vite, ["preview", "--host", "127.0.0.1", "--port", String(port), "--strictPort"], {
    cwd: root,
    env: { ...process.env, TETHER_PROXY_TARGET: tetherUrl },
    stdio: ["pipe", process.env.E2E_VERBOSE ? "inherit" : "ignore", "inherit"],
  });
  children.push(preview);
  await untilAnswers(base, preview);

  await step("the wire: POST /ai/chat answers a UI message stream the SDK's own parser and schema accept", async () => {
    const { createConversation } = await gql(`mutation { createConversation(input: { title: "Wire" }) { id } }`);
    const id = createConversation.id;
    const response = await fetch(`${tetherUrl}/ai/chat`, {
      method: "POST",
      headers: { "content-type": "application/json", ...auth },
      body: JSON.stringify({ id, messages: [{ id: "wire-1", role: "user", parts: [{ type: "text", text: "wire check" }] }], trigger: "submit-message" }),
    });
    check(response.status === 200, `POST /ai/chat answered ${response.status}: ${await response.clone().text()}`);
    check(response.headers.get("content-type")?.startsWith("text/event-stream"), `content-type ${response.headers.get("content-type")}`);
    check(response.headers.get("x-vercel-ai-ui-message-stream") === "v1", "no x-vercel-ai-ui-message-stream: v1 header");
    const raw = await response.text();
    // SSE framing: events of `data: …` lines, blank-line separated, `data: [DONE]` last.
    const events = raw.split("\n\n").filter((e) => e.split("\n").some((line) => line.startsWith("data:")));
    check(events.at(-1) === "data: [DONE]", `the stream does not end with data: [DONE]: ${JSON.stringify(raw.slice(-80))}`);
    // Every chunk through the client's own path: parse, then validate.
    const parsed = [];
    const reader = parseJsonEventStream({ stream: new Response(raw).body, schema: uiMessageChunkSchema }).getReader();
    for (let r = await reader.read(); !r.done; r = await reader.read()) {
      check(r.value.success, `a chunk the client rejects: ${r.value.error?.message} in ${JSON.stringify(r.value.rawValue)}`);
      parsed.push(r.value.value);
    }
    check(parsed[0]?.type === "start" && typeof parsed[0].messageId === "string", `first chunk: ${JSON.stringify(parsed[0])}`);
    check(parsed.at(-1)?.type === "finish", `last chunk: ${JSON.stringify(parsed.at(-1))}`);
    check(parsed.filter((c) => c.type === "text-delta").length >= 5, "fewer than 5 text-delta chunks");
    // And assembled as useChat assembles it.
    let message;
    for await (const m of readUIMessageStream({ stream: new ReadableStream({ start: (c) => (parsed.forEach((p) => c.enqueue(p)), c.close()) }) }))
      message = m;
    const text = message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
    check(text.startsWith('You said: "wire check"'), `assembled text: ${text}`);
    const stored = await runsOf(id);
    check(stored.messages.at(-1).id === parsed[0].messageId, "the stream's messageId is not the stored assistant message's id");
    // Nothing active any more: the resume URL answers 204.
    const resumed = await fetch(`${tetherUrl}/ai/chat/${id}/stream`, { headers: auth });
    check(resumed.status === 204, `GET …/stream with no active run answered ${resumed.status}`);
    // Unknown conversations are 404; no token is 401.
    const unknown = await fetch(`${tetherUrl}/ai/chat/${randomUUID()}/stream`, { headers: auth });
    check(unknown.status === 404, `GET …/stream of an unknown conversation answered ${unknown.status}`);
    const unknownPost = await fetch(`${tetherUrl}/ai/chat`, {
      method: "POST",
      headers: { "content-type": "application/json", ...auth },
      body: JSON.stringify({ id: randomUUID(), messages: [{ id: "wire-2", role: "user", parts: [{ type: "text", text: "x" }] }], trigger: "submit-message" }),
    });
    check(unknownPost.status === 404, `POST /ai/chat for an unknown conversation answered ${unknownPost.status}`);
    const anonymous = await fetch(`${tetherUrl}/ai/chat/${id}/stream`);
    check(anonymous.status === 401, `GET …/stream with no token answered ${anonymous.status}`);
  });

  const browser = await chromium.launch({
    executablePath: chromiumPath,
    headless: !process.env.E2E_HEADED,
    args: ["--no-sandbox", "--disable-dev-shm-usage"],
  });
  const context = await browser.newContext({ viewport: { width: 1100, height: 900 } });
  context.setDefaultTimeout(TIMEOUT);
  const page = await context.newPage();
  run.page = page;
  page.on("pageerror", (e) => console.log(`  [page error] ${e.message}`));

  // Every request the page makes to /ai/chat, and every answer's status and headers.
  const requests = [];
  const responses = [];
  const isChat = (url) => new URL(url).pathname.startsWith("/ai/chat");
  page.on("request", (r) => {
    if (isChat(r.url())) requests.push({ method: r.method(), path: new URL(r.url()).pathname, body: r.postData(), headers: r.headers() });
  });
  page.on("response", (r) => {
    if (isChat(r.url())) responses.push({ method: r.request().method(), path: new URL(r.url()).pathname, status: r.status(), headers: r.headers() });
  });
  // Kept for reading after a run: what the page sent and what it was answered.
  process.on("exit", () => writeFileSync(join(artifacts, "ai-chat-requests.json"), JSON.stringify({ requests, responses }, null, 2)));
  const since = (list, mark, method, path) => list.slice(mark).filter((x) => x.method === method && (!path || x.path === path));
  const waitUntil = (fn, what) => eventually(async () => fn(), what);

  const shot = (name) => page.screenshot({ path: join(artifacts, `${name}.png`), fullPage: true });
  const byId = (id) => page.getByTestId(id);
  const waitFor = (fn, arg) => page.waitForFunction(fn, arg, { timeout: TIMEOUT });
  const chatStatus = (status) => page.locator(`[data-testid="chat-status"][data-status="${status}"]`).waitFor();
  const conversationId = () => new URL(page.url()).searchParams.get("c");

  const send = async (text) => {
    await byId("composer-input").fill(text);
    await byId("composer-send").click();
    await waitFor(() => document.querySelector('[data-testid="composer-input"]').value === "");
  };
  /** The last assistant message: its id and its text parts joined. */
  const lastAssistant = () =>
    page.evaluate(() => {
      const m = [...document.querySelectorAll('[data-testid="message"][data-role="assistant"]')].at(-1);
      if (!m) return { id: null, text: "", state: null };
      const parts = [...m.querySelectorAll('[data-testid="part-text"]')];
      return { id: m.dataset.messageId, text: parts.map((p) => p.textContent.replace("▍", "")).join(""), state: parts.at(-1)?.dataset.state ?? null };
    });
  const countRole = (role) => page.locator(`[data-testid="message"][data-role="${role}"]`).count();
  const newConversation = async (title) => {
    if (conversationId()) await byId("home").click();
    await byId("new-conversation-title").fill(title);
    const mark = responses.length;
    await byId("new-conversation").click();
    await page.waitForURL((url) => url.searchParams.has("c"));
    await byId("chat").waitFor();
    // useChat({ resume: true }) asked for the active run's stream on mount: none yet, 204.
    const id = conversationId();
    await waitUntil(() => since(responses, mark, "GET", `/ai/chat/${id}/stream`).find((r) => r.status === 204), "the mount's resume GET answered 204");
    await chatStatus("ready");
    return id;
  };
  /** "holding 1… holding 2… …" with every number once, in order: no text lost or doubled. */
  const checkHolding = (text) => {
    const head = text.split("You said:")[0];
    const numbers = [...head.matchAll(/holding (\d+)… /g)].map((m) => Number(m[1]));
    check(head === numbers.map((n) => `holding ${n}… `).join(""), `garbled stream: ${JSON.stringify(head)}`);
    numbers.forEach((n, i) => check(n === i + 1, `stream lost or doubled text at ${i}: ${JSON.stringify(head)}`));
    return numbers.length;
  };

  await step("sign in with a pasted token", async () => {
    await page.goto(base);
    await byId("token-input").fill(token);
    await byId("sign-in").click();
    await byId("new-conversation").waitFor();
  });

  await step("send a message: POST /ai/chat with useChat's body, the reply streams in", async () => {
    const id = await newConversation("Streaming");
    // Record every length the reply's text takes, as the page renders it.
    await page.evaluate(() => {
      window.__lengths = [];
      new MutationObserver(() => {
        const el = document.querySelector('[data-testid="message"][data-role="assistant"] [data-testid="part-text"]');
        const n = el ? el.textContent.replace("▍", "").length : 0;
        if (n > 0 && window.__lengths.at(-1) !== n) window.__lengths.push(n);
      }).observe(document.body, { subtree: true, childList: true, characterData: true });
    });
    const mark = requests.length;
    await send("hello from the browser");
    await waitFor(() => {
      const el = document.querySelector('[data-testid="message"][data-role="assistant"] [data-testid="part-text"]');
      return el && el.dataset.state === "streaming" && el.textContent.length > 5;
    });
    const partial = (await lastAssistant()).text;
    await page.locator('[data-testid="message"][data-role="assistant"] [data-testid="part-text"][data-state="done"]').last().waitFor();
    await chatStatus("ready");
    const full = await lastAssistant();
    check(full.text.startsWith('You said: "hello from the browser"'), `unexpected reply: ${full.text}`);
    check(partial.length < full.text.length && full.text.startsWith(partial), `no streaming seen: ${partial} / ${full.text}`);
    const lengths = await page.evaluate(() => window.__lengths);
    check(lengths.length >= 10 && lengths.every((n, i) => i === 0 || n > lengths[i - 1]), `the text did not grow chunk by chunk: ${JSON.stringify(lengths)}`);

    const [post] = since(requests, mark, "POST", "/ai/chat");
    check(post, "no POST /ai/chat");
    check(post.headers.authorization === `Bearer ${token}`, "the POST has no bearer token");
    const body = JSON.parse(post.body);
    check(body.id === id && body.trigger === "submit-message" && body.messageId === undefined, `body: ${post.body}`);
    check(body.messages.length === 1, `only the new message is sent (the server holds the history): ${body.messages.length}`);
    const last = body.messages.at(-1);
    check(last.role === "user" && last.parts.length === 1 && last.parts[0].type === "text" && last.parts[0].text === "hello from the browser", `last message: ${JSON.stringify(last)}`);
    const [answer] = since(responses, mark, "POST", "/ai/chat");
    check(answer.status === 200 && answer.headers["content-type"]?.startsWith("text/event-stream"), `answer: ${JSON.stringify(answer)}`);
    check(answer.headers["x-vercel-ai-ui-message-stream"] === "v1", "no x-vercel-ai-ui-message-stream: v1");
    // The stream's message id is the stored assistant message's id.
    const stored = await runsOf(id);
    check(stored.messages.at(-1).role === "ASSISTANT" && stored.messages.at(-1).id === full.id, `stored ${stored.messages.at(-1).id}, page ${full.id}`);
    await shot("streamed");
  });

  let reloadedText = "";
  await step("reload mid-stream: GET /ai/chat/{id}/stream replays and follows, nothing lost or doubled", async () => {
    const id = await newConversation("Reload");
    await send("/hold 3");
    await waitFor(() => {
      const el = [...document.querySelectorAll('[data-testid="part-text"]')].at(-1);
      return el && el.dataset.state === "streaming" && el.textContent.includes("holding 5");
    });
    const before = (await lastAssistant()).text;
    checkHolding(before);
    const mark = requests.length;
    await page.reload();
    await byId("chat").waitFor();
    await waitUntil(() => since(responses, mark, "GET", `/ai/chat/${id}/stream`).find((r) => r.status === 200), "a resumed stream (GET …/stream answered 200)");
    await page.locator('[data-testid="part-text"][data-state="done"]').last().waitFor();
    await chatStatus("ready");
    const after = await lastAssistant();
    check(after.text.startsWith(before), `text lost across the reload:\n${before}\n${after.text}`);
    check(checkHolding(after.text) >= 20, `expected about 30 holding ticks: ${after.text}`);
    check(after.text.includes('You said: "/hold 3"'), `reply missing: ${after.text}`);
    check((await countRole("assistant")) === 1 && (await countRole("user")) === 1, "the reload doubled a message");
    check(since(requests, mark, "POST").length === 0, "the reload POSTed");
    reloadedText = after.text;
    await shot("reloaded");
  });

  await step("reload after the run ended: 204, the stored history shows the reply once", async () => {
    const id = conversationId();
    const mark = responses.length;
    await page.reload();
    await byId("chat").waitFor();
    await waitUntil(() => since(responses, mark, "GET", `/ai/chat/${id}/stream`).find((r) => r.status === 204), "GET …/stream answered 204");
    await chatStatus("ready");
    const after = await lastAssistant();
    check(after.text === reloadedText, `history differs from what streamed:\n${reloadedText}\n${after.text}`);
    check((await countRole("assistant")) === 1, "the reply is shown twice");
  });

  await step("stop() only disconnects: the run goes on, and Reconnect follows it again", async () => {
    const id = await newConversation("Disconnect");
    await send("/hold 3");
    await waitFor(() => [...document.querySelectorAll('[data-testid="part-text"]')].at(-1)?.textContent.includes("holding 3"));
    await byId("stop").click();
    await chatStatus("ready");
    const cut = (await lastAssistant()).text;
    const { activeRun } = await runsOf(id);
    check(activeRun && !activeRun.cancelRequested && !["CANCELLED", "COMPLETED", "FAILED"].includes(activeRun.status), `the disconnect touched the run: ${JSON.stringify(activeRun)}`);
    await sleep(700);
    check((await lastAssistant()).text === cut, "text arrived after stop()");
    const mark = requests.length;
    await byId("resume-stream").click();
    await waitUntil(() => since(responses, mark, "GET", `/ai/chat/${id}/stream`).find((r) => r.status === 200), "Reconnect's GET …/stream answered 200");
    await page.locator('[data-testid="part-text"][data-state="done"]').last().waitFor();
    await chatStatus("ready");
    const after = (await lastAssistant()).text;
    check(after.startsWith(cut) && after.includes('You said: "/hold 3"'), `after reconnect: ${after}`);
    checkHolding(after);
    check((await countRole("assistant")) === 1, "the reconnect doubled the message");
    const runs = await runsOf(id);
    check(runs.runs.at(-1).status === "COMPLETED", `run ${runs.runs.at(-1).status}`);
  });

  await step("answer a question: data-question, answerQuestion, the run resumes on a resumed stream", async () => {
    const id = await newConversation("Question");
    await send("/ask");
    const card = byId("question-card");
    await card.waitFor();
    // The stream finished when the run parked on the question.
    await chatStatus("ready");
    const part = page.locator('[data-testid="part-question"]').last();
    check((await part.getAttribute("data-status")) === "PENDING", "the question is not PENDING");
    const interactionId = await part.getAttribute("data-interaction-id");
    const { activeRun } = await runsOf(id);
    check(activeRun?.status === "WAITING_FOR_QUESTION", `run ${JSON.stringify(activeRun)}`);
    const { pendingQuestion } = await gql(`query($r: ID!) { pendingQuestion(runId: $r) { interactionId } }`, { r: activeRun.id });
    check(pendingQuestion?.interactionId === interactionId, `data-question id ${interactionId}, pending ${JSON.stringify(pendingQuestion)}`);
    await byId("option-color-blue").check();
    await byId("option-days-mon").check();
    await byId("option-days-wed").check();
    await byId("other-name").fill("Spring banner");
    await shot("question");
    const mark = requests.length;
    await byId("answer-submit").click();
    await card.waitFor({ state: "detached" });
    await waitUntil(() => since(responses, mark, "GET", `/ai/chat/${id}/stream`).find((r) => r.status === 200), "a resumed stream after the answer");
    await page.locator('[data-testid="part-question"][data-status="RESOLVED"]').waitFor();
    // The run goes on after the question: text after it, then the run ends.
    await waitFor(() => {
      const q = document.querySelector('[data-testid="part-question"]');
      return [...document.querySelectorAll('[data-testid="part-text"][data-state="done"]')].some(
        (t) => q.compareDocumentPosition(t) & Node.DOCUMENT_POSITION_FOLLOWING,
      );
    });
    await chatStatus("ready");
    await eventually(async () => (await runsOf(id)).runs.at(-1).status === "COMPLETED", "the run to complete");
    check((await countRole("assistant")) === 1, "the resumed run doubled the message");
    await shot("question-answered");
  });

  /** Sends a demo_publish call and returns the approval card's facts once the stream has parked on it. */
  const askApproval = async (text) => {
    const id = await newConversation(`Approval ${text}`);
    await send(`/tool demo_publish {"text": "${text}"}`);
    const card = byId("approval-card");
    await card.waitFor();
    await chatStatus("ready");
    const tool = page.locator('[data-testid="part-tool"][data-state="approval-requested"]');
    check((await tool.getAttribute("data-tool")) === "demo_publish", "wrong tool");
    check(JSON.parse(await tool.getByTestId("tool-input").textContent()).text === text, "wrong input shown");
    const approvalId = await card.getAttribute("data-approval-id");
    const toolCallId = await tool.getAttribute("data-tool-call-id");
    const messageId = (await lastAssistant()).id;
    const { activeRun } = await runsOf(id);
    check(activeRun?.status === "WAITING_FOR_APPROVAL", `run ${JSON.stringify(activeRun)}`);
    const { pendingApproval } = await gql(`query($r: ID!) { pendingApproval(runId: $r) { interactionId toolCallId } }`, { r: activeRun.id });
    check(pendingApproval?.interactionId === approvalId, `approvalId ${approvalId}, pending ${JSON.stringify(pendingApproval)}`);
    check(pendingApproval.toolCallId === toolCallId, `toolCallId ${toolCallId}, pending ${pendingApproval.toolCallId}`);
    return { id, approvalId, toolCallId, messageId };
  };
  /** The re-POST that addToolApprovalResponse + sendAutomaticallyWhen made. */
  const checkApprovalPost = async (mark, { id, approvalId, toolCallId, messageId }, approved) => {
    const post = await waitUntil(() => since(requests, mark, "POST", "/ai/chat")[0], "the approval re-POST");
    const body = JSON.parse(post.body);
    check(body.id === id && body.trigger === "submit-message" && body.messageId === messageId, `re-POST body head: ${JSON.stringify({ ...body, messages: undefined })}`);
    const last = body.messages.at(-1);
    check(last.role === "assistant" && last.id === messageId, `last message ${last.role} ${last.id}`);
    const decided = last.parts.find((p) => p.toolCallId === toolCallId);
    check(
      decided?.state === "approval-responded" && decided.approval?.id === approvalId && decided.approval.approved === approved,
      `decided part: ${JSON.stringify(decided)}`,
    );
  };

  await step("approve a tool: tool-approval-request, Approve re-POSTs the approval response, the same message goes on", async () => {
    const facts = await askApproval("x");
    await shot("approval");
    const mark = requests.length;
    await byId("approve").click();
    await checkApprovalPost(mark, facts, true);
    await page.locator(`[data-testid="part-tool"][data-tool-call-id="${facts.toolCallId}"][data-state="output-available"]`).waitFor();
    await waitFor(() => [...document.querySelectorAll('[data-testid="part-text"][data-state="done"]')].some((t) => t.textContent.includes("The tools answered")));
    await chatStatus("ready");
    check((await lastAssistant()).id === facts.messageId, "the answer went on in another message");
    check((await countRole("assistant")) === 1, "the approval doubled the message");
    check(since(requests, mark, "POST").length === 1, "more than one re-POST");
    const runs = await eventually(async () => {
      const r = await runsOf(facts.id);
      return r.runs.at(-1).status === "COMPLETED" && r;
    }, "the run to complete");
    check(runs.runs.at(-1).toolCalls[0]?.outcome === "SUCCEEDED", `tool call ${JSON.stringify(runs.runs.at(-1).toolCalls)}`);
    await shot("approved");
  });

  await step("deny a tool: the re-POST says approved: false, the call ends denied", async () => {
    const facts = await askApproval("y");
    const mark = requests.length;
    await byId("deny").click();
    await checkApprovalPost(mark, facts, false);
    await page.locator(`[data-testid="part-tool"][data-tool-call-id="${facts.toolCallId}"][data-state="output-denied"]`).waitFor();
    await chatStatus("ready");
    check((await countRole("assistant")) === 1, "the denial doubled the message");
    const runs = await eventually(async () => {
      const r = await runsOf(facts.id);
      return !r.activeRun && r;
    }, "the run to end");
    check(runs.runs.at(-1).toolCalls[0]?.outcome === "DENIED", `tool call ${JSON.stringify(runs.runs.at(-1).toolCalls)}`);
  });

  await step("cancel a run: cancelRun on the conversation's activeRun ends the stream", async () => {
    const id = await newConversation("Cancel");
    await send("/hold 30");
    await waitFor(() => [...document.querySelectorAll('[data-testid="part-text"]')].at(-1)?.textContent.includes("holding 2"));
    const { activeRun } = await runsOf(id);
    await byId("cancel-run").click();
    await byId("cancel-result").waitFor();
    await chatStatus("ready");
    await page
      .locator('[data-testid="message"][data-role="assistant"] [data-testid="message-run-status"][data-status="CANCELLED"]')
      .waitFor();
    const text = (await lastAssistant()).text;
    check(!text.includes("You said"), `the run was not cut short: ${text}`);
    const runs = await runsOf(id);
    check(runs.runs.find((r) => r.id === activeRun.id)?.status === "CANCELLED", `runs ${JSON.stringify(runs.runs)}`);
    await shot("cancelled");
  });

  await browser.close();
}

run.report(main);
