"""Golden tensors of LiveAvatar's VAE (Wan2.1's) from the authors' own code: the oracle of
tests/unit/test_liveavatar_vae.py.

    PYTHONPATH=/tmp/lasite .venv/bin/python scripts/liveavatar/golden_vae.py --authors /tmp/la \\
        --out tests/fixtures/liveavatar                     # CPU, float32, dim 16: golden_vae.safetensors/.json

Their VAE runs at a reduced width (``dim``; z_dim stays 16, their latent statistics need it) on synthetic
weights (``characters/families/liveavatar/synthetic.py``, by key name) and small frames, and records:

- encodes with their ``Wan2_1_VAE.encode`` (vae2_1.py, the single-GPU pipeline's): the reference image repeated
  5 times (causal_s2v_pipeline.py L891-892; the pipeline then drops latent 0), the reference repeated 73 times
  (the motion latents, L896-898), and a random (non-static) clip of 17 frames;
- the streaming decode of their ``WanVAE.stream_decode`` (vae_streaming.py, causal_s2v_pipeline_tpp.py
  L1118-1124): one fresh stream, first the first 7 motion latents (the pipeline drops those frames; recorded
  here), then blocks of 3 random latent frames, 12 frames each;
- the offline decode of ``Wan2_1_VAE.decode`` (L1162-1167): [motion latents, a random clip] from a fresh
  state, of which the pipeline keeps the clip's frames (the last 4 x clip latents): those are recorded.

Their code is imported from ``--authors`` unmodified; the adaptations (recorded in the manifest) are: package
``__init__`` files bypassed (registered with their real ``__path__``: they import the T5/DiT pipelines);
``ENABLE_COMPILE=false`` (their inference_utils, imported by vae_streaming.py); their wrappers build the model
through the module's ``_video_vae``, replaced by ``functools.partial(_video_vae, dim=D)`` (their function takes
``**kwargs`` into its config) so that the width is reduced; the synthetic state dict is saved to a temporary
``.pth`` that their ``_video_vae`` loads (``torch.load``, ``load_state_dict(assign=True)``); wrappers on
``device="cpu"``, ``dtype=float32`` (their ``torch.cuda.amp.autocast`` does nothing on the CPU).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from authors import AUTHORS_COMMIT, BYPASSED_PACKAGES, load_synthetic, provenance, register_packages

Z_DIM = 16
REFERENCE_REPEAT = 5  # causal_s2v_pipeline.py L891
MOTION_FRAMES = 73  # wan_s2v_14B_modified.py transformer.motion_frames
PRIME_LATENTS = 7  # causal_s2v_pipeline_tpp.py L1119: motion_latents[:, :, :7]
FRAMES_PER_BLOCK = 3  # num_frames_per_block


synthetic_state_dict = load_synthetic().synthetic_state_dict


def import_authors(root: Path) -> dict[str, types.ModuleType]:
    """Their two VAE modules, without their package ``__init__`` files."""
    os.environ["ENABLE_COMPILE"] = "false"
    register_packages(root)
    base = "liveavatar.models.wan.wan_2_2.modules."
    return {"vae2_1": importlib.import_module(base + "vae2_1"),
            "streaming": importlib.import_module(base + "vae_streaming")}


def model_spec(module: types.ModuleType, dim: int) -> dict[str, tuple[int, ...]]:
    """Key -> shape of their ``WanVAE_`` as their ``_video_vae`` configures it, at width ``dim``."""
    with torch.device("meta"):
        model = module.WanVAE_(dim=dim, z_dim=Z_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                               temperal_downsample=[False, True, True], dropout=0.0)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def build(module: types.ModuleType, wrapper: str, pth: Path, dim: int) -> Any:
    """Their wrapper (``Wan2_1_VAE`` / ``WanVAE``) on the CPU in float32, its model at width ``dim``."""
    original = module._video_vae
    module._video_vae = functools.partial(original, dim=dim)
    try:
        return getattr(module, wrapper)(z_dim=Z_DIM, vae_pth=str(pth), dtype=torch.float32, device="cpu")
    finally:
        module._video_vae = original


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    with torch.no_grad():
        out = fn(*args)
    return out, round(time.perf_counter() - started, 2)


def run(mods: dict[str, types.ModuleType], args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    spec = model_spec(mods["vae2_1"], args.dim)
    if spec != model_spec(mods["streaming"], args.dim):
        raise RuntimeError("vae2_1.WanVAE_ and vae_streaming.WanVAE_ differ in their state dicts")
    weights = synthetic_state_dict({k: (s, torch.float32) for k, s in spec.items()}, args.weight_seed)
    timing: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pth = Path(tmp) / "Wan2.1_VAE.pth"
        torch.save(weights, pth)
        offline = build(mods["vae2_1"], "Wan2_1_VAE", pth, args.dim)
        streaming = build(mods["streaming"], "WanVAE", pth, args.dim)

    g = torch.Generator().manual_seed(args.input_seed)
    h, w = args.height // 8, args.width // 8
    image = torch.rand(3, args.height, args.width, generator=g) * 2 - 1  # (3, H, W) in [-1, 1]
    clip = torch.rand(3, 1 + 4 * args.clip_latents, args.height, args.width, generator=g) * 2 - 1  # (3, F, H, W)
    blocks = torch.randn(args.blocks, Z_DIM, FRAMES_PER_BLOCK, h, w, generator=g)  # DiT outputs, normalised
    clip_out = torch.randn(Z_DIM, args.offline_latents, h, w, generator=g)

    ref, timing["encode_reference"] = timed(offline.encode, [image[:, None].repeat(1, REFERENCE_REPEAT, 1, 1)])
    motion, timing["encode_motion"] = timed(offline.encode, [image[:, None].repeat(1, MOTION_FRAMES, 1, 1)])
    video_latents, timing["encode_clip"] = timed(offline.encode, [clip])
    motion_latents = motion[0]  # (C, 19, h, w)

    primed, timing["stream_prime"] = timed(streaming.stream_decode, [motion_latents[:, :PRIME_LATENTS]])
    stream = []
    for b in range(args.blocks):
        frames, timing[f"stream_block{b}"] = timed(streaming.stream_decode, [blocks[b]])
        stream.append(frames[0])
    whole, timing["offline_decode"] = timed(offline.decode, [torch.cat([motion_latents, clip_out], dim=1)])
    kept = whole[0][:, -4 * args.offline_latents:]  # image[:, :, -(infer_frames):]

    tensors = {
        "image": image,
        "reference_encode": ref[0],  # (C, 2, h, w); the pipeline's ref_latents are [:, 1:]
        "motion_latents": motion_latents,  # (C, 19, h, w)
        "clip_video": clip,
        "clip_latents": video_latents[0],  # (C, 1 + clip_latents, h, w)
        "stream_prime_frames": primed[0],  # (3, 1 + 4 * 6, H, W)
        "block_latents": blocks,
        "stream_block_frames": torch.stack(stream),  # (blocks, 3, 12, H, W)
        "offline_clip_latents": clip_out,
        "offline_kept_frames": kept,  # (3, 4 * offline_latents, H, W)
    }
    for k, v in tensors.items():
        if not torch.isfinite(v).all():
            raise RuntimeError(f"non-finite {k}")
    return {k: v.contiguous() for k, v in tensors.items()}, {
        "timing_s": timing, "offline_decoded_frames": int(whole[0].shape[1]),
        "weights_num_keys": len(spec), "weights_num_parameters": sum(torch.Size(s).numel() for s in spec.values()),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--authors", type=Path, required=True, help="checkout of Alibaba-Quark/LiveAvatar")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--dim", type=int, default=16, help="VAE width (the checkpoint's: 96)")
    p.add_argument("--height", type=int, default=24, help="frame height (a multiple of 8)")
    p.add_argument("--width", type=int, default=40, help="frame width (a multiple of 8)")
    p.add_argument("--clip-latents", type=int, default=4, help="latent frames of the random clip encoded")
    p.add_argument("--blocks", type=int, default=3, help="streamed blocks of 3 latent frames")
    p.add_argument("--offline-latents", type=int, default=6, help="clip latents after the motion in the offline decode")
    p.add_argument("--weight-seed", type=int, default=0)
    p.add_argument("--input-seed", type=int, default=1)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    started = time.perf_counter()
    mods = import_authors(args.authors.resolve())
    tensors, info = run(mods, args)
    save_file(tensors, str(args.out / "golden_vae.safetensors"))
    manifest = {
        **provenance(args.authors, AUTHORS_COMMIT, torch=torch.__version__),
        "authors_files": ["liveavatar/models/wan/wan_2_2/modules/vae2_1.py",
                          "liveavatar/models/wan/wan_2_2/modules/vae_streaming.py"],
        "dtype": "float32", "device": "cpu",
        "config": {"dim": args.dim, "z_dim": Z_DIM, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                   "temperal_downsample": [False, True, True], "height": args.height, "width": args.width},
        "seeds": {"weights": args.weight_seed, "inputs": args.input_seed},
        "paths": {
            "encode": "vae2_1.Wan2_1_VAE.encode (chunks of 1, 4, 4, ... frames)",
            "stream": f"vae_streaming.WanVAE.stream_decode: one stream, motion_latents[:, :{PRIME_LATENTS}] (first "
                      f"latent frame alone, then one by one), then {args.blocks} blocks of {FRAMES_PER_BLOCK} latent "
                      "frames, each decoded one latent frame at a time",
            "offline": "vae2_1.Wan2_1_VAE.decode of [motion_latents, offline_clip_latents] from a fresh cache "
                       "(one latent frame at a time); the last 4 x offline latents frames kept",
        },
        "adaptations": [
            f"package __init__ bypassed: {', '.join(BYPASSED_PACKAGES)} (registered with their real __path__)",
            "ENABLE_COMPILE=false (their inference_utils: conditional_compile leaves stream_decode uncompiled)",
            f"the wrappers' _video_vae replaced by functools.partial(_video_vae, dim={args.dim}) while they are built "
            "(their cfg.update(**kwargs)); z_dim 16",
            "synthetic weights (characters/families/liveavatar/synthetic.py, seed above) saved with torch.save to a "
            "temporary Wan2.1_VAE.pth, loaded by their _video_vae",
            "wrappers built with device='cpu', dtype=torch.float32",
        ],
        "keys_dim96": {k: list(v) for k, v in model_spec(mods["vae2_1"], 96).items()},
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                    for k, v in tensors.items()},
        **info,
    }
    manifest["timing_s"]["total"] = round(time.perf_counter() - started, 1)
    (args.out / "golden_vae.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("tensors", "keys_dim96")}, indent=1))


if __name__ == "__main__":
    main()
