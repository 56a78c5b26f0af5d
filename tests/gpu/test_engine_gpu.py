"""The engine on a CUDA GPU: graph replay equals eager, and the step never synchronises the host."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest
import torch

from characters.audio import chunk_sample_range
from characters.config import session_config
from characters.engine import DecoderRunner, DiTRunner
from kernels.attention import AttentionBackend

pytestmark = pytest.mark.gpu

CHUNKS = 7


def _runner(dtype: str, attention_backend: AttentionBackend | Literal["auto"] = "auto", **gen: object) -> DiTRunner:
    cfg = session_config("tiny", "gpu1", seed=2, dtype=dtype, model={"generation": gen} if gen else {})
    return DiTRunner(cfg, device="cuda", attention_backend=attention_backend)


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
    first = _runner(dtype)
    eager = _session(first, graphs=False)
    # the same attention kernel on both sides: "auto" times the backends and may pick another for the second runner
    # (a first run on a fresh H200 took sdpa, then sdpa_efficient: 0.027 apart in bfloat16 after one step)
    graphed = _session(_runner(dtype, first.attention_backend), graphs=True)
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5 if dtype == "float32" else 2e-2, rtol=1e-4)


def test_graph_replay_equals_eager_with_extra_cache_pass() -> None:
    first = _runner("float32", cache_update="extra_pass", denoising_steps=3)
    eager = _session(first, graphs=False)
    graphed = _session(_runner("float32", first.attention_backend, cache_update="extra_pass", denoising_steps=3),
                       graphs=True)
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_chunk_given_up_between_part_graphs_goes_on_as_eager() -> None:
    """The step's parts as graphs (tiny: 4 blocks, a graph each), chunk 3 given up at the second ask (parts 0 and 1
    ran, on the GPU as in eager), the chunks after it: as the eager runner with the same give-up makes them."""
    def session(runner: DiTRunner, graphs: bool) -> list[torch.Tensor | None]:
        if graphs:
            runner.capture_graphs()
            assert [len(g) for g in runner.graphs.values()] == [4] * len(runner.graphs)
        h, w = runner.cfg.model.latent_hw
        ref = torch.randn(1, runner.cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(1))
        runner.start(ref.cuda())
        rng, outs = np.random.default_rng(0), []
        for k in range(CHUNKS):
            asks: list[int] = []
            pcm = rng.uniform(-0.5, 0.5, runner.frontend.expected_samples).astype(np.float32)
            outs.append(runner.step(pcm, stop=lambda: asks.append(1) or (k == 3 and len(asks) == 2)))  # noqa: B023
        return outs

    first = _runner("float32")
    eager = session(first, graphs=False)
    graphed = session(_runner("float32", first.attention_backend), graphs=True)
    assert eager[3] is None and graphed[3] is None
    for a, b in zip(eager, graphed, strict=True):
        if a is not None and b is not None:
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
        for k, pcm in enumerate(pcms):
            if k % 2:  # a speech onset's chunk: its first frame, then the rest (each a graph replay)
                decoder.decode_first(runner.step(pcm))
                decoder.decode_rest()
            else:
                decoder.decode(runner.step(pcm))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("parts", [True, False], ids=["with_parts", "whole_only"])
def test_decoder_graph_equals_eager(parts: bool) -> None:
    """The whole-chunk graph, captured with or without the two parts' graphs (`onset_first_frame` off: without)."""
    cfg = session_config("tiny", "gpu1", seed=2, dtype="bfloat16")
    h, w = cfg.model.latent_hw
    z = torch.randn(4, 1, cfg.model.dit.latent_channels, 1, h, w, generator=torch.Generator().manual_seed(3)).cuda()
    eager, graphed = DecoderRunner(cfg, device="cuda"), DecoderRunner(cfg, device="cuda")
    graphed.capture_graph(parts=parts)
    assert (graphed._graphs is not None) == parts
    eager.start()
    graphed.start()
    for k in range(4):
        a, b = eager.decode(z[k]), graphed.decode(z[k])
        assert (a.int() - b.int()).abs().max() <= 1


@pytest.mark.parametrize("preset", ["tiny", "wan-1.3b"])
def test_window_decoder_graph_is_as_accurate_as_the_concatenating_path(preset: str) -> None:
    """The serving decoder (windows written by the fused norm + SiLU, biases folded, conv_out padded, cuDNN
    search, one graph replay) in bf16 is as close to the float32 decoder as the concatenating bf16 path is,
    chunk after chunk (random weights: the deep Wan-size decoder amplifies bf16 rounding either way)."""
    z = torch.randn(3, 1, 16, 3, 60, 104, generator=torch.Generator().manual_seed(3)).cuda()

    def frames(dtype: str, **kw: bool) -> list[torch.Tensor]:
        cfg = session_config(preset, "gpu1", seed=2, dtype=dtype)
        h, w = cfg.model.latent_hw
        cf = cfg.model.generation.latent_frames_per_chunk
        runner = DecoderRunner(cfg, device="cuda", **kw)
        if kw.get("windows", True):
            runner.capture_graph()
        runner.start()
        return [runner.decode(z[k, :, : cfg.model.vae.latent_channels, :cf, :h, :w]).float() for k in range(3)]

    exact = frames("float32", windows=False, compile=False)
    plain = frames("bfloat16", windows=False, compile=False)
    serving = frames("bfloat16")
    for k in range(3):
        assert serving[k].shape == exact[k].shape
        err_plain, err_serving = (plain[k] - exact[k]).abs().mean(), (serving[k] - exact[k]).abs().mean()
        assert err_serving <= 1.1 * err_plain + 0.05, (k, err_serving.item(), err_plain.item())
        assert (serving[k] - exact[k]).abs().max() <= (plain[k] - exact[k]).abs().max() + 4


@pytest.mark.parametrize("preset", ["tiny", "wan-1.3b"])
def test_decoder_first_frame_then_rest_is_the_whole_chunk(preset: str) -> None:
    """An onset's chunk in two parts (`decode_first` + `decode_rest`, each its own graph) gives the whole chunk's
    frames, as accurate against float32 as the whole chunk's graph, and the stream goes on as if decoded whole
    (chunks alternate: two parts, whole, ...; the 1.3B preset has 3 latent frames, 12 video frames, a chunk)."""
    z = torch.randn(4, 1, 16, 3, 60, 104, generator=torch.Generator().manual_seed(4)).cuda()

    def frames(dtype: str, split: bool, **kw: bool) -> list[torch.Tensor]:
        cfg = session_config(preset, "gpu1", seed=2, dtype=dtype)
        h, w = cfg.model.latent_hw
        cf = cfg.model.generation.latent_frames_per_chunk
        runner = DecoderRunner(cfg, device="cuda", **kw)
        if dtype == "bfloat16":
            runner.capture_graph()
        runner.start()
        out = []
        for k in range(4):
            zk = z[k, :, : cfg.model.vae.latent_channels, :cf, :h, :w]
            if split and k % 2:
                first = runner.decode_first(zk)
                assert len(first) == 1
                out.append(torch.cat([first, runner.decode_rest()]).float())
            else:
                out.append(runner.decode(zk).float())
        return out

    exact = frames("float32", False, windows=True)
    whole, parts = frames("bfloat16", False), frames("bfloat16", True)
    for k in range(4):
        assert parts[k].shape == whole[k].shape == exact[k].shape
        err_whole, err_parts = (whole[k] - exact[k]).abs().mean(), (parts[k] - exact[k]).abs().mean()
        assert err_parts <= 1.1 * err_whole + 0.05, (k, err_parts.item(), err_whole.item())
        assert (parts[k] - exact[k]).abs().max() <= (whole[k] - exact[k]).abs().max() + 4
