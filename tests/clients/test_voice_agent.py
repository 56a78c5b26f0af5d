"""`examples/voice_agent.py`, unmodified, as a real LiveKit Agents worker (`dev --no-reload`: registered with the
LiveKit server, jobs in processes of their own) with its stand-in TTS (espeak-ng), against a real
`characters serve --livekit-dev` (Ray, the scheduler, the trained tiny pipeline). Its unmodified
`livekit-plugins-runway` AvatarSession asks our Runway API for the character; a user participant (this test)
dispatches the agent into its room, watches and listens:

- the character joins and publishes video and the agent's speech, and its mouth follows that speech: the
  mouth signal of the received frames (`characters.train.lipsync`) correlates with the received audio's
  envelope at a small lag, far better than with the same audio 2.5 s away (a control from the same run);
- the video track's first frame is the character (its avatar image, the poster), not the rtc library's black
  keepalive frames: the agent speaks as soon as the track exists, so those would be on screen at its first
  word (and, in the measurement's window, a black frame's mouth signal is ~10x a speaking mouth's);
- the agent's `session.interrupt()` (its RPC `interrupt`, which answers when it called it) silences the
  character within one chunk of the agent's `lk.clear_buffer` reaching it, as heard here: from the agent's
  `session.interrupt()`, one chunk plus the one-way RPC delivery, half the round trip this test's own call to the
  agent took (LiveKit's delivery of the agent's RPC is not the character's to shorten: under the full suite on two
  cores a round trip took 188 ms, against 61-80 ms alone);
- when the user leaves, the agent's session closes and `AvatarSession.aclose()` sends END_CALL and removes
  the avatar at once: the session ends COMPLETED with reason `end_call`.

Also the plugin's other end: `DELETE /v1/realtime_sessions/{id}` (its fallback when the room is already gone)
ends the session CANCELLED and the character leaves. The avatar is a held-out identity of the lip-sync data,
made with the official Python SDK.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from livekit import api as lkapi
from livekit import rtc
from PIL import Image
from serve_helpers import ROOT, Served, wait_for

from characters.train.data import load_split, reference_image
from characters.train.lipsync import mouth_signal, offset_correlations

pytestmark = [pytest.mark.ray, pytest.mark.livekit, pytest.mark.slow]

CLIP = load_split(ROOT / "tests" / "unit" / "data" / "lipsync_heldout.npz")[1]
AVATAR_IDENTITY = "runway-avatar-agent"  # the plugin's
CHUNK_S = 4 / 24
FPS = 24
SPEECH_RMS, SILENT_RMS = 0.02, 0.005  # per 10 ms frame; the stand-in's speech is ~0.05-0.2, silence is zeros
RECORD_S = 8.0  # a line of the script and the pause after it
MIN_R, MIN_MARGIN = 0.3, 0.2  # lip sync: r at the best lag, and its lead over the 2.5 s-away control



def token(served: Served, room: str, identity: str) -> str:
    return (lkapi.AccessToken(served.livekit_key, served.livekit_secret).with_identity(identity)
            .with_grants(lkapi.VideoGrants(room_join=True, room=room)).to_jwt())


class Watcher:
    """The user: in the room, subscribed to the character; records RGB frames (with their RTP-derived timestamps)
    and audio (10 ms frames, contiguous), each with its arrival time on this process's clock.

    On a loaded machine this process's loop can stall, and what arrived meanwhile is then read late, in a burst:
    arrival times only ever gain delay. So each stream is put on its own media timeline (video: the frames'
    timestamps; audio: the count of samples) and anchored to the clock by its least-delayed item, which makes
    the two comparable whatever the stalls."""

    def __init__(self) -> None:
        self.room = rtc.Room()
        self.frames: list[tuple[float, float, np.ndarray]] = []  # (arrival, media time s, RGB)
        self.audio: list[tuple[float, float, np.ndarray]] = []  # (arrival, media time s of its end, float32 16 kHz)
        self.tasks: list[asyncio.Task[None]] = []
        self._samples = 0
        self.room.on("track_subscribed", self._on_track)

    def _on_track(self, track: rtc.Track, _: Any, participant: rtc.RemoteParticipant) -> None:
        if participant.identity != AVATAR_IDENTITY:
            return
        if track.kind == rtc.TrackKind.KIND_VIDEO:
            self.tasks.append(asyncio.create_task(self._video(rtc.VideoStream(track))))
        else:
            self.tasks.append(asyncio.create_task(self._audio(rtc.AudioStream(track, sample_rate=16000,
                                                                              num_channels=1))))

    async def _video(self, stream: rtc.VideoStream) -> None:
        async for ev in stream:
            rgb = ev.frame.convert(rtc.VideoBufferType.RGB24)
            self.frames.append((time.monotonic(), ev.timestamp_us / 1e6,
                                np.frombuffer(rgb.data, np.uint8).reshape(rgb.height, rgb.width, 3)))

    async def _audio(self, stream: rtc.AudioStream) -> None:
        async for ev in stream:
            pcm = np.frombuffer(ev.frame.data, np.int16).astype(np.float32) / 32768
            self._samples += pcm.size
            self.audio.append((time.monotonic(), self._samples / 16000, pcm))

    @staticmethod
    def clock(items: list[tuple[float, float, np.ndarray]]) -> np.ndarray:
        """Each item's time on this clock: its media time plus the smallest (arrival - media time) seen."""
        arrival, media = np.array([a for a, _, _ in items]), np.array([m for _, m, _ in items])
        return media + float(np.min(arrival - media))

    def rms_since(self, t0: float) -> list[tuple[float, float]]:
        """(arrival, RMS) of the audio frames that arrived at or after t0 (for waiting on what is heard)."""
        return [(t, float(np.sqrt(np.mean(a * a)))) for t, _, a in self.audio if t >= t0]

    def levels(self) -> list[tuple[float, float]]:
        """(clock time of its end, RMS) of every audio frame."""
        return [(t, float(np.sqrt(np.mean(a * a)))) for t, (_, _, a) in zip(self.clock(self.audio), self.audio,
                                                                            strict=True)]

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.room.disconnect()


async def line_onset(watcher: Watcher, deadline: float) -> float:
    """When the next line of the script starts: speech after at least 1 s of silence."""
    quiet_since = None
    seen = len(watcher.audio)
    while time.monotonic() < deadline:
        for t, _, a in watcher.audio[seen:]:
            level = float(np.sqrt(np.mean(a * a)))
            if level < SILENT_RMS:
                quiet_since = quiet_since or t
            elif level > SPEECH_RMS and quiet_since is not None and t - quiet_since >= 1.0:
                return t
            elif level > SILENT_RMS:
                quiet_since = None
        seen = len(watcher.audio)
        await asyncio.sleep(0.02)
    raise AssertionError("the stand-in did not start another line")


def lipsync(watcher: Watcher, t0: float, t1: float) -> tuple[float, int, float]:
    """r of the mouth signal with the audio envelope at the best lag (-8..8 frames), the lag, and the control:
    the best r against the envelope 2.5 s later. Both on a 24 Hz grid of the watcher's clock (see Watcher), from
    t0 or the first frame received, whichever is later (before it there is no frame to score)."""
    times = Watcher.clock(watcher.frames)
    grid = np.arange(max(t0, float(times.min())), t1, 1 / FPS)
    order = np.argsort(times)
    frames = np.stack([watcher.frames[i][2] for i in order])
    mouth = mouth_signal(frames, CLIP.identity, reference_image(CLIP.identity))
    video = mouth[np.searchsorted(times[order], grid, side="right") - 1]
    ends = Watcher.clock(watcher.audio)
    pcm = [a for _, _, a in watcher.audio]

    def envelope(shift_s: float) -> np.ndarray:
        out = np.full(grid.size, -60.0)
        for k, g in enumerate(grid + shift_s):
            seg = [pcm[i] for i in np.nonzero((ends > g - 1 / FPS) & (ends <= g))[0]]
            if seg:
                joined = np.concatenate(seg)
                out[k] = max(-60.0, 10 * np.log10(float(np.mean(joined * joined)) + 1e-12))
        return out

    near = offset_correlations(video, envelope(0.0), 8)
    lag = max(near, key=lambda d: near[d])
    control = offset_correlations(video, envelope(2.5), 8)
    return near[lag], lag, max(control.values())


def avatar_of_the_clip(served: Served) -> str:
    import runwayml

    buf = io.BytesIO()
    Image.fromarray(reference_image(CLIP.identity)).save(buf, "PNG")
    client = runwayml.RunwayML(base_url=served.url, api_key=served.keys["app"], max_retries=0)
    made = client.avatars.create(name="Held-out", personality="Reads the script.", voice={
        "type": "runway-live-preset", "preset_id": "max"},
        reference_image="data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    wait_for(lambda: client.avatars.retrieve(made.id).status == "READY", 20, "the avatar READY", 0.1)
    return made.id


def start_worker(served: Served, log: Path, agent_name: str, avatar_id: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "LIVEKIT_URL": served.livekit_url, "LIVEKIT_API_KEY": served.livekit_key,
           "LIVEKIT_API_SECRET": served.livekit_secret, "RUNWAYML_BASE_URL": served.url,
           "RUNWAYML_API_SECRET": served.keys["app"], "CHARACTER_AGENT_NAME": agent_name,
           "CHARACTER_AVATAR_ID": avatar_id, "CHARACTER_MAX_DURATION": "120", "LIVEKIT_LOG_LEVEL": "info"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "voice_agent.py"), "dev", "--no-reload"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def registered() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        return "registered worker" in log.read_text()

    wait_for(registered, 90, "the agent worker to register", 0.3)
    return proc


def stop_worker(proc: subprocess.Popen[bytes], log: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError("the agent worker did not stop on SIGINT: " + log.read_text()[-2000:]) from None


def test_the_example_agent_lip_syncs_is_interrupted_and_ends_with_end_call(served: Served, tmp_path: Path) -> None:
    avatar_id = avatar_of_the_clip(served)
    agent_name, room = f"character-agent-{secrets.token_hex(3)}", f"agent-room-{secrets.token_hex(3)}"
    log = tmp_path / "agent.log"
    worker = start_worker(served, log, agent_name, avatar_id)
    lk_http = served.livekit_url.replace("ws://", "http://")
    try:
        async def main() -> dict[str, Any]:
            watcher = Watcher()
            await watcher.room.connect(served.livekit_url, token(served, room, "user"))
            t_dispatch = time.monotonic()
            async with lkapi.LiveKitAPI(lk_http, served.livekit_key, served.livekit_secret) as lk:
                await lk.agent_dispatch.create_dispatch(lkapi.CreateAgentDispatchRequest(agent_name=agent_name,
                                                                                         room=room))
            deadline = time.monotonic() + 120
            while len(watcher.tasks) < 2 or not watcher.frames:
                assert time.monotonic() < deadline, "the character's tracks never arrived: " + log.read_text()[-3000:]
                await asyncio.sleep(0.1)
            t_joined = time.monotonic()
            while not any(r > SPEECH_RMS for _, r in watcher.rms_since(t_joined)):  # the stand-in starts a line
                assert time.monotonic() < deadline, "no speech was heard"
                await asyncio.sleep(0.05)
            t_speech = next(t for t, r in watcher.rms_since(t_joined) if r > SPEECH_RMS)
            await asyncio.sleep(max(0.0, t_speech + RECORD_S - time.monotonic()))
            r, lag, control = lipsync(watcher, t_speech - 0.5, t_speech + RECORD_S)
            session = served.session_of("app")
            # interrupt 1 s into a line (each lasts 5-8 s): after a pause of the script, speech starts again
            onset = await line_onset(watcher, deadline)
            await asyncio.sleep(max(0.0, onset + 1.0 - time.monotonic()))
            while not all(level > SPEECH_RMS for _, level in watcher.rms_since(time.monotonic() - 0.04)[-3:]):
                assert time.monotonic() < deadline, "no word to interrupt"
                await asyncio.sleep(0.005)  # mid-word: the last 30 ms heard are speech
            agent = next(p.identity for p in watcher.room.remote_participants.values()
                         if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT and p.identity != AVATAR_IDENTITY)
            t_call = time.monotonic()
            answer = json.loads(await watcher.room.local_participant.perform_rpc(
                destination_identity=agent, method="interrupt", payload=""))
            t_answered = time.monotonic()
            t_interrupt = answer["interruptedAt"] - (time.time() - time.monotonic())  # session.interrupt(), here
            await asyncio.sleep(1.5)
            levels = watcher.levels()  # on the clock, so a stall of this loop adds nothing
            loud_before = [t for t, level in levels if t_interrupt - 0.3 <= t < t_interrupt and level > SPEECH_RMS]
            loud_after = [t for t, level in levels if t_interrupt <= t < t_interrupt + 1.5 and level > SILENT_RMS]
            silent_from = (loud_after[-1] if loud_after else t_interrupt) - t_interrupt
            fps = sum(t_speech <= t < t_speech + RECORD_S for t, _, _ in watcher.frames) / RECORD_S
            black = sum(not frame.any() for _, _, frame in watcher.frames)
            await watcher.aclose()  # the user leaves: the agent's session closes, END_CALL, the avatar removed
            return {"session": session, "r": r, "lag": lag, "control": control, "answer": answer, "fps": fps,
                    "black": black, "first_frame_s": float(Watcher.clock(watcher.frames).min()) - t_speech,
                    "speaking": len(loud_before),
                    "silent_after_s": silent_from, "rpc_s": t_answered - t_call,
                    "joined_s": t_joined - t_dispatch}

        got = asyncio.run(main())
        sid = got["session"]["id"]
        ended = wait_for(lambda: (s := served.request("GET", f"/v1/sessions/{sid}")[1])["status"] == "ENDED" and s, 30,
                         "the session to end after the user left")
        status, runway_view = served.request("GET", f"/v1/realtime_sessions/{sid}")
    finally:
        stop_worker(worker, log)
    stats = ended["stats"]
    print(f"voice agent: the session generated {stats['frames']} frames in {stats['chunks']} chunks, "
          f"{stats['lateChunks']} late; generated {stats['fps']:.2f} fps over its last seconds, presented "
          f"{stats['presentedFps']:.2f}")
    print(f"voice agent: character joined {got['joined_s']:.1f} s after dispatch, its first frame "
          f"{-got['first_frame_s']:.2f} s before its first speech ({got['black']} black frames); "
          f"{got['fps']:.1f} fps; lip sync "
          f"r {got['r']:.3f} at lag {got['lag']} frames (control {got['control']:.3f}); interrupt RPC "
          f"{got['rpc_s'] * 1000:.0f} ms, silent {got['silent_after_s'] * 1000:.0f} ms after session.interrupt()")
    assert got["session"]["status"] == "RUNNING" and set(got["answer"]) == {"interruptedAt"}
    assert got["black"] == 0, got  # the poster is the track's first frame
    assert got["r"] >= MIN_R and got["r"] - got["control"] >= MIN_MARGIN, got
    assert -3 <= got["lag"] <= 8, got  # the mouth moves with the speech, not before it
    assert got["speaking"] >= 3, got  # it was speaking in the 300 ms before the call (10 ms frames)
    assert got["silent_after_s"] <= CHUNK_S + got["rpc_s"] / 2, got  # a chunk after the clear reached it
    assert "(interrupted)" in log.read_text(), "the agent's speech handle was not interrupted"
    assert ended["reason"] == "end_call", ended
    assert status == 200 and runway_view["status"] == "COMPLETED" and runway_view["duration"] > 0, runway_view
    # generated frames, not presented ones (a late chunk's held repeats count in presentedFps only): the session kept
    # its clock beside the agent, the watcher and the rest of the suite's processes on the same cores. Alone: 0 late
    # of 84-85 chunks in each of three runs; the acceptance (0 in 60 s, >= 23.5 fps at the viewer) is the
    # README flow's (benchmarks/cpu/voice_agent_flow.json). Two allowed here, under the suite's load; at issue 18's
    # start 135-175 of 205-230 chunks were late.
    assert stats["chunks"] >= 60 and stats["lateChunks"] <= 2, stats


def test_the_plugins_delete_fallback_cancels_and_the_character_leaves(served: Served) -> None:
    """What livekit-plugins-runway sends when the room is already gone: DELETE /v1/realtime_sessions/{id}."""
    room = f"delete-room-{secrets.token_hex(3)}"
    avatar_token = (lkapi.AccessToken(served.livekit_key, served.livekit_secret).with_kind("agent")
                    .with_identity(AVATAR_IDENTITY).with_grants(lkapi.VideoGrants(room_join=True, room=room))
                    .with_attributes({"lk.publish_on_behalf": "agent"}).to_jwt())
    body = {"model": "gwm1_avatars", "avatar": {"type": "runway-preset", "presetId": "sample-face"},
            "livekit": {"url": served.livekit_url, "token": avatar_token, "roomName": room, "agentIdentity": "agent"}}

    async def main() -> tuple[float, list[str]]:
        watcher = Watcher()
        await watcher.room.connect(served.livekit_url, token(served, room, "agent"))
        status, created = served.request("POST", "/v1/realtime_sessions", body,
                                         headers={"X-Runway-Version": "2024-11-06"})
        assert status == 200 and set(created) == {"id"}, created
        deadline = time.monotonic() + 90
        while AVATAR_IDENTITY not in watcher.room.remote_participants or not watcher.frames:
            assert time.monotonic() < deadline, "the character never joined"
            await asyncio.sleep(0.1)
        t0 = time.monotonic()
        assert served.request("DELETE", f"/v1/realtime_sessions/{created['id']}")[0] == 204
        while AVATAR_IDENTITY in watcher.room.remote_participants:
            assert time.monotonic() < t0 + 10, "the character did not leave after DELETE"
            await asyncio.sleep(0.05)
        left = time.monotonic() - t0
        await watcher.aclose()
        return left, [created["id"]]

    left, (sid,) = asyncio.run(main())
    assert served.request("GET", f"/v1/realtime_sessions/{sid}")[1]["status"] == "CANCELLED"
    assert served.request("GET", f"/v1/sessions/{sid}")[1]["reason"] == "deleted"
    print(f"plugin DELETE: the character left {left:.2f} s after it")
