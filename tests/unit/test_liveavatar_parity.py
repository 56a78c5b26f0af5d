"""Parity with the authors' code: our LiveAvatar transformer and streaming loop, on the same synthetic
weights, inputs, noise and random draws, against the golden tensors their own `CausalWanModel_S2V` produced
through their single-GPU loop (tests/fixtures/liveavatar/golden.json says how: commit, command,
adaptations). Reduced depth (5 blocks: audio injected after blocks 0 and 4), full width; 2 clips of 2 blocks,
so the per-step caches roll in the second clip and the reference's RoPE position moves."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from characters.families.liveavatar import LiveAvatarDiT, LiveAvatarDiTConfig, LiveAvatarLoopConfig, LiveAvatarStream
from characters.families.liveavatar.loop import euler_schedule
from characters.families.liveavatar.synthetic import synthetic_state_dict

FIXTURES = Path(__file__).parents[1] / "fixtures" / "liveavatar"


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((FIXTURES / "golden.json").read_text()), load_file(FIXTURES / "golden.safetensors")


def _model(manifest: dict) -> tuple[LiveAvatarDiT, LiveAvatarLoopConfig]:
    mc, lp = manifest["model_config"], manifest["loop"]
    cfg = LiveAvatarDiTConfig(
        num_layers=mc["num_layers"], dim=mc["dim"], num_heads=mc["num_heads"], ffn_dim=mc["ffn_dim"],
        text_dim=mc["text_dim"], text_len=mc["text_len"], audio_dim=mc["audio_dim"], cond_dim=mc["cond_dim"],
        audio_inject_layers=tuple(i for i in mc["audio_inject_layers"] if i < mc["num_layers"]))
    loop = LiveAvatarLoopConfig(height=lp["height"], width=lp["width"], steps=lp["steps"], shift=lp["shift"],
                                blocks_per_clip=lp["num_blocks_per_clip"], motion_frames=lp["motion_frames"])
    with torch.device("meta"):
        model = LiveAvatarDiT(cfg)
    spec = {k: (tuple(v.shape), torch.float32) for k, v in model.state_dict().items()}
    model.load_state_dict(synthetic_state_dict(spec, manifest["seeds"]["weights"]), strict=True, assign=True)
    return model.eval(), loop


def test_schedule_is_theirs(golden: tuple[dict, dict[str, torch.Tensor]]) -> None:
    manifest, t = golden
    timesteps, sigmas = euler_schedule(manifest["loop"]["steps"], manifest["loop"]["shift"])
    assert torch.equal(timesteps, t["timesteps"]) and torch.equal(sigmas, t["sigmas"])


def test_streaming_loop_equals_the_authors(golden: tuple[dict, dict[str, torch.Tensor]]) -> None:
    manifest, t = golden
    model, loop = _model(manifest)
    stream = LiveAvatarStream(model, loop, random.Random(manifest["seeds"]["python_random"]))
    draws: list[int] = []
    randint = stream.rng.randint
    stream.rng.randint = lambda a, b: draws.append(randint(a, b)) or draws[-1]  # type: ignore[method-assign]
    preds: list[torch.Tensor] = []
    forward = stream.forward

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        out = forward(*args, **kwargs)  # type: ignore[arg-type]
        preds.append(out)
        return out

    stream.forward = recording  # type: ignore[method-assign]
    stream.start(t["ref_latents"][0], t["motion_latents"][0], t["context"])
    f, per_clip = loop.frames_per_block, loop.blocks_per_clip
    audio = t["audio_emb"].float()
    clips = []
    for r in range(t["clip_noise"].shape[0]):
        blocks = []
        for b in range(per_clip):
            frames = slice((r * per_clip + b) * 4 * f, (r * per_clip + b + 1) * 4 * f)
            blocks.append(stream.block(t["clip_noise"][r][:, b * f:(b + 1) * f], audio[..., frames]))
        clips.append(torch.cat(blocks, dim=1))
    assert draws == t["relative_dist"].flatten().tolist()
    ours = torch.stack(preds).reshape(t["noise_pred"].shape)
    theirs = t["noise_pred"]
    worst = 0.0
    for idx in range(ours.shape[0] * ours.shape[1] * ours.shape[2]):
        a, b = ours.flatten(0, 2)[idx], theirs.flatten(0, 2)[idx]
        rel = ((a - b).norm() / b.norm()).item()
        worst = max(worst, rel)
        assert rel < 1e-4, f"forward {idx} (clip, block, step) = {divmod(idx, 4)}: relative error {rel:.2e}"
    print(f"worst relative error of a forward: {worst:.2e}")
    torch.testing.assert_close(torch.stack(clips), t["clip_output"], rtol=1e-4, atol=1e-4)
