import { useState } from "react";

async function devToken(): Promise<string> {
  const response = await fetch("/__dev/token?tenant=acme&sub=ada");
  const text = await response.text();
  if (!response.ok) throw new Error(text);
  return text;
}

export function SignIn({ reason, onToken }: { reason: string | null; onToken(token: string): void }) {
  const [value, setValue] = useState("");
  const [devError, setDevError] = useState<string | null>(null);
  return (
    <div className="signin">
      <h1>Tether chat</h1>
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
              devToken().then(
                (token) => onToken(token),
                (e: unknown) => setDevError(e instanceof Error ? e.message : String(e)),
              )
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
