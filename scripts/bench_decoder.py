"""Benchmark: the causal VAE decoder, ms per 4-frame chunk, with its FLOP floor.

    python scripts/bench_decoder.py --preset 57b --device cuda      # 704x1088 on one GPU
    python scripts/bench_decoder.py --preset tiny                   # 176x272 on the CPU

Variants timed in one run (CUDA): fp32 eager NCDHW, bf16 eager NCDHW, bf16 channels-last eager,
bf16 channels-last CUDA graph (the serving path). The floor is the convolutions' FLOPs at the bf16
(or fp32 on CPU) matmul rate measured in the same run. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from characters.config import session_config
from characters.engine import DecoderRunner
from characters.vae import decoder_flops_per_chunk
from scripts.bench_step import env_info, matmul_rate, timed


def variant(cfg_dtype: str, device: torch.device, channels_last: bool, graph: bool, preset: str,
            iters: int, warmup: int, compile: bool | None = None) -> float:
    cfg = session_config(preset, "gpu1", dtype=cfg_dtype)
    runner = DecoderRunner(cfg, device=device, channels_last=channels_last, compile=compile)
    if graph:
        runner.capture_graph()
    runner.start()
    h, w = cfg.model.latent_hw
    z = torch.randn(1, cfg.model.vae.latent_channels, cfg.model.generation.latent_frames_per_chunk, h, w,
                    device=device)
    with torch.inference_mode():
        return statistics.median(timed(lambda: runner.decode(z), device, iters, warmup))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="57b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    cfg = session_config(args.preset, "gpu1")
    h, w = cfg.model.latent_hw
    flops = decoder_flops_per_chunk(cfg.model.vae, h, w) * cfg.model.generation.latent_frames_per_chunk
    if device.type == "cuda":
        rate = matmul_rate(device, torch.bfloat16)
        variants = {"fp32_ncdhw_eager": ("float32", False, False, False),
                    "bf16_ncdhw_eager": ("bfloat16", False, False, False),
                    "bf16_cl3d_eager": ("bfloat16", True, False, False),
                    "bf16_cl3d_graph": ("bfloat16", True, True, False),
                    "bf16_cl3d_compiled_graph": ("bfloat16", True, True, True)}
    else:
        rate = matmul_rate(device, torch.float32)
        variants = {"fp32_eager": ("float32", False, False)}
    rows = {name: variant(v[0], device, v[1], v[2], args.preset, args.iters, args.warmup, *v[3:])
            for name, v in variants.items()}
    floor = flops / rate * 1e3
    result = {"command": " ".join(["python", *sys.argv]), "preset": args.preset,
              "resolution": f"{cfg.model.generation.width}x{cfg.model.generation.height}",
              "frames_per_chunk": cfg.model.generation.frames_per_chunk,
              **env_info(device), "gflops_per_chunk": flops / 1e9, "matmul_tflops": rate / 1e12,
              "floor_ms": floor, "ms": rows, "target_ms": 60.0}
    out = Path(args.out or f"benchmarks/decoder_{args.preset}_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"decoder {args.preset} {result['resolution']}, {flops / 1e9:.0f} GFLOP/chunk, {result['device']}")
    print(f"{'variant':<18} {'ms/chunk':>9} {'floor ms':>9} {'ratio':>6}")
    for name, ms in rows.items():
        print(f"{name:<18} {ms:>9.2f} {floor:>9.2f} {ms / floor:>6.2f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
