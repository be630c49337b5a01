import { execFile } from "node:child_process";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { defineConfig, type Plugin } from "vite";
import react from "@vitejs/plugin-react";

const here = dirname(fileURLToPath(import.meta.url));
const repoRoot = resolve(here, "..", "..");

// Where the dev and preview servers forward `/graphql` (mutations and
// queries) and `/ai` (the AI SDK UI message stream), so the page calls its
// own origin and the server needs no CORS set-up. http-proxy passes the
// event stream through as it arrives.
const target = process.env.TETHER_PROXY_TARGET ?? "http://127.0.0.1:8080";
const proxy = {
  "/graphql": { target, changeOrigin: true },
  "/ai": { target, changeOrigin: true },
};

/**
 * Dev server only: `GET /__dev/token?tenant=acme&sub=ada` runs
 * `tether token` in the repository root (where `cargo run` keeps tether.db
 * and its generated secret) and answers with the token. Never in a build.
 */
function devToken(): Plugin {
  return {
    name: "tether-dev-token",
    apply: "serve",
    configureServer(server) {
      server.middlewares.use("/__dev/token", (req, res) => {
        const url = new URL(req.url ?? "/", "http://localhost");
        const tenant = url.searchParams.get("tenant") || "acme";
        const sub = url.searchParams.get("sub") || "ada";
        const bin = process.env.TETHER_BIN ?? resolve(repoRoot, "target", "release", "tether");
        execFile(bin, ["token", "--tenant", tenant, "--sub", sub, "--ttl", "8h"], { cwd: repoRoot }, (error, stdout, stderr) => {
          res.setHeader("Content-Type", "text/plain");
          if (error) {
            res.statusCode = 500;
            res.end(`could not run ${bin} token (set TETHER_BIN): ${stderr || error.message}`);
            return;
          }
          res.end(stdout.trim());
        });
      });
    },
  };
}

export default defineConfig({
  plugins: [react(), devToken()],
  server: { port: 5174, proxy },
  preview: { port: 4174, proxy },
});
