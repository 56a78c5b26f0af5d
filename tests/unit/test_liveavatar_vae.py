"""LiveAvatar's VAE (Wan2.1's) served by our decoder, against golden tensors of the authors' own code
(tests/fixtures/liveavatar/golden_vae.json says how: commit, command, adaptations). Width 16 (z_dim 16), 24x40
frames, float32 on the CPU: their encode, their streaming decode (a primed stream, then blocks of 3 latent
frames) and their offline decode, through the same synthetic weights loaded from a .pth by our loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from characters.families.liveavatar.synthetic import synthetic_state_dict
from characters.families.liveavatar.vae import (
    MOTION_PRIME_LATENTS,
    WanEncoder,
    load_wan_vae,
    motion_latents,
    prime_decoder,
    reference_latents,
    wan21_vae_config,
    wan_vae_spec,
)
from characters.vae import CausalDecoder

FIXTURES = Path(__file__).parents[1] / "fixtures" / "liveavatar"
TOL = 2e-5  # worst |ours - theirs| relative to the largest |theirs|, float32


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((FIXTURES / "golden_vae.json").read_text()), load_file(FIXTURES / "golden_vae.safetensors")


@pytest.fixture(scope="module")
def pth(golden: tuple[dict, dict[str, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden's synthetic weights as a Wan2.1_VAE.pth (a torch pickle of the state dict, their key names)."""
    manifest, _ = golden
    spec = wan_vae_spec(wan21_vae_config(manifest["config"]["dim"]))
    path = tmp_path_factory.mktemp("vae") / "Wan2.1_VAE.pth"
    torch.save(synthetic_state_dict({k: (s, torch.float32) for k, s in spec.items()}, manifest["seeds"]["weights"]),
               path)
    return path


@pytest.fixture(scope="module")
def vae(golden: tuple[dict, dict[str, torch.Tensor]], pth: Path) -> tuple[CausalDecoder, WanEncoder]:
    return load_wan_vae(pth, wan21_vae_config(golden[0]["config"]["dim"]))


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_checkpoint_names_and_shapes_are_theirs(golden: tuple[dict, dict[str, torch.Tensor]]) -> None:
    manifest, _ = golden
    theirs = {k: tuple(v) for k, v in manifest["keys_dim96"].items()}
    assert wan_vae_spec() == theirs  # every key of their WanVAE_ at the checkpoint's width, and no other
    assert len(theirs) == 194 and sum(torch.Size(s).numel() for s in theirs.values()) == 126_892_531


@torch.inference_mode()
def test_encoder_equals_theirs(golden: tuple[dict, dict[str, torch.Tensor]],
                               vae: tuple[CausalDecoder, WanEncoder]) -> None:
    _, t = golden
    _, encoder = vae
    image = t["image"][None]  # (1, 3, H, W)
    reference = encoder(image[:, :, None].expand(-1, -1, 5, -1, -1))  # (1, C, 2, h, w)
    assert _rel(reference[0], t["reference_encode"]) < TOL
    assert torch.equal(reference_latents(encoder, image), reference[:, :, 1:])  # the pipeline's ref_latents
    assert _rel(motion_latents(encoder, image)[0], t["motion_latents"]) < TOL  # 73 frames -> 19 latents
    assert _rel(encoder(t["clip_video"][None])[0], t["clip_latents"]) < TOL  # a moving clip: 17 frames -> 5


@pytest.mark.parametrize("serving", ["windows", "cpu_forms"])
@torch.inference_mode()
def test_streaming_decode_equals_theirs(golden: tuple[dict, dict[str, torch.Tensor]],
                                        vae: tuple[CausalDecoder, WanEncoder], serving: str) -> None:
    """A stream: the first 7 motion latents (1 + 4 x 6 frames), then each block of 3 latent frames as one chunk
    through the serving windows (our decoder worker's path), against their one-latent-frame-at-a-time decode;
    `cpu_forms`: the CPU serving forms (sub-pixel up-sampling, uint8 frames) within 1 of their frames in 0..255."""
    _, t = golden
    decoder, _ = vae
    blocks = t["block_latents"]  # (blocks, C, 3, h, w)
    h, w = blocks.shape[-2:]
    state = decoder.init_state(1, h, w, "cpu", torch.float32, chunk_frames=blocks.shape[2])
    motion = t["motion_latents"][None]
    if serving == "cpu_forms":
        decoder = CausalDecoder(decoder.cfg).eval()
        decoder.load_state_dict(vae[0].state_dict())
        decoder.prepare_cpu()
    first = decoder.decode_chunk(motion[:, :, :MOTION_PRIME_LATENTS], state)
    assert _rel(first[0], t["stream_prime_frames"]) < TOL  # 25 frames: the first latent frame makes one
    for b, theirs in enumerate(t["stream_block_frames"]):
        if serving == "windows":
            assert _rel(decoder.decode_chunk(blocks[b : b + 1], state)[0], theirs) < TOL
        else:
            frames = decoder.frames_uint8(blocks[b : b + 1], state)[0]  # (12, H, W, 3)
            expected = ((theirs + 1) * 127.5).round().permute(1, 2, 3, 0)
            assert (frames.float() - expected).abs().max() <= 1
    prime_decoder(decoder, state, motion)  # the stream restarts: same frames again
    if serving == "windows":
        assert _rel(decoder.decode_chunk(blocks[:1], state)[0], t["stream_block_frames"][0]) < TOL


@torch.inference_mode()
def test_first_chunk_of_one_latent_frame(golden: tuple[dict, dict[str, torch.Tensor]],
                                         vae: tuple[CausalDecoder, WanEncoder]) -> None:
    """A stream begun by a single latent frame (1 frame out), then chunks of 2 and 4: their 25 primed frames."""
    _, t = golden
    decoder, _ = vae
    motion = t["motion_latents"][None, :, :MOTION_PRIME_LATENTS]
    state = decoder.init_state(1, *motion.shape[-2:], "cpu", torch.float32)
    parts = [decoder.decode_chunk(motion[:, :, a:b], state) for a, b in ((0, 1), (1, 3), (3, 7))]
    assert [p.shape[2] for p in parts] == [1, 8, 16]
    assert _rel(torch.cat(parts, dim=2)[0], t["stream_prime_frames"]) < TOL


@torch.inference_mode()
def test_offline_decode_equals_theirs(golden: tuple[dict, dict[str, torch.Tensor]],
                                      vae: tuple[CausalDecoder, WanEncoder]) -> None:
    _, t = golden
    decoder, _ = vae
    z = torch.cat([t["motion_latents"], t["offline_clip_latents"]], dim=1)[None]  # (1, C, 19 + 6, h, w)
    video = decoder.decode(z)
    assert video.shape[2] == 1 + 4 * (z.shape[2] - 1)
    kept = t["offline_kept_frames"]
    assert _rel(video[0, :, -kept.shape[1] :], kept) < TOL


@torch.inference_mode()
def test_onset_split_equals_the_chunk(golden: tuple[dict, dict[str, torch.Tensor]],
                                      vae: tuple[CausalDecoder, WanEncoder]) -> None:
    """The decoder worker's onset path (first frame, then the rest) on the Wan2.1 decoder: the same frames."""
    _, t = golden
    decoder, _ = vae
    blocks = t["block_latents"]
    state = decoder.init_state(1, *blocks.shape[-2:], "cpu", torch.float32, chunk_frames=blocks.shape[2])
    with pytest.raises(ValueError, match="first chunk with decode_chunk"):
        decoder.decode_first(blocks[:1], state, 1)  # a fresh stream's first latent frame is one frame: no serving form
    decoder.decode_chunk(t["motion_latents"][None, :, :MOTION_PRIME_LATENTS], state)
    for b, theirs in enumerate(t["stream_block_frames"]):
        first = decoder.decode_first(blocks[b : b + 1], state, 1)
        rest = decoder.decode_rest(state, 1)
        assert _rel(torch.cat([first, rest], dim=2)[0], theirs) < TOL


def test_loader_refuses_a_wrong_file(pth: Path, tmp_path: Path) -> None:
    cfg = wan21_vae_config(16)
    state = torch.load(pth, weights_only=True)
    cases = {
        "missing": ({k: v for k, v in state.items() if k != "decoder.middle.1.to_qkv.weight"},
                    "'decoder.middle.1.to_qkv.weight' .* is missing"),
        "shape": (state | {"encoder.head.0.gamma": torch.ones(64)},
                  r"'encoder.head.0.gamma' has shape \(64,\); .* needs \(64, 1, 1, 1\)"),
        "unknown": (state | {"decoder.upsamples.99.shortcut.weight": torch.ones(1)},
                    "'decoder.upsamples.99.shortcut.weight' is not in Wan2.1's VAE"),
    }
    for name, (bad, message) in cases.items():
        path = tmp_path / f"{name}.pth"
        torch.save(bad, path)
        with pytest.raises(ValueError, match=f"{path}: tensor {message}"):
            load_wan_vae(path, cfg)
    with pytest.raises(ValueError, match=r"'decoder.conv1.weight' has shape \(64, 16, 3, 3, 3\); .* needs \(384, 16"):
        load_wan_vae(pth)  # a dim-16 file is not the checkpoint's width (96)
