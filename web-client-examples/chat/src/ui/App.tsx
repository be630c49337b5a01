import { useCallback, useEffect, useState } from "react";
import { Link, Route, Routes, useNavigate } from "react-router-dom";
import { TetherProvider, describeError, useConversations, useCreateConversation, useMe, useTether } from "../tether";
import { ConversationPage } from "./ConversationPage";
import { OAuthCallback } from "./OAuthCallback";
import { SignIn } from "./SignIn";

const TOKEN_KEY = "tether.token";

export function App() {
  const [token, setToken] = useState<string | null>(() => localStorage.getItem(TOKEN_KEY));
  const [signInReason, setSignInReason] = useState<string | null>(null);

  const signIn = useCallback((value: string) => {
    localStorage.setItem(TOKEN_KEY, value);
    setSignInReason(null);
    setToken(value);
  }, []);
  const signOut = useCallback((reason: string | null) => {
    localStorage.removeItem(TOKEN_KEY);
    setSignInReason(reason);
    setToken(null);
  }, []);
  const onAuthFailure = useCallback((reason: string) => signOut(reason), [signOut]);

  if (!token) return <SignIn reason={signInReason} onToken={signIn} />;
  return (
    <TetherProvider token={token} onAuthFailure={onAuthFailure}>
      <Shell onSignOut={() => signOut(null)} />
    </TetherProvider>
  );
}

declare global {
  interface Window {
    /** For trying a dropped socket from the console (and for the browser test). */
    tetherDebug?: { dropSocket(): void };
  }
}

function Shell({ onSignOut }: { onSignOut(): void }) {
  const { me, error: meError } = useMe();
  const tether = useTether();
  useEffect(() => {
    window.tetherDebug = { dropSocket: () => tether.ws.terminate() };
    return () => {
      delete window.tetherDebug;
    };
  }, [tether]);
  return (
    <div className="shell">
      <aside className="sidebar">
        <div className="who" data-testid="whoami">
          {me ? `${me.principal} @ ${me.tenant}` : meError ? "" : "…"}
          <button type="button" className="link" onClick={onSignOut} data-testid="sign-out">
            Sign out
          </button>
        </div>
        {meError && (
          <div className="error" data-testid="error-banner" data-code={meError.code}>
            {describeError(meError)}{" "}
            {meError.code === "UNAUTHENTICATED" && (
              <button type="button" onClick={onSignOut}>
                Sign in again
              </button>
            )}
          </div>
        )}
        <ConversationList />
      </aside>
      <main className="main">
        <Routes>
          <Route path="/" element={<p className="hint">Pick a conversation, or start a new one.</p>} />
          <Route path="/c/:id" element={<ConversationPage />} />
          <Route path="/oauth/callback" element={<OAuthCallback />} />
          <Route path="*" element={<p className="error">No such page.</p>} />
        </Routes>
      </main>
    </div>
  );
}

function ConversationList() {
  const { conversations, error, refresh } = useConversations();
  const { create, creating } = useCreateConversation();
  const [title, setTitle] = useState("");
  const [createError, setCreateError] = useState<string | null>(null);
  const navigate = useNavigate();

  return (
    <nav>
      <form
        className="new-conversation"
        onSubmit={async (e) => {
          e.preventDefault();
          const r = await create(title.trim());
          if (!r.ok) {
            setCreateError(describeError(r.error));
            return;
          }
          setCreateError(null);
          setTitle("");
          refresh();
          navigate(`/c/${r.data.id}`);
        }}
      >
        <input
          value={title}
          placeholder="New conversation title"
          onChange={(e) => setTitle(e.target.value)}
          data-testid="new-conversation-title"
        />
        <button type="submit" disabled={creating} data-testid="new-conversation">
          New
        </button>
      </form>
      {createError && <div className="error">{createError}</div>}
      {error && (
        <div className="error" data-testid="error-banner" data-code={error.code}>
          {describeError(error)}
        </div>
      )}
      <ul className="conversations" data-testid="conversation-list">
        {conversations.map((c) => (
          <li key={c.id}>
            <Link to={`/c/${c.id}`} data-testid="conversation-link">
              {c.title ?? "Untitled"} <small>{new Date(c.createdAt).toLocaleString()}</small>
            </Link>
          </li>
        ))}
      </ul>
    </nav>
  );
}
