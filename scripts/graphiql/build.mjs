// Builds the GraphiQL page's script and stylesheet from the pinned packages
// (package-lock.json) into src/api/graphiql/, which is committed so that
// `cargo build` needs no npm. Run after changing a version here:
//
//   npm ci && npm run build
//
// The output is minified, without source maps, and the same bytes for the
// same lockfile. THIRD_PARTY_LICENSES.txt collects the licences of what the
// bundle contains.
import { build } from "esbuild";
import { existsSync, mkdirSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = resolve(here, "../../src/api/graphiql");
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });

const result = await build({
  entryPoints: { graphiql: join(here, "src/main.jsx") },
  outdir: out,
  bundle: true,
  minify: true,
  format: "iife",
  target: ["es2020"],
  platform: "browser",
  jsx: "automatic",
  define: { "process.env.NODE_ENV": '"production"' },
  sourcemap: false,
  legalComments: "none",
  charset: "utf8",
  metafile: true,
  logLevel: "warning",
});

// Every package with a file in the bundle, and its licence text.
const packages = new Map();
for (const input of Object.keys(result.metafile.inputs)) {
  const match = input.match(/^(.*node_modules\/(?:@[^/]+\/)?[^/]+)\//);
  if (!match || packages.has(match[1])) continue;
  const dir = resolve(here, match[1]);
  const manifest = JSON.parse(readFileSync(join(dir, "package.json"), "utf8"));
  const licenceFile = readdirSync(dir).find((name) => /^(licen[cs]e|copying)(\.|$)/i.test(name));
  packages.set(match[1], {
    name: manifest.name,
    version: manifest.version,
    license: manifest.license ?? "see text",
    text: licenceFile ? readFileSync(join(dir, licenceFile), "utf8").trim() : null,
  });
}
const sorted = [...packages.values()].sort((a, b) => a.name.localeCompare(b.name));
const missing = sorted.filter((p) => !p.text).map((p) => `${p.name}@${p.version}`);
const notices = [
  "Third-party software in graphiql.js and graphiql.css, built by scripts/graphiql/build.mjs.",
  "",
  ...sorted.map((p) =>
    [`${"=".repeat(72)}`, `${p.name} ${p.version} (${p.license})`, "", p.text ?? `License: ${p.license}`, ""].join("\n"),
  ),
].join("\n");
writeFileSync(join(out, "THIRD_PARTY_LICENSES.txt"), notices + "\n");

for (const name of readdirSync(out)) {
  const path = join(out, name);
  const text = readFileSync(path, "utf8");
  if (/sourceMappingURL/.test(text)) throw new Error(`${name} refers to a source map`);
  console.log(`${relative(process.cwd(), path)}  ${(statSync(path).size / 1024).toFixed(0)} KiB`);
}
if (missing.length) console.warn(`no licence file found for: ${missing.join(", ")}`);
if (!existsSync(join(out, "graphiql.js")) || !existsSync(join(out, "graphiql.css"))) {
  throw new Error("expected graphiql.js and graphiql.css");
}
