"""Benchmark: agent speech -> the first published frame made from it, through a real LiveKit server.

    python scripts/benchmarks/bench_latency.py                                   # the tiny model in-process (CPU)
    python scripts/benchmarks/bench_latency.py --generator synthetic --depth 2   # a stand-in with the pipeline's delay
    python scripts/benchmarks/bench_latency.py --utterances 12 --out benchmarks/cpu/latency_synthetic.json

Setup, all on loopback: a `livekit-server --dev` (scripts/setup/install_livekit.sh), the character's room
(`LiveKitSink`, the path `RoomWorker` uses: its own loop thread), a chunk loop thread that takes chunk
k's audio from the session queue at t0 + k * 166.7 ms and produces its frames, an agent participant
speaking through LiveKit Agents' `DataStreamAudioOutput` (the real avatar protocol: `lk.audio_stream`,
`lk.playback_started`, `lk.playback_finished`) and a viewer counting what it receives.

Generators: `tiny` runs `characters.engine.CharacterEngine` (the tiny preset, random weights) in the
chunk loop, one chunk at a time (no DiT/decoder overlap in one process); `synthetic` makes frames at
once and delivers them `--depth` chunks later, the Ray pipeline's chunks in flight.

Measured per utterance (p50/p95): `speech_to_frame_s`, room side: agent audio handed to the session
-> the first video frame whose audio window holds its first sample is published (`SegmentEvent.
latency_s`); `agent_to_started_s`, agent side: first audio frame captured -> `lk.playback_started`
received. Also delivered fps (publisher and viewer), the publisher's measured A/V offset (sampled every
0.5 s), late chunks, and the chunk compute time. Compared with the 0.49 s video share of a 2.13 s
median conversational turn (DESIGN.md section 1). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from livekit import api, rtc
from livekit.agents.utils.audio import AudioByteStream
from livekit.agents.voice.avatar import DataStreamAudioOutput

from characters.audio import SAMPLE_AUDIO, chunk_sample_range, convert_pcm, load_audio, pcm16_to_float
from characters.cpu import cpu_model
from characters.pacing import SegmentEvent, to_int16
from deployments.livekit import LiveKitOutput, LiveKitServer, LiveKitSink, MediaFormat, install_server
from deployments.sessions.runner import AudioBuffer
from deployments.settings import ServiceConfig
from scripts.benchmarks import results

ROOT = Path(__file__).resolve().parents[2]
VIDEO_SHARE_S = 0.49  # DESIGN.md section 1: the video pipeline's share of a 2.13 s median turn
SR, FPS, F = 16000, 24, 4
CHUNK_S = F / FPS
AVATAR, AGENT, ROOM = "character", "agent", "bench"
TTS_FRAME_MS = 200  # livekit.agents.tts.AudioEmitter's default frame_size_ms


class SessionQueue:
    """The session's side of the room's agent-audio callbacks, over the session's own `AudioBuffer`."""

    def __init__(self) -> None:
        self.buffer = AudioBuffer(F, SR, FPS)

    def push_audio(self, pcm16: bytes, sample_rate: int, channels: int) -> None:
        self.buffer.push(convert_pcm(pcm16_to_float(pcm16), sample_rate, channels))

    def clear_audio(self) -> int:
        return self.buffer.clear()

    def end_session(self, reason: str) -> None:
        pass

    def take(self, k: int) -> np.ndarray:
        return self.buffer.take(k)


def synthetic_frames(k: int, pcm: np.ndarray, h: int, w: int) -> np.ndarray:
    frames = np.full((F, h, w, 3), 40, np.uint8)
    level = int(min(1.0, float(np.abs(pcm).mean()) * 8) * 200)
    for i in range(F):
        x = (k * F + i) % w
        frames[i, :, x:x + 4] = 255
        frames[i, h // 2:, :, 0] = 40 + level
    return frames


class ChunkLoop(threading.Thread):
    """Chunk k's audio is taken at t0 + k * T; its frames go to the sink when made (tiny) or `depth`
    chunks later (synthetic)."""

    def __init__(self, sink: LiveKitSink, queue: SessionQueue, generator: str, depth: int) -> None:
        super().__init__(name="chunk-loop", daemon=True)
        self.sink, self.queue, self.generator, self.depth = sink, queue, generator, depth
        self.stop_event = threading.Event()
        self.step_s: list[float] = []
        self.engine: Any = None
        self.ready = threading.Event()

    def run(self) -> None:
        h, w = self.sink.media.height, self.sink.media.width
        if self.generator == "tiny":
            import torch

            from characters.config import session_config
            from characters.engine import CharacterEngine
            from characters.media import load_image

            torch.set_num_threads(1)
            self.engine = CharacterEngine(session_config("tiny"))
            self.engine.start(load_image(SAMPLE_AUDIO.parent / "sample_face.png", h, w))
            for k in range(2):  # warm up, then start over
                s0, s1 = chunk_sample_range(k, F)
                self.engine.step(np.zeros(s1 - s0, np.float32))
            self.engine.start(load_image(SAMPLE_AUDIO.parent / "sample_face.png", h, w))
        self.ready.set()
        inflight: deque[tuple[np.ndarray, np.ndarray]] = deque()
        t0 = time.monotonic()
        k = 0
        while not self.stop_event.wait(max(0.0, t0 + k * CHUNK_S - time.monotonic())):
            pcm = self.queue.take(k)
            t = time.perf_counter()
            if self.engine is not None:
                self.sink.write(self.engine.step(pcm), pcm)
            else:
                inflight.append((synthetic_frames(k, pcm, h, w), pcm))
                if len(inflight) > self.depth:
                    self.sink.write(*inflight.popleft())
            self.step_s.append(time.perf_counter() - t)
            k += 1


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


async def run(server: LiveKitServer, args: argparse.Namespace) -> dict[str, Any]:
    events: list[tuple[float, SegmentEvent]] = []
    queue = SessionQueue()
    out = LiveKitOutput(url=server.url, room_name=ROOM, api_key=server.api_key, api_secret=server.api_secret,
                        identity=AVATAR, agent_identity=AGENT)
    sink = LiveKitSink(out, MediaFormat(272, 176), queue, on_playback=lambda e: events.append((time.monotonic(), e)))
    await asyncio.to_thread(sink.start)
    loop_thread = ChunkLoop(sink, queue, args.generator, args.depth)
    loop_thread.start()
    await asyncio.to_thread(loop_thread.ready.wait)

    def tok(identity: str, kind: Any = None) -> str:
        t = (api.AccessToken(server.api_key, server.api_secret).with_identity(identity)
             .with_grants(api.VideoGrants(room_join=True, room=ROOM)))
        return (t.with_kind(kind) if kind else t).to_jwt()

    agent, viewer = rtc.Room(), rtc.Room()
    frames_seen: list[float] = []
    streams: list[rtc.VideoStream] = []
    tasks: list[asyncio.Task[None]] = []

    async def count(stream: rtc.VideoStream) -> None:
        async for _ in stream:
            frames_seen.append(time.monotonic())

    def on_track(track: rtc.Track, *_: Any) -> None:
        if track.kind == rtc.TrackKind.KIND_VIDEO:
            streams.append(rtc.VideoStream(track))
            tasks.append(asyncio.create_task(count(streams[-1])))

    viewer.on("track_subscribed", on_track)
    await viewer.connect(server.url, tok("viewer"))
    await agent.connect(server.url, tok(AGENT, "agent"))
    output = DataStreamAudioOutput(agent, destination_identity=AVATAR, sample_rate=SR,
                                   wait_remote_track=rtc.TrackKind.KIND_VIDEO, wait_playback_start=True)
    started_at: list[float] = []
    output.on("playback_started", lambda ev: started_at.append(time.monotonic()))
    speech = to_int16(load_audio(SAMPLE_AUDIO))
    voiced = np.flatnonzero(np.abs(speech) > 500)
    offsets: list[float] = []
    t_run = time.monotonic()

    async def sample_offsets() -> None:
        while True:
            await asyncio.sleep(0.5)
            stats = await asyncio.to_thread(sink.stats)
            if stats is not None and stats.playout.started:
                offsets.append(stats.playout.av_offset_ms)

    tasks.append(asyncio.create_task(sample_offsets()))
    agent_latency: list[float] = []
    await asyncio.sleep(1.0)
    rng = random.Random(args.seed)
    for i in range(args.utterances):
        start = int(voiced[(i * 7919) % voiced.size])  # begin on a voiced sample: the first frame shows speech
        utter = speech[start:start + int(args.utterance_s * SR)]
        n_started = len(started_at)
        t_send = time.monotonic()
        for j in range(0, utter.size, 320):
            piece = utter[j:j + 320]
            await output.capture_frame(rtc.AudioFrame(piece.tobytes(), SR, 1, piece.size))
        output.flush()
        await asyncio.wait_for(output.wait_for_playout(), 30)
        if len(started_at) > n_started:
            agent_latency.append(started_at[n_started] - t_send)
        await asyncio.sleep(pause_s(args, rng))
    t_end = time.monotonic()
    stats = sink.stats()
    for s in streams:
        await s.aclose()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await agent.disconnect()
    await viewer.disconnect()
    loop_thread.stop_event.set()
    await asyncio.to_thread(loop_thread.join, 10)
    await asyncio.to_thread(sink.close)

    room_latency = [e.latency_s for _, e in events if e.kind == "started" and e.latency_s is not None]
    viewer_fps = sum(t_run + 1 <= t < t_end for t in frames_seen) / (t_end - t_run - 1)
    abs_off = [abs(o) for o in offsets]
    p = stats.playout if stats is not None else None
    return {
        "generator": args.generator,
        "depth": args.depth if args.generator == "synthetic" else None,
        "utterances": args.utterances,
        "speech_to_frame_s": {"p50": pct(room_latency, 50), "p95": pct(room_latency, 95), "n": len(room_latency),
                              "all": [round(x, 4) for x in room_latency]},
        "agent_to_started_s": {"p50": pct(agent_latency, 50), "p95": pct(agent_latency, 95), "n": len(agent_latency)},
        "video_share_s": VIDEO_SHARE_S,
        "p50_over_video_share": (pct(room_latency, 50) or 0.0) / VIDEO_SHARE_S,
        "fps_publisher": p.fps if p else None,
        "fresh_fps_publisher": p.fresh_fps if p else None,  # new frames (held frames excluded), last 2 s
        "stall_s": p.stall_s if p else None,
        "fps_viewer": viewer_fps,
        "av_offset_ms": {"mean_abs": float(np.mean(abs_off)) if abs_off else None, "p95_abs": pct(abs_off, 95),
                         "max_abs": max(abs_off, default=None)},
        "late_chunks": p.late_chunks if p else None,
        "buffered_s_at_end": p.buffered_s if p else None,
        "dropped_idle_chunks": p.dropped_idle_chunks if p else None,
        "underruns": p.underruns if p else None,
        "slips": p.slips if p else None,
        "chunk_compute_ms": {"p50": (pct(loop_thread.step_s, 50) or 0) * 1e3,
                             "p95": (pct(loop_thread.step_s, 95) or 0) * 1e3},
        "duration_s": t_end - t_run,
    }


# ------------------------------------------------------------------------------------------ the Ray pipeline

SCRIPT = ["Hello there, it is good to see you.", "I can answer that in a moment.", "Let me think about it.",
          "The weather today is bright and clear.", "Yes, that is exactly right.", "Thank you for asking."]


def espeak(text: str) -> np.ndarray:
    """The stand-in TTS: espeak-ng's speech for `text`, as int16 mono 16 kHz (what a TTS plugin hands the agent)."""
    import subprocess

    wav = subprocess.run(["espeak-ng", "-s", "170", "--stdout", text], capture_output=True, check=True, timeout=30)
    import io
    import wave

    with wave.open(io.BytesIO(wav.stdout)) as w:
        pcm, rate = np.frombuffer(w.readframes(w.getnframes()), np.int16), w.getframerate()
    return to_int16(convert_pcm(pcm16_to_float(pcm.tobytes()), rate, 1))


def agent_frames(pcm: np.ndarray, shape: str) -> list[rtc.AudioFrame]:
    """An utterance as the agent hands it to its audio output. `tts`: as a LiveKit Agents TTS emits it
    (`tts.AudioEmitter`: `utils.audio.AudioByteStream`, progressive, 200 ms frames: 20, 40, 80, 160, then
    200 ms each, the last one shorter); a number: fixed frames of that many ms."""
    if shape == "tts":
        stream = AudioByteStream(SR, 1, samples_per_channel=SR // 1000 * TTS_FRAME_MS, progressive=True)
        return [*stream.push(pcm.tobytes()), *stream.flush()]
    n = SR * int(shape) // 1000
    return [rtc.AudioFrame(pcm[j:j + n].tobytes(), SR, 1, pcm[j:j + n].size) for j in range(0, pcm.size, n)]


def kv(detail: str | None) -> dict[str, str]:
    return dict(part.split("=", 1) for part in (detail or "").split() if "=" in part)


def local_motion(luma: np.ndarray, prev: np.ndarray, tile: int = 16) -> float:
    """The largest mean |change| of luma over tiles of tile x tile pixels between two frames: a mouth that
    starts to move changes a few tiles a lot, which a mean over the whole frame would drown."""
    h, w = (luma.shape[0] // tile) * tile, (luma.shape[1] // tile) * tile
    d = np.abs(luma[:h, :w] - prev[:h, :w]).reshape(h // tile, tile, w // tile, tile)
    return float(d.mean(axis=(1, 3)).max())


def av_lag(video_t: list[float], motion: list[float], audio_t: list[float], rms: list[float], heard: float,
           span_s: float = 1.5, max_lag: int = 6) -> float | None:
    """How far the viewer's video lags its audio over one utterance heard from `heard` on: the lag (in frames,
    -max_lag..max_lag, as seconds) at which the frames' motion best correlates with the audio level at the
    same frame times. The mouth moves with the speech, so in sync this peaks at 0 or +1 frame (the model's
    own lead, `benchmarks/cpu/lipsync_tiny.json`); a video behind its audio peaks later."""
    vt, vm = np.asarray(video_t), np.asarray(motion)
    keep = (vt >= heard - 0.3) & (vt < heard + span_s)
    if keep.sum() < 2 * max_lag + 8 or not audio_t:
        return None
    level = np.interp(vt[keep], np.asarray(audio_t), np.asarray(rms))  # the audio level at each frame's time
    m = vm[keep]
    best, best_r = None, -np.inf
    for d in range(-max_lag, max_lag + 1):
        a, b = (level[: len(level) - d], m[d:]) if d >= 0 else (level[-d:], m[: len(m) + d])
        if a.std() == 0 or b.std() == 0:
            continue
        r = float(np.corrcoef(a, b)[0, 1])
        if r > best_r:
            best, best_r = d, r
    return None if best is None else best / FPS


def onset(times: list[float], values: list[float], after: float, threshold: float) -> float | None:
    """The first time at or after `after` whose value exceeds `threshold`."""
    return next((t for t, v in zip(times, values, strict=True) if t >= after and v > threshold), None)


def heard_sample0(times: list[float], frames: list[np.ndarray], utterance: np.ndarray, near: float,
                  template_s: float = 0.15, before_s: float = 0.3, after_s: float = 0.5,
                  min_match: float = 0.6) -> tuple[float, float] | None:
    """When the viewer received the utterance's sample 0: the received audio (int16 frames, each stamped
    with its arrival time; sample j of a frame at its stamp + j / SR) is matched against the utterance's first
    `template_s` by normalised cross-correlation, from `before_s` before `near` (where its level first rose) to
    `after_s` after it. A level threshold alone fires on the first loud frame: up to 100 ms into an espeak-ng
    utterance that starts quietly (that much had already played), or on a 20 ms click of the codec before the
    speech (measured: 180 ms early once). Returns (time, match in [0, 1]), or None when nothing matches
    `min_match`."""
    pick = [i for i, t in enumerate(times) if near - before_s <= t <= near + after_s + template_s]
    tpl = utterance[: int(template_s * SR)].astype(np.float64)
    if not pick or not np.any(tpl):
        return None
    r = np.concatenate([frames[i] for i in pick]).astype(np.float64)
    at = np.concatenate([times[i] + np.arange(frames[i].size) / SR for i in pick])
    if r.size < tpl.size:
        return None
    dot = np.correlate(r, tpl, mode="valid")
    energy = np.convolve(r * r, np.ones(tpl.size), mode="valid")
    ncc = dot / np.sqrt(np.maximum(energy, 1e-12) * float(tpl @ tpl))
    best = int(np.argmax(ncc))
    return (float(at[best]), float(ncc[best])) if ncc[best] >= min_match else None


async def run_ray(server: LiveKitServer, args: argparse.Namespace, base: str, scheduler: Any) -> dict[str, Any]:
    """One session of the real pipeline (Serve ingress, scheduler, warm slot, compiled graph, room worker) in
    a room on `server`; an agent speaking espeak-ng utterances through DataStreamAudioOutput; a plain viewer."""
    import urllib.request

    from characters.media import SAMPLE_IMAGE

    room_name = "bench-ray"
    body = {"avatar": {"image": __import__("base64").b64encode(SAMPLE_IMAGE.read_bytes()).decode()},
            "maxDuration": 600, "output": {"kind": "livekit", "url": server.url, "roomName": room_name,
                                           "apiKey": server.api_key, "apiSecret": server.api_secret,
                                           "identity": AVATAR, "agentIdentity": AGENT}}

    def post() -> dict[str, Any]:
        req = urllib.request.Request(f"{base}/v1/sessions", data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return dict(json.loads(resp.read()))

    def get(path: str, method: str = "GET") -> dict[str, Any]:
        with urllib.request.urlopen(urllib.request.Request(f"{base}{path}", method=method), timeout=60) as resp:
            return dict(json.loads(resp.read()))

    def tok(identity: str, kind: Any = None) -> str:
        t = (api.AccessToken(server.api_key, server.api_secret).with_identity(identity)
             .with_grants(api.VideoGrants(room_join=True, room=room_name)))
        return (t.with_kind(kind) if kind else t).to_jwt()

    agent, viewer = rtc.Room(), rtc.Room()
    audio_t: list[float] = []
    audio_rms: list[float] = []
    audio_pcm: list[np.ndarray] = []  # what the viewer received, frame by frame (int16, SR)
    video_t: list[float] = []
    video_motion: list[float] = []
    streams: list[Any] = []
    tasks: list[asyncio.Task[None]] = []

    async def watch_video(stream: rtc.VideoStream) -> None:
        prev: np.ndarray | None = None
        async for ev in stream:
            f = ev.frame
            luma = np.frombuffer(f.data, np.uint8)[: f.width * f.height].astype(np.int16).reshape(f.height, f.width)
            video_t.append(time.monotonic())
            video_motion.append(0.0 if prev is None or prev.shape != luma.shape else local_motion(luma, prev))
            prev = luma

    async def watch_audio(stream: rtc.AudioStream) -> None:
        async for ev in stream:
            pcm = np.frombuffer(ev.frame.data, np.int16).copy()
            a = pcm.astype(np.float64) / 32768
            audio_t.append(time.monotonic())
            audio_rms.append(float(np.sqrt(np.mean(a * a))) if a.size else 0.0)
            audio_pcm.append(pcm)

    def on_track(track: rtc.Track, *_: Any) -> None:
        if track.kind == rtc.TrackKind.KIND_VIDEO:
            streams.append(rtc.VideoStream(track))
            tasks.append(asyncio.create_task(watch_video(streams[-1])))
        else:
            streams.append(rtc.AudioStream(track, sample_rate=SR, num_channels=1))
            tasks.append(asyncio.create_task(watch_audio(streams[-1])))

    viewer.on("track_subscribed", on_track)
    await agent.connect(server.url, tok(AGENT, "agent"))
    await viewer.connect(server.url, tok("viewer"))
    t_req = time.monotonic()  # the request (POST /v1/sessions) leaves
    created = await asyncio.to_thread(post)
    sid = created["id"]
    output = DataStreamAudioOutput(agent, destination_identity=AVATAR, sample_rate=SR,
                                   wait_remote_track=rtc.TrackKind.KIND_VIDEO, wait_playback_start=True)
    utterances = [espeak(SCRIPT[i % len(SCRIPT)]) for i in range(args.utterances)]  # made ahead: TTS is not timed
    while len(video_t) < 24:  # the character is in the room, its video reaches the viewer
        await asyncio.sleep(0.1)
    t_joined = time.monotonic() - t_req
    first_frame = video_t[0] - t_req  # the character's first frame at the viewer
    await asyncio.sleep(2.0)  # idle video, for the motion baseline
    t_run = time.monotonic()
    cpu_before = await asyncio.to_thread(cpu_times_by_process)
    first_sample: list[float] = []
    rng = random.Random(args.seed)
    for pcm in utterances:
        first_sample.append(time.monotonic())  # the first sample is pushed now
        for frame in agent_frames(pcm, args.agent_frames):  # as fast as the output takes them, as a TTS does
            await output.capture_frame(frame)
        output.flush()
        await asyncio.wait_for(output.wait_for_playout(), 60)
        await asyncio.sleep(pause_s(args, rng))
    t_end = time.monotonic()
    cpu_use = cpu_share(cpu_before, await asyncio.to_thread(cpu_times_by_process), t_end - t_run, os.getpid())
    info = await asyncio.to_thread(get, f"/v1/sessions/{sid}")
    events: list[Any] = []
    seq = 0
    while batch := await scheduler.events.remote(sid, seq, 0.5):
        events += batch
        seq = batch[-1].seq
    await asyncio.to_thread(get, f"/v1/sessions/{sid}", "DELETE")
    for s in streams:
        await s.aclose()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await agent.disconnect()
    await viewer.disconnect()

    if args.dump is not None:  # what the viewer received and what the agent said, to check `heard_sample0` by hand
        np.savez_compressed(args.dump, audio_t=np.array(audio_t), audio_sizes=np.array([a.size for a in audio_pcm]),
                            audio=np.concatenate(audio_pcm) if audio_pcm else np.zeros(0, np.int16),
                            first_sample=np.array(first_sample), utterance_sizes=np.array([u.size for u in utterances]),
                            utterances=np.concatenate(utterances))
    chunks = {e.chunk: kv(e.detail) for e in events if e.kind == "chunk"}
    starts = [kv(e.detail) for e in events if e.kind == "playback_started"]
    rows = []
    for i, t_first in enumerate(first_sample):
        if i >= len(starts) or "shown_at" not in starts[i]:
            continue
        st = starts[i]
        shown_at, latency = float(st["shown_at"]), float(st["latency_ms"]) / 1e3
        level = onset(audio_t, audio_rms, t_first, 0.01)  # the first loud frame: up to 100 ms into the utterance
        match = None if level is None else heard_sample0(audio_t, audio_pcm, utterances[i], level)
        heard = match[0] if match is not None else None
        lag = av_lag(video_t, video_motion, audio_t, audio_rms, level) if level is not None else None
        ch = chunks.get(int(st["chunk"]), {})
        compute = (float(ch.get("dit_ms", 0)) + float(ch.get("decode_ms", 0))) / 1e3
        in_transit = float(st["compute_ms"]) / 1e3
        rows.append({
            "total_s": None if heard is None else heard - t_first,
            "total_level_s": None if level is None else level - t_first,  # the level threshold's (before this)
            "match": None if match is None else round(match[1], 3),  # the cross-correlation at `heard`
            "agent_to_room_s": shown_at - latency - t_first,
            "boundary_s": float(st["boundary_ms"]) / 1e3,
            "compute_s": compute,
            "dit_s": float(ch.get("dit_ms", 0)) / 1e3, "decode_s": float(ch.get("decode_ms", 0)) / 1e3,
            "in_flight_s": in_transit - compute,
            "buffer_s": float(st["buffer_ms"]) / 1e3,
            "network_s": None if heard is None else heard - shown_at,
            "video_minus_audio_s": lag,
            "chunk": int(st["chunk"]),
            "first_sample_at": t_first,  # time.monotonic() of this host
            "onset_cut_s": float(ch.get("cut_ms", 0)) / 1e3,  # idle content the room cut ahead of it (0: no onset)
        })
    stats = info["stats"]

    def summary(key: str) -> dict[str, float | None]:
        xs = [r[key] for r in rows if r[key] is not None]
        return {"p50": pct(xs, 50), "p95": pct(xs, 95), "n": len(xs)}

    keys = ("total_s", "total_level_s", "agent_to_room_s", "boundary_s", "compute_s", "in_flight_s", "buffer_s",
            "network_s", "video_minus_audio_s")
    run_s = t_end - t_run
    return {
        "generator": "ray", "utterances": args.utterances, "split": {k: summary(k) for k in keys}, "rows": rows,
        "late_chunk_indices": sorted(k for k, ch in chunks.items() if ch.get("late") == "1"),
        # the room's audio source found empty before a push (the SDK's estimate of its queue): a gap the viewer heard
        "audio_dry": max((int(ch.get("audio_dry", 0)) for ch in chunks.values()), default=0),
        "joined_after_request_s": t_joined,  # a second of its video (24 frames) had reached the viewer
        "first_frame_after_request_s": first_frame,
        "viewer_fps": sum(t_run <= t < t_end for t in video_t) / run_s,
        "generated_fps": stats["fps"], "presented_fps": stats["presentedFps"], "late_chunks": stats["lateChunks"],
        "chunks": stats["chunks"], "stage_ms": stats["stageMs"], "speech_ms_p50": stats["speechMsP50"],
        "video_share_s": VIDEO_SHARE_S, "duration_s": run_s, "cores_used": cpu_use,
        "jitter_buffer_chunks": args.jitter_buffer, "pipeline_depth": args.depth, "graph": args.graph,
        "jitter_min_slack_ms": None if args.min_slack_ms < 0 else args.min_slack_ms,
        "run_ahead_chunks": args.run_ahead, "onset_slack_ms": None if args.onset_slack_ms < 0 else args.onset_slack_ms,
        "audio_lead_ms": args.audio_lead_ms, "onset_first_frame": args.onset_first_frame,
        "preempt_idle": args.preempt_idle == "on", "pause_s": args.pause_s, "pause_jitter_s": args.pause_jitter_s,
        # idle chunks the DiT gave up for the onset after them (`ServiceConfig.preempt_idle`; none went out)
        "given_up_chunks": sorted(k for k, ch in chunks.items() if ch.get("given_up") == "1"),
        "agent_frames": args.agent_frames,
    }


def pause_s(args: argparse.Namespace, rng: random.Random) -> float:
    """The pause after a playout ends: `--pause-s` plus up to `--pause-jitter-s` (a playout ends on a chunk boundary;
    a real agent's next turn does not wait for one)."""
    return float(args.pause_s + rng.uniform(0.0, args.pause_jitter_s))


def cpu_times_by_process() -> dict[int, tuple[str, float]]:
    """Every process's name and CPU seconds (user + system) so far, read from /proc. Ray workers are named
    by their proctitle (`ray::ClassName...`), the rest by their executable."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            t = proc.cpu_times()
            cmd = proc.info["cmdline"] or []
            ray_worker = bool(cmd) and cmd[0].startswith("ray::")  # e.g. "ray::DiTWorker.step()": the class
            name = cmd[0].split(" ")[0].split(".")[0].split("(")[0] if ray_worker else proc.info["name"] or "?"
            out[proc.pid] = (name, t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def cpu_share(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float,
              driver_pid: int) -> dict[str, float]:
    """Cores used over `seconds` per process name, largest first; this process (the agent and the viewer)
    is `bench (agent + viewer)`. Processes that started in between count from 0."""
    use: dict[str, float] = {}
    for pid, (name, t) in after.items():
        dt = t - before.get(pid, (name, 0.0))[1]
        label = "bench (agent + viewer)" if pid == driver_pid else name
        use[label] = use.get(label, 0.0) + dt / seconds
    return dict(sorted(((k, round(v, 3)) for k, v in use.items() if v >= 0.005), key=lambda kv: -kv[1]))


def main_ray(args: argparse.Namespace) -> dict[str, Any]:
    import socket

    from ray import serve

    from deployments.api.app import APP_NAME, build_app, connect_scheduler
    from deployments.sessions.cluster import init_local, stop_local

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    service_args = {"warm_slots": 1, "pipeline_depth": args.depth, "jitter_buffer_chunks": args.jitter_buffer,
                    "jitter_min_slack_ms": None if args.min_slack_ms < 0 else args.min_slack_ms,
                    "run_ahead_chunks": args.run_ahead,
                    "onset_slack_ms": None if args.onset_slack_ms < 0 else args.onset_slack_ms,
                    "audio_lead_ms": args.audio_lead_ms, "onset_first_frame": args.onset_first_frame,
                    "preempt_idle": args.preempt_idle == "on"}
    if args.graph:
        service_args["graph"] = args.graph
    with tempfile.TemporaryDirectory() as tmp, LiveKitServer(install_server(), Path(tmp)) as server:
        init_local()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app({"service": service_args}), name=APP_NAME, route_prefix="/")
            scheduler = connect_scheduler(ServiceConfig.from_env(**service_args))
            import ray

            deadline = time.monotonic() + 300
            while ray.get(scheduler.capacity.remote()).warm_slots_free < 1 and time.monotonic() < deadline:
                time.sleep(0.5)
            return asyncio.run(run_ray(server, args, f"http://127.0.0.1:{port}", scheduler))
        finally:
            serve.shutdown()
            stop_local()


def print_ray(result: dict[str, Any]) -> None:
    sp = result["split"]
    print(f"ray pipeline: {result['utterances']} utterances over {result['duration_s']:.1f} s; the character's first "
          f"frame reached the viewer {result['first_frame_after_request_s']:.2f} s after the request")
    print(f"{'agent speech -> the viewer (s)':<44}{'p50':>9}{'p95':>9}")
    names = {"total_s": "first sample -> heard at the viewer",
             "total_level_s": "  (its first loud 10 ms frame heard)", "agent_to_room_s": "  agent -> the room worker",
             "boundary_s": "  wait for the next chunk boundary", "compute_s": "  compute (DiT + decode)",
             "in_flight_s": "  in flight (queued behind chunks, transfer)", "buffer_s": "  jitter buffer",
             "network_s": "  publish -> viewer (audio queue, WebRTC)",
             "video_minus_audio_s": "video behind audio at the viewer (motion x level)"}
    for k, name in names.items():
        p50, p95 = (float("nan") if sp[k][q] is None else sp[k][q] for q in ("p50", "p95"))
        print(f"{name:<44}{p50:>9.3f}{p95:>9.3f}")
    print(f"viewer {result['viewer_fps']:.2f} fps; server generated {result['generated_fps']:.2f} fps, presented "
          f"{result['presented_fps']:.2f}; late chunks {result['late_chunks']} of {result['chunks']}; the audio "
          f"source ran dry {result['audio_dry']} times" + (f"; idle chunks given up for an onset: "
                                                           f"{len(result['given_up_chunks'])}"
                                                           if "given_up_chunks" in result else ""))
    print("cores used over the run: " + ", ".join(f"{k} {v:.2f}" for k, v in result["cores_used"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generator", choices=["ray", "tiny", "synthetic"], default="ray",
                    help="ray: the real pipeline (Serve, scheduler, warm slot, compiled graph, room worker); tiny / "
                         "synthetic: an in-process chunk loop")
    ap.add_argument("--jitter-buffer", type=float, default=1.0, help="ray: the output's jitter buffer, chunks")
    ap.add_argument("--min-slack-ms", type=float, default=ServiceConfig().jitter_min_slack_ms,
                    help="ray: idle chunks trimmed down to this slack (ServiceConfig.jitter_min_slack_ms); < 0: off")
    ap.add_argument("--run-ahead", type=float, default=2.0,
                    help="ray: a chunk whose audio is queued goes up to this many chunks early "
                         "(ServiceConfig.run_ahead_chunks); 0: every chunk waits for its boundary")
    ap.add_argument("--onset-slack-ms", type=float, default=ServiceConfig().onset_slack_ms,
                    help="ray: a speech onset plays this long after it reaches the room, idle frames ahead of it cut "
                         "(ServiceConfig.onset_slack_ms); < 0: off")
    ap.add_argument("--audio-lead-ms", type=float, default=ServiceConfig().audio_lead_ms,
                    help="ray: audio goes to the room's audio source this long before its frames "
                         "(ServiceConfig.audio_lead_ms)")
    ap.add_argument("--onset-first-frame", choices=["auto", "on", "off"],
                    default=ServiceConfig().onset_first_frame,
                    help="ray: an onset's first frame decoded and played before the rest of its chunk "
                         "(ServiceConfig.onset_first_frame; auto: GPU decoders only)")
    ap.add_argument("--preempt-idle", choices=["on", "off"],
                    default="on" if ServiceConfig().preempt_idle else "off",
                    help="ray: a speech onset takes the place of the idle chunk the DiT is making "
                         "(ServiceConfig.preempt_idle)")
    ap.add_argument("--graph", choices=["compiled", "actor_calls"], default=None,
                    help="ray: how the chunk flows between the workers (ServiceConfig.graph; default: the service's)")
    ap.add_argument("--agent-frames", choices=["tts", "10", "20", "40", "100", "200"], default="20",
                    help="ray: how the agent frames its speech for DataStreamAudioOutput: fixed frames of that many "
                         "ms, or tts: as a LiveKit Agents TTS emits it (progressive: 20 ms up to 200 ms)")
    ap.add_argument("--depth", type=int, default=2, help="synthetic: chunks in flight (the pipeline's depth)")
    ap.add_argument("--dump", type=Path, default=None, help="ray: an .npz of the viewer's audio and the utterances")
    ap.add_argument("--utterances", type=int, default=10)
    ap.add_argument("--utterance-s", type=float, default=1.5)
    ap.add_argument("--pause-s", type=float, default=0.5)
    ap.add_argument("--pause-jitter-s", type=float, default=1 / 6,
                    help="a uniform random share of this added to each pause (seeded: --seed): the agent's turns "
                         "come at any point of a chunk, not where the last playout ended (a chunk boundary); 0: off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/cpu/latency_ray.json (--generator ray), benchmarks/cpu/"
                         "latency_<generator>.json otherwise; a run is appended (scripts/benchmarks/results.py)")
    args = ap.parse_args()
    if args.generator == "ray":
        result = main_ray(args)
        result["machine"] = {"platform": platform.platform(), "python": platform.python_version(),
                             "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
                             "loadavg_end": os.getloadavg()}
        result["command"] = " ".join(sys.argv)
        print_ray(result)
        out = args.out or ROOT / "benchmarks" / "cpu" / "latency_ray.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        results.record(out, result)
        print(f"wrote {out}")
        return
    with tempfile.TemporaryDirectory() as tmp, LiveKitServer(install_server(), Path(tmp)) as server:
        result = asyncio.run(run(server, args))
    result["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    result["command"] = " ".join(sys.argv)
    rl, al = result["speech_to_frame_s"], result["agent_to_started_s"]
    print(f"generator {result['generator']}: {result['utterances']} utterances over {result['duration_s']:.1f} s")
    print(f"{'metric':<42}{'p50':>10}{'p95':>10}")
    print(f"{'speech at room -> first frame published (s)':<42}{rl['p50']:>10.3f}{rl['p95']:>10.3f}")
    print(f"{'agent capture -> playback_started (s)':<42}{al['p50']:>10.3f}{al['p95']:>10.3f}")
    cc = result["chunk_compute_ms"]
    print(f"{'chunk compute (ms)':<42}{cc['p50']:>10.1f}{cc['p95']:>10.1f}")
    print(f"p50 / video share of a turn ({VIDEO_SHARE_S} s): {result['p50_over_video_share']:.2f}")
    print(f"fps publisher {result['fps_publisher']:.2f} (new frames {result['fresh_fps_publisher']:.2f}), viewer "
          f"{result['fps_viewer']:.2f}; A/V offset |mean| "
          f"{result['av_offset_ms']['mean_abs']:.2f} ms, p95 {result['av_offset_ms']['p95_abs']:.2f} ms; late chunks "
          f"{result['late_chunks']} (stalled {result['stall_s']:.2f} s), slips {result['slips']}")
    out = args.out or ROOT / "benchmarks" / "cpu" / f"latency_{args.generator}.json"
    results.record(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
