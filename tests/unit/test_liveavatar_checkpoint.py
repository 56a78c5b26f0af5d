"""LiveAvatar's published layout: sharded safetensors with an index, the LoRA merged at load, every mismatch
refused naming the file and the tensor."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from characters.families.liveavatar import LiveAvatarDiT, LiveAvatarDiTConfig, LiveAvatarLoopConfig, LiveAvatarStream
from characters.families.liveavatar.checkpoint import INDEX, CheckpointError, load_liveavatar

SMALL = LiveAvatarDiTConfig(num_layers=2, dim=64, num_heads=2, ffn_dim=32, text_dim=24, text_len=8, audio_dim=16,
                            audio_layers=3, audio_inject_layers=(0,))


def _model(seed: int) -> LiveAvatarDiT:
    torch.manual_seed(seed)
    return LiveAvatarDiT(SMALL)


def _publish(state: dict[str, torch.Tensor], root: Path, shards: int = 2) -> None:
    """The hub's diffusers layout: N shards and an index mapping each tensor to its shard."""
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        fname = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n].to(torch.bfloat16).contiguous() for n in names[i::shards]}
        save_file(part, str(root / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_shards_load_exactly_and_lora_merges(tmp_path: Path) -> None:
    src = _model(0)
    _publish(src.state_dict(), tmp_path)
    rank = 4
    a, b = torch.randn(rank, SMALL.dim), torch.randn(SMALL.dim, rank)
    lora = tmp_path / "liveavatar.safetensors"
    save_file({"base_model.model.blocks.1.self_attn.q.lora_A.default.weight": a,
               "base_model.model.blocks.1.self_attn.q.lora_B.default.weight": b,
               "blocks.0.ffn.0.lora_A.weight": torch.ones(rank, SMALL.dim),  # no adapter name: PEFT drops it
               "head.head.bias": torch.full((64,), 0.5)}, str(lora))  # a plain tensor replaces the base's
    dst = _model(1)
    load_liveavatar(dst, tmp_path, lora=lora, dtype=torch.float32)
    for name, value in src.state_dict().items():
        expect = value.to(torch.bfloat16).float()
        if name == "blocks.1.self_attn.q.weight":
            expect = expect + (64.0 / rank) * (b @ a)
        if name == "head.head.bias":
            expect = torch.full((64,), 0.5)
        torch.testing.assert_close(dst.state_dict()[name], expect, msg=name)
    assert dst.casual_audio_encoder.weights.dtype == torch.float32


def test_missing_tensor_names_it(tmp_path: Path) -> None:
    state = _model(0).state_dict()
    del state["blocks.0.ffn.2.bias"]
    _publish(state, tmp_path)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.ffn\.2\.bias"):
        load_liveavatar(_model(1), tmp_path)


def test_wrong_shape_names_file_and_tensor(tmp_path: Path) -> None:
    state = _model(0).state_dict()
    state["head.head.weight"] = torch.zeros(3, SMALL.dim)
    _publish(state, tmp_path, shards=1)
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model-00001-of-00001\.safetensors: tensor "
                                              r"'head\.head\.weight' has shape \(3, 64\)"):
        load_liveavatar(_model(1), tmp_path)


def test_missing_shard_and_foreign_folder(tmp_path: Path) -> None:
    _publish(_model(0).state_dict(), tmp_path)
    (tmp_path / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard files that are not there"):
        load_liveavatar(_model(1), tmp_path)
    with pytest.raises(CheckpointError, match="neither"):
        load_liveavatar(_model(1), tmp_path / "nowhere")


def test_stream_rolls_its_cache_and_keeps_static_shapes() -> None:
    """Past one clip the writes wrap: block k writes slot k mod blocks_per_clip of each step's cache."""
    loop = LiveAvatarLoopConfig(height=128, width=128)
    model = _model(0).eval()
    stream = LiveAvatarStream(model, loop, random.Random(0))
    h, w = loop.latent_hw
    stream.start(torch.randn(16, 1, h, w), torch.randn(16, 19, h, w), torch.randn(5, SMALL.text_dim))
    snapshots = []
    for _ in range(loop.blocks_per_clip + 1):
        out = stream.block(torch.randn(16, 3, h, w), torch.randn(1, SMALL.audio_layers, SMALL.audio_dim, 12))
        assert out.shape == (16, 3, h, w) and torch.isfinite(out).all()
        snapshots.append(stream.layers[0].k[0].clone())
    t = loop.block_tokens
    # the fifth block overwrote the first block's slots and nothing else
    changed = (snapshots[-1] != snapshots[-2]).any(dim=(0, 2, 3))
    assert changed[:t].all() and not changed[t:].any()
    assert stream.layers[0].k[0].shape == (1, loop.cache_slots, SMALL.num_heads, SMALL.head_dim)


def test_every_preset_has_one_family() -> None:
    from characters.config import MODEL_PRESETS
    from characters.families import FAMILIES, family_of

    assert all(family_of(p).name == "reference" for p in MODEL_PRESETS)
    assert family_of("liveavatar-14b").module == "characters.families.liveavatar"
    presets = [p for f in FAMILIES.values() for p in f.presets]
    assert len(presets) == len(set(presets))
    with pytest.raises(ValueError, match="belongs to no model family"):
        family_of("sora")


def test_full_size_state_dict_is_the_authors() -> None:
    """Every key, shape and count of the 14B transformer equals the authors' model's state dict (recorded by
    scripts/liveavatar/golden.py from their CausalWanModel_S2V on the meta device)."""
    spec = json.loads((Path(__file__).parents[1] / "fixtures/liveavatar/dit_keys_14b.json").read_text())
    with torch.device("meta"):
        model = LiveAvatarDiT(LiveAvatarDiTConfig())
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == {k: v["shape"] for k, v in spec["keys"].items()}
    assert sum(v.numel() for v in model.state_dict().values()) == spec["num_parameters"]
