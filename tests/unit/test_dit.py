"""The DiT, its KV cache and the DiT runner: cache == full recomputation, write-time == naive,
seeds, and checkpoints (whole and per-rank shards)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from characters.audio import chunk_sample_range
from characters.config import TOPOLOGIES, SessionConfig, session_config
from characters.dit import CausalDiT, block_causal_mask
from characters.engine import DiTRunner, ForwardRecord
from characters.stage_times import StageRecorder
from characters.weights import init_weights, load_weights, save_dit_shards, save_weights, shard_path

CHUNKS = 7  # ring of 4 slots: chunks 4..6 evict chunks 0..2


# float32 GEMMs whatever the CPU: these tests hold the cache's arithmetic to the full recomputation's (with bf16
# GEMMs on a CPU that has them, `cpu_matmul="auto"`, two shapes of the same product round differently)
CPU_F32 = TOPOLOGIES["cpu"].model_copy(update={"cpu_matmul": "float32"}).model_dump()


def small(cache_mode: str = "write_time", **generation: object) -> SessionConfig:
    gen = {"cache_mode": cache_mode, **generation}
    return session_config("tiny", CPU_F32, seed=3, model={"dit": {"num_layers": 2}, "generation": gen})


def pcm_for(runner: DiTRunner, k: int, seed: int = 0) -> np.ndarray:
    g = runner.cfg.model.generation
    n = (k + 1) * g.frames_per_chunk * 16000 // 24 - k * g.frames_per_chunk * 16000 // 24
    return np.random.default_rng(seed + k).uniform(-0.5, 0.5, n).astype(np.float32)


def run_chunks(
    cfg: SessionConfig, n: int = CHUNKS, record: list[ForwardRecord] | None = None, ref_seed: int = 11
) -> tuple[DiTRunner, torch.Tensor, list[torch.Tensor]]:
    runner = DiTRunner(cfg)
    h, w = cfg.model.latent_hw
    ref = torch.randn(1, cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(ref_seed))
    runner.start(ref)
    outs = [runner.step(pcm_for(runner, k), record).clone() for k in range(n)]
    return runner, ref, outs


@pytest.mark.parametrize("cache_update", ["last_step", "extra_pass"])
def test_cached_chunks_equal_full_causal_recomputation(cache_update: str) -> None:
    cfg = small(cache_update=cache_update)
    m = cfg.model
    record: list[ForwardRecord] = []
    runner, ref, outs = run_chunks(cfg, record=record)
    sink_ctx = runner.audio_context(runner.frontend.silence_windows())[:, :1]
    x = torch.cat([ref[:, :, None], *[r.x for r in record]], dim=2)  # (1, C, 1 + K, h, w)
    n, t_chunk = m.tokens_per_frame, m.tokens_per_chunk
    t = torch.cat([torch.zeros(n), *[torch.full((t_chunk,), r.t) for r in record]])[None]  # (1, T)
    ctx = torch.cat([sink_ctx, *[r.ctx for r in record]], dim=1)
    tables = [runner.sink_rope, *[runner.rope.chunk(k) for k in range(CHUNKS)]]
    cos, sin = torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])
    mask = block_causal_mask(n, t_chunk, CHUNKS, m.generation.ring_slots)
    with torch.inference_mode():
        v = runner.dit.forward_sequence(x, t, ctx, cos, sin, mask)  # (1, C, 1 + K, h, w)
    for k, rec in enumerate(record):
        torch.testing.assert_close(v[:, :, 1 + k : 2 + k], rec.v, atol=2e-4, rtol=1e-3)
        if cache_update == "last_step":  # that forward's velocity also made the chunk's final Euler step
            torch.testing.assert_close(outs[k], rec.x + (0.0 - rec.t) * rec.v, atol=1e-5, rtol=1e-5)
    # and the recomputation diverges from the cached run if the window were not enforced
    wrong = torch.ones_like(mask)
    with torch.inference_mode():
        v_all = runner.dit.forward_sequence(x, t, ctx, cos, sin, wrong)
    assert not torch.allclose(v_all[:, :, -1], v[:, :, -1], atol=1e-3)


def test_write_time_cache_equals_naive_path() -> None:
    _, _, fast = run_chunks(small("write_time"))
    _, _, naive = run_chunks(small("naive"))
    for a, b in zip(fast, naive, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(fast[0], fast[-1])


def test_reference_frame_conditions_every_chunk() -> None:
    _, _, a = run_chunks(small(), n=6, ref_seed=1)
    _, _, b = run_chunks(small(), n=6, ref_seed=2)
    assert (a[-1] - b[-1]).abs().mean() > 1e-3  # the sink is still attended after the ring wrapped


def test_same_seed_same_output_and_different_seed_differs() -> None:
    _, _, a = run_chunks(small(), n=3)
    _, _, b = run_chunks(small(), n=3)
    c = run_chunks(small().model_copy(update={"seed": 4}), n=3)[2]
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not torch.allclose(a[-1], c[-1])


def test_restart_wipes_session_state() -> None:
    runner, ref, first = run_chunks(small(), n=5)
    runner.start(ref)
    again = [runner.step(pcm_for(runner, k)).clone() for k in range(5)]
    for x, y in zip(first, again, strict=True):
        assert torch.equal(x, y)


def test_safetensors_round_trip_and_rank_shards(tmp_path) -> None:
    cfg = session_config("tiny", "cpu", model={"dit": {"num_layers": 2}})
    model = init_weights(CausalDiT(cfg.model), seed=5)
    save_weights(model, tmp_path / "dit.safetensors")
    other = load_weights(init_weights(CausalDiT(cfg.model), seed=6), tmp_path / "dit.safetensors")
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    paths = save_dit_shards(model, tmp_path / "tp2", ranks=2)
    assert paths == [shard_path(tmp_path / "tp2", r, 2) for r in range(2)]
    from characters.tp import apply_tensor_parallel

    for rank in range(2):
        with torch.device("meta"):
            sharded = CausalDiT(cfg.model)
        apply_tensor_parallel(sharded, rank=rank, size=2)
        init_weights(sharded, seed=5)  # seeded init of a shard == the shard of the seeded whole
        from_seed = {k: v.clone() for k, v in sharded.state_dict().items()}
        load_weights(sharded, paths[rank])
        for name, tensor in sharded.state_dict().items():
            assert torch.equal(tensor, from_seed[name]), name
        assert sharded.blocks[0].self_attn.qkv.weight.shape == (3 * 96, 192)  # half the heads of q, k and v


def test_weights_for_another_shape_are_refused(tmp_path) -> None:
    model = init_weights(CausalDiT(small().model), seed=0)
    save_weights(model, tmp_path / "dit.safetensors")
    bigger = session_config("tiny", "cpu", model={"dit": {"num_layers": 3}})
    with pytest.raises(ValueError, match="do not fit the model"):
        load_weights(CausalDiT(bigger.model), tmp_path / "dit.safetensors")


def test_a_step_given_up_between_parts_leaves_the_runner_as_if_it_never_began() -> None:
    """`DiTRunner.step`'s `stop`: asked between the step's parts (4 blocks, 4 parts: 3 asks), True gives the chunk
    up (None) after writing part of its cache slot; the next step makes that slot again from the same noise, with
    the next chunk's audio: exactly what a runner that only took that audio in (never began the chunk) makes. The
    stage times carry the stream's chunk index, the given-up chunk's counted."""
    cfg = session_config("tiny", "cpu")
    assert cfg.topology.step_groups >= cfg.model.dit.num_layers == 4
    ref = torch.zeros(1, cfg.model.dit.latent_channels, *cfg.model.latent_hw)
    rng = np.random.default_rng(0)
    pcm = [rng.uniform(-0.3, 0.3, np.subtract(*chunk_sample_range(k, 4)[::-1])).astype(np.float32)
           for k in range(4)]
    given, never = DiTRunner(cfg), DiTRunner(cfg)
    for r in (given, never):
        r.start(ref)
        r.step(pcm[0])
    given.recorder = StageRecorder("cpu")
    asks: list[int] = []
    assert given.step(pcm[1], stop=lambda: asks.append(1) or len(asks) == 2) is None
    assert (given.chunk, given.given_up) == (1, 1)
    never.frontend.push(pcm[1])
    for k in (2, 3):
        a, b = given.step(pcm[k]), never.step(pcm[k])
        assert torch.equal(a, b)
    assert [t.chunk for t in given.recorder.harvest() if t.stage == "dit"] == [1, 2, 3]
    asks.clear()
    n = given.frontend.expected_samples
    given.step(np.zeros(n, np.float32), stop=lambda: asks.append(1) or False)
    assert len(asks) == len(given.dit.blocks) - 1  # never stopped: asked between every two parts
