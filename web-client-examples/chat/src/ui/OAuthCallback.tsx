import { useEffect, useRef, useState } from "react";
import { Link, useNavigate, useSearchParams } from "react-router-dom";
import { describeError, useCompleteConnection } from "../tether";

export const RETURN_KEY = "tether.oauth.returnTo";

/** The provider sends the person back here with `code` and `state`, or `error`. */
export function OAuthCallback() {
  const [params] = useSearchParams();
  const { complete } = useCompleteConnection();
  const navigate = useNavigate();
  const started = useRef(false);
  const [message, setMessage] = useState("Completing the connection…");

  useEffect(() => {
    if (started.current) return;
    started.current = true;
    const state = params.get("state");
    const code = params.get("code");
    const error = params.get("error");
    const back = sessionStorage.getItem(RETURN_KEY);
    if (!state) {
      setMessage("The provider sent no state; nothing to complete.");
      return;
    }
    void complete({ state, code: error ? null : code, error: error ?? null }).then((r) => {
      if (!r.ok) {
        setMessage(describeError(r.error));
        return;
      }
      sessionStorage.removeItem(RETURN_KEY);
      if (back) navigate(`/c/${back}`, { replace: true });
      else setMessage(error ? "You declined the connection." : "Connected.");
    });
  }, [params, complete, navigate]);

  const back = sessionStorage.getItem(RETURN_KEY);
  return (
    <div data-testid="oauth-callback">
      <p>{message}</p>
      {back && <Link to={`/c/${back}`}>Back to the conversation</Link>}
    </div>
  );
}
