"""Tensor parallelism over gloo on the CPU: TP=2 and TP=4 sessions equal TP=1."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from characters.config import session_config
from characters.engine import DiTRunner

CHUNKS = 5


def _cfg():  # type: ignore[no-untyped-def]
    return session_config("tiny", "cpu", seed=9, model={"dit": {"num_layers": 2}})


def _session(runner: DiTRunner) -> list[torch.Tensor]:
    h, w = runner.cfg.model.latent_hw
    ref = torch.randn(1, runner.cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(1))
    runner.start(ref)
    rng = np.random.default_rng(0)
    outs = []
    for _ in range(CHUNKS):
        pcm = rng.uniform(-0.5, 0.5, runner.frontend.expected_samples).astype(np.float32)
        outs.append(runner.step(pcm).clone())
    return outs


def _rank(rank: int, ranks: int, port: int, out_path: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    try:
        runner = DiTRunner(_cfg(), group=dist.group.WORLD, rank=rank, ranks=ranks)
        outs = _session(runner)
        torch.save(outs, f"{out_path}.{rank}")
        dist.barrier()  # no rank tears gloo down while its peer is still using the connection
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_equals_single_rank(ranks: int, tmp_path) -> None:
    expected = _session(DiTRunner(_cfg()))
    mp.spawn(_rank, args=(ranks, _free_port(), str(tmp_path / "out")), nprocs=ranks, join=True)
    for rank in range(ranks):
        got = torch.load(tmp_path / f"out.{rank}")
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_rank_holds_its_share_of_heads() -> None:
    runner = DiTRunner(_cfg(), rank=1, ranks=4, communicate=False)
    attn = runner.dit.blocks[0].self_attn
    assert attn.num_heads == 1 and attn.qkv.weight.shape == (3 * 48, 192)
    assert runner.dit.blocks[0].fc1.weight.shape == (768 // 4, 192)
    assert runner.cache.k.shape[2] == 1  # (L, B, Hh, S, Dh): one local head


def test_tensor_parallel_split_that_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by 3"):
        DiTRunner(_cfg(), rank=0, ranks=3, communicate=False)
