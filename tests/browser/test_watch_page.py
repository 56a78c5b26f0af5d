"""The watch page end to end: a real `characters serve --livekit-dev` (its own Ray cluster, the scheduler,
the embedded tiny preset, a real LiveKit server on loopback), driven by Debian's Chromium headless through
Playwright. The page starts a session from the keyboard, plays the character's video through
livekit-client (frames counted in the page with requestVideoFrameCallback), hears its audio (a WebAudio
analyser on the remote track), sends the sample speech and interrupts it, shows the live stats, and
explains a 503 with its Retry-After.

Chromium and the built page are requirements, not options: without them this test fails, saying how to
install them (`scripts/setup.sh --dev` does both). `CHARACTERS_UPDATE_SCREENSHOT=1` also writes the
screenshot to docs/watch_page.png (the README's picture).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.livekit, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("CHARACTERS_CHROMIUM", "/usr/bin/chromium"))
PAGE = ROOT / "deployments" / "api" / "watch_page" / "index.html"
CHROMIUM_ARGS = ["--no-sandbox", "--autoplay-policy=no-user-gesture-required", "--disable-dev-shm-usage",
                 "--disable-background-timer-throttling", "--disable-renderer-backgrounding"]
MIN_FPS = 20.0
SILENT_DB, SPEECH_DB = -60.0, -45.0  # analyser RMS: digital silence reads -100 dBFS; the sample speech ~-20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(fn: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last value {value!r}")
        time.sleep(every_s)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`characters serve --livekit-dev` (HTTP on a free port, LiveKit on its default 7880), refusing a second
    session at once (queue_max 0)."""
    if not CHROMIUM.is_file():
        pytest.fail(f"Chromium is not at {CHROMIUM}; run scripts/install_chromium.sh (or scripts/setup.sh --dev)")
    if not PAGE.is_file():
        pytest.fail(f"the watch page is not built ({PAGE} is missing); run `npm ci && npm run build` in web/ "
                    "(scripts/setup.sh does)")
    from deployments.livekit.server import install_server

    install_server()  # built once and cached: its first build does not count against the start-up below
    work = tmp_path_factory.mktemp("watch")
    config = work / "serve.yaml"
    config.write_text("service: {queue_max: 0}\n")
    port = free_port()
    env = {**os.environ, "CHARACTERS_API_KEYS": "", "RAY_ADDRESS": ""}
    log_path = work / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.serve", "--config", str(config), "--port",
                                 str(port), "--grpc-port", "0", "--livekit-dev"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            def started() -> bool:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                return "Ctrl-C to stop" in log_path.read_text()

            wait_for(started, 180, "characters serve to start", every_s=0.5)
            text = log_path.read_text()
            assert f"Watch http://127.0.0.1:{port}/watch/" in text
            # LiveKit's own port unless told otherwise, with the dev keys on the first screen and over HTTP
            assert "LiveKit ws://127.0.0.1:7880  API key devkey  secret secret" in text, text[-2000:]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/livekit", timeout=10) as resp:
                assert json.loads(resp.read()) == {"configured": True, "url": "ws://127.0.0.1:7880",
                                                   "apiKey": "devkey", "apiSecret": "secret", "dev": True}
            yield f"http://127.0.0.1:{port}"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def probe(page: Any) -> dict[str, Any]:
    """What the page measured (window.__watch, web/src/main.ts), with the page's clock."""
    return page.evaluate("""() => { const w = window.__watch; return {status: w.status, sessionId: w.sessionId,
        presented: w.presentedFrames, now: performance.now(), audioDb: w.audioDb, audioPeakDb: w.audioPeakDb,
        audioPackets: w.audioPackets, statsUpdates: w.statsUpdates, stats: w.stats}; }""")


def stat_text(page: Any, key: str) -> str:
    return str(page.locator(f'[data-stat="{key}"]').inner_text())


def test_watch_page_plays_speaks_interrupts_and_explains_refusals(server: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with urllib.request.urlopen(f"{server}/v1/watch/config", timeout=10) as resp:
        cfg = json.loads(resp.read())
    assert cfg["livekit"] is True and cfg["url"].startswith("ws://127.0.0.1:") and cfg["preset"] == "tiny", cfg

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 760})
            page = context.new_page()
            page.goto(f"{server}/")  # redirects to /watch/
            assert page.url == f"{server}/watch/"
            page.get_by_text("LiveKit at ws://127.0.0.1:").wait_for(timeout=15_000)
            for label in ("Upload a face (PNG, JPEG or WebP)", "Session length (seconds)", "API key",
                          "Or send a WAV file (16-bit PCM) as the agent's speech"):
                assert page.get_by_label(label).count() == 1, label
            assert page.get_by_role("button", name="Speak the sample line").is_disabled()

            # keyboard only: Tab to "Start session", Enter submits
            for _ in range(30):
                page.keyboard.press("Tab")
                if page.evaluate("document.activeElement.id") == "start":
                    break
            else:
                raise AssertionError("Tab never reached the Start session button")
            page.keyboard.press("Enter")

            wait_for(lambda: probe(page)["status"] == "RUNNING" and probe(page)["presented"] > 24, 120,
                     "the session to run and its video to play in the page", every_s=0.5)
            time.sleep(2.0)  # past the first frames' jitter

            # video: frames presented by the <video> element over 5 s
            a = probe(page)
            time.sleep(5.0)
            b = probe(page)
            fps = (b["presented"] - a["presented"]) * 1000.0 / (b["now"] - a["now"])
            print(f"\nwatch page: {fps:.1f} fps presented in Chromium; server stats {b['stats']}")
            assert fps >= MIN_FPS, f"the page presented {fps:.1f} fps, want >= {MIN_FPS}"

            # the stats panel follows the API: updated, with playout and per-stage numbers
            assert b["statsUpdates"] >= a["statsUpdates"] + 5, (a["statsUpdates"], b["statsUpdates"])
            s = b["stats"]
            assert s["chunks"] > a["stats"]["chunks"] and s["fps"] > 0 and s["bufferMs"] > 0, s  # (load: fps may sag)
            assert {"dit", "decode", "publish"} <= set(s["stageMs"]) and all(v > 0 for v in s["stageMs"].values()), s
            shown = stat_text(page, "chunks")
            assert shown != "–" and stat_text(page, "fps") != "–", shown
            wait_for(lambda: stat_text(page, "chunks") != shown, 5, "the stats panel to change")
            assert stat_text(page, "bufferMs").endswith(" ms") and stat_text(page, "avOffsetMs").endswith(" ms")
            stage_rows = page.locator("#stages tbody th").all_inner_texts()
            assert stage_rows[:1] == ["dit"] and "decode" in stage_rows, stage_rows

            # audio: packets arrive all along; silence before speech, speech after "Speak"
            assert b["audioPackets"] > a["audioPackets"] > 0, (a["audioPackets"], b["audioPackets"])
            assert b["audioPeakDb"] < SILENT_DB, f"idle audio peaked at {b['audioPeakDb']:.1f} dBFS"
            page.get_by_role("button", name="Speak the sample line").click()
            wait_for(lambda: probe(page)["audioPeakDb"] > SPEECH_DB, 10, "the sample speech to be heard in the page")
            wait_for(lambda: stat_text(page, "audioQueuedS") not in ("–", "0.00 s"), 5, "speech queued in the stats")
            shot = tmp_path / "watch_page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            if os.environ.get("CHARACTERS_UPDATE_SCREENSHOT") == "1":
                shutil.copyfile(shot, ROOT / "docs" / "watch_page.png")

            # interrupt: the queue is dropped, and the audio goes quiet within the frames in flight
            page.get_by_role("button", name="Interrupt").click()
            page.get_by_text("Interrupted: queued speech dropped.").wait_for(timeout=5_000)
            wait_for(lambda: probe(page)["stats"]["audioQueuedS"] == 0, 3, "the speech queue to be dropped")
            time.sleep(1.0)  # chunks already generated from speech still play (in flight + buffered: ~0.5-0.9 s)

            def quiet_second() -> bool:  # a whole second of silence (the sample's pauses are far shorter)
                page.evaluate("window.__watch.resetAudioPeak()")
                time.sleep(1.0)
                return bool(probe(page)["audioPeakDb"] < SILENT_DB)

            wait_for(quiet_second, 4, "the character to fall silent after the interruption", every_s=0)

            # a second viewer: no capacity (queue_max 0) -> a readable 503 with the Retry-After
            other = context.new_page()
            other.goto(f"{server}/watch/")
            other.get_by_text("LiveKit at ws://127.0.0.1:").wait_for(timeout=15_000)
            other.get_by_role("button", name="Start session").click()
            alert = other.get_by_role("alert")
            alert.wait_for(state="visible", timeout=15_000)
            text = alert.inner_text()
            assert "no free capacity right now: try again in" in text and " s." in text, text
            other.close()

            # end: the API says ENDED, the page says so and offers a new start
            page.get_by_role("button", name="End session").click()
            page.get_by_text("Session ended (deleted).").wait_for(timeout=15_000)
            assert page.get_by_role("button", name="Start session").is_enabled()
            with urllib.request.urlopen(f"{server}/v1/sessions/{b['sessionId']}", timeout=10) as resp:
                assert json.loads(resp.read())["status"] == "ENDED"
        finally:
            browser.close()
