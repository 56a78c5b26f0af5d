"""FP8 on the GPU: step times per precision, the attention kernels, and FP8-vs-bf16 drift along the KV cache.

    python scripts/benchmarks/bench_fp8.py steps --preset 57b --ranks 3 --variants sp:fp8:fp8,sp:bf16:bf16 --out X.json
    python scripts/benchmarks/bench_fp8.py attention --out X.json
    python scripts/benchmarks/bench_fp8.py drift --preset wan-1.3b --chunks 100 --out X.json
    python scripts/benchmarks/bench_fp8.py rates --out X.json

steps: one DiT rank of a `ranks`-way tensor-parallel session with exactly that rank's shapes and weight share
(communication excluded: no all-gather / reduce-scatter / all-reduce), replayed from CUDA graphs. A variant is
`layout:precision:attention`, attention `bf16`, `fp8` (the kernel `auto` picks), `fp8-triton` or `fp8-cudnn`;
layout `sp` (sequence parallel: the rank's 1/n of the token-wise work), `spl` (sequence parallel with the token-local
layers whole: `topology.local_layers`, the MLP and the audio cross-attention on the rank's rows with whole weights),
`spa` (`spl` with self-attention whole too: `topology.local_attention`, each rank's queries over every key, its K/V
rows gathered; here the gather is left out and the copy of the rows into the cache timed) or `rep` (every token on
every rank, the serving default). Each variant runs in a process of its own (memory;
one failing variant does not lose the others). The floor beside each time is the rank's FLOPs at the matmul
rates measured in the same process: bf16 `torch.mm` and FP8 `torch._scaled_mm` (row-wise scales, fast
accumulation), the best of five medians of an 8192^3 product each (`characters.flops.ChunkCost.floor_ms`).

attention: the FP8 Triton kernel (`kernels.attention_fp8`, tilings swept) against bf16 cuDNN (plain and
split-KV) at the 57b rank's shapes for 2, 3 and 4 ranks (q over the full 14960-key context), each checked
against its reference; and the FP8 cache write against the bf16 one.

drift: the same seeded session (random weights) in bf16 and in FP8 side by side for `chunks` chunks, one GPU;
the per-chunk relative error of the latents, and the slope of the error against the chunk index (error carried
through the KV cache would grow with it). `--layers` cuts the block count (the 57b's full width does not fit
twice on one GPU with 58 blocks).

lipsync: the trained `tiny` (shipped weights) on the GPU, per precision and noise seed, on the held-out clips
(`--data`/test.npz, built by `characters.train.data.load_or_build` where espeak-ng is installed (it excludes the
training sentences), carried to the GPU machine).

Prints a table, writes JSON (command, GPU, driver, versions).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from characters.config import session_config  # noqa: E402
from characters.engine import DiTRunner  # noqa: E402
from characters.flops import chunk_cost  # noqa: E402
from scripts.benchmarks import results  # noqa: E402
from scripts.benchmarks.common import env_info, rank_config, timed  # noqa: E402


# ------------------------------------------------------------------------------------------------ rates
def _best_median(fn: Any, trials: int = 5, iters: int = 10) -> float:
    dev = torch.device("cuda")
    return min(statistics.median(timed(fn, dev, iters=iters, warmup=3)) for _ in range(trials))


def matmul_rates(n: int = 8192) -> dict[str, float]:
    """bf16 and FP8 (row-wise scaled) GEMM rates in FLOP/s on random data, best of five medians each."""
    from kernels.fp8 import fp8_linear, quantize_rows_ref, quantize_weight

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16_ms = _best_median(lambda: a @ b)
    x8 = quantize_rows_ref(a)
    w8, sw = quantize_weight(b)
    fp8_ms = _best_median(lambda: fp8_linear(x8.data, x8.scale, w8, sw))
    return {"bf16": 2 * n**3 / (bf16_ms / 1e3), "fp8": 2 * n**3 / (fp8_ms / 1e3)}


# ------------------------------------------------------------------------------------------------ steps
def step_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    layout, precision, attention, *steps = variant.split(":")  # a 4th part "inductor": no row kernels
    if steps not in ([], ["inductor"]):
        raise ValueError(f"variant {variant!r}: expected layout:precision:attention[:inductor]")
    device = torch.device("cuda")
    cfg = rank_config(args.preset, args.ranks, layout, precision, attention, args.layers)
    t0 = time.perf_counter()
    runner = DiTRunner(cfg, device=device, rank=0, ranks=args.ranks, communicate=False)
    if steps == ["inductor"]:  # the FP8 steps compiled by Inductor (kernels.row_quant's kernels off)
        runner.dit.fuse_elementwise(True, row_kernels=False)
    built_s = time.perf_counter() - t0
    runner.capture_graphs()
    captured_s = time.perf_counter() - t0 - built_s
    h, w = cfg.model.latent_hw
    runner.start(torch.randn(1, cfg.model.dit.latent_channels, h, w, device=device))
    windows = runner.frontend.push(np.zeros(runner.frontend.expected_samples, dtype=np.float32))
    for _ in range(cfg.model.generation.ring_slots):  # the ring full: every timed chunk sees the whole context
        runner.step_windows(windows)
    times = timed(lambda: runner.step_windows(windows), device, args.iters, args.warmup)
    rates = matmul_rates()
    cost = chunk_cost(cfg)
    ms = statistics.median(times)
    floor_bf16 = cost.floor_ms(rates["bf16"])
    floor_prec = cost.floor_ms(rates["bf16"], rates["fp8"] if precision == "fp8" else None,
                               attention.startswith("fp8"))
    row = {"variant": variant, "layout": layout, "precision": precision, "attention_precision": attention,
           "ms_p50": ms, "ms_min": min(times), "ms_max": max(times), "iters": len(times),
           "floor_ms_bf16_rate": floor_bf16, "floor_ms_at_its_rates": floor_prec, "ratio": ms / floor_prec,
           "attention_kernel": runner.attention_kernel, "rates_tflops": {k: v / 1e12 for k, v in rates.items()},
           "build_s": built_s, "capture_s": captured_s, "flops_per_chunk_per_rank": cost.flops_per_chunk_per_rank,
           "linear_tflop": cost.linear_flops_per_chunk_per_rank / 1e12,
           "attention_tflop": cost.attention_flops_per_chunk_per_rank / 1e12,
           "max_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
           "row_kernels": bool(getattr(runner.dit.blocks[0].ops, "row_kernels", False))}
    if args.profile:
        row["profile"] = profile_step(runner, windows)
    if args.timeline:
        row["timeline"] = timeline_step(runner, windows)
    return row


def profile_step(runner: DiTRunner, windows: np.ndarray) -> dict[str, Any]:
    """Kernel time per chunk by family (torch.profiler over eager steps: the graph's kernels, device time only)."""
    from torch.profiler import ProfilerActivity, profile

    from scripts.benchmarks.profile_step import family

    steps = 3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step_windows(windows, record=[])  # eager (the graph's kernels, launched one by one)
        torch.cuda.synchronize()
    fams: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = ev.device_time_total / steps / 1e3
        fam = "fp8 attention" if "attention_fp8" in ev.key else family(ev.key)
        fam = "fp8 cache write" if "qkv_prep_fp8" in ev.key else fam
        fams[fam] = fams.get(fam, 0.0) + ms
        kernels[ev.key] = kernels.get(ev.key, 0.0) + ms
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:25])
    return {"ms_per_chunk_by_family": fams, "ms_total": sum(fams.values()), "top_kernels_ms": top}


def timeline_step(runner: DiTRunner, windows: np.ndarray, steps: int = 3) -> dict[str, Any]:
    """The kernels of the served step as they ran (graph replays, torch.profiler's trace): per step the device's
    busy time, its idle gaps between consecutive kernels, and those gaps by the kernel families on each side:
    what of the wall time no kernel ran, and next to what. Gaps over 1 ms are counted apart (between steps)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from scripts.benchmarks.profile_step import family

    def fam(name: str) -> str:  # our Triton kernels and the copies by name, the rest by family
        return name.split(" (")[0][:40] if name.startswith(("_", "Memset", "Memcpy")) else family(name)

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step_windows(windows)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    ks = sorted((float(e["ts"]), float(e["dur"]), str(e["name"])) for e in events
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy = sum(d for _, d, _ in ks) / 1e3 / steps
    gaps: dict[str, float] = {}
    small = big = 0.0
    counts = {"gaps_under_2us": 0, "gaps_2_10us": 0, "gaps_10_100us": 0, "gaps_100us_1ms": 0, "gaps_over_1ms": 0}
    for (t0, d0, n0), (t1, _, n1) in itertools.pairwise(ks):
        gap = t1 - (t0 + d0)
        if gap <= 0:
            continue
        if gap > 1000:
            big += gap
            counts["gaps_over_1ms"] += 1
            continue
        small += gap
        key = "gaps_under_2us" if gap < 2 else "gaps_2_10us" if gap < 10 else "gaps_10_100us" if gap < 100 else (
            "gaps_100us_1ms")
        counts[key] += 1
        pair = f"{fam(n0)} -> {fam(n1)}"
        gaps[pair] = gaps.get(pair, 0.0) + gap
    top = dict(sorted(((k, v / 1e3 / steps) for k, v in gaps.items()), key=lambda kv: -kv[1])[:20])
    return {"steps": steps, "kernels_per_step": len(ks) / steps, "busy_ms_per_step": busy,
            "idle_gaps_ms_per_step": small / 1e3 / steps, "gaps_over_1ms_total_ms": big / 1e3,
            "gap_counts_per_step": {k: v / steps for k, v in counts.items()}, "idle_ms_by_pair": top}


def cmd_steps(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for variant in args.variants.split(","):
        if args.inline:
            rows.append(step_variant(args, variant))
            continue
        out = Path(args.out).with_suffix(f".{variant.replace(':', '_')}.part.json")
        cmd = [sys.executable, __file__, "steps", "--inline", "--preset", args.preset, "--ranks", str(args.ranks),
               "--variants", variant, "--iters", str(args.iters), "--warmup", str(args.warmup), "--out", str(out)]
        cmd += ["--layers", str(args.layers)] if args.layers else []
        cmd += ["--profile"] if variant in (args.profile_variants or "").split(",") else []
        cmd += ["--timeline"] if variant in (args.timeline_variants or "").split(",") else []
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.variant_timeout)
        if res.returncode == 0 and out.is_file():
            rows.extend(results.latest(out)["rows"])
            out.unlink()
        else:
            rows.append({"variant": variant, "error": (res.stdout + res.stderr)[-3000:],
                         "wall_s": time.perf_counter() - t0})
        print(f"  {variant}: {'ok' if res.returncode == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return {"preset": args.preset, "ranks": args.ranks, "layers": args.layers,
            "communication": "excluded (one rank's share: no all-gather / reduce-scatter / all-reduce)", "rows": rows}


def print_steps(result: dict[str, Any]) -> None:
    print(f"{result['preset']}: one rank of {result['ranks']}" + (f", {result['layers']} layers" if result['layers']
                                                                   else ""))
    print(f"{'variant':<16} {'ms/chunk':>9} {'floor':>7} {'ratio':>6} {'floor bf16':>10}  attention")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['variant']:<16} FAILED: {r['error'].strip().splitlines()[-1][:150] if r['error'] else ''}")
            continue
        print(f"{r['variant']:<16} {r['ms_p50']:>9.2f} {r['floor_ms_at_its_rates']:>7.1f} {r['ratio']:>6.2f} "
              f"{r['floor_ms_bf16_rate']:>10.1f}  {r['attention_kernel']}")
        for fam, ms in sorted(r.get("profile", {}).get("ms_per_chunk_by_family", {}).items(), key=lambda kv: -kv[1]):
            print(f"    {fam:<26} {ms:8.2f} ms")
        if "timeline" in r:
            tl = r["timeline"]
            print(f"    replayed: {tl['kernels_per_step']:.0f} kernels, busy {tl['busy_ms_per_step']:.2f} ms, "
                  f"idle gaps {tl['idle_gaps_ms_per_step']:.2f} ms a step; {tl['gap_counts_per_step']}")
            for pair, ms in list(tl["idle_ms_by_pair"].items())[:8]:
                print(f"      {ms:7.3f} ms  {pair}")


# ------------------------------------------------------------------------------------------------ attention
def cmd_attention(args: argparse.Namespace) -> dict[str, Any]:
    from kernels.attention import attention, attention_ref
    from kernels.attention_fp8 import attention_fp8_ref, attention_fp8_triton
    from kernels.fp8 import FP8
    from kernels.qkv_prep import qkv_prep
    from kernels.qkv_prep_fp8 import qkv_prep_fp8
    from kernels.testing import make_qkv_prep_inputs, rel_err

    dev = torch.device("cuda")
    tq, s, dh = 2992, 14960, 128
    configs = [((64, 128, 4, 3), False), ((128, 128, 8, 3), False), ((128, 128, 8, 3), True),
               ((64, 128, 4, 3), True), ((128, 64, 4, 3), True), ((128, 128, 8, 4), True), ((64, 64, 4, 3), True),
               ((128, 64, 8, 3), True)]
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for ranks in (4, 3):
        hh = 72 // ranks
        flops = 4 * tq * s * dh * hh
        inp = make_qkv_prep_inputs(1, tq, hh, dh, s, torch.bfloat16, device=dev, generator=gen)
        k8 = torch.empty(1, hh, s, dh, device=dev, dtype=FP8)
        vt8 = torch.empty(1, hh, dh, s, device=dev, dtype=FP8)
        vs = torch.empty(1, hh, s, device=dev)
        qks = torch.empty(2, device=dev)
        kb = torch.empty(1, hh, s, dh, device=dev, dtype=torch.bfloat16)
        vb = torch.empty_like(kb)
        args_w = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
        for slot in range(5):  # fill the whole cache, chunk by chunk, as a session does
            q8 = qkv_prep_fp8(*args_w, k8, vt8, vs, qks, slot * tq, 1e-6)
            qb = qkv_prep(*args_w, kb, vb, slot * tq, 1e-6)
        write_fp8 = _best_median(partial(qkv_prep_fp8, *args_w, k8, vt8, vs, qks, 4 * tq, 1e-6), trials=3)
        write_bf16 = _best_median(partial(qkv_prep, *args_w, kb, vb, 4 * tq, 1e-6), trials=3)
        ref = attention_fp8_ref(q8[:, :4], k8[:, :4], vt8[:, :4], vs[:, :4], qks, torch.float32)  # 4 heads checked
        exact = attention_ref(qb[:, :4], kb[:, :4], vb[:, :4]).float()
        for name in ("sdpa_cudnn", "sdpa_cudnn_split2"):
            ms = _best_median(partial(attention, qb, kb, vb, name), trials=3)
            err = rel_err(attention(qb, kb, vb, name)[:, :4], exact)
            rows.append({"ranks": ranks, "heads": hh, "kernel": name, "ms": ms, "tflops": flops / ms / 1e9,
                         "rel_err_vs_ref": err})
        for cfg, tma in configs:
            name = f"triton_fp8 {'tma' if tma else 'ptr'} {cfg}"
            try:
                out = attention_fp8_triton(q8, k8, vt8, vs, qks, config=cfg, tma=tma)
                torch.cuda.synchronize()
                err = rel_err(out[:, :4], ref)
                ms = _best_median(partial(attention_fp8_triton, q8, k8, vt8, vs, qks, config=cfg, tma=tma), trials=3)
                rows.append({"ranks": ranks, "heads": hh, "kernel": name, "ms": ms,
                             "tflops": flops / ms / 1e9, "rel_err_vs_ref": err,
                             "rel_err_vs_bf16_attention": rel_err(out[:, :4], exact)})
            except Exception as e:  # noqa: BLE001 (a tiling that does not compile: recorded, the sweep goes on)
                rows.append({"ranks": ranks, "heads": hh, "kernel": name, "error": str(e)[:500]})
        rows.append({"ranks": ranks, "heads": hh, "kernel": "cache write qkv_prep (bf16)", "ms": write_bf16})
        rows.append({"ranks": ranks, "heads": hh, "kernel": "cache write qkv_prep_fp8", "ms": write_fp8})
        del k8, vt8, kb, vb, inp
        torch.cuda.empty_cache()
    return {"shapes": {"tq": tq, "keys": s, "head_dim": dh}, "floor_note": "tflops = 4*Tq*S*Dh*Hh / time",
            "rows": rows}


def print_attention(result: dict[str, Any]) -> None:
    print(f"{'ranks':>5} {'kernel':<34} {'ms':>7} {'TFLOP/s':>8} {'rel err':>8}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['ranks']:>5} {r['kernel']:<34} FAILED {r['error'].splitlines()[0][:80]}")
        elif "tflops" in r:
            print(f"{r['ranks']:>5} {r['kernel']:<34} {r['ms']:>7.3f} {r['tflops']:>8.0f} {r['rel_err_vs_ref']:>8.4f}")
        else:
            print(f"{r['ranks']:>5} {r['kernel']:<34} {r['ms']:>7.3f}")


# ------------------------------------------------------------------------------------------------ drift
def cmd_drift(args: argparse.Namespace) -> dict[str, Any]:
    """bf16 and FP8 sessions of the same seed, side by side: per-chunk relative error of the latents."""
    from kernels.testing import rel_err

    dev = torch.device("cuda")
    variants = [v.split(":") for v in args.variants.split(",")]  # precision:attention pairs against bf16:bf16
    runners = {"bf16:bf16": DiTRunner(rank_config(args.preset, 1, "rep", "bf16", "bf16", args.layers), device=dev)}
    for p, a in variants:
        runners[f"{p}:{a}"] = DiTRunner(rank_config(args.preset, 1, "rep", p, a, args.layers), device=dev)
    for r in runners.values():
        r.capture_graphs()
    m = runners["bf16:bf16"].cfg.model
    h, w = m.latent_hw
    ref = torch.randn(1, m.dit.latent_channels, h, w, device=dev, generator=torch.Generator(dev).manual_seed(1))
    for r in runners.values():
        r.start(ref, seed=7)
    rng = np.random.default_rng(0)
    frontend = runners["bf16:bf16"].frontend
    errs: dict[str, list[float]] = {k: [] for k in runners if k != "bf16:bf16"}
    for _ in range(args.chunks):
        pcm = rng.uniform(-0.3, 0.3, frontend.expected_samples).astype(np.float32)  # speech-like level noise
        outs = {k: r.step(pcm) for k, r in runners.items()}
        base = outs["bf16:bf16"]
        for k in errs:
            errs[k].append(rel_err(outs[k], base))
    fits = {}
    for k, e in errs.items():
        x = np.arange(len(e))
        slope, icpt = np.polyfit(x, np.asarray(e), 1)
        q = len(e) // 4
        fits[k] = {"slope_per_chunk": float(slope), "intercept": float(icpt),
                   "first_quarter_mean": float(np.mean(e[:q])), "last_quarter_mean": float(np.mean(e[-q:])),
                   "max": float(np.max(e)), "median": float(np.median(e))}
    return {"preset": args.preset, "layers": args.layers or m.dit.num_layers, "chunks": args.chunks,
            "weights": "seeded random", "audio": "uniform noise in [-0.3, 0.3]", "per_chunk_rel_err": errs,
            "fit": fits}


def print_drift(result: dict[str, Any]) -> None:
    print(f"{result['preset']} ({result['layers']} layers), {result['chunks']} chunks, latents vs bf16")
    for k, f in result["fit"].items():
        print(f"  {k:<10} median {f['median']:.4f}  first quarter {f['first_quarter_mean']:.4f}  last quarter "
              f"{f['last_quarter_mean']:.4f}  max {f['max']:.4f}  slope {f['slope_per_chunk']:+.2e}/chunk")


# ------------------------------------------------------------------------------------------------ lip sync
def cmd_lipsync(args: argparse.Namespace) -> dict[str, Any]:
    """The trained `tiny` on the GPU: lip-sync on the held-out clips per precision, several noise seeds each (the
    run-to-run spread), scored as `eval_lipsync.py` does (`characters.train.lipsync.lipsync_score`)."""
    from characters.engine import DecoderRunner, ReferenceEncoder
    from characters.train.data import load_split, reference_image
    from characters.train.evaluate import generate
    from characters.train.lipsync import lipsync_score
    from characters.weights import resolve_weights

    clips = load_split(Path(args.data) / "test.npz")[: args.clips]  # the held-out split of eval_lipsync.py
    refs = [reference_image(c.identity) for c in clips]
    rows = []
    for variant in args.variants.split(","):
        precision, attention = variant.split(":")
        cfg = session_config("tiny", "gpu1", dtype="bfloat16", model={"precision": precision,
                                                                        "attention_precision": attention})
        if resolve_weights(cfg) is None:
            raise ValueError("the shipped tiny weights do not fit this config; lip sync needs the trained model")
        dit = DiTRunner(cfg, device="cuda")
        dit.capture_graphs()
        enc, dec = ReferenceEncoder(cfg, device="cuda"), DecoderRunner(cfg, device="cuda")
        dec.capture_graph()
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            frames = [generate(dit, enc, dec, ref, c.pcm, c.frames, seed * 1000 + i)
                      for i, (c, ref) in enumerate(zip(clips, refs, strict=True))]
            score = lipsync_score(frames, [c.pcm for c in clips], [c.identity for c in clips], refs)
            rows.append({"variant": variant, "seed": seed, **score.as_dict(), "generate_s": time.perf_counter() - t0})
            print(f"  {variant} seed {seed}: r {score.r:.4f} at offset {score.offset} ({rows[-1]['generate_s']:.0f} s)",
                  flush=True)
        del dit, enc, dec
        torch.cuda.empty_cache()
    summary = {}
    for variant in args.variants.split(","):
        rs = [r["r"] for r in rows if r["variant"] == variant]
        summary[variant] = {"r_mean": float(np.mean(rs)), "r_min": float(min(rs)), "r_max": float(max(rs)),
                            "offsets": sorted({r["offset"] for r in rows if r["variant"] == variant})}
    return {"preset": "tiny", "weights": "shipped (trained)", "clips": len(clips), "seeds": args.seeds,
            "rows": rows, "summary": summary}


def print_lipsync(result: dict[str, Any]) -> None:
    print(f"tiny (trained), {result['clips']} held-out clips, {result['seeds']} noise seeds per precision")
    print(f"{'precision:attention':<20} {'r mean':>7} {'r min':>7} {'r max':>7}  best offset")
    for k, v in result["summary"].items():
        print(f"{k:<20} {v['r_mean']:>7.4f} {v['r_min']:>7.4f} {v['r_max']:>7.4f}  {v['offsets']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["steps", "attention", "drift", "rates", "lipsync"])
    p.add_argument("--preset", default="57b")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=None, help="blocks built (default: the preset's)")
    p.add_argument("--variants", default="sp:bf16:bf16,sp:fp8:bf16,sp:fp8:fp8")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunks", type=int, default=100)
    p.add_argument("--profile", action="store_true", help="(with --inline) add the kernel profile")
    p.add_argument("--profile-variants", default="", help="variants to profile (comma-separated)")
    p.add_argument("--timeline", action="store_true", help="(with --inline) add the replayed graph's timeline")
    p.add_argument("--timeline-variants", default="",
                   help="variants whose graph replays are traced: kernel time and the idle gaps between kernels")
    p.add_argument("--inline", action="store_true", help="run the variants in this process")
    p.add_argument("--variant-timeout", type=float, default=400)
    p.add_argument("--seeds", type=int, default=3, help="(lipsync) noise seeds per precision")
    p.add_argument("--clips", type=int, default=51, help="(lipsync) held-out clips")
    p.add_argument("--data", default=str(ROOT / ".cache" / "tiny_data"), help="(lipsync) the data set's directory")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.perf_counter()
    part = {"steps": cmd_steps, "attention": cmd_attention, "drift": cmd_drift, "lipsync": cmd_lipsync,
            "rates": lambda a: {k: v / 1e12 for k, v in matmul_rates().items()}}[args.part](args)
    result = {"command": " ".join(["python", *sys.argv]), **env_info(torch.device("cuda")), "part": args.part,
              **part, "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results.record(out, result)
    if args.inline:
        return
    {"steps": print_steps, "attention": print_attention, "drift": print_drift, "lipsync": print_lipsync,
     "rates": lambda r: print({k: r[k] for k in ("bf16", "fp8")})}[args.part](result)
    print(f"-> {out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
