"""A real session end to end: Ray scheduler and workers, the compiled chunk graph, and the room worker
publishing into a real LiveKit server, watched by a real subscriber."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray
from lk_helpers import H, Viewer, W

from deployments.livekit import LiveKitServer
from deployments.livekit.config import LiveKitOutput
from deployments.sessions.cluster import init_local, stop_local
from deployments.sessions.scheduler import get_or_create_scheduler
from deployments.settings import ServiceConfig
from deployments.types import SessionSpec, SessionStatus

pytestmark = [pytest.mark.livekit, pytest.mark.ray]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    init_local(num_cpus=8, num_gpus=1)
    yield
    stop_local()


def _wait_status(sched: object, sid: str, status: SessionStatus, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (info := ray.get(sched.get_session.remote(sid))).status is not status:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"{sid} is {info.status} ({info.reason}), waited for {status}"
        assert not info.status.terminal or status.terminal, f"{sid} ended early: {info.reason}"
        time.sleep(0.1)


def test_session_publishes_into_a_livekit_room(cluster: None, livekit_server: LiveKitServer) -> None:
    service = ServiceConfig(topology="gpu1", model_overrides={"dit": {"num_layers": 1}}, queue_max=0,
                            queue_timeout_s=120.0, placement_timeout_s=60.0)
    sched = get_or_create_scheduler(service, name="t-livekit")
    output = LiveKitOutput(url=livekit_server.url, room_name="ray-room", api_key=livekit_server.api_key,
                           api_secret=livekit_server.api_secret)
    image = np.random.default_rng(1).integers(0, 256, (H, W, 3), dtype=np.uint8)

    async def watch() -> tuple[float, set[tuple[int, int]], int]:
        viewer = Viewer(livekit_server, "ray-room")
        await viewer.start()
        try:
            ray.get(sched.create_session.remote(SessionSpec("lk1", image, output=output, max_duration_s=120)))
            await asyncio.wait_for(viewer.subscribed.wait(), 90)
            await asyncio.to_thread(_wait_status, sched, "lk1", SessionStatus.RUNNING)
            await asyncio.sleep(3.0)  # past start-up and the jitter buffer
            t0 = time.monotonic()
            await asyncio.sleep(8.0)
            fps = viewer.fps(t0, time.monotonic())
            sizes = {(w, h) for _, w, h in viewer.video}
            samples = sum(a.size for t, a in viewer.audio if t >= t0)
        finally:
            await viewer.aclose()
        return fps, sizes, samples

    try:
        fps, sizes, samples = asyncio.run(watch())
        assert sizes == {(W, H)}
        assert fps >= 20.0, f"the viewer saw {fps:.1f} fps"
        assert samples >= 0.9 * 8.0 * 16000  # continuous audio (silence is audio too)
        ended = ray.get(sched.end_session.remote("lk1"))
        assert (ended.status, ended.reason) == (SessionStatus.ENDED, "deleted")
    finally:
        ray.get(sched.shutdown.remote(), timeout=120)
        ray.kill(sched)
