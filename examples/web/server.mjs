// The page's backend, as a Runway Characters application has one: it holds the API key, starts a realtime
// session with @runwayml/sdk, waits for READY and consumes it (@runwayml/avatars/api), and hands the browser
// only what joins the call: {sessionId, serverUrl, token, roomName}. It also serves the built page (dist/).
//
//   RUNWAYML_BASE_URL=http://127.0.0.1:8000 RUNWAYML_API_SECRET=<key> node server.mjs   # then open :3000
// Environment: RUNWAYML_BASE_URL (characters serve), RUNWAYML_API_SECRET (a key of its CHARACTERS_API_KEYS;
// any value with keys off), HOST (127.0.0.1), PORT (3000).
import { readFile } from "node:fs/promises";
import { createServer } from "node:http";
import { extname, join, normalize } from "node:path";
import { fileURLToPath } from "node:url";

import { consumeSession, pollUntilReady } from "@runwayml/avatars/api";
import RunwayML from "@runwayml/sdk";

const baseUrl = process.env.RUNWAYML_BASE_URL || "http://127.0.0.1:8000";
const apiKey = process.env.RUNWAYML_API_SECRET || "dev-key-0123456789";
const host = process.env.HOST || "127.0.0.1";
const port = Number(process.env.PORT || 3000);
const dist = fileURLToPath(new URL("./dist/", import.meta.url));
const runway = new RunwayML({ baseURL: baseUrl, apiKey });
const PRESETS = new Set(["sample-face", "game-character", "music-superstar", "game-character-man", "cat-character",
  "influencer", "tennis-coach", "human-resource", "fashion-designer", "cooking-teacher"]);
const TYPES = { ".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml",
  ".png": "image/png", ".json": "application/json" };

async function connect(avatarId) {
  const avatar = PRESETS.has(avatarId) ? { type: "runway-preset", presetId: avatarId }
    : { type: "custom", avatarId };
  const { id: sessionId } = await runway.realtimeSessions.create({ model: "gwm1_avatars", avatar });
  const { sessionKey } = await pollUntilReady({ sessionId, apiKey, baseUrl, timeoutMs: 120000, intervalMs: 500 });
  const { url, token, roomName } = await consumeSession({ sessionId, sessionKey, baseUrl });
  return { sessionId, serverUrl: url, token, roomName };
}

async function body(req) {
  const parts = [];
  for await (const part of req) parts.push(part);
  return parts.length ? JSON.parse(Buffer.concat(parts).toString("utf8")) : {};
}

createServer(async (req, res) => {
  try {
    if (req.method === "POST" && req.url === "/api/avatar/connect") {
      const { avatarId } = await body(req);
      const credentials = await connect(String(avatarId || "sample-face"));
      res.writeHead(200, { "Content-Type": "application/json" }).end(JSON.stringify(credentials));
      return;
    }
    const path = normalize(decodeURIComponent(new URL(req.url, "http://x").pathname)).replace(/^(\.\.[/\\])+/, "");
    const file = join(dist, path === "/" ? "index.html" : path);
    if (!file.startsWith(dist)) throw Object.assign(new Error("outside dist"), { status: 404 });
    const data = await readFile(file);
    res.writeHead(200, { "Content-Type": TYPES[extname(file)] || "application/octet-stream" }).end(data);
  } catch (err) {
    const status = err.status || (err.code === "ENOENT" ? 404 : 502);
    res.writeHead(status, { "Content-Type": "application/json" }).end(JSON.stringify({ error: String(err.message) }));
  }
}).listen(port, host, () => console.log(`avatar call page on http://${host}:${port}/`));
