"""One session on CPU cores, in process: the DiT of chunk k+1 beside the decode of chunk k on two threads, and
a calibration against the chunk budget.

`StagePipeline` runs an in-process engine's two stages overlapped when there are two or more cores: while the
decoder thread decodes chunk k, the caller's thread runs the DiT of chunk k+1; nothing runs further ahead (the
same depth as serving's, `ChunkPathConfig.depth` = 2). With one core the stages run one after the other on the
caller's thread. Each stage's CPU time comes from `time.thread_time` in the thread that ran it, so a chunk's CPU
time is the sum over the stages' threads. `calibrate` times a few chunks of silence through such a pipeline and
says whether this machine, as loaded now, keeps up with the chunk budget; `characters demo --realtime` prints
its advice before it starts (it warns, it never refuses).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from characters.host import cores, cpu_model, load_average

if TYPE_CHECKING:
    from characters.engine import CharacterEngine

# chunk time / budget above which `calibrate` warns: the rest is the slack for other programs' bursts
WARN_SHARE = 0.8
@dataclass(frozen=True)
class StageTimes:
    """One stage of one chunk: wall and CPU milliseconds (CPU: `time.thread_time` of the stage's thread)."""

    wall_ms: float
    cpu_ms: float


def _timed(fn: Callable[[], object]) -> tuple[object, StageTimes]:
    w, c = time.perf_counter(), time.thread_time()
    out = fn()
    return out, StageTimes((time.perf_counter() - w) * 1e3, (time.thread_time() - c) * 1e3)


@dataclass(frozen=True)
class ChunkResult:
    """Chunk k's frames (F, H, W, 3) uint8 and where its time went."""

    chunk: int
    frames: np.ndarray
    dit: StageTimes
    decode: StageTimes
    wall_ms: float  # this chunk's turn of the pipeline: its decode beside the next chunk's DiT (or both in turn)

    @property
    def cpu_ms(self) -> float:
        """The chunk's compute summed over both stages' threads."""
        return self.dit.cpu_ms + self.decode.cpu_ms


class StagePipeline:
    """A `CharacterEngine`'s DiT and decoder, overlapped on two threads when `overlap` (default: 2+ cores).

    `stream(chunks)` yields chunk k's frames once they are decoded; by then the DiT has made chunk k+1 as
    well (on the caller's thread, during the decode), and the decode of k+1 starts only when the caller
    asks for the next chunk: compute never runs more than one chunk ahead of what the caller took.
    `dit_threads` / `decoder_threads` set each stage's intra-op threads (the topology's fields).
    """

    def __init__(self, engine: CharacterEngine, *, overlap: bool | None = None, dit_threads: int | None = None,
                 decoder_threads: int | None = None) -> None:
        topo = engine.cfg.topology
        self.engine = engine
        self.overlap = cores() >= 2 if overlap is None else overlap
        self.dit_threads = dit_threads or topo.dit_cpu_threads
        self.decoder_threads = decoder_threads or topo.decoder_cpu_threads
        self._pool: ThreadPoolExecutor | None = None
        self._threads_before: int | None = None

    def __enter__(self) -> StagePipeline:
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.dit_threads)
        if self.overlap:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="decoder",
                                            initializer=torch.set_num_threads, initargs=(self.decoder_threads,))
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the decoder thread; the caller's intra-op threads are what they were before `__enter__`."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _dit(self, pcm: np.ndarray) -> tuple[torch.Tensor, StageTimes]:
        latents, t = _timed(lambda: self.engine.dit.step(pcm))
        return latents, t  # type: ignore[return-value]

    def _decode(self, latents: torch.Tensor) -> tuple[np.ndarray, StageTimes]:
        frames, t = _timed(lambda: self.engine.decoder.decode(latents).cpu().numpy())
        return frames, t  # type: ignore[return-value]

    def stream(self, chunks: Iterable[np.ndarray]) -> Iterator[ChunkResult]:
        """Each chunk's exact audio samples in, its frames and times out, in order."""
        it = iter(chunks)
        first = next(it, None)
        if first is None:
            return
        start = self.engine.chunk
        latents, dit_t = self._dit(first)
        k = start
        while True:
            t0 = time.perf_counter()
            nxt = next(it, None)
            if self._pool is not None:
                pending: Future[tuple[np.ndarray, StageTimes]] = self._pool.submit(self._decode, latents)
                ahead = self._dit(nxt) if nxt is not None else None  # the next DiT beside this decode
                frames, dec_t = pending.result()
            else:
                frames, dec_t = self._decode(latents)
                ahead = self._dit(nxt) if nxt is not None else None
            yield ChunkResult(k, frames, dit_t, dec_t, (time.perf_counter() - t0) * 1e3)
            if ahead is None:
                return
            (latents, dit_t), k = ahead, k + 1


@dataclass(frozen=True)
class Calibration:
    """What a few chunks of silence took here, now, against the chunk budget."""

    cores: int
    overlap: bool
    chunk_ms: float  # median pipelined wall time per chunk
    dit_ms: float  # median wall
    decode_ms: float
    cpu_ms: float  # median CPU time per chunk, both stages
    budget_ms: float
    load: float | None

    @property
    def too_slow(self) -> bool:
        return self.chunk_ms > WARN_SHARE * self.budget_ms

    def advice(self) -> str:
        """One paragraph for the user: the measurement, and what to do when it is too close to the budget."""
        load = f", load average {self.load:.1f}" if self.load is not None else ""
        mode = "DiT and decoder overlapped on two threads" if self.overlap else "DiT then decoder on one core"
        head = (f"calibration: {self.chunk_ms:.0f} ms per chunk ({mode}; DiT {self.dit_ms:.0f} ms, decoder "
                f"{self.decode_ms:.0f} ms, {self.cpu_ms:.0f} ms of CPU) against the {self.budget_ms:.1f} ms budget, "
                f"on {self.cores} core{'s' if self.cores != 1 else ''} of {cpu_model()}{load}")
        if not self.too_slow:
            return head
        busy = self.load is not None and self.load > self.cores
        why = (f"other programs keep the {self.cores} core{'s' if self.cores != 1 else ''} busy (load "
               f"{self.load:.1f})" if busy else "this machine is too slow for it")
        return (f"{head}.\nwarning: --realtime will likely deliver late chunks (frozen frames): {why}. Close other "
                "programs or give this process more cores (taskset / container CPU limits); or run without "
                "--realtime, which writes the same video at whatever speed the machine has.")


def calibrate(engine: CharacterEngine, image: np.ndarray, *, chunks: int = 8, measured: int = 4,
              overlap: bool | None = None) -> Calibration:
    """Run `chunks` chunks of silence through a `StagePipeline` (the last `measured` of them timed, once the
    cache window is full), then leave the engine ready for `engine.start` (call it again before the session)."""
    g = engine.cfg.model.generation
    engine.start(image)
    silence = [np.zeros(engine.chunk_samples(k)[1] - engine.chunk_samples(k)[0], np.float32) for k in range(chunks)]
    with StagePipeline(engine, overlap=overlap) as pipe:
        results = list(pipe.stream(silence))[-measured:]
    med = statistics.median
    return Calibration(cores=cores(), overlap=pipe.overlap, chunk_ms=med(r.wall_ms for r in results),
                       dit_ms=med(r.dit.wall_ms for r in results), decode_ms=med(r.decode.wall_ms for r in results),
                       cpu_ms=med(r.cpu_ms for r in results), budget_ms=1000 * g.frames_per_chunk / g.fps,
                       load=load_average())
