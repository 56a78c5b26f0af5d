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


def _topology(sequence_parallel: bool, local_layers: bool = False, local_attention: bool = False
              ) -> dict[str, object]:
    # the rank count comes from DiTRunner's `ranks`; the topology carries the parallelism options. float32 GEMMs on
    # one rank too (`cpu_matmul`: bf16 ones serve one rank only, and round otherwise than the ranks' split GEMMs)
    return {"name": "cpu", "dit_ranks": 1, "decoder_gpus": 0, "sequence_parallel": sequence_parallel,
            "local_layers": local_layers or local_attention, "local_attention": local_attention,
            "cpu_matmul": "float32"}


def _cfg(sequence_parallel: bool = True, local_layers: bool = False, frames: int = 1,
         local_attention: bool = False):  # type: ignore[no-untyped-def]
    # 6 heads split over 2 and 3 ranks; over 4, tiny's own 4 heads (`_cfg_for`). `frames`: latent frames per chunk
    # (the audio cross-attention is per frame: > 1 puts frame boundaries inside a rank's rows)
    model: dict[str, object] = {"dit": {"num_layers": 2, "num_heads": 6}}
    if frames > 1:
        model["generation"] = {"latent_frames_per_chunk": frames, "window_latent_frames": 2 * frames}
    return session_config("tiny", _topology(sequence_parallel, local_layers, local_attention), seed=9, model=model)


def _cfg_for(ranks: int, sequence_parallel: bool = True, local_layers: bool = False,
             frames: int = 1, local_attention: bool = False):  # type: ignore[no-untyped-def]
    cfg = _cfg(sequence_parallel, local_layers, frames, local_attention)
    if cfg.model.dit.num_heads % ranks:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"dit": cfg.model.dit.model_copy(update={"num_heads": 4})})})
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


def _session_rank(rank: int, ranks: int, sp: bool, overlap: str, switch_at: int | None, local: bool, frames: int,
                  out_path: str) -> None:
    runner = DiTRunner(_cfg_for(ranks, sp, local, frames), group=dist.group.WORLD, rank=rank, ranks=ranks,
                       tp_overlap=overlap)  # type: ignore[arg-type]
    torch.save(_session(runner, switch_at), f"{out_path}.{rank}")


@pytest.mark.parametrize(("ranks", "sp", "overlap", "switch_at", "local", "frames"), [
    (2, False, "none", None, False, 1),  # all-reduce after the row layers, every rank holds every token
    (2, True, "none", None, False, 1),
    (2, True, "ring", None, False, 1),
    (3, True, "ring", None, False, 1),
    (4, True, "none", None, False, 1),
    (4, True, "ring", None, False, 1),
    (3, True, "none", 2, False, 1),  # switched to the ring between chunks 1 and 2
    # the MLP and the audio cross-attention kept whole on each rank's own tokens (T = 187: 3 and 4 ranks pad)
    (2, True, "none", None, True, 1),
    (3, True, "ring", None, True, 1),
    (4, True, "none", None, True, 1),
    (3, True, "none", None, True, 2),  # two frames a chunk (T = 374): rank 1's rows hold both frames' tokens
])
def test_tensor_parallel_equals_single_rank(ranks: int, sp: bool, overlap: str, switch_at: int | None, local: bool,
                                            frames: int, tmp_path) -> None:
    expected = _session(DiTRunner(_cfg_for(ranks, frames=frames)))
    _spawn(_session_rank, ranks, sp, overlap, switch_at, local, frames, str(tmp_path / "out"))
    for rank in range(ranks):
        got = torch.load(tmp_path / f"out.{rank}")
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _attention_rank(rank: int, ranks: int, frames: int, out_path: str) -> None:
    runner = DiTRunner(_cfg_for(ranks, frames=frames, local_attention=True), group=dist.group.WORLD, rank=rank,
                       ranks=ranks)
    torch.save(_session(runner), f"{out_path}.{rank}")


@pytest.mark.parametrize(("ranks", "frames"), [
    (2, 1),
    (3, 1),  # T = 187: the last rank's rows end in 2 padding rows, kept out of the cache
    (4, 2),  # two frames a chunk (T = 374), 2 padding rows
])
def test_local_attention_equals_single_rank(ranks: int, frames: int, tmp_path) -> None:
    """Self-attention kept whole on each rank's rows too (`topology.local_attention`): every rank gathers the
    chunk's K/V rows into its cache and attends its own queries; the session equals one rank's, chunk by chunk (the
    ring of cache slots turning over: 5 chunks, 3 slots)."""
    expected = _session(DiTRunner(_cfg_for(ranks, frames=frames)))
    _spawn(_attention_rank, ranks, frames, str(tmp_path / "out"))
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


# ---------------------------------------------------------------- token-local layers kept whole

def test_local_layers_keep_the_token_local_layers_whole_and_split_self_attention() -> None:
    runner = DiTRunner(_cfg_for(4, local_layers=True), rank=1, ranks=4, communicate=False)
    block = runner.dit.blocks[0]
    assert block.self_attn.num_heads == 1 and block.self_attn.qkv.weight.shape == (3 * 48, 192)  # split as before
    assert block.fc1.weight.shape == (768, 192) and block.fc2.weight.shape == (192, 768)  # whole
    cross = block.cross_attn
    assert cross.num_heads == 4 and cross.q.weight.shape == cross.o.weight.shape == (192, 192)
    assert cross.kv.weight.shape == (2 * 192, 192)
    assert cross.local_shards is runner.dit.shards
    assert all(m.kept_whole for m in (block.fc1, block.fc2, cross.q, cross.kv, cross.o))
    assert not block.self_attn.qkv.kept_whole and block.fc1.shards is None and block.self_attn.qkv.shards is not None


def test_local_attention_keeps_self_attention_whole_with_every_head_in_the_cache() -> None:
    runner = DiTRunner(_cfg_for(4, local_attention=True), rank=1, ranks=4, communicate=False)
    attn = runner.dit.blocks[0].self_attn
    assert attn.num_heads == 4 and attn.qkv.weight.shape == (3 * 192, 192) and attn.o.weight.shape == (192, 192)
    assert attn.qkv.kept_whole and attn.o.kept_whole and attn.qkv.shards is None and attn.o.shards is None
    assert attn.local_shards is runner.dit.shards is runner.dit.kv_shards
    assert runner.cache.k.shape[2] == 4  # every head's keys
    split = DiTRunner(_cfg_for(4, local_layers=True), rank=1, ranks=4, communicate=False)
    assert split.dit.kv_shards is None and split.cache.k.shape[2] == 1


def _gathers_per_chunk(runner: DiTRunner) -> dict[str, int]:
    """The TokenShards calls one chunk's forward makes (the reference frame's pass aside)."""
    shards = runner.dit.shards
    assert shards is not None
    calls = {"gather": 0, "reduce_scatter": 0, "gather_blocks": 0}
    for name in calls:
        method = getattr(shards, name)

        def counted(*a: object, _name: str = name, _method: Callable[..., torch.Tensor] = method) -> torch.Tensor:
            calls[_name] += 1
            return _method(*a)

        setattr(shards, name, counted)
    h, w = runner.cfg.model.latent_hw
    runner.start(torch.randn(1, runner.cfg.model.dit.latent_channels, h, w))
    calls.update(gather=0, reduce_scatter=0, gather_blocks=0)
    runner.step(np.zeros(runner.frontend.expected_samples, dtype=np.float32))
    return calls


def test_local_attention_gathers_only_the_key_value_rows() -> None:
    """Per block one gather of every rank's K/V rows and no reduce-scatter; the head's gather per pass. The counts
    and the bytes (K and V of every rank's m rows, padding included) are what `chunk_collectives` lists."""
    from characters.flops import chunk_collectives

    cfg = _cfg_for(3, local_attention=True)
    calls = _gathers_per_chunk(DiTRunner(cfg, rank=2, ranks=3, communicate=False))
    layers = cfg.model.dit.num_layers
    passes = calls["gather"]
    assert passes >= 1 and calls == {"gather": passes, "reduce_scatter": 0, "gather_blocks": passes * layers}
    listed = chunk_collectives(cfg.model_copy(update={"topology": cfg.topology.model_copy(update={"dit_ranks": 3})}))
    assert sum(c.calls for c in listed if c.op == "reduce_scatter") == 0
    kv = [c for c in listed if "K/V" in c.what]
    t, d = cfg.model.tokens_per_chunk, cfg.model.dit.dim
    assert [(c.calls, c.bytes) for c in kv] == [(passes * layers, 2 * 3 * -(-t // 3) * d * 4)]  # float32 rows
    assert sum(c.calls for c in listed if c.op == "all_gather") == passes * (layers + 1)


def test_local_attention_needs_the_token_local_layers_whole() -> None:
    from characters.dit import CausalDiT
    from characters.tp import apply_tensor_parallel

    with pytest.raises(ValueError, match=r"local_attention=true needs topology\.local_layers=true"):
        session_config("tiny", {**_topology(True), "local_attention": True})
    with torch.device("meta"), pytest.raises(ValueError, match=r"local_attention .* needs local_layers=True"):
        apply_tensor_parallel(CausalDiT(_cfg_for(2).model), rank=0, size=2, communicate=False,
                              sequence_parallel=True, local_attention=True)


def _collectives_per_forward(local: bool) -> tuple[int, int]:
    """All-gathers and reduce-scatters one rank's forward calls (built without communication: the calls are the
    same, each gather filling only this rank's rows)."""
    calls = _gathers_per_chunk(DiTRunner(_cfg_for(4, local_layers=local), rank=1, ranks=4, communicate=False))
    return calls["gather"], calls["reduce_scatter"]


def test_local_layers_leave_only_self_attention_communicating() -> None:
    """Per block: 3 all-gathers and 3 reduce-scatters split (self-attention, audio cross-attention, MLP), 1 and 1
    with the token-local layers whole; plus the head's gather of the output, per pass. `chunk_collectives` (what
    the latency budget's estimate counts) lists the same calls."""
    from characters.flops import chunk_collectives

    layers = _cfg_for(4).model.dit.num_layers
    split, whole = _collectives_per_forward(False), _collectives_per_forward(True)
    passes = split[1] // (3 * layers)
    assert passes >= 1 and split == (passes * (3 * layers + 1), passes * 3 * layers)
    assert whole == (passes * (layers + 1), passes * layers)
    for local, counted in ((False, split), (True, whole)):
        cfg = _cfg_for(4, local_layers=local)
        listed = chunk_collectives(cfg.model_copy(update={"topology": cfg.topology.model_copy(
            update={"dit_ranks": 4})}))
        assert tuple(sum(c.calls for c in listed if c.op == op) for op in ("all_gather", "reduce_scatter")) == counted
        t, d = cfg.model.tokens_per_chunk, cfg.model.dit.dim
        assert {c.bytes for c in listed if c.op == "reduce_scatter"} == {t * d * 4}  # (T, D) float32, whole


@pytest.mark.parametrize(("tokens", "ranks", "frames", "expected"), [
    (12, 3, 1, [[(0, 4, 0)], [(0, 4, 0)], [(0, 4, 0)]]),
    (12, 3, 2, [[(0, 4, 0)], [(0, 2, 0), (2, 4, 1)], [(0, 4, 1)]]),
    (10, 4, 2, [[(0, 3, 0)], [(0, 2, 0), (2, 3, 1)], [(0, 3, 1)], [(0, 3, 1)]]),  # rank 3: 1 row + 2 of padding
    (3, 4, 3, [[(0, 1, 0)], [(0, 1, 1)], [(0, 1, 2)], [(0, 1, 2)]]),  # rank 3: padding only
    (12, 2, 4, [[(0, 3, 0), (3, 6, 1)], [(0, 3, 2), (3, 6, 3)]]),
])
def test_frame_segments_cover_each_ranks_rows_in_frame_runs(tokens: int, ranks: int, frames: int,
                                                             expected: list[list[tuple[int, int, int]]]) -> None:
    for rank in range(ranks):
        shards = TokenShards(rank, ranks, None, communicate=False)
        shards.begin(tokens)
        assert shards.frame_segments(frames) == expected[rank]


def test_frame_segments_refuse_tokens_that_do_not_split_into_frames() -> None:
    shards = TokenShards(0, 2, None, communicate=False)
    shards.begin(10)
    with pytest.raises(ValueError, match="T=10 tokens do not split into 3 frames"):
        shards.frame_segments(3)


def test_local_layers_need_sequence_parallelism() -> None:
    with pytest.raises(ValueError, match=r"local_layers=true needs topology\.sequence_parallel=true"):
        _cfg_for(2, sequence_parallel=False, local_layers=True)
    from characters.dit import CausalDiT
    from characters.tp import apply_tensor_parallel

    with torch.device("meta"), pytest.raises(ValueError, match=r"local_layers .* needs sequence_parallel=True"):
        apply_tensor_parallel(CausalDiT(_cfg_for(2).model), rank=0, size=2, communicate=False, local_layers=True)


def test_local_layers_load_the_whole_checkpoint_not_a_rank_shard(tmp_path) -> None:
    """Shard files hold 1/n of every split layer; a model keeping the token-local layers whole reads their whole
    weights from dit.safetensors, and says what to do when the checkpoint has only shards."""
    from characters.weights import save_dit_shards, save_weights

    whole = DiTRunner(_cfg_for(2))
    save_dit_shards(whole.dit, tmp_path, 2)
    save_weights(whole.audio_encoder, tmp_path / "audio.safetensors")
    cfg = _cfg_for(2, local_layers=True).model_copy(update={"weights": str(tmp_path), "seed": 5})
    with pytest.raises(FileNotFoundError, match=r"no dit\.safetensors: topology\.local_layers keeps the MLP"):
        DiTRunner(cfg, rank=1, ranks=2, communicate=False)
    save_weights(whole.dit, tmp_path / "dit.safetensors")
    loaded = DiTRunner(cfg, rank=1, ranks=2, communicate=False)  # seed 5: weights unlike the seeded ones
    block, ref = loaded.dit.blocks[1], whole.dit.blocks[1]
    torch.testing.assert_close(block.fc1.weight, ref.fc1.weight)  # whole
    torch.testing.assert_close(block.cross_attn.o.weight, ref.cross_attn.o.weight)
    torch.testing.assert_close(block.self_attn.o.weight, ref.self_attn.o.weight[:, 96:])  # rank 1's half


def test_a_rank_reads_its_slices_of_the_whole_checkpoint_and_refuses_one_of_another_shape(tmp_path) -> None:
    """Without shard files each rank cuts its slices from dit.safetensors, one tensor at a time; a checkpoint of
    another width is refused naming the tensors (not a shape error from deep inside PyTorch)."""
    from characters.weights import save_weights

    whole = DiTRunner(_cfg_for(2))
    save_weights(whole.dit, tmp_path / "dit.safetensors")
    save_weights(whole.audio_encoder, tmp_path / "audio.safetensors")
    rank = DiTRunner(_cfg_for(2).model_copy(update={"weights": str(tmp_path), "seed": 5}), rank=1, ranks=2,
                     communicate=False)
    torch.testing.assert_close(rank.dit.blocks[0].fc1.weight, whole.dit.blocks[0].fc1.weight[384:])
    torch.testing.assert_close(rank.dit.blocks[0].fc2.weight, whole.dit.blocks[0].fc2.weight[:, 384:])
    wider = _cfg_for(2)
    wider = wider.model_copy(update={"model": wider.model.model_copy(
        update={"dit": wider.model.dit.model_copy(update={"ffn_dim": 1536})})})
    save_weights(DiTRunner(wider).dit, tmp_path / "dit.safetensors")
    refusal = r"do not fit the model: .* wrong shapes .*'blocks\.0\.fc1\.weight \(768, 192\) for \(384, 192\)'"
    with pytest.raises(ValueError, match=refusal):
        DiTRunner(_cfg_for(2).model_copy(update={"weights": str(tmp_path)}), rank=1, ranks=2, communicate=False)
