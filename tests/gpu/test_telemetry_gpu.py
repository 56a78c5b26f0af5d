"""Stage timing on a CUDA GPU: CUDA events around the DiT step and the decode, recorded without a host
synchronisation (sync debug mode "error") and read back later, placed on the host's clock."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from characters.audio import chunk_sample_range
from characters.config import session_config
from characters.engine import DecoderRunner, DiTRunner
from characters.stage_times import StageRecorder, StageTime

pytestmark = pytest.mark.gpu

CHUNKS = 12


def _pcms(runner: DiTRunner) -> list[np.ndarray]:
    spans = [chunk_sample_range(k, runner.cfg.model.generation.frames_per_chunk) for k in range(CHUNKS)]
    return [np.zeros(b - a, dtype=np.float32) for a, b in spans]


def test_graph_replays_are_timed_without_a_synchronisation() -> None:
    cfg = session_config("tiny", "gpu1", seed=2, dtype="bfloat16")
    runner, decoder = DiTRunner(cfg, device="cuda"), DecoderRunner(cfg, device="cuda")
    runner.capture_graphs()
    decoder.capture_graph()
    runner.recorder, decoder.recorder = StageRecorder("cuda"), StageRecorder("cuda")
    h, w = cfg.model.latent_hw
    runner.start(torch.zeros(1, cfg.model.dit.latent_channels, h, w, device="cuda"))
    decoder.start()
    pcms = _pcms(runner)
    for rec in (runner.recorder, decoder.recorder):
        rec.anchor()  # outside the loop: the one synchronisation
    torch.cuda.synchronize()
    before = time.time_ns()
    harvested: list[StageTime] = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k, pcm in enumerate(pcms):
            if k % 3 == 1:  # an onset's chunk in two parts: one "decode" region over both
                decoder.decode_first(runner.step(pcm))
                decoder.decode_rest()
            else:
                decoder.decode(runner.step(pcm))
            harvested += runner.recorder.harvest() + decoder.recorder.harvest()  # only completed events
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = time.time_ns()
    harvested += runner.recorder.harvest() + decoder.recorder.harvest()
    got = {(t.chunk, t.stage) for t in harvested}
    assert got == {(k, s) for k in range(CHUNKS) for s in ("dit", "decode")}
    assert len(harvested) == len(got) and runner.recorder.dropped == decoder.recorder.dropped == 0
    for t in harvested:
        assert t.source == "cuda" and 0 < t.duration_ns < 1_000_000_000
        assert before - 5_000_000 <= t.start_ns <= t.end_ns <= after + 5_000_000  # on the host's clock
    for stage in ("dit", "decode"):
        starts = [t.start_ns for t in sorted((t for t in harvested if t.stage == stage), key=lambda t: t.chunk)]
        assert starts == sorted(starts)
    dit = {t.chunk: t for t in harvested if t.stage == "dit"}
    dec = {t.chunk: t for t in harvested if t.stage == "decode"}
    # one stream: decode k after dit k (two anchors, each placed within ~0.1 ms of the host clock)
    assert all(dec[k].start_ns >= dit[k].end_ns - 500_000 for k in range(CHUNKS))
    print(f"\nGPU dit {np.median([t.duration_ns for t in dit.values()]) / 1e6:.2f} ms, "
          f"decode {np.median([t.duration_ns for t in dec.values()]) / 1e6:.2f} ms (median of {CHUNKS})")


def test_eager_steps_time_the_cache_write_pass_inside_the_step() -> None:
    cfg = session_config("tiny", "gpu1", seed=2, dtype="bfloat16",
                         model={"generation": {"cache_update": "extra_pass", "denoising_steps": 2}})
    runner = DiTRunner(cfg, device="cuda")
    runner.recorder = StageRecorder("cuda")
    h, w = cfg.model.latent_hw
    runner.start(torch.zeros(1, cfg.model.dit.latent_channels, h, w, device="cuda"))
    runner.recorder.anchor()
    for pcm in _pcms(runner)[:4]:
        runner.step(pcm)
    torch.cuda.synchronize()
    times = runner.recorder.harvest()
    assert sorted((t.chunk, t.stage) for t in times) == [(k, s) for k in range(4) for s in ("cache_write", "dit")]
    for k in range(4):
        d, c = (next(t for t in times if (t.chunk, t.stage) == (k, s)) for s in ("dit", "cache_write"))
        assert d.start_ns <= c.start_ns and c.end_ns <= d.end_ns + 1_000 and c.duration_ns < d.duration_ns


def test_a_recorder_nobody_harvests_stays_bounded() -> None:
    rec = StageRecorder("cuda", max_pending=8)
    x = torch.randn(256, 256, device="cuda")
    for k in range(50):
        rec.chunk = k
        mark = rec.begin("dit")
        x = x @ x.T / 256
        rec.end(mark)
    assert len(rec._pending) == 8 and rec.dropped == 42
    torch.cuda.synchronize()
    assert [t.chunk for t in rec.harvest()] == list(range(42, 50))
