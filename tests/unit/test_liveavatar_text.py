"""LiveAvatar's prompt encoder (characters/families/liveavatar/text.py) against the authors' own umT5 code:
umT5 through transformers' UMT5EncoderModel, loaded through our key mapping from a .pth in THEIR layout, equals
what their T5EncoderModel (their T5Encoder, tokenizer wrapper and __call__) returned for the same prompts
(tests/fixtures/liveavatar/golden_text.json says how: commit, command, adaptations). Tiny umT5, float32."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from characters.families.liveavatar.text import (
    T5_CHECKPOINT,
    LiveAvatarTextConfig,
    PromptEncoder,
    TextEncoderError,
    clean_prompt,
    map_state_dict,
    their_names,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "liveavatar"
SNAPSHOT = FIXTURES / "tiny_umt5"


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((FIXTURES / "golden_text.json").read_text()), load_file(FIXTURES / "golden_text.safetensors")


def _config(manifest: dict) -> LiveAvatarTextConfig:
    c = manifest["config"]
    return LiveAvatarTextConfig(vocab_size=c["vocab_size"], dim=c["dim"], dim_attn=c["dim_attn"],
                                dim_ffn=c["dim_ffn"], num_heads=c["num_heads"], num_layers=c["encoder_layers"],
                                num_buckets=c["num_buckets"], text_len=c["text_len"])


@pytest.fixture(scope="module")
def encoder(golden: tuple[dict, dict[str, torch.Tensor]]) -> PromptEncoder:
    return PromptEncoder.from_snapshot(SNAPSHOT, config=_config(golden[0]), dtype=torch.float32)


def test_prompts_are_cleaned_and_tokenized_as_theirs(golden: tuple[dict, dict[str, torch.Tensor]],
                                                     encoder: PromptEncoder) -> None:
    manifest, t = golden
    for i, p in enumerate(manifest["prompts"]):
        assert clean_prompt(p["prompt"]) == p["cleaned"]
        ids, mask = encoder.tokenize(p["prompt"])
        assert ids.shape == mask.shape == (1, p["padded_to"])
        assert int(mask.sum()) == p["tokens"]
        assert torch.equal(ids[0, :p["tokens"]], t[f"ids_{i}"])
        assert torch.equal(ids[0, p["tokens"]:], torch.zeros(p["padded_to"] - p["tokens"], dtype=ids.dtype))
    assert manifest["prompts"][4]["tokens"] == manifest["config"]["text_len"]  # the long prompt was truncated
    assert t["ids_4"][-1].item() == 1  # and still ends with </s>


def test_encode_equals_the_authors(golden: tuple[dict, dict[str, torch.Tensor]], encoder: PromptEncoder) -> None:
    manifest, t = golden
    for i, p in enumerate(manifest["prompts"]):
        ours, theirs = encoder.encode(p["prompt"]), t[f"context_{i}"]
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (p["tokens"], manifest["config"]["dim"])
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=f"prompt {i}")


def test_encode_in_bfloat16_equals_the_authors(golden: tuple[dict, dict[str, torch.Tensor]]) -> None:
    """Their config's t5_dtype: weights and activations in bfloat16 on both sides (bit-equal on the 2-core box
    the goldens were made on; the tolerance is bfloat16's, for other CPUs' kernels)."""
    manifest, t = golden
    encoder = PromptEncoder.from_snapshot(SNAPSHOT, config=_config(manifest), dtype=torch.bfloat16)
    for i, p in enumerate(manifest["prompts"]):
        ours, theirs = encoder.encode(p["prompt"]), t[f"context_bf16_{i}"]
        assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2, msg=f"prompt {i}")
    assert not torch.equal(t["context_bf16_0"].float(), t["context_0"])  # the bfloat16 golden is a bfloat16 run


def test_full_size_mapping_covers_umt5_xxl(golden: tuple[dict, dict[str, torch.Tensor]]) -> None:
    """Every key of their full-size encoder (recorded from their T5Encoder at umt5-xxl size) maps onto
    transformers' UMT5EncoderModel for umt5-xxl with the same shape, and nothing of it is left out."""
    from transformers import UMT5EncoderModel

    config = LiveAvatarTextConfig()
    with torch.device("meta"):
        model = UMT5EncoderModel(config.umt5())
    expected = {k: v.shape for k, v in model.state_dict().items()}
    full = golden[0]["full_size_keys"]
    assert len(full) == 2 + 10 * config.num_layers
    theirs = {k: torch.empty(shape, dtype=torch.bfloat16, device="meta") for k, shape in full.items()}
    mapped = map_state_dict(theirs, expected, config.num_layers, T5_CHECKPOINT, torch.bfloat16)
    assert set(mapped) == set(expected)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v) for k, v in expected.items()}
    assert sorted(their_names(config.num_layers)) == sorted(full)
    assert mapped["encoder.embed_tokens.weight"] is mapped["shared.weight"]
    assert expected["shared.weight"] == (256384, 4096)


def _save_variant(tmp_path: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """A copy of the tiny snapshot whose .pth has tensors replaced (or removed, for None)."""
    state = torch.load(SNAPSHOT / T5_CHECKPOINT, weights_only=True)
    for name, value in edit.items():
        if value is None:
            del state[name]
        else:
            state[name] = value
    root = tmp_path / "snapshot"
    (root / "google").mkdir(parents=True)
    (root / "google" / "umt5-xxl").symlink_to((SNAPSHOT / "google" / "umt5-xxl").resolve())
    torch.save(state, root / T5_CHECKPOINT)
    return root


@pytest.mark.parametrize(("edit", "message"), [
    ({"blocks.1.attn.q.weight": None}, "tensors missing: ['blocks.1.attn.q.weight']"),
    ({"blocks.2.norm1.weight": torch.ones(32)}, "tensors the umT5 encoder does not have: ['blocks.2.norm1.weight']"),
    ({"blocks.0.attn.o.weight": torch.zeros(48, 32)},
     "tensor 'blocks.0.attn.o.weight' (encoder.block.0.layer.0.SelfAttention.o.weight) has shape (48, 32), "
     "the encoder expects (32, 48)"),
    ({"norm.weight": torch.ones(32, dtype=torch.int64)}, "tensor 'norm.weight' is torch.int64, not a float tensor"),
])
def test_bad_checkpoints_are_refused_naming_file_and_tensor(tmp_path: Path, golden: tuple[dict, dict],
                                                            edit: dict[str, torch.Tensor | None],
                                                            message: str) -> None:
    root = _save_variant(tmp_path, edit)
    with pytest.raises(TextEncoderError, match=re.escape(f"{T5_CHECKPOINT}: {message}")):
        PromptEncoder.from_snapshot(root, config=_config(golden[0]), dtype=torch.float32)


def test_a_config_of_other_depth_is_refused(golden: tuple[dict, dict]) -> None:
    deeper = _config(golden[0]).model_copy(update={"num_layers": 3})
    with pytest.raises(TextEncoderError, match=re.escape("tensors missing: ['blocks.2.attn.k.weight'")):
        PromptEncoder.from_snapshot(SNAPSHOT, config=deeper, dtype=torch.float32)


def test_missing_files_say_where_they_belong(tmp_path: Path) -> None:
    with pytest.raises(TextEncoderError, match=re.escape(f"has {T5_CHECKPOINT} at its top level")):
        PromptEncoder.from_snapshot(tmp_path)


def test_config_refuses_heads_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="dim_attn=48 must split into num_heads=5"):
        LiveAvatarTextConfig(dim_attn=48, num_heads=5)
