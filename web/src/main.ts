// The watch page: pick a face, start a character whose output is a LiveKit room, watch and hear it with
// livekit-client, send it speech, interrupt it, and read its live stats from the API.
import { RemoteAudioTrack, RemoteTrack, Room, RoomEvent, Track } from "livekit-client";

import { Api, ApiError, type Session, type WatchConfig } from "./api";
import { AudioLevel, FrameCounter, packetsReceived } from "./measure";
import "./style.css";

const STATS_EVERY_MS = 500;
const TERMINAL = new Set(["ENDED", "FAILED"]);

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;
const ui = {
  serverInfo: $<HTMLParagraphElement>("server-info"),
  video: $<HTMLVideoElement>("video"),
  videoNote: $<HTMLParagraphElement>("video-note"),
  pageFps: $<HTMLElement>("page-fps"),
  audioMeter: $<HTMLMeterElement>("audio-meter"),
  audioLevel: $<HTMLElement>("audio-level"),
  form: $<HTMLFormElement>("start-form"),
  preview: $<HTMLImageElement>("preview"),
  imageFile: $<HTMLInputElement>("image-file"),
  useSample: $<HTMLButtonElement>("use-sample"),
  maxDuration: $<HTMLInputElement>("max-duration"),
  apiKey: $<HTMLInputElement>("api-key"),
  start: $<HTMLButtonElement>("start"),
  speak: $<HTMLButtonElement>("speak"),
  speechFile: $<HTMLInputElement>("speech-file"),
  interrupt: $<HTMLButtonElement>("interrupt"),
  end: $<HTMLButtonElement>("end"),
  status: $<HTMLParagraphElement>("status"),
  error: $<HTMLParagraphElement>("error"),
  statsAge: $<HTMLElement>("stats-age"),
  stages: $<HTMLTableElement>("stages"),
};

const api = new Api();
const frames = new FrameCounter(ui.video);
const audio = new AudioLevel();
let config: WatchConfig | null = null;
let image: string | null = null; // data URL of the chosen face
let session: Session | null = null;
let room: Room | null = null;
let audioTrack: RemoteAudioTrack | null = null;
let audioPackets = 0;
let statsUpdates = 0;
let poller = 0;
let watching = false; // a session was started here and not yet stopped

/** State the end-to-end test reads (tests/browser/test_watch_page.py). */
const probe = {
  get sessionId() { return session?.id ?? null; },
  get status() { return session?.status ?? null; },
  get stats() { return session?.stats ?? null; },
  get statsUpdates() { return statsUpdates; },
  get presentedFrames() { return frames.presented; },
  get pageFps() { return frames.fps(); },
  get audioDb() { return audio.levelDb; },
  get audioPeakDb() { return audio.peakDb; },
  get audioPackets() { return audioPackets; },
  resetAudioPeak: () => audio.resetPeak(),
};
(window as unknown as { __watch: typeof probe }).__watch = probe;

// ------------------------------------------------------------------------------------------ messages

function say(text: string): void {
  ui.status.textContent = text;
}

function fail(e: unknown): void {
  const text = e instanceof ApiError ? e.explain() : e instanceof Error ? e.message : String(e);
  ui.error.textContent = text;
  ui.error.hidden = false;
  if (e instanceof ApiError && e.status === 401) ui.apiKey.focus();
}

function clearError(): void {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

function setRunning(running: boolean): void {
  ui.start.disabled = running || config?.livekit === false;
  ui.imageFile.disabled = ui.useSample.disabled = ui.maxDuration.disabled = running;
  ui.speak.disabled = ui.speechFile.disabled = ui.interrupt.disabled = ui.end.disabled = !running;
}

// ------------------------------------------------------------------------------------------ the face

function readAsDataUrl(blob: Blob): Promise<string> {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result));
    reader.onerror = () => reject(reader.error ?? new Error("could not read the file"));
    reader.readAsDataURL(blob);
  });
}

async function chooseImage(blob: Blob, label: string): Promise<void> {
  image = await readAsDataUrl(blob);
  ui.preview.src = image;
  ui.preview.alt = `The reference image: ${label}`;
}

async function useSample(): Promise<void> {
  const resp = await fetch("samples/face.png");
  if (!resp.ok) throw new Error(`the sample face could not be loaded (${resp.status})`);
  await chooseImage(await resp.blob(), "the sample face");
}

// ------------------------------------------------------------------------------------------ the session

async function startSession(): Promise<void> {
  clearError();
  api.apiKey = ui.apiKey.value.trim();
  if (!config) await loadConfig(); // e.g. it needed the API key just entered
  if (!image) await useSample();
  const maxDuration = Number(ui.maxDuration.value);
  if (!Number.isFinite(maxDuration) || maxDuration <= 0) {
    throw new Error("Session length must be a number of seconds above 0.");
  }
  ui.start.disabled = true;
  say("Starting the session…");
  let started;
  try {
    started = await api.start(image as string, maxDuration);
  } catch (e) {
    setRunning(false);
    throw e;
  }
  session = started.session;
  watching = true;
  setRunning(true);
  say(`Session ${session.id.slice(0, 8)}: ${session.status.toLowerCase()}; joining room ${started.viewer.roomName}…`);
  poller = window.setInterval(() => void pollStats(), STATS_EVERY_MS);
  await watchRoom(started.viewer.url, started.viewer.token);
}

async function watchRoom(url: string, token: string): Promise<void> {
  const r = (room = new Room({ adaptiveStream: false, dynacast: false }));
  r.on(RoomEvent.TrackSubscribed, (track: RemoteTrack) => {
    if (track.kind === Track.Kind.Video) {
      track.attach(ui.video);
      ui.videoNote.hidden = true;
      frames.start();
    } else if (track.kind === Track.Kind.Audio) {
      const el = track.attach();
      el.hidden = true;
      document.body.appendChild(el);
      audioTrack = track as RemoteAudioTrack;
      audio.start(track.mediaStreamTrack);
    }
  });
  r.on(RoomEvent.TrackUnsubscribed, (track: RemoteTrack) => {
    track.detach().forEach((el) => el !== ui.video && el.remove());
  });
  r.on(RoomEvent.Disconnected, () => {
    if (session && !TERMINAL.has(session.status)) say("Disconnected from the room.");
  });
  await r.connect(url, token, { autoSubscribe: true });
  await r.startAudio();
}

async function pollStats(): Promise<void> {
  if (!session) return;
  const before = session.status;
  try {
    session = await api.session(session.id);
  } catch (e) {
    fail(e);
    return;
  }
  statsUpdates += 1;
  if (session.status === "RUNNING" && before !== "RUNNING") say("Running: send it speech, or interrupt it.");
  render(session);
  audioPackets = (await packetsReceived(audioTrack?.receiver).catch(() => null)) ?? audioPackets;
  if (TERMINAL.has(session.status)) await stopWatching(session);
}

/** Leave the room and reset the controls (once per session). */
async function stopWatching(ended: Session): Promise<void> {
  if (!watching) return;
  watching = false;
  window.clearInterval(poller);
  frames.stop();
  audio.stop();
  audioTrack = null;
  const r = room;
  room = null;
  await r?.disconnect();
  ui.videoNote.hidden = false;
  ui.videoNote.textContent = "The session has ended. Start another one.";
  setRunning(false);
  say(`Session ${ended.status === "FAILED" ? "failed" : "ended"} (${ended.reason ?? "deleted"}).`);
}

async function sendSpeech(wav: Blob, what: string): Promise<void> {
  if (!session) return;
  clearError();
  audio.resetPeak();
  await api.speak(session.id, wav);
  say(`Sent ${what} as the agent's speech.`);
}

// ------------------------------------------------------------------------------------------ rendering

const fmt = (x: number | undefined, digits = 1, unit = "") => (x === undefined ? "–" : `${x.toFixed(digits)}${unit}`);

function render(s: Session): void {
  const st = s.stats;
  const cells: Record<string, string> = {
    status: s.status === "QUEUED" && s.queuePosition !== null ? `queued (#${s.queuePosition})` : s.status.toLowerCase(),
    fps: fmt(st.fps),
    presentedFps: fmt(st.presentedFps),
    speechMsP50: st.speechMsP50 ? fmt(st.speechMsP50, 0, " ms") : "–",
    lateChunks: String(st.lateChunks),
    bufferMs: fmt(st.bufferMs, 0, " ms"),
    avOffsetMs: fmt(st.avOffsetMs, 1, " ms"),
    step: `${fmt(st.stepMsP50, 0)} / ${fmt(st.stepMsP95, 0, " ms")}`,
    audioQueuedS: fmt(st.audioQueuedS, 2, " s"),
    chunks: `${st.chunks} / ${st.frames}`,
  };
  for (const [key, text] of Object.entries(cells)) {
    const dd = document.querySelector<HTMLElement>(`[data-stat="${key}"]`);
    if (dd) dd.textContent = text;
  }
  ui.statsAge.textContent = `(updated ${new Date().toLocaleTimeString()})`;
  const budget = config ? (4 * 1000) / config.fps : 166.7; // one chunk of 4 frames
  const body = ui.stages.tBodies[0];
  body.replaceChildren(...Object.entries(st.stageMs ?? {}).map(([stage, ms]) => {
    const row = document.createElement("tr");
    const name = document.createElement("th");
    name.scope = "row";
    name.textContent = stage;
    const value = document.createElement("td");
    value.textContent = ms.toFixed(1);
    const bar = document.createElement("td");
    bar.setAttribute("aria-hidden", "true");
    const fill = document.createElement("span");
    fill.className = "bar";
    fill.style.width = `${Math.min(100, (100 * ms) / budget)}%`;
    bar.append(fill);
    row.append(name, value, bar);
    return row;
  }));
}

function renderMeters(): void {
  const fps = frames.fps();
  ui.pageFps.textContent = fps > 0 ? fps.toFixed(1) : "–";
  ui.audioMeter.value = Math.max(-90, audio.levelDb);
  ui.audioLevel.textContent = audio.levelDb > -100 ? `${audio.levelDb.toFixed(0)} dBFS` : "–";
}

// ------------------------------------------------------------------------------------------ wiring

function guarded(fn: () => Promise<void>): () => void {
  return () => void fn().catch(fail);
}

ui.form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  guarded(startSession)();
});
ui.useSample.addEventListener("click", guarded(useSample));
ui.imageFile.addEventListener("change", guarded(async () => {
  const file = ui.imageFile.files?.[0];
  if (file) await chooseImage(file, file.name);
}));
ui.speak.addEventListener("click", guarded(async () => {
  const resp = await fetch("samples/speech.wav");
  if (!resp.ok) throw new Error(`the sample speech could not be loaded (${resp.status})`);
  await sendSpeech(await resp.blob(), "the sample line");
}));
ui.speechFile.addEventListener("change", guarded(async () => {
  const file = ui.speechFile.files?.[0];
  if (file) await sendSpeech(file, file.name);
  ui.speechFile.value = "";
}));
ui.interrupt.addEventListener("click", guarded(async () => {
  if (!session) return;
  await api.interrupt(session.id);
  say("Interrupted: queued speech dropped.");
}));
ui.end.addEventListener("click", guarded(async () => {
  if (!session) return;
  session = await api.end(session.id);
  await stopWatching(session);
}));
window.addEventListener("pagehide", () => {
  if (session && !TERMINAL.has(session.status)) api.endOnUnload(session.id);
});
window.setInterval(renderMeters, 250);

async function loadConfig(): Promise<void> {
  try {
    config = await api.config();
  } catch (e) {
    ui.serverInfo.textContent = "Could not read the service's configuration.";
    throw e;
  }
  const box = ui.video.parentElement as HTMLElement; // shown at twice the preset's size
  box.style.width = `${2 * config.width}px`;
  box.style.height = `${2 * config.height}px`;
  if (config.livekit) {
    ui.serverInfo.textContent = `Preset ${config.preset} (${config.width}x${config.height}, ${config.fps} fps), ` +
      `LiveKit at ${config.url}.`;
  } else {
    ui.serverInfo.textContent = `Preset ${config.preset}. No LiveKit server is configured.`;
    fail(new Error("This service has no LiveKit server for the watch page: set CHARACTERS_LIVEKIT_URL, " +
      "CHARACTERS_LIVEKIT_API_KEY and CHARACTERS_LIVEKIT_API_SECRET, or run `characters serve --livekit-dev`."));
  }
  setRunning(false);
}

setRunning(false);
void useSample().catch(fail);
void loadConfig().catch(fail);
