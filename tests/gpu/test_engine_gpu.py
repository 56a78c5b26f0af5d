"""The engine on a CUDA GPU: graph replay equals eager, and the step never synchronises the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from characters.audio import chunk_sample_range
from characters.config import session_config
from characters.engine import DecoderRunner, DiTRunner

pytestmark = pytest.mark.gpu

CHUNKS = 7


def _runner(dtype: str, **gen: object) -> DiTRunner:
    cfg = session_config("tiny", "gpu1", seed=2, dtype=dtype, model={"generation": gen} if gen else {})
    return DiTRunner(cfg, device="cuda")


def _session(runner: DiTRunner, graphs: bool) -> list[torch.Tensor]:
    if graphs:
        runner.capture_graphs()
    h, w = runner.cfg.model.latent_hw
    ref = torch.randn(1, runner.cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(1))
    runner.start(ref.cuda())
    rng = np.random.default_rng(0)
    return [runner.step(rng.uniform(-0.5, 0.5, runner.frontend.expected_samples).astype(np.float32))
            for _ in range(CHUNKS)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager(dtype: str) -> None:
    eager = _session(_runner(dtype), graphs=False)
    graphed = _session(_runner(dtype), graphs=True)
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5 if dtype == "float32" else 2e-2, rtol=1e-4)


def test_graph_replay_equals_eager_with_extra_cache_pass() -> None:
    eager = _session(_runner("float32", cache_update="extra_pass", denoising_steps=3), graphs=False)
    graphed = _session(_runner("float32", cache_update="extra_pass", denoising_steps=3), graphs=True)
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_steps_never_synchronise() -> None:
    runner = _runner("bfloat16")
    runner.capture_graphs()
    decoder = DecoderRunner(runner.cfg, device="cuda")
    decoder.capture_graph()
    h, w = runner.cfg.model.latent_hw
    runner.start(torch.zeros(1, runner.cfg.model.dit.latent_channels, h, w, device="cuda"))
    decoder.start()
    spans = [chunk_sample_range(k, runner.cfg.model.generation.frames_per_chunk) for k in range(CHUNKS)]
    pcms = [np.zeros(b - a, dtype=np.float32) for a, b in spans]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for pcm in pcms:
            decoder.decode(runner.step(pcm))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_decoder_graph_equals_eager() -> None:
    cfg = session_config("tiny", "gpu1", seed=2, dtype="bfloat16")
    h, w = cfg.model.latent_hw
    z = torch.randn(4, 1, cfg.model.dit.latent_channels, 1, h, w, generator=torch.Generator().manual_seed(3)).cuda()
    eager, graphed = DecoderRunner(cfg, device="cuda"), DecoderRunner(cfg, device="cuda")
    graphed.capture_graph()
    eager.start()
    graphed.start()
    for k in range(4):
        a, b = eager.decode(z[k]), graphed.decode(z[k])
        assert (a.int() - b.int()).abs().max() <= 1
