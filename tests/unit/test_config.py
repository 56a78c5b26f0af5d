"""Configs and presets: sizes the presets promise, cross-field checks that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from characters.commands import main
from characters.config import MODEL_PRESETS, SessionConfig, model_preset, session_config
from characters.flops import build_meta_dit, chunk_cost


def test_57b_preset_has_57b_parameters() -> None:
    cost = chunk_cost(session_config("57b", "h100x5"))
    assert 56e9 <= cost.params <= 58e9
    assert cost.tokens_per_chunk == 2992
    assert cost.cache_tokens == 2992 * 5  # reference + 3 past frames + current
    assert cost.forwards_per_chunk == 1
    assert cost.flops_per_chunk_per_rank == pytest.approx(cost.flops_per_chunk / 4, rel=0.01)


def test_wan_preset_matches_public_wan21_t2v_13b_dimensions() -> None:
    m = MODEL_PRESETS["wan-1.3b"]
    d = m.dit
    assert (d.num_layers, d.dim, d.num_heads, d.ffn_dim, d.latent_channels, d.patch_size, d.freq_dim) == (
        30,
        1536,
        12,
        8960,
        16,
        (2, 2),
        256,
    )
    assert (m.generation.width, m.generation.height) == (832, 480)
    assert m.tokens_per_frame == 1560
    assert m.generation.latent_frames_per_chunk == 3
    assert m.generation.forwards_per_chunk == 5  # 4 denoising steps + 1 cache update
    assert 1.3e9 < sum(p.numel() for p in build_meta_dit(m).parameters()) < 1.5e9


def test_tiny_preset_resolution() -> None:
    m = MODEL_PRESETS["tiny"]
    assert (m.generation.height, m.generation.width) == (176, 272)


def test_tensor_parallel_split_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match=r"dit.ffn_dim=8960 is not divisible by 3"):
        session_config("wan-1.3b", "h100x4")
    for topo in ("gpu1", "b200x3", "h100x4", "h100x5"):
        assert session_config("57b", topo).topology.name == topo


def test_bad_fields_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValidationError, match=r"generation.height=180 must be a multiple of 16"):
        model_preset("tiny", generation={"height": 180})
    with pytest.raises(ValidationError, match="extra"):
        model_preset("tiny", generation={"heigth": 176})
    with pytest.raises(ValueError, match="preset='huge' is unknown"):
        model_preset("huge")


def test_yaml_round_trip(tmp_path) -> None:
    path = tmp_path / "session.yaml"
    path.write_text("preset: tiny\ntopology: cpu\nseed: 7\nmodel:\n  generation:\n    cache_mode: naive\n")
    cfg = SessionConfig.from_yaml(path)
    assert cfg.seed == 7 and cfg.model.generation.cache_mode == "naive"
    full = tmp_path / "full.yaml"
    full.write_text(cfg.model_dump_json())
    assert SessionConfig.from_yaml(full) == cfg


def test_presets_command_prints_every_preset(capsys) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "wan-1.3b", "57b"):
        assert name in out
    assert "57.5" in out and "1088x704" in out and "2992" in out
    assert "20.6 + 5.3 -> 46.1 + 5.3 -> 59.3 + 16.0 GB held" in out  # 57b on h100x4: weights + FP8 cache a rank
    # LiveAvatar: 16.3 B parameters, 3168 tokens a block; its floors at the H200 rates, a rank's bf16 weights + caches
    assert "liveavatar-14b" in out and "3168 tokens a block of 12 frames (480 ms)" in out
    assert "2 + 1: 16.30B params, 241.6 TFLOP, 320 / 224 ms, 16.3 + 21.8 GB" in out


def test_cpu_threads_and_decoder_output_fields() -> None:
    from characters.config import TOPOLOGIES, VAEConfig

    assert all((t.dit_cpu_threads, t.decoder_cpu_threads) == (1, 1) for t in TOPOLOGIES.values())
    with pytest.raises(ValidationError, match="dit_cpu_threads"):
        session_config("tiny", {"name": "x", "dit_ranks": 1, "decoder_gpus": 0, "dit_cpu_threads": 0})
    base = {"latent_channels": 4, "base_channels": 4, "channel_mult": (1, 2, 2, 2), "encoder_base_channels": 4}
    assert VAEConfig(**base).decoder_output == "conv"  # Wan's: the large presets keep it
    assert MODEL_PRESETS["57b"].vae.decoder_output == MODEL_PRESETS["wan-1.3b"].vae.decoder_output == "conv"
    with pytest.raises(ValidationError, match="decoder_output"):
        VAEConfig(**base, decoder_output="bilinear")
    assert (MODEL_PRESETS["tiny"].vae.decoder_last_channels, MODEL_PRESETS["tiny"].vae.decoder_last_kt) == (None, 1)
    with pytest.raises(ValidationError, match=r"decoder_last_channels=12.*pixel_shuffle"):
        VAEConfig(**base, decoder_last_channels=12)  # a 'conv' decoder has no such stage
    with pytest.raises(ValidationError, match="decoder_last_kt"):
        VAEConfig(**base, decoder_output="pixel_shuffle", decoder_last_kt=2)
