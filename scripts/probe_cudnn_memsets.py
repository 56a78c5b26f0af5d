"""Probe: the device memsets around cuDNN's FP8 attention in a CUDA graph, and what removes them.

    python scripts/probe_cudnn_memsets.py --out benchmarks/h200/cudnn_memsets.json

The traced 57b rank step (`bench_fp8.py steps --timeline-variants`, `step_57b_tp3_timeline_lt_ws0.json`) shows two
device memsets before every attention call (116 a step) and ~0.56 ms of idle gaps beside them. This captures
`reps` calls of the model's own graph (`kernels.attention_cudnn_fp8.CudnnFp8Graph`, the TP3 rank's shapes:
q (1, 24, 2992, 128) over 14960 of 14976 cached keys, padding mask) in one CUDA graph, per variant:

  * `amax`: the graph as the model builds it (P's and the output's amax as graph outputs);
  * `no_amax`: those two left virtual (the model reads neither);

and reports per call: device time (CUDA events around a replay), the memsets and kernels a replay runs
(torch.profiler), and the output's difference from the `amax` variant's (0: the same kernel). A variant that fails
to build is recorded with its error. CUDA only; prints a table, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention_cudnn_fp8 import CudnnFp8Graph, cudnn_handle, padded_keys
from kernels.fp8 import FP8, FP8_MAX
from scripts.bench_step import env_info


def variant(amax: bool, tensors: dict[str, torch.Tensor], valid: int, reps: int) -> dict[str, Any]:
    import cudnn
    from torch.profiler import ProfilerActivity, profile

    dev = tensors["q"].device
    handle = cudnn_handle(dev.index or 0)
    q, k, v, out = tensors["q"], tensors["k"], tensors["v"], torch.empty_like(tensors["q"])
    graph = CudnnFp8Graph(cudnn, handle, q, k, v, out, valid, amax=amax)
    qk = torch.full((2,), 1.0 / 32, device=dev)
    vs = torch.full((1,), 1.0 / 64, device=dev)
    vinv = 1 / vs
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        cudnn.set_stream(handle=handle, stream=stream.cuda_stream)
        for _ in range(3):
            graph.run(handle, q, k, v, qk, vs, vinv, out)
    torch.cuda.current_stream(dev).wait_stream(stream)
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(dev).cuda_stream)
        for _ in range(reps):
            graph.run(handle, q, k, v, qk, vs, vinv, out)
    for _ in range(3):
        cg.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        cg.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cg.replay()
        torch.cuda.synchronize()
    names = [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    memsets = sum("memset" in n.lower() for n in names)
    return {"ms_per_call": statistics.median(times), "memsets_per_call": memsets / reps,
            "device_ops_per_call": len(names) / reps, "out": out.float().clone()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    t, dh, valid = 2992, 128, 14960
    slots = padded_keys(valid)
    g = torch.Generator(device=dev).manual_seed(0)

    def e4m3(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device=dev, generator=g) * 64
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)

    hh = args.heads
    tensors = {"q": e4m3(1, hh, t, dh), "k": e4m3(1, hh, slots, dh), "v": e4m3(1, hh, slots, dh)}
    rows: dict[str, Any] = {}
    ref: torch.Tensor | None = None
    for name, amax in (("amax", True), ("no_amax", False)):
        try:
            r = variant(amax, tensors, valid, args.reps)
        except Exception as e:  # noqa: BLE001 (a variant cuDNN refuses is a result)
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        out = r.pop("out")
        ref = out if ref is None else ref
        r["max_abs_diff_vs_amax"] = float((out - ref).abs().max())
        rows[name] = r
    result = {"command": " ".join(["python", *sys.argv]), **env_info(dev),
              "shape": {"heads": args.heads, "queries": t, "head_dim": dh, "valid_keys": valid, "slots": slots},
              "reps_per_graph": args.reps, "rows": rows}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(f"{'variant':<10} {'ms/call':>8} {'memsets':>8} {'ops':>5} {'diff':>8}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<10} FAILED: {r['error'][:150]}")
            continue
        print(f"{name:<10} {r['ms_per_call']:>8.3f} {r['memsets_per_call']:>8.1f} {r['device_ops_per_call']:>5.1f} "
              f"{r['max_abs_diff_vs_amax']:>8.3g}")
    print(f"-> {out_path}")


if __name__ == "__main__":
    main()
