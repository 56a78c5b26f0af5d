"""The chunk pipeline on a real local cluster: the tiny preset through the compiled graph to an MP4,
tensor parallelism over gloo, and the plain-actor-call fallback against the compiled graph.

One cluster for the module: 8 logical CPUs and 3 logical GPUs (enough for one 2-rank + decoder bundle).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from deploy_helpers import (
    all_events,
    chunk_digests,
    info,
    reference_digests,
    scheduler,
    slots,
    small_service,
    spec,
    wait_chunks,
    wait_status,
)

from characters.audio import chunk_sample_range
from characters.config import TopologyConfig, session_config
from characters.media import read_mp4
from deployments.pipeline.graph import ActorCallPipeline, CompiledPipeline, Workers
from deployments.pipeline.handoff import REFERENCE, pack
from deployments.pipeline.output import RoomWorker
from deployments.pipeline.workers import ChunkInput, DecoderWorker
from deployments.sessions.cluster import init_local, stop_local
from deployments.sessions.slot import DIT_ACTOR
from deployments.settings import ServiceConfig
from deployments.types import OutputSpec, SessionStatus

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_local(num_cpus=8, num_gpus=3)
    yield
    stop_local()


def test_tiny_session_streams_through_the_compiled_graph(tmp_path: Path) -> None:
    """The real tiny preset on CPU bundles, 8 s of video to an MP4 with the agent's audio muxed in."""
    service = ServiceConfig(preset="tiny", topology="cpu", use_gpus=False, output_dir=str(tmp_path),
                            placement_timeout_s=60.0, graph="compiled", onset_first_frame="on")
    with scheduler(service, "t-tiny") as sched:
        s = spec("tiny", service, output=OutputSpec("file", "tiny.mp4"), max_duration_s=8.0)
        assert ray.get(sched.create_session.remote(s)).status is SessionStatus.STARTING
        wait_status(sched, "tiny", SessionStatus.RUNNING, timeout_s=120)
        (slot,) = slots(sched)
        tone = (0.3 * np.sin(np.arange(48000) * 2 * np.pi * 220 / 48000) * 32767).astype("<i2")
        ray.get(sched.push_audio.remote("tiny", np.repeat(tone, 2).tobytes(), 48000, 2))  # 1 s stereo 48 kHz
        done = wait_status(sched, "tiny", SessionStatus.ENDED, timeout_s=60)
        assert done.reason == "max_duration"
        # the tone after silence is a speech onset: its chunk went out in two parts (first frame, then the rest; on
        # for this test: by default only GPU decoders do)
        heads = [e.chunk for e in all_events(sched, "tiny")
                 if e.kind == "chunk" and "head_frames=1" in (e.detail or "")]
        assert len(heads) == 1, heads
        stats = done.stats
        print("\ntiny session on CPU bundles:", json.dumps(
            {"chunks": stats.chunks, "delivered_fps": round(stats.fps, 2), "late_chunks": stats.late_chunks,
             "latency_ms_p50": round(stats.step_ms_p50, 1), "latency_ms_p95": round(stats.step_ms_p95, 1),
             "slot_build_s": round(slot["build_s"], 2)}))
        frames, fps, audio, rate = read_mp4(tmp_path / "tiny.mp4")
        assert frames.shape == (4 * stats.chunks, 176, 272, 3) and fps == 24
        assert rate > 0 and abs(audio.size / rate - stats.chunks * 4 / 24) < 0.1  # audio as long as the video
        assert np.abs(audio).max() > 0.1  # the pushed tone is in it
        assert stats.frames == 4 * stats.chunks and stats.chunks >= 4


@pytest.mark.parametrize("layout", [{}, {"sequence_parallel": True, "tp_overlap": "ring"}],
                         ids=["replicated", "sequence_parallel_ring"])
def test_tensor_parallel_session_over_gloo(layout: dict[str, object]) -> None:
    service = small_service(topology=TopologyConfig(name="tp2", dit_ranks=2, decoder_gpus=1, **layout))
    with scheduler(service, "t-tp2") as sched:
        ray.get(sched.create_session.remote(spec("tp2", service)))
        wait_chunks(sched, "tp2", 8)
        (slot,) = slots(sched)
        assert set(slot["stages"]) == {"dit0", "dit1", "decoder"}
        assert len(slot["actors"]) == 4  # 2 DiT ranks, decoder, room
        assert all(slot["stages"][r]["init_process_group"] > 0 for r in ("dit0", "dit1"))
        ended = ray.get(sched.end_session.remote("tp2"))
        assert (ended.status, ended.reason) == (SessionStatus.ENDED, "deleted")
        assert len(set(chunk_digests(sched, "tp2").values())) > 1


def test_actor_call_fallback_makes_the_frames_of_the_single_process_engine() -> None:
    service = small_service(graph="actor_calls")
    session = spec("calls", service, seed=5)
    with scheduler(service, "t-calls") as sched:
        ray.get(sched.create_session.remote(session))
        got = wait_chunks(sched, "calls", 6)
        assert info(sched, "calls").status is SessionStatus.RUNNING
    assert [got[k] for k in range(6)] == reference_digests(service, session, 6)


def test_a_slots_dit_actor_takes_preempt_while_it_makes_a_chunk() -> None:
    """The slot's DiT actor (`deployments.sessions.slot.DIT_ACTOR`, as `build_slot` makes it) runs `preempt` beside
    the step it stops (its own concurrency group): an idle chunk asked for while it is being made is given up
    (queued behind the step, the call would come too late); the onset then goes on in its place."""
    cfg = session_config("tiny", "cpu", model={"dit": {"num_layers": 24}})  # a step of 24 parts (~10 ms each)
    dit = DIT_ACTOR.options(num_cpus=1).remote(cfg, cpu_threads=1)
    ray.get(dit.init_device.remote())
    ray.get(dit.init_process_group.remote(0))
    ray.get(dit.load_weights.remote())
    ray.get(dit.warm_up.remote())
    ref = pack("s", REFERENCE, torch.zeros(1, cfg.model.dit.latent_channels, *cfg.model.latent_hw))
    ray.get(dit.start.remote("s", ref, 11))
    silence = [np.zeros(np.subtract(*chunk_sample_range(k, 4)[::-1]), np.float32) for k in range(2)]
    t0 = time.monotonic()
    made = ray.get(dit.step.remote(ChunkInput("s", 0, silence[0], preemptible=True)))
    step_s = time.monotonic() - t0
    assert not made.header.given_up
    ref1 = dit.step.remote(ChunkInput("s", 1, silence[1], preemptible=True))
    time.sleep(step_s / 4)  # into the step
    ray.get(dit.preempt.remote("s", 1))
    given_up = ray.get(ref1)
    assert given_up.header.given_up, f"chunk 1 was made ({step_s * 1e3:.0f} ms a step): preempt came after it"
    speech = 0.1 * np.ones(np.subtract(*chunk_sample_range(2, 4)[::-1]), np.float32)
    onset = ray.get(dit.step.remote(ChunkInput("s", 2, speech, onset=True)))
    assert not onset.header.given_up and onset.header.chunk == 2 and onset.tensor.abs().sum() > 0
    ray.kill(dit)


@pytest.mark.parametrize("graph", ["compiled", "actor_calls"])
def test_a_chunk_given_up_flows_through_the_pipeline(graph: str) -> None:
    """Real actors (the slot's DiT actor class), the chunk path as a session drives it (`CompiledPipeline` /
    `ActorCallPipeline`): idle chunk 1 asked for while the DiT makes it comes out as a report of a chunk given up
    (nothing published, a chunk cut), and the onset after it and the chunks after that come out whole."""
    small = {"dit": {"num_layers": 24}, "generation": {"height": 64, "width": 96}, "vae": {"num_res_blocks": 0}}
    cfg = session_config("tiny", "cpu", model=small)
    dit = DIT_ACTOR.options(num_cpus=1).remote(cfg, cpu_threads=1)
    dec = ray.remote(DecoderWorker).options(num_cpus=1).remote(cfg, cpu_threads=1)
    room = ray.remote(RoomWorker).options(num_cpus=1).remote(cfg)
    ray.get([w.init_device.remote() for w in (dit, dec)])
    ray.get([dit.init_process_group.remote(0), dec.init_process_group.remote()])
    ray.get([w.load_weights.remote() for w in (dit, dec)])
    ray.get([w.warm_up.remote() for w in (dit, dec)])
    image = np.random.default_rng(4).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    ray.get(dit.start.remote("s", dec.encode_reference.remote("s", image), 11))
    ray.get([dec.start.remote("s"), room.open.remote("s", OutputSpec())])
    workers = Workers([dit], dec, room, "shm")
    pipe = (CompiledPipeline(workers, depth=2, buffer_bytes=1 << 20, teardown_timeout_s=10) if graph == "compiled"
            else ActorCallPipeline(workers))
    try:
        def chunk(k: int, speech: bool = False) -> ChunkInput:
            n = np.subtract(*chunk_sample_range(k, 4)[::-1])
            return ChunkInput("s", k, np.full(n, 0.1 if speech else 0.0, np.float32), onset=speech and k == 2,
                              preemptible=not speech)

        pipe.submit(chunk(0))
        assert pipe.fetch(60).frames == 4
        pipe.submit(chunk(1))
        time.sleep(0.01)
        pipe.preempt("s", 1)  # as the loop does before it submits the onset
        pipe.submit(chunk(2, speech=True))
        reports = [pipe.fetch(60)]
        for k in (3, 4):
            pipe.submit(chunk(k, speech=True))
            reports.append(pipe.fetch(60))
        reports.append(pipe.fetch(60))
        assert [(r.chunk, r.given_up, r.frames) for r in reports] == [
            (1, True, 0), (2, False, 4), (3, False, 4), (4, False, 4)]
        assert reports[0].cut_s == pytest.approx(4 / 24)
        assert len({r.digest for r in reports[1:]}) == 3
    finally:
        if isinstance(pipe, CompiledPipeline):
            pipe.teardown()
        for w in (dit, dec, room):
            ray.kill(w)
