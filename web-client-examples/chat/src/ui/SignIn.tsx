import { useState } from "react";

export function SignIn({ reason, onToken }: { reason: string | null; onToken(token: string): void }) {
  const [value, setValue] = useState("");
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
    </div>
  );
}
