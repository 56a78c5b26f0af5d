"""The chunk path on a CUDA GPU through Ray, as a user runs it: the compiled graph (the default on CUDA), CUDA
graphs in the workers, and a speech onset decoded in two parts (`onset_first_frame="auto"`: on for GPU decoders)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))  # the Ray tests' helpers

from deploy_helpers import all_events, scheduler, spec, wait_status

from deployments.sessions.cluster import init_local, stop_local
from deployments.settings import ServiceConfig
from deployments.types import SessionStatus

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_local(num_cpus=8, num_gpus=1)
    yield
    stop_local()


def test_an_onset_goes_out_in_two_parts_through_the_compiled_graph_on_a_gpu(tmp_path: Path) -> None:
    service = ServiceConfig(preset="tiny", topology="gpu1", use_gpus=True, output_dir=str(tmp_path),
                            placement_timeout_s=60.0)
    assert service.graph == "auto" and service.onset_first_frame == "auto"
    with scheduler(service, "g-tiny") as sched:
        s = spec("gpu", service, max_duration_s=6.0)  # a null output (the GPU machine's image has no PyAV)
        ray.get(sched.create_session.remote(s))
        wait_status(sched, "gpu", SessionStatus.RUNNING, timeout_s=300)
        tone = (0.3 * np.sin(np.arange(16000) * 2 * np.pi * 220 / 16000) * 32767).astype("<i2")
        ray.get(sched.push_audio.remote("gpu", tone.tobytes(), 16000, 1))  # 1 s after silence (16 kHz: no PyAV)
        done = wait_status(sched, "gpu", SessionStatus.ENDED, timeout_s=120)
        heads = [e.chunk for e in all_events(sched, "gpu") if e.kind == "chunk" and "head_frames=1" in (e.detail or "")]
    assert done.reason == "max_duration" and len(heads) == 1, heads
    assert done.stats.frames == 4 * done.stats.chunks and done.stats.chunks >= 12
