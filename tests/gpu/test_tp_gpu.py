"""Sequence-parallel tensor parallelism over NCCL on 2 GPUs: every overlap mode equals the unsplit
computation (the collectives next to the GEMMs) and a TP=2 session equals TP=1 (needs 2 GPUs)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from characters.config import session_config
from characters.engine import DiTRunner
from characters.process_group import free_port, join, leave
from characters.tp import OVERLAPS, TokenShards

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nvidia-h200-x2 or larger)"),
]
RANKS = 2


def _spawn(fn: Callable[..., None], *args: object) -> None:
    mp.spawn(_bootstrap, args=(fn, free_port(), *args), nprocs=RANKS, join=True)


def _bootstrap(rank: int, fn: Callable[..., None], port: int, *args: object) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    join("nccl", port, rank, RANKS, device=device)
    done = False
    try:
        fn(rank, device, *args)
        done = True
    finally:
        leave(wait=done)


def _whole(tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(3)
    return {"x": torch.randn(1, tokens, 256, generator=g, device=device, dtype=torch.bfloat16),
            "w_col": torch.randn(128, 256, generator=g, device=device, dtype=torch.bfloat16) / 16,
            "b_col": torch.randn(128, generator=g, device=device, dtype=torch.bfloat16),
            "h": torch.randn(RANKS, 1, tokens, 128, generator=g, device=device, dtype=torch.bfloat16),
            "w_row": torch.randn(RANKS, 256, 128, generator=g, device=device, dtype=torch.bfloat16) / 16,
            "b_row": torch.randn(256, generator=g, device=device, dtype=torch.bfloat16)}


def _shards_rank(rank: int, device: torch.device, tokens: int, out_path: str) -> None:
    t = _whole(tokens, device)
    got = {}
    for overlap in OVERLAPS:
        shards = TokenShards(rank, RANKS, dist.group.WORLD, overlap=overlap)
        shards.begin(tokens)
        got[f"col_{overlap}"] = shards.gather_linear(shards.split(t["x"]), t["w_col"], t["b_col"]).cpu()
        got[f"row_{overlap}"] = shards.linear_reduce_scatter(t["h"][rank], t["w_row"][rank], t["b_row"]).cpu()
    torch.save(got, f"{out_path}.{rank}")


@pytest.mark.parametrize("tokens", [64, 63])
def test_collectives_over_nccl_equal_the_whole(tokens: int, tmp_path) -> None:
    _spawn(_shards_rank, tokens, str(tmp_path / "out"))
    t = {k: v.float().cpu() for k, v in _whole(tokens, torch.device("cuda", 0)).items()}
    col = F.linear(t["x"], t["w_col"], t["b_col"])
    row = sum(F.linear(t["h"][r], t["w_row"][r]) for r in range(RANKS)) + t["b_row"]
    m = -(-tokens // RANKS)
    for rank in range(RANKS):
        got = torch.load(tmp_path / f"out.{rank}")
        for overlap in OVERLAPS:
            torch.testing.assert_close(got[f"col_{overlap}"].float(), col, atol=0.1, rtol=0.02)
            mine = got[f"row_{overlap}"].float()
            lo, hi = rank * m, min((rank + 1) * m, tokens)
            torch.testing.assert_close(mine[:, :hi - lo], row[:, lo:hi], atol=0.1, rtol=0.02)


def _cfg(overlap: str = "none", sp: bool = True, local: bool = False):  # type: ignore[no-untyped-def]
    topo = {"name": "tp2", "dit_ranks": 1, "decoder_gpus": 0, "tp_overlap": overlap, "sequence_parallel": sp,
            "local_layers": local}
    return session_config("tiny", topo, seed=9, dtype="float32", model={"dit": {"num_layers": 2}})


def _session(runner: DiTRunner) -> list[torch.Tensor]:
    h, w = runner.cfg.model.latent_hw
    ref = torch.randn(1, runner.cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(1))
    runner.start(ref)
    rng = np.random.default_rng(0)
    return [runner.step(rng.uniform(-0.5, 0.5, runner.frontend.expected_samples).astype(np.float32)).cpu()
            for _ in range(3)]


def _session_rank(rank: int, device: torch.device, overlap: str, sp: bool, local: bool, out_path: str) -> None:
    runner = DiTRunner(_cfg(overlap, sp, local), device=device, group=dist.group.WORLD, rank=rank, ranks=RANKS,
                       attention_backend="sdpa")
    torch.save(_session(runner), f"{out_path}.{rank}")


@pytest.mark.parametrize(("overlap", "sp", "local"),
                         [(o, True, False) for o in OVERLAPS] + [("none", False, False), ("none", True, True)])
def test_tp2_session_over_nccl_equals_one_gpu(overlap: str, sp: bool, local: bool, tmp_path) -> None:
    expected = _session(DiTRunner(_cfg(), device="cuda:0", attention_backend="sdpa"))
    torch.cuda.synchronize()
    _spawn(_session_rank, overlap, sp, local, str(tmp_path / "out"))
    for rank in range(RANKS):
        for a, b in zip(torch.load(tmp_path / f"out.{rank}"), expected, strict=True):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
