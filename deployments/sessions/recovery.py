"""Session recovery (`SessionSpec.recover`, off by default): a session whose bundle is lost resumes on
a fresh bundle, in the same room, with the character re-primed from its reference and recent history.

What survives lives in host memory in the SessionActor (never on a GPU): `History` keeps the audio of
the last `keep` chunks it submitted and knows which of them the viewer got. When the chunk loop
fails because a worker died (or timed out), the actor hands the scheduler a `Resume`:

    chunks    the session-wide index of the next chunk (= chunks the viewer got)
    prime     the audio of the last published chunks, one contiguous stream (oldest first)
    pending   audio taken for chunks that were never published, then whatever was still queued

The scheduler removes the broken slot, takes a free warm slot (else builds a cold one when a whole
bundle is free, else the session fails for good) and starts the session on that slot's SessionActor
with the `Resume`. Before its first chunk enters the slot's graph, `prime` replays the `prime` audio
(plain actor calls) through every DiT rank and the decoder (frames discarded): the KV cache ring and
the decoder's temporal state hold the last chunks' context again, conditioned on the same reference.
The viewer then gets chunk `chunks`, with `pending` played first, so no speech is lost (chunks in
flight at the failure are regenerated).

If the SessionActor itself died, its history died with it: the session resumes from its reference
alone, at the chunk after the last one the scheduler heard of. A `worker_error` (a task raised) is
not recovered: it would raise again.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from characters.audio import chunk_sample_range
from deployments.pipeline.graph import Workers
from deployments.pipeline.workers import ChunkInput
from deployments.types import SessionStats

RECOVER_MAX_ATTEMPTS = 3  # recoveries per session; the next failure ends it FAILED
RECOVERABLE = ("actor_died", "chunk_timeout", "session_failed")  # failure reasons worth a new bundle


def recoverable(reason: str) -> bool:
    """A failure that a fresh bundle can cure: a worker or the session actor died, or a chunk timed out."""
    return any(code in reason for code in RECOVERABLE) and "worker_error" not in reason


@dataclass(frozen=True)
class Resume:
    """What a recovering session carries to its new slot (see the module docstring)."""

    chunks: int
    primed: int = 0  # chunks of audio in `prime`
    prime: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (n,) float32 mono 16 kHz
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (m,) float32 mono 16 kHz
    stats: SessionStats = field(default_factory=SessionStats)
    attempt: int = 1
    reason: str = ""  # why the last bundle was lost


class History:
    """The audio of the last `keep` chunks submitted, and which chunk the viewer got last. Thread-safe:
    the loop thread records, the actor's event loop reads at the end."""

    def __init__(self, keep: int) -> None:
        self._taken: deque[tuple[int, np.ndarray]] = deque(maxlen=keep + 8)  # (local chunk, its pcm)
        self.keep = keep
        self.published = -1  # local index of the last chunk published
        self._lock = threading.Lock()

    def taken(self, k: int, pcm: np.ndarray) -> np.ndarray:
        with self._lock:
            self._taken.append((k, pcm))
        return pcm

    def on_published(self, k: int) -> None:
        with self._lock:
            self.published = max(self.published, k)

    def resume(self, *, chunks: int, queued: np.ndarray, stats: SessionStats, attempt: int, reason: str) -> Resume:
        """The state to resume from: `chunks` published so far (session-wide), `queued` audio not yet taken."""
        with self._lock:
            done = [pcm for k, pcm in self._taken if k <= self.published][-self.keep:]
            lost = [pcm for k, pcm in self._taken if k > self.published]
        empty = np.zeros(0, np.float32)
        return Resume(chunks, len(done), np.concatenate(done) if done else empty,
                      np.concatenate([*lost, queued]) if lost or queued.size else empty, stats, attempt, reason)


def prime_windows(audio: np.ndarray, chunks: int, frames_per_chunk: int, sample_rate: int, fps: int
                  ) -> list[np.ndarray]:
    """Re-slice a contiguous stream into local chunks 0..chunks-1 (exact sample counts; the newest audio
    kept, silence in front when the stream is short)."""
    total = chunk_sample_range(chunks - 1, frames_per_chunk, sample_rate, fps)[1] if chunks else 0
    stream = np.zeros(total, np.float32)
    n = min(total, audio.size)
    if n:
        stream[total - n:] = audio[audio.size - n:]
    out = []
    for j in range(chunks):
        a, b = chunk_sample_range(j, frames_per_chunk, sample_rate, fps)
        out.append(stream[a:b])
    return out


async def prime(workers: Workers, session_id: str, windows: list[np.ndarray]) -> None:
    """Replay `windows` as local chunks 0.. through every DiT rank and the decoder, discarding the
    frames: the new slot's KV cache and decoder state hold the session's recent context again."""
    last = None
    for j, pcm in enumerate(windows):
        inp = ChunkInput(session_id, j, pcm)
        outs = [d.step.remote(inp) for d in workers.dits]
        last = workers.decoder.decode.remote(outs[0], *outs[1:])  # actor calls run in submission order
    if last is not None:
        await last
