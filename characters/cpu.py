"""Former home of `characters.host` (OS probes, priorities, the garbage collector) and `characters.stages` (the
in-process two-stage pipeline and its calibration): re-exported here for one release."""

from __future__ import annotations

from characters.host import (
    GC_PAUSE_WARN_S,
    GcPauses,
    cores,
    cpu_flags,
    cpu_model,
    freeze_heap,
    load_average,
    prioritize,
    prioritize_thread,
)
from characters.stages import WARN_SHARE, Calibration, ChunkResult, StagePipeline, StageTimes, calibrate

__all__ = ["GC_PAUSE_WARN_S", "WARN_SHARE", "Calibration", "ChunkResult", "GcPauses", "StagePipeline", "StageTimes",
           "calibrate", "cores", "cpu_flags", "cpu_model", "freeze_heap", "load_average", "prioritize",
           "prioritize_thread"]
