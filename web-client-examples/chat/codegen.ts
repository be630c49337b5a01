import type { CodegenConfig } from "@graphql-codegen/cli";

// The schema is the repository's own `schema.graphql`, read in place.
const config: CodegenConfig = {
  schema: "../../schema.graphql",
  documents: ["src/**/*.{ts,tsx}", "!src/gql/**/*"],
  ignoreNoDocuments: false,
  generates: {
    "src/gql/": {
      preset: "client",
      config: {
        scalars: { DateTime: "string", JSON: "unknown" },
        enumsAsTypes: true,
        strictScalars: true,
        useTypeImports: true,
      },
      presetConfig: { fragmentMasking: false },
    },
    // The concrete types of every interface (TransportEvent's event types).
    "src/gql/possibleTypes.ts": {
      plugins: ["fragment-matcher"],
      config: { module: "es2015", apolloClientVersion: 3, useExplicitTyping: true },
    },
  },
};

export default config;
