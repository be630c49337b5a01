// The page behind tether's `/graphiql`: GraphiQL with queries and mutations
// over HTTP and subscriptions over `graphql-transport-ws`, both on the
// server's own `/graphql`. The server passes its settings in a JSON block
// (`#tether-graphiql-config`), never inside this script.
import { createRoot } from "react-dom/client";
import { GraphiQL } from "graphiql";
import { createGraphiQLFetcher } from "@graphiql/toolkit";
import { parse } from "graphql";
import { createClient } from "graphql-ws";
import "graphiql/style.css";
import "./page.css";

const DEFAULT_QUERY = `# Run with Ctrl-Enter. The book icon
# (top left) lists the whole API.
{
  me { tenant principal }
  agents { name model tools }
}
`;

function readConfig() {
  const block = document.getElementById("tether-graphiql-config");
  const config = block ? JSON.parse(block.textContent) : {};
  return {
    endpoint: typeof config.endpoint === "string" ? config.endpoint : "/graphql",
    token: typeof config.token === "string" && config.token ? config.token : null,
  };
}

/** The `Authorization` among headers, whatever its letter case. */
function authorizationOf(headers) {
  for (const [name, value] of Object.entries(headers ?? {})) {
    if (name.toLowerCase() === "authorization" && value != null) return String(value);
  }
  return undefined;
}

/**
 * The parsed operation sent. GraphiQL hands the fetcher the editor's last
 * parse, made 100 ms after an edit: a subscription run sooner would be
 * taken for a query and sent over HTTP.
 */
function documentOf(query, options) {
  try {
    return parse(query);
  } catch {
    return options?.documentAST;
  }
}

/**
 * A fetcher whose subscriptions authenticate as the header editor says: the
 * WebSocket's `connection_init` carries the editor's `Authorization` (the
 * URL's token when the editor has none). A new value gets a new socket; the
 * old one closes once its subscriptions end (graphql-ws is lazy).
 */
function tetherFetcher(endpoint, fallbackAuthorization) {
  const httpUrl = new URL(endpoint, window.location.href);
  const wsUrl = new URL(httpUrl);
  wsUrl.protocol = httpUrl.protocol === "https:" ? "wss:" : "ws:";
  const staticHeaders = fallbackAuthorization ? { Authorization: fallbackAuthorization } : {};
  let current = null;
  return (params, options) => {
    const authorization = authorizationOf(options?.headers) ?? fallbackAuthorization;
    if (!current || current.authorization !== authorization) {
      const wsClient = createClient({
        url: wsUrl.href,
        connectionParams: authorization ? { Authorization: authorization } : {},
      });
      current = {
        authorization,
        fetcher: createGraphiQLFetcher({ url: httpUrl.href, wsClient, headers: staticHeaders }),
      };
    }
    return current.fetcher(params, { ...options, documentAST: documentOf(params.query, options) });
  };
}

const { endpoint, token } = readConfig();
const bearer = token ? `Bearer ${token}` : undefined;
const root = createRoot(document.getElementById("graphiql"));
root.render(
  <GraphiQL
    fetcher={tetherFetcher(endpoint, bearer)}
    defaultQuery={DEFAULT_QUERY}
    defaultHeaders={bearer ? JSON.stringify({ Authorization: bearer }, null, 2) : undefined}
    isHeadersEditorEnabled
  />,
);
