// One command for the whole example: `cargo run --release` in the
// repository root (the sample tether.toml, the scripted model), then Vite's
// dev server forwarding /graphql to it. Ctrl-C stops both.
import { spawn } from "node:child_process";
import { dirname, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const chat = resolve(here, "..");
const repoRoot = resolve(chat, "..", "..");

const server = spawn("cargo", ["run", "--release"], { cwd: repoRoot, stdio: ["ignore", "pipe", "inherit"] });
let vite = null;
const stop = (code) => {
  vite?.kill("SIGTERM");
  server.kill("SIGTERM");
  process.exitCode = code;
};
process.on("SIGINT", () => stop(0));
process.on("SIGTERM", () => stop(0));
server.on("exit", (code) => {
  if (!vite) console.error(`the server exited (${code}) before it listened`);
  stop(code ?? 1);
});

createInterface({ input: server.stdout }).on("line", (line) => {
  console.log(line);
  const match = line.match(/tether listening on (http:\/\/\S+)/);
  if (!match || vite) return;
  vite = spawn(resolve(chat, "node_modules", ".bin", "vite"), process.argv.slice(2), {
    cwd: chat,
    stdio: "inherit",
    env: { ...process.env, TETHER_PROXY_TARGET: match[1] },
  });
  vite.on("exit", (code) => stop(code ?? 0));
  console.log("\nSign in with a token from: cargo run --release -- token --tenant acme --sub ada");
  console.log("(or the page's dev sign-in button)\n");
});
