"""Benchmark: the causal VAE decoder, ms per 4-frame chunk, with its FLOP floor.

    python scripts/benchmarks/bench_decoder.py --preset 57b --device cuda      # 704x1088 on one GPU
    python scripts/benchmarks/bench_decoder.py --preset tiny                   # 176x272 on the CPU

Variants timed in one run (CUDA, all bf16 channels-last): the concatenating path eager, and compiled by
Inductor into a CUDA graph, with and without cuDNN's algorithm search; the window path (fused norm + SiLU
written into preallocated conv windows, conv_out padded to 8 channels) eager and as a CUDA graph, with and
without the search. The serving default is `windows_graph_bench`. The floor is the convolutions' FLOPs at
the bf16 (or fp32 on CPU) matmul rate measured in the same run. Each CUDA variant runs in a process of its
own (PyTorch keeps the first cuDNN algorithm it used per shape for the whole process). `--variants a,b`
picks some; `--profile` with one variant adds its top kernels. Prints a table, writes JSON.

`--first-frame` (CUDA: the serving variant; CPU: the window path) also times a speech onset's chunk as the
pipeline makes it (`DecoderRunner.decode_first` + `decode_rest`), each part to the host as the decoder worker
hands it on (`.cpu()`), against the whole chunk to the host, and checks the two parts' frames against the whole
chunk's (`first_frame` in the JSON).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.config import session_config
from characters.engine import DecoderRunner
from characters.vae import decoder_flops_per_chunk
from scripts.benchmarks import results
from scripts.benchmarks.common import env_info, matmul_rate, timed


def variant(cfg_dtype: str, device: torch.device, graph: bool, preset: str, iters: int, warmup: int,
            profile: dict[str, float] | None = None, **runner_kw: Any) -> float:
    cfg = session_config(preset, "gpu1", dtype=cfg_dtype)
    runner = DecoderRunner(cfg, device=device, **runner_kw)
    if graph:
        runner.capture_graph()
    runner.start()
    h, w = cfg.model.latent_hw
    z = torch.randn(1, cfg.model.vae.latent_channels, cfg.model.generation.latent_frames_per_chunk, h, w,
                    device=device)
    with torch.inference_mode():
        ms = statistics.median(timed(lambda: runner.decode(z), device, iters, warmup))
        if profile is not None:
            profile.update(top_kernels(lambda: runner.decode(z), device))
    return ms


def first_frame(cfg_dtype: str, device: torch.device, graph: bool, preset: str, iters: int, warmup: int,
                **runner_kw: Any) -> dict[str, float]:
    """A chunk in two parts (its first frame, then the rest), each copied to the host, against the whole chunk
    copied to the host: ms p50 of each (host clock, the copies wait for the GPU), and how far the parts' frames
    are from the whole chunk's (the same latents, from the same state)."""
    import time

    cfg = session_config(preset, "gpu1", dtype=cfg_dtype)
    runner = DecoderRunner(cfg, device=device, **runner_kw)
    if graph:
        runner.capture_graph()
    h, w = cfg.model.latent_hw
    z = torch.randn(1, cfg.model.vae.latent_channels, cfg.model.generation.latent_frames_per_chunk, h, w,
                    generator=torch.Generator().manual_seed(0)).to(device)
    times: dict[str, list[float]] = {"whole_to_host": [], "first_to_host": [], "rest_to_host": []}

    def clock() -> float:
        return time.perf_counter() * 1e3

    with torch.inference_mode():
        for i in range(warmup + iters):
            runner.start()
            t0 = clock()
            whole = runner.decode(z).cpu()
            t1 = clock()
            runner.start()
            t2 = clock()
            first = runner.decode_first(z).cpu()
            t3 = clock()
            rest = runner.decode_rest().cpu()
            t4 = clock()
            if i >= warmup:
                times["whole_to_host"].append(t1 - t0)
                times["first_to_host"].append(t3 - t2)
                times["rest_to_host"].append(t4 - t3)
    diff = (torch.cat([first, rest]).int() - whole.int()).abs()
    return {**{f"{k}_ms": statistics.median(v) for k, v in times.items()},
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.float().mean()),
            "frames_first": len(first), "frames_rest": len(rest)}


def isolated(name: str, args: argparse.Namespace) -> float:
    """ms per chunk of one variant, measured by this script in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, __file__, "--preset", args.preset, "--device", args.device, "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--variants", name, "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return float(results.latest(out)["ms"][name])


def top_kernels(fn: Callable[[], object], device: torch.device, steps: int = 3) -> dict[str, float]:
    """Device ms per call of the 20 most expensive kernels of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    rows = [(ev.key, ev.device_time_total / steps / 1e3) for ev in prof.key_averages()
            if ev.device_type == torch.autograd.DeviceType.CUDA]
    ops = [(f"{ev.key} {ev.input_shapes[:2]} x{ev.count // steps}", ev.device_time_total / steps / 1e3)
           for ev in prof.key_averages(group_by_input_shape=True)
           if ev.device_type == torch.autograd.DeviceType.CPU and ev.key.startswith("aten::") and ev.device_time_total
           and ev.key not in ("aten::conv3d", "aten::convolution", "aten::_convolution")]
    return dict(sorted(rows, key=lambda kv: -kv[1])[:20] + sorted(ops, key=lambda kv: -kv[1])[:25])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="57b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--variants", default=None, help="comma-separated subset of the variants (CUDA)")
    p.add_argument("--profile", action="store_true", help="also list the serving path's top kernels (CUDA)")
    p.add_argument("--first-frame", action="store_true", help="also time an onset's chunk in two parts (see above)")
    p.add_argument("--split-only", action="store_true", help=argparse.SUPPRESS)  # --first-frame's own process
    args = p.parse_args()
    device = torch.device(args.device)
    cfg = session_config(args.preset, "gpu1")
    h, w = cfg.model.latent_hw
    flops = decoder_flops_per_chunk(cfg.model.vae, h, w) * cfg.model.generation.latent_frames_per_chunk
    variants: dict[str, tuple[str, bool, dict[str, Any]]]
    rows: dict[str, float] = {}
    if device.type == "cuda":
        rate = matmul_rate(device, torch.bfloat16)
        concat, win = {"windows": False}, {"windows": True}
        variants = {
            "concat_eager": ("bfloat16", False, {**concat, "compile": False, "cudnn_benchmark": False}),
            "concat_compiled_graph": ("bfloat16", True, {**concat, "compile": True, "cudnn_benchmark": False}),
            "concat_compiled_graph_bench": ("bfloat16", True, {**concat, "compile": True, "cudnn_benchmark": True}),
            "windows_eager_bench": ("bfloat16", False, {**win, "cudnn_benchmark": True}),
            "windows_graph": ("bfloat16", True, {**win, "cudnn_benchmark": False}),
            "windows_graph_bench": ("bfloat16", True, {**win, "cudnn_benchmark": True}),
        }
        if args.variants:
            variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
        if len(variants) > 1:  # PyTorch caches cuDNN's algorithm per shape for the process (the first
            # variant's choice, searched or not, would stick): each variant in a process of its own
            rows = {name: isolated(name, args) for name in variants}
            variants = {}
    else:
        rate = matmul_rate(device, torch.float32)
        variants = {"concat_eager": ("float32", False, {"windows": False}),
                    "windows_eager": ("float32", False, {"windows": True})}
    kernels: dict[str, float] = {}
    profiled = next(iter(variants), "")
    rows.update({name: variant(dt, device, graph, args.preset, args.iters, args.warmup,
                               kernels if args.profile and name == profiled else None, **kw)
                 for name, (dt, graph, kw) in variants.items()})
    split: dict[str, float] = {}
    if args.first_frame:  # in a process of its own on CUDA, like every variant (cuDNN keeps its first choice)
        if device.type == "cuda":
            with tempfile.TemporaryDirectory() as tmp:
                out_one = Path(tmp) / "split.json"
                subprocess.run([sys.executable, __file__, "--preset", args.preset, "--device", args.device,
                                "--iters", str(args.iters), "--warmup", str(args.warmup), "--variants", "none",
                                "--split-only", "--out", str(out_one)], check=True, stdout=subprocess.DEVNULL)
                split = results.latest(out_one)["first_frame"]
        else:
            split = first_frame("float32", device, False, args.preset, args.iters, args.warmup, windows=True)
    if args.split_only:
        split = first_frame("bfloat16", device, True, args.preset, args.iters, args.warmup, windows=True,
                            cudnn_benchmark=True)
    floor = flops / rate * 1e3
    result = {"command": " ".join(["python", *sys.argv]), "preset": args.preset,
              "resolution": f"{cfg.model.generation.width}x{cfg.model.generation.height}",
              "frames_per_chunk": cfg.model.generation.frames_per_chunk,
              **env_info(device), "gflops_per_chunk": flops / 1e9, "matmul_tflops": rate / 1e12,
              "floor_ms": floor, "ms": rows, "target_ms": 60.0,
              **({f"top_kernels_ms_{profiled}": kernels} if kernels else {}),
              **({"first_frame": split} if split else {})}
    out = Path(args.out or results.default_path(f"decoder_{args.preset}", device.type))
    out.parent.mkdir(parents=True, exist_ok=True)
    results.record(out, result)
    print(f"decoder {args.preset} {result['resolution']}, {flops / 1e9:.0f} GFLOP/chunk, {result['device']}")
    print(f"{'variant':<28} {'ms/chunk':>9} {'floor ms':>9} {'ratio':>6}")
    for name, ms in rows.items():
        print(f"{name:<28} {ms:>9.2f} {floor:>9.2f} {ms / floor:>6.2f}")
    for name, ms in kernels.items():
        print(f"  {ms:8.2f}  {name[:150]}")
    if split:
        print(f"onset chunk in two parts, to the host: first frame {split['first_to_host_ms']:.2f} ms, the rest "
              f"{split['rest_to_host_ms']:.2f} ms; whole chunk {split['whole_to_host_ms']:.2f} ms; frames vs the "
              f"whole chunk's: max |diff| {split['max_abs_diff']:.0f}, mean {split['mean_abs_diff']:.4f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
