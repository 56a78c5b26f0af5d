"""Tensor parallelism over gloo on the CPU: TP=2, 3 and 4 sessions equal TP=1, with and without sequence
parallelism, with NCCL-style collectives and with the ring-overlapped ones, and switching between them."""

from __future__ import annotations

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
from characters.tp import TokenShards

CHUNKS = 5


def _topology(sequence_parallel: bool) -> dict[str, object]:
    # the rank count comes from DiTRunner's `ranks`; the topology carries the parallelism options. float32 GEMMs on
    # one rank too (`cpu_matmul`: bf16 ones serve one rank only, and round otherwise than the ranks' split GEMMs)
    return {"name": "cpu", "dit_ranks": 1, "decoder_gpus": 0, "sequence_parallel": sequence_parallel,
            "cpu_matmul": "float32"}


def _cfg(sequence_parallel: bool = True):  # type: ignore[no-untyped-def]
    # 6 heads split over 2 and 3 ranks; over 4, tiny's own 4 heads (`_cfg_for`)
    return session_config("tiny", _topology(sequence_parallel), seed=9,
                          model={"dit": {"num_layers": 2, "num_heads": 6}})


def _cfg_for(ranks: int, sequence_parallel: bool = True):  # type: ignore[no-untyped-def]
    cfg = _cfg(sequence_parallel)
    if cfg.model.dit.num_heads % ranks:
        cfg = session_config("tiny", _topology(sequence_parallel), seed=9, model={"dit": {"num_layers": 2}})
    return cfg


def _session(runner: DiTRunner, switch_at: int | None = None) -> list[torch.Tensor]:
    h, w = runner.cfg.model.latent_hw
    ref = torch.randn(1, runner.cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(1))
    runner.start(ref)
    rng = np.random.default_rng(0)
    outs = []
    for k in range(CHUNKS):
        if k == switch_at:
            runner.set_tp_overlap("ring")
        pcm = rng.uniform(-0.5, 0.5, runner.frontend.expected_samples).astype(np.float32)
        outs.append(runner.step(pcm).clone())
    return outs


def _spawn(fn: Callable[..., None], ranks: int, *args: object) -> None:
    mp.spawn(_bootstrap, args=(fn, ranks, free_port(), *args), nprocs=ranks, join=True)


def _bootstrap(rank: int, fn: Callable[..., None], ranks: int, port: int, *args: object) -> None:
    torch.set_num_threads(1)
    join("gloo", port, rank, ranks)
    done = False
    try:
        fn(rank, ranks, *args)  # every runner `fn` built over the group is gone when it returns
        done = True
    finally:
        released = leave(wait=done)
    assert released, f"rank {rank}: the process group outlived destroy_process_group (see characters.process_group)"


def _session_rank(rank: int, ranks: int, sp: bool, overlap: str, switch_at: int | None, out_path: str) -> None:
    runner = DiTRunner(_cfg_for(ranks, sp), group=dist.group.WORLD, rank=rank, ranks=ranks,
                       tp_overlap=overlap)  # type: ignore[arg-type]
    torch.save(_session(runner, switch_at), f"{out_path}.{rank}")




@pytest.mark.parametrize(("ranks", "sp", "overlap", "switch_at"), [
    (2, False, "none", None),  # all-reduce after the row layers, every rank holds every token
    (2, True, "none", None),
    (2, True, "ring", None),
    (3, True, "ring", None),
    (4, True, "none", None),
    (4, True, "ring", None),
    (3, True, "none", 2),  # switched to the ring between chunks 1 and 2
])
def test_tensor_parallel_equals_single_rank(ranks: int, sp: bool, overlap: str, switch_at: int | None,
                                            tmp_path) -> None:
    expected = _session(DiTRunner(_cfg_for(ranks)))
    _spawn(_session_rank, ranks, sp, overlap, switch_at, str(tmp_path / "out"))
    for rank in range(ranks):
        got = torch.load(tmp_path / f"out.{rank}")
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the collectives next to the GEMMs

def _shards_rank(rank: int, ranks: int, tokens: int, batch: int, out_path: str) -> None:
    g = torch.Generator().manual_seed(3)  # every rank draws the same whole tensors
    x = torch.randn(batch, tokens, 40, generator=g)  # (B, T, K) the residual stream, whole
    w_col = torch.randn(24, 40, generator=g)  # this rank's column block (any: same on every rank is fine)
    b_col = torch.randn(24, generator=g)
    h = torch.randn(ranks, batch, tokens, 16, generator=g)  # (n, B, T, K/n): each rank's slice of a row input
    w_row = torch.randn(ranks, 40, 16, generator=g)  # each rank's row block
    b_row = torch.randn(40, generator=g)
    got = {}
    for overlap in ("none", "ring"):
        shards = TokenShards(rank, ranks, dist.group.WORLD, overlap=overlap)  # type: ignore[arg-type]
        shards.begin(tokens)
        local = shards.split(x)  # (B, m, K)
        got[f"gather_linear_{overlap}"] = shards.gather_linear(local, w_col, b_col)
        got[f"reduce_scatter_{overlap}"] = shards.linear_reduce_scatter(h[rank], w_row[rank], b_row)
        got["gather"] = shards.gather(local)
    torch.save(got, f"{out_path}.{rank}")


@pytest.mark.parametrize(("ranks", "tokens", "batch"), [(2, 10, 1), (3, 10, 1), (4, 12, 2), (3, 2, 1)])
def test_token_shards_collectives_equal_the_whole(ranks: int, tokens: int, batch: int, tmp_path) -> None:
    """gather+linear and linear+reduce-scatter, NCCL-style and ring, equal the unsplit computation: tokens
    that the ranks divide and that they do not (padding), B > 1, and fewer tokens than ranks."""
    _spawn(_shards_rank, ranks, tokens, batch, str(tmp_path / "out"))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, tokens, 40, generator=g)
    w_col, b_col = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    h, w_row = torch.randn(ranks, batch, tokens, 16, generator=g), torch.randn(ranks, 40, 16, generator=g)
    b_row = torch.randn(40, generator=g)
    col = F.linear(x, w_col, b_col)  # (B, T, 24)
    row = sum(F.linear(h[r], w_row[r]) for r in range(ranks)) + b_row  # (B, T, 40)
    m = -(-tokens // ranks)
    for rank in range(ranks):
        got = torch.load(tmp_path / f"out.{rank}")
        torch.testing.assert_close(got["gather"], x)
        for overlap in ("none", "ring"):
            torch.testing.assert_close(got[f"gather_linear_{overlap}"], col)
            mine = got[f"reduce_scatter_{overlap}"]  # (B, m, 40): this rank's rows, zero past T
            assert mine.shape == (batch, m, 40)
            lo, hi = min(rank * m, tokens), min((rank + 1) * m, tokens)
            torch.testing.assert_close(mine[:, :hi - lo], row[:, lo:hi])
            assert not mine[:, hi - lo:].any()


def test_rank_holds_its_share_of_heads_and_tokens() -> None:
    runner = DiTRunner(_cfg_for(4), rank=1, ranks=4, communicate=False)
    attn = runner.dit.blocks[0].self_attn
    assert attn.num_heads == 1 and attn.qkv.weight.shape == (3 * 48, 192)
    assert runner.dit.blocks[0].fc1.weight.shape == (768 // 4, 192)
    assert runner.cache.k.shape[2] == 1  # (L, B, Hh, S, Dh): one local head
    shards = runner.dit.shards
    assert shards is not None and attn.qkv.shards is shards and runner.dit.blocks[0].cross_attn.kv.shards is None
    shards.begin(runner.cfg.model.tokens_per_chunk)
    assert shards.rows == 47  # ceil(187 / 4): the token-wise work of one rank


def test_tensor_parallel_split_that_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by 3"):
        DiTRunner(_cfg_for(4), rank=0, ranks=3, communicate=False)


def test_unknown_overlap_is_refused() -> None:
    with pytest.raises(ValueError, match="tp overlap='fused' is unknown"):
        TokenShards(0, 2, None, overlap="fused")  # type: ignore[arg-type]


def test_switching_the_overlap_needs_sequence_parallel_collectives() -> None:
    replicated = DiTRunner(_cfg_for(4, sequence_parallel=False), rank=1, ranks=4, communicate=False)
    with pytest.raises(ValueError, match="tp overlap='ring' applies to sequence-parallel collectives"):
        replicated.set_tp_overlap("ring")
    split = DiTRunner(_cfg_for(4), rank=1, ranks=4, communicate=False)
    split.set_tp_overlap("ring")
    assert split.dit.shards is not None and split.dit.shards.overlap == "ring"


def test_symm_mem_overlap_on_cpu_is_refused_with_the_alternatives() -> None:
    shards = TokenShards(0, 2, None, overlap="symm_mem")
    shards.begin(10)
    with pytest.raises(ValueError, match=r"needs CUDA tensors with batch 1; got cpu.*use overlap='ring' or 'none'"):
        shards.gather_linear(torch.zeros(1, 5, 4), torch.zeros(3, 4), None)


def _forward_flops(sp: bool, ranks: int = 4) -> tuple[int, object]:
    """GEMM FLOPs (FlopCounterMode) of one full-context forward of a rank built without communication, the way
    the benchmarks build one rank of a TP session; and its session config."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = session_config("tiny", {"name": "t", "dit_ranks": ranks, "decoder_gpus": 0, "sequence_parallel": sp},
                         seed=1, model={"dit": {"num_layers": 2}})
    runner = DiTRunner(cfg, rank=1, ranks=ranks, communicate=False)
    h, w = cfg.model.latent_hw
    runner.start(torch.randn(1, cfg.model.dit.latent_channels, h, w))
    windows = runner.frontend.push(np.zeros(runner.frontend.expected_samples, dtype=np.float32))
    for _ in range(cfg.model.generation.ring_slots):  # the full context
        runner.step_windows(windows)
    ctx, k = runner.audio_context(windows), runner.chunk
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        runner.dit(runner.x, runner.times[runner.sigmas[0]], ctx, runner.rope.chunk(0), runner.cache,
                   runner.cache.chunk_offset(k), runner.cache.chunk_valid(k))
    return counter.get_total_flops(), cfg


def test_a_rank_without_communication_runs_exactly_its_share_of_the_gemms() -> None:
    """The benchmarks' rank (collectives left out) must do the GEMM work of one rank of the session: every
    token through its column and row blocks, whatever the token layout. Checked against the FLOP model the
    floors use (attention and the audio embedding, not counted here, taken out of it)."""
    from characters.flops import build_meta_dit, chunk_cost

    for sp in (True, False):
        counted, cfg = _forward_flops(sp)
        m, cost = cfg.model, chunk_cost(cfg)  # type: ignore[attr-defined]
        d, t = m.dit, m.tokens_per_chunk
        attention = d.num_layers * (4 * t * m.cache_tokens * d.dim + 4 * t * m.audio_tokens_per_latent * d.dim) // 4
        audio = sum(2 * m.generation.latent_frames_per_chunk * m.audio_tokens_per_latent * p.numel()
                    for n, p in build_meta_dit(m).audio_embed.named_parameters() if n.endswith("weight"))
        expected = cost.flops_per_chunk_per_rank / cost.forwards_per_chunk - attention - audio
        assert counted == pytest.approx(expected, rel=2e-3), sp
    # sequence parallelism only moves the per-token embedding and head to this rank's rows
    sp_flops, cfg = _forward_flops(True)
    rep_flops, _ = _forward_flops(False)
    model = cfg.model  # type: ignore[attr-defined]
    per_token = 2 * model.dit.dim * model.dit.latent_channels * model.dit.patch_size[0] * model.dit.patch_size[1]
    rows = -(-model.tokens_per_chunk // 4)
    assert rep_flops - sp_flops == 2 * per_token * (model.tokens_per_chunk - rows)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("tokens", "batch"), [(10, 1), (12, 1), (10, 2)])
def test_a_row_layer_writes_its_padded_output_in_place(fp8: bool, tokens: int, batch: int) -> None:
    """Under sequence parallelism a row layer's GEMM writes into a buffer padded to the ranks' rows (its padding
    zero), so the reduce-scatter copies nothing when the ranks do not divide T; the rank's rows are still the
    GEMM's, zero past T. One rank's share (no collectives), bf16 and FP8 (the emulated reference on a CPU)."""
    from characters.tp import ParallelLinear
    from kernels.fp8 import fp8_linear_ref, quantize_rows_ref

    ranks, rank = 3, 2
    g = torch.Generator().manual_seed(tokens)
    shards = TokenShards(rank, ranks, None, communicate=False)
    shards.begin(tokens)
    layer = ParallelLinear(48, 20, "row")
    layer.shard_(rank, ranks, None, communicate=False, shards=shards)
    if fp8:
        layer.to_fp8_()
    x = torch.randn(batch, tokens, 16, generator=g)  # (B, T, K/n): this rank's slice of the input, every token
    copies: list[torch.Size] = []
    padded_copy = shards._padded
    shards._padded = lambda t: copies.append(t.shape) or padded_copy(t)  # type: ignore[method-assign]
    with torch.no_grad():
        y = layer(x)
        if fp8:
            act = quantize_rows_ref(x)
            whole = fp8_linear_ref(act.data, act.scale, layer.weight, layer.weight_scale, None, torch.float32)
        else:
            whole = F.linear(x, layer.weight)  # rank 2 adds no bias: rank 0 does, once
    # the reduce-scatter pads by a copy only where the ranks do not divide T and the GEMM could not write into a
    # padded buffer (B > 1)
    assert copies == ([torch.Size((batch, tokens, 20))] if tokens % ranks and batch > 1 else [])
    m = -(-tokens // ranks)
    assert y.shape == (batch, m, 20)
    lo, hi = min(rank * m, tokens), min((rank + 1) * m, tokens)
    torch.testing.assert_close(y[:, :hi - lo], whole[:, lo:hi].to(y.dtype))
    assert not y[:, hi - lo:].any()
    padded = shards.row_buffer(x, 20, x.dtype)
    assert (padded is None) == (tokens % ranks == 0 or batch > 1)
    if padded is not None:
        assert padded.shape == (1, ranks * m, 20) and not padded[:, tokens:].any()
