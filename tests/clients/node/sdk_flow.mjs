// What a Node application written against Runway Characters does, with the official clients unmodified:
// @runwayml/sdk for avatars and realtime sessions, @runwayml/avatars/api for the web flow (pollUntilReady,
// consumeSession). Run by tests/clients/test_runway_sdks.py against `characters serve`; every check throws,
// and the last line printed is a JSON report that the Python side reads.
//
// Environment: RUNWAYML_BASE_URL, RUNWAYML_API_SECRET (a tenant's key), OTHER_API_SECRET (another tenant's),
// FACE_URI (a data:image/png;base64, URI), ROOM / ROOM_TOKEN / LIVEKIT_URL (a room of the caller's own).
import assert from "node:assert/strict";

import RunwayML from "@runwayml/sdk";
import { consumeSession, pollUntilReady } from "@runwayml/avatars/api";

const env = process.env;
const baseURL = env.RUNWAYML_BASE_URL;
const client = new RunwayML({ baseURL, apiKey: env.RUNWAYML_API_SECRET, maxRetries: 0 });
const report = {};
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const KEYS = {
  NOT_READY: ["createdAt", "id", "queued", "status"],
  READY: ["createdAt", "expiresAt", "id", "sessionKey", "status"],
  RUNNING: ["createdAt", "id", "status"],
  COMPLETED: ["createdAt", "duration", "id", "status"],
  FAILED: ["createdAt", "failure", "failureCode", "id", "status"],
  CANCELLED: ["createdAt", "id", "status"],
};

async function until(what, fn, timeoutMs = 60000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await fn();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(200);
  }
}

async function session(id, statuses) {
  const got = await client.realtimeSessions.retrieve(id);
  assert.deepEqual(Object.keys(got).sort(), KEYS[got.status], `the ${got.status} member's fields exactly`);
  assert.ok(!Number.isNaN(Date.parse(got.createdAt)));
  statuses?.push(got.status);
  return got;
}

async function errorName(promise) {
  try {
    await promise;
  } catch (err) {
    return err.constructor.name;
  }
  return "no error";
}

// ----------------------------------------------------------------------------------------------- avatars
const statuses = [];
const made = await client.avatars.create({
  name: "Ada", personality: "A patient guide.", referenceImage: env.FACE_URI,
  voice: { type: "runway-live-preset", presetId: "clara" }, startScript: "Hello!", documentIds: ["doc-1"],
});
statuses.push(made.status);
assert.equal(made.name, "Ada");
assert.equal(made.voice.presetId, "clara");
const ready = await until("the avatar READY", async () => {
  const a = await client.avatars.retrieve(made.id);
  statuses.push(a.status);
  return a.status === "READY" && a;
});
assert.equal(ready.voice.name, "Clara");
const second = await client.avatars.create({
  name: "Bea", personality: "Brisk.", referenceImage: env.FACE_URI, voice: { type: "custom", id: "my-voice" },
});
const listed = [];
for await (const avatar of client.avatars.list({ limit: 1 })) listed.push(avatar.id); // follows nextCursor
const updated = await client.avatars.update(made.id, { name: "Ada II", startScript: null });
assert.equal(updated.name, "Ada II");
assert.equal(updated.startScript ?? null, null);
report.avatar = { statuses: [...new Set(statuses)], listed, ids: [second.id, made.id] };

// ------------------------------------------------------------------- a session in the caller's own room
const intStatuses = [];
const created = await client.realtimeSessions.create({
  model: "gwm1_avatars", avatar: { type: "custom", avatarId: made.id }, maxDuration: 60,
  integration: { type: "livekit", url: env.LIVEKIT_URL, token: env.ROOM_TOKEN, roomName: env.ROOM,
                 agentIdentity: "agent-node" },
});
assert.deepEqual(Object.keys(created), ["id"]);
await until("the integration session RUNNING", async () => (await session(created.id, intStatuses)).status === "RUNNING");
await client.realtimeSessions.delete(created.id);
const intEnd = await until("CANCELLED", async () => {
  const s = await session(created.id);
  return s.status === "CANCELLED" && s.status;
});
report.integration = { statuses: [...new Set(intStatuses)], end: intEnd };

// ------------------------------------- a session in a room of the service: pollUntilReady, then consume
const own = await client.realtimeSessions.create({
  model: "gwm1_avatars", avatar: { type: "runway-preset", presetId: "music-superstar" },
});
const { sessionKey } = await pollUntilReady({ sessionId: own.id, apiKey: env.RUNWAYML_API_SECRET, baseUrl: baseURL,
                                             timeoutMs: 90000, intervalMs: 300 });
const consumed = await consumeSession({ sessionId: own.id, sessionKey, baseUrl: baseURL });
assert.deepEqual(Object.keys(consumed).sort(), ["roomName", "token", "url"]);
assert.equal(consumed.token.split(".").length, 3);
const after = (await session(own.id)).status;
const twice = await consumeSession({ sessionId: own.id, sessionKey, baseUrl: baseURL }).then(
  () => "consumed twice", (err) => err.code);
assert.equal(twice, "CONSUME_FAILED");
await client.realtimeSessions.delete(own.id);
const ownEnd = await until("CANCELLED", async () => {
  const s = await session(own.id);
  return s.status === "CANCELLED" && s.status;
});
report.own = { ready: true, room: `watch-${own.id}`, consumed: { roomName: consumed.roomName, url: consumed.url },
               after, end: ownEnd };

// ----------------------------------------------------------------------------------------------- errors
const other = new RunwayML({ baseURL, apiKey: env.OTHER_API_SECRET, maxRetries: 0 });
report.errors = {
  notFound: await errorName(client.realtimeSessions.retrieve("0".repeat(32))),
  unprocessable: await errorName(client.avatars.create({
    name: "x", personality: "y", referenceImage: "https://example.com/a.png",
    voice: { type: "runway-live-preset", presetId: "clara" } })),
  auth: await errorName(new RunwayML({ baseURL, apiKey: "not-a-key-0123456789", maxRetries: 0 }).avatars.retrieve(made.id)),
  otherTenant: await errorName(other.avatars.retrieve(made.id)),
};
await client.avatars.delete(made.id);
await client.avatars.delete(second.id);
console.log(JSON.stringify(report));
