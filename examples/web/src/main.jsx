// A call with a character, through Runway's own React component, unmodified. The page asks its backend
// (server.mjs, POST /api/avatar/connect) for the call's credentials; the backend starts the session on
// `characters serve` with @runwayml/sdk. ?avatar=<an avatar id, or a preset id> picks the face.
import { AvatarCall } from "@runwayml/avatars-react";
import "@runwayml/avatars-react/styles.css";
import { StrictMode, useState } from "react";
import { createRoot } from "react-dom/client";

const params = new URLSearchParams(window.location.search);
const avatarId = params.get("avatar") || "sample-face";

function App() {
  const [state, setState] = useState("calling");
  const [error, setError] = useState(null);
  return (
    <main style={{ maxWidth: 720, margin: "2rem auto", fontFamily: "system-ui, sans-serif" }}>
      <h1 style={{ fontSize: "1.25rem" }}>A call with a character</h1>
      <AvatarCall
        avatarId={avatarId}
        connectUrl="/api/avatar/connect"
        video={false}
        onEnd={() => setState("ended")}
        onError={(err) => setError(String(err && err.message ? err.message : err))}
        style={{ aspectRatio: "272 / 176", width: "100%" }}
      />
      <p data-call-state={state}>{error ? `Error: ${error}` : state === "ended" ? "The call ended." : ""}</p>
    </main>
  );
}

createRoot(document.getElementById("root")).render(<StrictMode><App /></StrictMode>);
