import { defineConfig } from "vitest/config";
import react from "@vitejs/plugin-react";

// Where the dev and preview servers forward `/graphql` (HTTP and WebSocket),
// so the page can use its own origin with no CORS set-up on the server.
const target = process.env.TETHER_PROXY_TARGET ?? "http://127.0.0.1:8080";
const proxy = {
  "/graphql": { target, ws: true, changeOrigin: true },
};

export default defineConfig({
  plugins: [react()],
  server: { port: 5173, proxy },
  preview: { port: 4173, proxy },
  test: {
    environment: "node",
    include: ["src/**/*.test.ts"],
  },
});
