"""Stage timing of the chunk step, for telemetry: plain timings, no exporter (no Ray, no OpenTelemetry).

`StageRecorder` brackets named regions of a step (`begin` / `end`) and hands out their times later
(`harvest`). It is optional and off by default: a runner records only when an owner attaches one
(`DiTRunner.recorder`, `DecoderRunner.recorder`).

- On a CPU device the step runs synchronously, so a region's time is the host's: two `time.time_ns()`
  reads. Harvest returns every region ended since the last harvest.
- On a CUDA device the host only enqueues work (a graph replay returns at once), so a region is two
  CUDA events recorded on the current stream. Nothing waits for them: `harvest` reads only regions
  whose end event has completed (`Event.query()`, which never blocks) and leaves the rest for a later
  harvest, so a chunk's GPU times arrive with a later chunk. Events are reused from a pool; when more
  than `max_pending` regions wait (nobody harvests), the oldest are dropped and counted.

GPU times are placed on the host's wall clock through an *anchor*: one event whose host time is
known, taken by `anchor()` with a synchronize, so call it outside the loop (after warm-up, at a
session's start). Durations come from `cudaEventElapsedTime` (~0.5 us resolution); absolute
positions drift with the GPU clock by a few ppm until the next anchor.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch

Source = Literal["host", "cuda"]

#: Stage names of one chunk, in pipeline order. `handoff` is measured between workers (DiT end ->
#: decoder start), the others inside one worker.
CHUNK_STAGES = ("dit", "cache_write", "handoff", "decode", "publish")


@dataclass(frozen=True)
class StageTime:
    """One timed region: which chunk, which stage, when (epoch ns on this node's clock) and how long."""

    chunk: int
    stage: str
    start_ns: int
    duration_ns: int
    source: Source

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


class StageRecorder:
    """Host timers (CPU device) or CUDA events (CUDA device) around named regions; see the module docstring."""

    def __init__(self, device: torch.device | str, max_pending: int = 64) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.max_pending = max_pending
        self.chunk = 0  # the chunk the next regions belong to (set by the owner per step)
        self.dropped = 0  # regions dropped unread (no harvest for max_pending regions)
        self._done: list[StageTime] = []
        self._pending: deque[tuple[int, str, Any, Any]] = deque()  # (chunk, stage, start event, end event)
        self._pool: list[Any] = []
        self._anchor: tuple[Any, int] | None = None  # (event, its host time ns)

    # ----------------------------------------------------------------------------- in the step
    def begin(self, stage: str) -> tuple[int, str, Any]:
        """Start region `stage` of chunk `self.chunk`; pass the token to `end`. Never synchronises."""
        if not self.cuda:
            return self.chunk, stage, time.time_ns()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        return self.chunk, stage, event

    def end(self, token: tuple[int, str, Any]) -> None:
        chunk, stage, start = token
        if not self.cuda:
            now = time.time_ns()
            self._done.append(StageTime(chunk, stage, start, now - start, "host"))
            return
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append((chunk, stage, start, event))
        while len(self._pending) > self.max_pending:
            _, _, a, b = self._pending.popleft()
            self._pool += [a, b]
            self.dropped += 1

    # ----------------------------------------------------------------------------- later
    def harvest(self) -> list[StageTime]:
        """Regions finished since the last harvest, oldest first; never blocks (unfinished ones wait)."""
        out, self._done = self._done, []
        if not self.cuda:
            return out
        while self._pending and self._pending[0][3].query():
            chunk, stage, a, b = self._pending.popleft()
            if self._anchor is not None:
                anchor, host_ns = self._anchor
                start_ns = host_ns + int(anchor.elapsed_time(a) * 1e6)
            else:  # no anchor yet: place the region at harvest time (the duration is still exact)
                start_ns = time.time_ns() - int(a.elapsed_time(b) * 1e6)
            out.append(StageTime(chunk, stage, start_ns, int(a.elapsed_time(b) * 1e6), "cuda"))
            self._pool += [a, b]
        return out

    def anchor(self) -> None:
        """Tie GPU event time to host time: synchronises once, so call it outside the chunk loop."""
        if not self.cuda:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        self._anchor = (event, time.time_ns())

    def reset(self) -> None:
        """Forget every region (a new session): pending events go back to the pool unread."""
        for _, _, a, b in self._pending:
            self._pool += [a, b]
        self._pending.clear()
        self._done.clear()
        self.chunk = 0
