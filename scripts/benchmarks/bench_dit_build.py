"""Benchmark: the memory and time of making one DiT rank's weights in FP8: the rank's whole share in bf16 first, then
quantised (the build before `materialize_dit`), against a block at a time (`characters.weights.materialize_dit`, what
`DiTRunner` does).

    python scripts/benchmarks/bench_dit_build.py --preset 57b --layers 4 --ranks 3 --layouts sp,spl,spa  # CPU: peak RSS
    python scripts/benchmarks/bench_dit_build.py --preset 57b --ranks 3 --layouts spl,spa --device cuda  # 58 blocks

Layouts as `bench_fp8.py`'s: `sp` every layer split by sequence parallelism, `spl` the token-local layers
whole (`topology.local_layers`), `spa` self-attention whole too (`topology.local_attention`), `rep` replicated tokens.
Each (layout, build) runs in a process of its own, rank 0 of `--ranks` with seeded random weights: on CUDA the peak is
`torch.cuda.max_memory_allocated` over the build, on the CPU the process's peak resident set (`ru_maxrss`) less its
resident set just before the build. Beside it, the rank's FP8 share (its state dict's bytes) and its bf16 share:
the whole-share build cannot go under the bf16 share. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from characters.cpu import cpu_model  # noqa: E402
from characters.dit import CausalDiT  # noqa: E402
from characters.tp import apply_tensor_parallel  # noqa: E402
from characters.weights import init_weights, materialize_dit  # noqa: E402
from scripts.benchmarks import results  # noqa: E402
from scripts.benchmarks.common import rank_config  # noqa: E402

BUILDS = ("whole", "blocks")
LAYOUTS = ("sp", "spl", "spa", "rep")


def _rss_bytes() -> int:
    """This process's resident set now (Linux: /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def build_one(preset: str, layers: int | None, ranks: int, layout: str, build: str, device: str) -> dict[str, Any]:
    """Make rank 0's FP8 DiT one way, in this process; its peak memory over the build, its time and its bytes."""
    if build not in BUILDS:
        raise ValueError(f"build {build!r}: expected one of {BUILDS}")
    cfg = rank_config(preset, ranks, layout, "fp8", "bf16", layers)
    topo = cfg.topology
    with torch.device("meta"):
        dit = CausalDiT(cfg.model)
    apply_tensor_parallel(dit, None, rank=0, size=ranks, communicate=False, sequence_parallel=topo.sequence_parallel,
                          local_layers=topo.local_layers, local_attention=topo.local_attention)
    dit.to(torch.bfloat16)
    bf16_bytes = sum(p.numel() * 2 for p in dit.parameters())
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    start = time.perf_counter()
    if build == "whole":
        init_weights(dit, cfg.seed, device=device)
        dit.to_fp8()
    else:
        materialize_dit(dit, cfg.seed, device, fp8=True)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    build_s = time.perf_counter() - start
    made = sum(t.numel() * t.element_size() for t in dit.state_dict().values())
    block_bf16 = sum(p.numel() * 2 for p in dit.blocks[0].parameters())
    return {"layout": layout, "build": build, "peak_gb": round(peak / 1e9, 2), "build_s": round(build_s, 2),
            "fp8_share_gb": round(made / 1e9, 2), "bf16_share_gb": round(bf16_bytes / 1e9, 2),
            "block_bf16_gb": round(block_bf16 / 1e9, 3), "blocks": len(dit.blocks), "fp8_share_bytes": made,
            "bf16_share_bytes": bf16_bytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="57b")
    p.add_argument("--layers", type=int, default=None, help="DiT blocks (default: the preset's)")
    p.add_argument("--ranks", type=int, default=3, choices=(1, 2, 3, 4))
    p.add_argument("--layouts", default="sp,spl,spa", help="comma list of sp, spl, spa, rep")
    p.add_argument("--builds", default=",".join(BUILDS), help=f"comma list of {BUILDS}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--one", nargs=2, metavar=("LAYOUT", "BUILD"), help=argparse.SUPPRESS)  # a variant's own process
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    unknown = [v for v in args.layouts.split(",") if v not in LAYOUTS] + [v for v in args.builds.split(",")
                                                                         if v not in BUILDS]
    if unknown:
        p.error(f"unknown layouts or builds {unknown}; layouts: {LAYOUTS}, builds: {BUILDS}")
    if args.one:
        print(json.dumps(build_one(args.preset, args.layers, args.ranks, *args.one, args.device)))
        return 0
    rows = []
    for layout in args.layouts.split(","):
        for build in args.builds.split(","):
            cmd = [sys.executable, __file__, "--preset", args.preset, "--ranks", str(args.ranks), "--device",
                   args.device, "--one", layout, build, *(["--layers", str(args.layers)] if args.layers else [])]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            else:  # e.g. the whole share in bf16 out of a card's memory: a result too
                lines = done.stderr.strip().splitlines() or [f"rc {done.returncode}"]
                rows.append({"layout": layout, "build": build, "error": lines[-1][-300:]})
            print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_model()
    out = {"bench": "dit_build", "preset": args.preset, "layers": args.layers, "ranks": args.ranks,
           "device": device, "torch": torch.__version__, "python": platform.python_version(),
           "peak": "CUDA: max_memory_allocated over the build; CPU: peak resident set less the resident set before it",
           "command": " ".join(["python", "scripts/benchmarks/bench_dit_build.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
           "rows": rows}
    print(f"\n{'layout':<7} {'build':<7} {'peak GB':>8} {'FP8 share':>10} {'bf16 share':>11} {'block bf16':>11} "
          f"{'build s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:<7} {r['build']:<7} failed: {r['error']}")
            continue
        print(f"{r['layout']:<7} {r['build']:<7} {r['peak_gb']:8.2f} {r['fp8_share_gb']:10.2f} "
              f"{r['bf16_share_gb']:11.2f} {r['block_bf16_gb']:11.3f} {r['build_s']:8.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results.record(args.out, out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
