"""Runway's own React call UI, unmodified: `examples/web/` renders `@runwayml/avatars-react`'s `AvatarCall`
(0.16.0, with `@runwayml/avatars` and `@runwayml/sdk`, pinned in its package-lock.json), and its backend
(`examples/web/server.mjs`) starts the session on a real `characters serve --livekit-dev` (the client
tests' shared one, tests/clients/conftest.py) with the SDK, waits
for READY and consumes it. Debian's Chromium (headless, Playwright) opens the page: the component joins the
session's room, shows the character's video (frames counted with requestVideoFrameCallback on its <video>, as
the watch page's test does) and plays its audio (a WebAudio analyser on its <audio>): silence, then the
sample speech sent to the session (`POST /v1/sessions/{id}/audio`, the same id). Closing the page empties the
room: the session ends, COMPLETED. Chromium, Node and the built page are requirements: missing, the test fails
and says how to get them (`scripts/setup.sh --dev` does all three).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import ROOT, Served, free_port, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.livekit, pytest.mark.ray, pytest.mark.slow]

CHROMIUM = Path(os.environ.get("CHARACTERS_CHROMIUM", "/usr/bin/chromium"))
WEB = ROOT / "examples" / "web"
CHROMIUM_ARGS = ["--no-sandbox", "--autoplay-policy=no-user-gesture-required", "--disable-dev-shm-usage",
                 "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]  # the user's microphone
MIN_FPS = 20.0
SILENT_DB, SPEECH_DB = -60.0, -45.0  # analyser RMS: digital silence reads -100 dBFS; the sample speech ~-20
# Installed before the page's own scripts: counts the frames the component's <video> presents and measures the
# level of what its <audio> plays, without touching the component.
PROBE = """
window.__probe = {presented: 0, audioDb: -100, audioPeakDb: -100, videos: 0, audios: 0};
const probed = new WeakSet();
setInterval(() => {
  for (const v of document.querySelectorAll("[data-avatar-call] video")) {
    if (probed.has(v)) continue;
    probed.add(v); window.__probe.videos++;
    const tick = (now, meta) => { window.__probe.presented = meta.presentedFrames; v.requestVideoFrameCallback(tick); };
    v.requestVideoFrameCallback(tick);
  }
  for (const a of document.querySelectorAll("audio")) {
    if (probed.has(a) || !a.srcObject) continue;
    probed.add(a); window.__probe.audios++;
    const ctx = new AudioContext();
    const analyser = ctx.createAnalyser();
    analyser.fftSize = 2048;
    ctx.createMediaStreamSource(a.srcObject).connect(analyser);
    const buf = new Float32Array(analyser.fftSize);
    setInterval(() => {
      analyser.getFloatTimeDomainData(buf);
      let sum = 0; for (const x of buf) sum += x * x;
      const db = 10 * Math.log10(sum / buf.length + 1e-10);
      window.__probe.audioDb = db;
      window.__probe.audioPeakDb = Math.max(window.__probe.audioPeakDb, db);
    }, 20);
  }
}, 100);
"""



@pytest.fixture()
def page_server(served: Served, tmp_path: Path) -> Iterator[str]:
    """examples/web/server.mjs: the built page and its backend, with the application's key."""
    node = shutil.which("node")
    assert node is not None, "node is not installed (Debian: apt-get install nodejs npm)"
    port = free_port()
    log = tmp_path / "page-server.log"
    env = {**os.environ, "RUNWAYML_BASE_URL": served.url, "RUNWAYML_API_SECRET": served.keys["app"],
           "HOST": "127.0.0.1", "PORT": str(port)}
    with log.open("w") as out:
        proc = subprocess.Popen([node, str(WEB / "server.mjs")], cwd=WEB, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        def listening() -> bool:
            assert proc.poll() is None, log.read_text()
            return "avatar call page on" in log.read_text()

        wait_for(listening, 30, "the page's server to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def probe(page: Any) -> dict[str, Any]:
    return dict(page.evaluate("() => ({...window.__probe, now: performance.now()})"))


def test_avatar_call_shows_the_characters_video_and_plays_its_speech(served: Served, page_server: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 900, "height": 700})
            context.add_init_script(PROBE)
            page = context.new_page()
            t0 = time.monotonic()
            page.goto(f"{page_server}/?avatar=sample-face")
            wait_for(lambda: probe(page)["presented"] > 24, 120, "the character's video in the AvatarCall",
                     every_s=0.5)
            shown = time.monotonic() - t0
            session = served.session_of("app")
            assert session["status"] == "RUNNING", session
            status, runway = served.request("GET", f"/v1/realtime_sessions/{session['id']}")
            assert status == 200 and runway["status"] == "RUNNING", runway  # consumed: RUNNING
            assert page.locator("[data-avatar-call] [data-avatar-video]").count() == 1
            time.sleep(2.0)  # past the first frames' jitter
            a = probe(page)
            time.sleep(5.0)
            b = probe(page)
            fps = (b["presented"] - a["presented"]) * 1000.0 / (b["now"] - a["now"])
            assert b["videos"] == 1 and b["audios"] >= 1, b
            assert b["audioPeakDb"] < SILENT_DB, f"the idle character's audio peaked at {b['audioPeakDb']:.1f} dBFS"
            speech = (ROOT / "characters" / "assets" / "sample_speech.wav").read_bytes()
            status, _ = served.request("POST", f"/v1/sessions/{session['id']}/audio", raw=speech,
                                       headers={"Content-Type": "audio/wav"})
            assert status == 204
            t_sent = time.monotonic()
            wait_for(lambda: probe(page)["audioPeakDb"] > SPEECH_DB, 10, "the speech to play in the page")
            heard = time.monotonic() - t_sent
            print(f"\navatars-react: video {shown:.1f} s after load, {fps:.1f} fps presented; speech heard "
                  f"{heard:.2f} s after it was sent (peak {probe(page)['audioPeakDb']:.1f} dBFS)")
            assert fps >= MIN_FPS, f"the AvatarCall presented {fps:.1f} fps, want >= {MIN_FPS}"
            page.close()  # the user hangs up: the room empties and the session ends
            ended = wait_for(lambda: (s := served.request("GET", f"/v1/realtime_sessions/{session['id']}")[1])[
                "status"] in ("COMPLETED", "CANCELLED", "FAILED") and s, 30, "the session to end")
            assert ended["status"] == "COMPLETED", ended
            assert served.request("GET", f"/v1/sessions/{session['id']}")[1]["reason"] == "room_empty"
        finally:
            browser.close()
