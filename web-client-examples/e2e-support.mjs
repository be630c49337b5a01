// What the examples' browser tests share: the processes they start (tether,
// mocks, `vite preview`), each stopped when the test exits, and the waits
// for them; tether's environment; the steps and their report. Node
// built-ins only, so that each example's e2e imports it as it is.
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";

/** The tether binary under test (`TETHER_BIN`); exits when it is not set. */
export function tetherBinary() {
  const bin = process.env.TETHER_BIN;
  if (!bin) {
    console.error("TETHER_BIN must name a built tether binary (e.g. $CARGO_TARGET_DIR/debug/tether)");
    process.exit(2);
  }
  return bin;
}

/**
 * A temporary directory for tether's database and configuration, removed
 * (and every process stopped) when the test exits, and tether's
 * environment there, with `extra` on top.
 */
export function tetherWorkspace(label, extra = {}) {
  const work = mkdtempSync(join(tmpdir(), `tether-${label}-`));
  process.on("exit", () => {
    stopAll();
    rmSync(work, { recursive: true, force: true });
  });
  process.on("SIGINT", () => process.exit(130));
  const env = {
    ...process.env,
    TETHER_DATABASE_URL: `sqlite://${join(work, "tether.db")}?mode=rwc`,
    TETHER_JWT_SECRET: randomBytes(32).toString("hex"),
    TETHER_LISTEN: "127.0.0.1:0",
    TETHER_CONFIG: join(work, "tether.toml"),
    RUST_LOG: process.env.RUST_LOG ?? "warn",
    ...extra,
  };
  return { work, env };
}

/**
 * The test's steps: `step(name, fn)` runs one and prints `ok` or `not ok`
 * (with a screenshot of `page`, when set, into `artifacts`); `report(main)`
 * runs them all and exits with the count.
 */
export function steps(artifacts) {
  const results = [];
  const run = {
    page: null,
    async step(name, fn) {
      const started = Date.now();
      try {
        await fn();
        results.push({ name, ok: true });
        console.log(`ok - ${name} (${Date.now() - started} ms)`);
      } catch (error) {
        results.push({ name, ok: false });
        await run.page?.screenshot({ path: join(artifacts, `failed-${results.length}.png`), fullPage: true }).catch(() => {});
        console.log(`not ok - ${name}\n  ${String(error?.stack ?? error).split("\n").join("\n  ")}`);
        throw error;
      }
    },
    report(main) {
      const failedStep = () => results.some((r) => !r.ok);
      main()
        .then(() => {
          const passed = results.filter((r) => r.ok).length;
          console.log(`e2e: ${passed} passed, ${results.length - passed} failed`);
          process.exit(0);
        })
        .catch((error) => {
          if (!failedStep()) console.log(`error: ${error?.stack ?? error}`);
          const passed = results.filter((r) => r.ok).length;
          console.log(`e2e: ${passed} passed, ${results.length - passed + (failedStep() ? 0 : 1)} failed`);
          process.exit(1);
        });
    },
  };
  return run;
}

/** Every process started, to stop at the end. */
export const children = [];
/** The last process started under each name (`what`). */
export const byName = {};

/** Stops every process still running. */
export function stopAll() {
  for (const child of children) if (child.exitCode === null) child.kill("SIGTERM");
}

/** Starts a process and resolves with the first stdout line matching `pattern`. */
export function startAndWait(command, args, options, pattern, what) {
  return new Promise((resolveLine, reject) => {
    const child = spawn(command, args, { ...options, stdio: ["pipe", "pipe", "pipe"] });
    children.push(child);
    byName[what] = child;
    let stderr = "";
    child.stderr.on("data", (d) => {
      stderr += d;
      if (process.env.E2E_VERBOSE) process.stderr.write(d);
    });
    const timer = setTimeout(() => reject(new Error(`${what} did not start in time:\n${stderr}`)), 60_000);
    child.on("exit", (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`${what} exited with ${code ?? signal}:\n${stderr}`));
    });
    createInterface({ input: child.stdout }).on("line", (line) => {
      if (process.env.E2E_VERBOSE) console.log(`[${what}] ${line}`);
      const match = line.match(pattern);
      if (match) {
        clearTimeout(timer);
        resolveLine(match);
      }
    });
  });
}

/** Resolves once `url` answers HTTP 200 (polled every 100 ms, 60 s at most). */
export async function untilAnswers(url, child) {
  const deadline = Date.now() + 60_000;
  while (Date.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`the server for ${url} exited with ${child.exitCode}`);
    try {
      if ((await fetch(url)).ok) return;
    } catch {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`${url} did not answer in time`);
}

/** A TCP port free on 127.0.0.1 now. */
export function freePort() {
  return new Promise((res, rej) => {
    const server = createServer();
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => res(port));
    });
    server.on("error", rej);
  });
}
