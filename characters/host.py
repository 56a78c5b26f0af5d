"""This host's CPU as the chunk path sees it: the cores this process may use, which CPU it is, the nice value
of the chunk path's threads, and a garbage collector kept off a warm process's heap.

`cores()` reads the affinity mask (`os.sched_getaffinity`: what a container or `taskset` allows, not the
machine's count). `prioritize(nice)` asks the OS for a nice value for every thread of this process (threads
started later inherit it): the chunk path's workers are real-time work beside a voice agent, a LiveKit server
and a viewer on the same cores; below 0 it needs CAP_SYS_NICE, without it nothing changes. `freeze_heap(name)`
takes what a warm process built out of the garbage collector's reach, so a full collection over it never
holds the interpreter for most of a chunk's budget; a collection slower than `GC_PAUSE_WARN_S` is logged.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import threading
import time
from pathlib import Path

GC_PAUSE_WARN_S = 0.02  # a garbage collection this long is logged (`freeze_heap`)
log = logging.getLogger(__name__)


def cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def prioritize(nice: int) -> int | None:
    """Set every thread of this process to `nice` (Linux keeps a nice value per thread; threads started later
    inherit their creator's). Returns the value set, or None when the OS refused (lowering a nice value needs
    CAP_SYS_NICE) or has no per-thread niceness; the process keeps what it had then."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:  # a thread that has just ended
                continue
    except (PermissionError, AttributeError):
        return None
    return nice


def prioritize_thread(nice: int) -> bool:
    """Set the calling thread to `nice`; False when the OS refused (see `prioritize`)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (PermissionError, AttributeError):
        return False
    return True


class GcPauses:
    """A `gc.callbacks` entry: logs each collection of this process that took `GC_PAUSE_WARN_S` or longer (it
    held the interpreter, so every thread of the process waited)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        if took >= GC_PAUSE_WARN_S:
            log.warning("%s: a generation-%d garbage collection held the interpreter for %.0f ms (%d collectable)",
                        self.name, info.get("generation", -1), took * 1e3, info.get("collected", 0))


_gc_pauses: GcPauses | None = None


def freeze_heap(name: str) -> None:
    """Call once a process of the chunk path is warm (weights loaded, shapes run, its libraries imported): collect,
    then freeze everything left (`gc.freeze`: never scanned again, freed by reference counting only), and log slow
    collections from then on. Later collections scan only what was made since. Objects of a session must not be
    frozen (a cycle among them would never be freed): call it at start-up, not per session."""
    global _gc_pauses
    gc.collect()
    gc.freeze()
    if _gc_pauses is None:
        _gc_pauses = GcPauses(name)
        gc.callbacks.append(_gc_pauses)


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> list[str]:
    """The instruction-set flags that matter to these kernels (AVX2, AVX-512, bf16, AMX) present on this CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return [f for f in wanted if f in flags]


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), None where the OS does not say."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
