import { useCallback, useEffect, useState } from "react";
import { ChatView } from "./Chat";
import { TOKEN_KEY, conversationFromUrl } from "./config";
import { COMPLETE_CONNECTION, CONVERSATION, CREATE_CONVERSATION, TetherError, gql, type ConversationData } from "./graphql";
import { toUIMessages, type TetherUIMessage } from "./messages";

export function App() {
  const [token, setToken] = useState<string | null>(() => localStorage.getItem(TOKEN_KEY));
  const [reason, setReason] = useState<string | null>(null);
  const [conversationId, setConversationId] = useState<string | null>(conversationFromUrl);

  useEffect(() => {
    const onPop = () => setConversationId(conversationFromUrl());
    window.addEventListener("popstate", onPop);
    return () => window.removeEventListener("popstate", onPop);
  }, []);

  const signIn = useCallback((value: string) => {
    localStorage.setItem(TOKEN_KEY, value);
    setReason(null);
    setToken(value);
  }, []);
  const signOut = useCallback((why: string | null) => {
    localStorage.removeItem(TOKEN_KEY);
    setReason(why);
    setToken(null);
  }, []);
  const open = useCallback((id: string | null) => {
    window.history.pushState({}, "", id ? `/?c=${encodeURIComponent(id)}` : "/");
    setConversationId(id);
  }, []);

  if (!token) return <SignIn reason={reason} onToken={signIn} />;
  if (window.location.pathname === "/oauth/callback") return <OAuthCallback token={token} />;
  return (
    <div className="shell">
      <header>
        <b>Tether + AI SDK</b>
        <button type="button" data-testid="home" onClick={() => open(null)}>
          Conversations
        </button>
        <button type="button" data-testid="sign-out" onClick={() => signOut(null)}>
          Sign out
        </button>
      </header>
      {conversationId ? (
        <ConversationLoader key={conversationId} token={token} id={conversationId} onAuthFailure={signOut} />
      ) : (
        <NewConversation token={token} onCreated={open} onAuthFailure={signOut} />
      )}
    </div>
  );
}

function describe(error: unknown): { code: string; message: string } {
  if (error instanceof TetherError) return { code: error.code, message: error.message };
  return { code: "INTERNAL", message: error instanceof Error ? error.message : String(error) };
}

function NewConversation({ token, onCreated, onAuthFailure }: { token: string; onCreated(id: string): void; onAuthFailure(reason: string): void }) {
  const [title, setTitle] = useState("");
  const [error, setError] = useState<{ code: string; message: string } | null>(null);
  const create = async () => {
    setError(null);
    try {
      const { createConversation } = await gql<{ createConversation: { id: string } }>(token, CREATE_CONVERSATION, {
        input: title.trim() ? { title: title.trim() } : {},
      });
      onCreated(createConversation.id);
    } catch (e) {
      const d = describe(e);
      if (d.code === "UNAUTHENTICATED") onAuthFailure(d.message);
      else setError(d);
    }
  };
  return (
    <div className="new-conversation">
      <input placeholder="Title (optional)" value={title} onChange={(e) => setTitle(e.target.value)} data-testid="new-conversation-title" />
      <button type="button" onClick={() => void create()} data-testid="new-conversation">
        New conversation
      </button>
      {error && (
        <p className="error" data-testid="error-banner" data-code={error.code}>
          {error.message}
        </p>
      )}
    </div>
  );
}

type Loaded = { messages: TetherUIMessage[]; title: string | null; viewer: string } | { error: { code: string; message: string } };

/** Reads the stored conversation once, then hands it to useChat as the initial messages. */
function ConversationLoader({ token, id, onAuthFailure }: { token: string; id: string; onAuthFailure(reason: string): void }) {
  const [loaded, setLoaded] = useState<Loaded | null>(null);
  useEffect(() => {
    let live = true;
    gql<ConversationData>(token, CONVERSATION, { id }).then(
      (data) => {
        if (!live) return;
        if (!data.conversation) setLoaded({ error: { code: "NOT_FOUND", message: "not found" } });
        else
          setLoaded({
            messages: toUIMessages(data.conversation),
            title: data.conversation.title,
            viewer: `${data.me.principal} @ ${data.me.tenant}`,
          });
      },
      (e: unknown) => {
        if (!live) return;
        const d = describe(e);
        if (d.code === "UNAUTHENTICATED") onAuthFailure(d.message);
        else setLoaded({ error: d });
      },
    );
    return () => {
      live = false;
    };
  }, [token, id, onAuthFailure]);

  if (!loaded) return <p data-testid="loading">Loading…</p>;
  if ("error" in loaded)
    return (
      <p className="error" data-testid="error-banner" data-code={loaded.error.code}>
        {loaded.error.message}
      </p>
    );
  return (
    <>
      <h2>
        {loaded.title ?? "Conversation"} <small data-testid="viewer">{loaded.viewer}</small>
      </h2>
      <ChatView token={token} conversationId={id} initialMessages={loaded.messages} />
    </>
  );
}

async function devToken(): Promise<string> {
  const response = await fetch("/__dev/token?tenant=acme&sub=ada");
  const text = await response.text();
  if (!response.ok) throw new Error(text);
  return text;
}

function SignIn({ reason, onToken }: { reason: string | null; onToken(token: string): void }) {
  const [value, setValue] = useState("");
  const [devError, setDevError] = useState<string | null>(null);
  return (
    <div className="signin">
      <h1>Tether + AI SDK useChat</h1>
      {reason && (
        <p className="error" data-testid="signin-reason">
          You were signed out: {reason}.
        </p>
      )}
      <form
        onSubmit={(e) => {
          e.preventDefault();
          if (value.trim()) onToken(value.trim());
        }}
      >
        <label>
          Paste a token
          <textarea rows={4} value={value} onChange={(e) => setValue(e.target.value)} data-testid="token-input" />
        </label>
        <button type="submit" data-testid="sign-in">
          Sign in
        </button>
      </form>
      <p className="hint">
        Make one beside the server with <code>cargo run --release -- token --tenant acme --sub ada</code>.
      </p>
      {import.meta.env.DEV && (
        <p>
          <button
            type="button"
            data-testid="dev-token"
            onClick={() =>
              devToken().then(onToken, (e: unknown) => setDevError(e instanceof Error ? e.message : String(e)))
            }
          >
            Sign in as ada @ acme (dev server: runs <code>tether token</code>)
          </button>
          {devError && <span className="error"> {devError}</span>}
        </p>
      )}
    </div>
  );
}

/** Where the provider sends the person back after consent: completeConnection, then back to the conversation. */
function OAuthCallback({ token }: { token: string }) {
  const [error, setError] = useState<string | null>(null);
  useEffect(() => {
    const params = new URLSearchParams(window.location.search);
    const state = params.get("state") ?? "";
    const code = params.get("code");
    const input = code ? { state, code } : { state, error: params.get("error") ?? "access_denied" };
    const back = sessionStorage.getItem("tether.oauth.returnTo") ?? "";
    gql(token, COMPLETE_CONNECTION, { input }).then(
      () => window.location.replace(`/${back}`),
      (e: unknown) => setError(describe(e).message),
    );
  }, [token]);
  return error ? (
    <p className="error" data-testid="error-banner">
      {error}
    </p>
  ) : (
    <p>Completing the connection…</p>
  );
}
