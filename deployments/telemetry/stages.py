"""Telemetry of a slot's workers: their start-up stages as spans, and the stage recorder of their chunk step."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from characters.stage_times import StageRecorder
from deployments import telemetry
from deployments.telemetry import names as N

StageHook = Callable[[str, int, int, str | None], None]  # (stage, start ns, end ns, error type or None)


def stage_spans(role: str, rank: int | None, trace_context: Mapping[str, str] | None, last: str) -> StageHook | None:
    """A StageTimer hook that makes each stage a span in this process, under the slot's build span."""
    tel = telemetry.setup(role)  # this actor's process (OTEL_* of its environment; off by default)
    if not tel.traces or not trace_context:
        return None
    parent = telemetry.extract(trace_context)

    def hook(stage: str, start_ns: int, end_ns: int, error: str | None) -> None:
        attrs: dict[str, str | int] = {N.WORKER_ROLE: role, N.STAGE: stage}
        if rank is not None:
            attrs[N.WORKER_RANK] = rank
        span = tel.start_span(N.WORKER_STAGE[stage], parent, start_ns=start_ns, attributes=attrs)
        if error is not None:
            telemetry.fail(span, error)
        span.end(end_time=end_ns)
        if stage == last or error is not None:
            tel.flush_in_background()  # the slot may be torn down before the next periodic export

    return hook


def chunk_recorder(device: torch.device) -> StageRecorder:
    """A stage recorder for the chunk step (host timers on CPU, CUDA events on GPU). Always on, telemetry or not:
    the session's stats report per-stage times (`SessionStats.stage_ms`); nothing in the step synchronises."""
    recorder = StageRecorder(device)
    recorder.anchor()  # after warm-up: one synchronize, outside any session
    return recorder
