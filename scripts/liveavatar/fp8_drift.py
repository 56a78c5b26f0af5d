"""LiveAvatar's FP8 quality guard: the latents of an FP8 stream against the same stream in bf16 (or float32 on
a CPU), block by block, same weights, noise and audio; the error must stay flat along the rolling caches.

    python scripts/liveavatar/fp8_drift.py --blocks 100                       # CPU, a small model (FP8 emulated)
    python scripts/liveavatar/fp8_drift.py --device cuda --full --blocks 100  # the 14B model on one GPU

Prints the relative error per block (first, median, last quarter) and records the run (benchmarks/<machine>/).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.families.liveavatar import LiveAvatarDiT, LiveAvatarDiTConfig, LiveAvatarLoopConfig, LiveAvatarStream
from characters.families.liveavatar.layers import to_fp8_
from characters.families.liveavatar.synthetic import synthetic_state_dict
from scripts.benchmarks import results

SMALL = LiveAvatarDiTConfig(num_layers=4, dim=256, num_heads=2, ffn_dim=512, text_dim=64, text_len=16,
                            audio_dim=64, audio_layers=5, audio_inject_layers=(0, 3))


def build(cfg: LiveAvatarDiTConfig, device: str, dtype: torch.dtype, fp8: bool) -> LiveAvatarDiT:
    with torch.device("meta"):
        model = LiveAvatarDiT(cfg)
    spec = {k: (tuple(v.shape), torch.float32) for k, v in model.state_dict().items()}
    model.load_state_dict(synthetic_state_dict(spec, seed=0, device="cpu"), strict=True, assign=True)
    model = model.to(device=device, dtype=dtype)
    model.casual_audio_encoder.float()
    if fp8:
        to_fp8_(model)
    return model.eval()


def stream(model: LiveAvatarDiT, cfg: LiveAvatarDiTConfig, loop: LiveAvatarLoopConfig, blocks: int,
           device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    h, w = loop.latent_hw
    s = LiveAvatarStream(model, loop, random.Random(0))
    s.start(torch.randn(16, 1, h, w, generator=gen).to(device), torch.randn(16, 19, h, w, generator=gen).to(device),
            torch.randn(12, cfg.text_dim, generator=gen).to(device))
    return [s.block(torch.randn(16, 3, h, w, generator=gen).to(device),
                    torch.randn(1, cfg.audio_layers, cfg.audio_dim, 12, generator=gen).to(device)).float().cpu()
            for _ in range(blocks)]


def drift(blocks: int, device: str, full: bool) -> dict:
    cfg = LiveAvatarDiTConfig() if full else SMALL
    loop = LiveAvatarLoopConfig() if full else LiveAvatarLoopConfig(height=128, width=128)
    ref_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    ref = stream(build(cfg, device, ref_dtype, False), cfg, loop, blocks, device)
    fp8 = stream(build(cfg, device, ref_dtype, True), cfg, loop, blocks, device)
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(fp8, ref, strict=True)]
    q = max(1, blocks // 4)
    return {"blocks": blocks, "reference_dtype": str(ref_dtype).removeprefix("torch."), "full_size": full,
            "rel_error_per_block": [round(r, 5) for r in rel], "first_quarter_mean": statistics.fmean(rel[:q]),
            "last_quarter_mean": statistics.fmean(rel[-q:]), "median": statistics.median(rel),
            "growth": statistics.fmean(rel[-q:]) / statistics.fmean(rel[:q])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--full", action="store_true", help="the 14B transformer at 704x384 (a GPU)")
    ap.add_argument("--out", default=None,
                    help="measurement file (default benchmarks/<machine>/liveavatar_fp8_drift.json)")
    args = ap.parse_args()
    torch.manual_seed(0)
    fig = drift(args.blocks, args.device, args.full)
    print(f"FP8 vs {fig['reference_dtype']}: relative error first quarter {fig['first_quarter_mean']:.4f}, median "
          f"{fig['median']:.4f}, last quarter {fig['last_quarter_mean']:.4f} (growth x{fig['growth']:.2f})")
    kind = "cpu" if args.device == "cpu" else "h100"
    results.record(Path(args.out or f"benchmarks/{kind}/liveavatar_fp8_drift.json"), fig)


if __name__ == "__main__":
    main()
