"""Benchmark the write-time cache kernel (`qkv_prep`, Triton vs its PyTorch reference), the attention backends,
and the VAE decoder's fused passes (`norm_silu`, `bias_add`, `upsample_nearest`) at the 57b decoder's shapes.

Default shapes: the `57b` preset's rank-local shapes at TP=4 (T=2992 tokens per chunk, Hh=72/4=18 heads of
Dh=128, a cache of S=5*2992 slots: reference + 3 past + current latent frames), bf16, writing the last chunk.

Each time is the median of N CUDA-event timed calls after warm-up, rotating over several input sets so that
repeated calls do not just hit L2. Beside each time its floor:
    qkv_prep   bytes read + written / HBM bandwidth (measured here by a device-to-device copy, or --hbm-bw)
    decoder    the same byte floor for norm_silu / bias_add / upsample (704x1088, 4 frames, bf16; the
               up-sampling also against the unfused path it replaced: add, reshape, NHWC interpolate, layout copy)
    attention  max(4 B Hh Tq S Dh FLOPs / matmul rate (an 8192^3 matmul, measured here, or --matmul-flops),
                   bytes of q, k, v, out / HBM bandwidth)
On CPU it runs small shapes, times the PyTorch paths with a host clock and says so (ratios only; the Triton
interpreter is a correctness tool, not timed). Prints a table; `--out path.json` writes everything.

    python scripts/benchmarks/bench_kernels.py --out bench_kernels.json
    python scripts/benchmarks/bench_kernels.py --sweep            # also try Triton tilings
    python scripts/benchmarks/bench_kernels.py --only decoder     # the decoder's passes only
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import (
    AttentionBackend,
    attention,
    attention_ref,
    available_backends,
    qkv_prep_ref,
    qkv_prep_triton,
)
from kernels._triton import HAS_TRITON
from kernels.norm_silu import bias_add_ref, bias_add_triton, norm_silu_ref, norm_silu_triton
from kernels.testing import QKVPrepInputs, make_qkv_prep_inputs, rel_err
from kernels.upsample import upsample_nearest_ref, upsample_nearest_triton
from scripts.benchmarks import results

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
H200_HBM_BW = 4.3e12  # B/s: the measured-copy figure for an H200; used only when nothing can be measured
EPS = 1e-6
SWEEP = [  # (block_t, block_h, num_warps) for --sweep
    (1, 2, 1), (2, 2, 2), (4, 2, 4), (8, 2, 4), (16, 2, 4), (16, 2, 8), (32, 2, 8),
    (4, 1, 4), (8, 1, 4), (2, 4, 4), (4, 4, 4), (8, 4, 8),
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1, help="B")
    p.add_argument("--tokens", type=int, default=None, help="T tokens written per call (default 2992; CPU 64)")
    p.add_argument("--heads", type=int, default=None, help="Hh rank-local heads (default 18; CPU 4)")
    p.add_argument("--head-dim", type=int, default=None, help="Dh (default 128; CPU 64)")
    p.add_argument("--cache-slots", type=int, default=None, help="S cache slots (default 5 * T)")
    p.add_argument("--offset", type=int, default=None, help="slot written (default S - T, the current chunk)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="compute dtype (default bf16; CPU fp32)")
    p.add_argument("--cache-dtype", choices=sorted(DTYPES), default=None, help="cache dtype (default: --dtype)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per variant (median reported)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first")
    p.add_argument("--sets", type=int, default=3, help="input sets rotated between calls (defeats L2 reuse)")
    p.add_argument("--hbm-bw", type=float, default=None, help="HBM bytes/s to use instead of measuring")
    p.add_argument("--matmul-flops", type=float, default=None, help="bf16 matmul FLOP/s to use instead of measuring")
    p.add_argument("--sweep", action="store_true", help="also time the Triton tilings in SWEEP")
    p.add_argument("--skip-attention", action="store_true", help="time qkv_prep only")
    p.add_argument("--only", choices=["qkv_prep", "attention", "decoder"], default=None, help="one group of rows")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------------
# Timing and ceilings
# ------------------------------------------------------------------------------------------------------


def time_ms(fn: Callable[[int], Any], warmup: int, iters: int, n_sets: int, cuda: bool) -> dict[str, float]:
    """Median / min / max milliseconds of fn(i % n_sets): CUDA events on a GPU, a host clock on CPU."""
    for i in range(warmup):
        fn(i % n_sets)
    samples: list[float] = []
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(i % n_sets)
            end.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in events]
    else:
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i % n_sets)
            samples.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples)}


def measure_hbm_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    n = 1 << 30  # bf16 elements: 2 GiB
    src = torch.randn(n // 2, device=device, dtype=torch.float32).view(torch.bfloat16)  # (n,), random bits
    dst = torch.empty_like(src)
    t = time_ms(lambda _: dst.copy_(src), warmup=3, iters=20, n_sets=1, cuda=True)
    return 2 * src.numel() * src.element_size() / (t["median_ms"] * 1e-3)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of an 8192^3 matmul on random data."""
    n = 8192
    a = torch.randn(n, n, device=device).to(dtype)  # (n, n)
    b = torch.randn(n, n, device=device).to(dtype)
    t = time_ms(lambda _: torch.mm(a, b), warmup=3, iters=20, n_sets=1, cuda=True)
    return 2 * n**3 / (t["median_ms"] * 1e-3)


# ------------------------------------------------------------------------------------------------------
# qkv_prep
# ------------------------------------------------------------------------------------------------------


def qkv_prep_bytes(inp: QKVPrepInputs) -> int:
    """Fewest bytes: read q, k, v, the weights and the RoPE tables once; write q out and T slots of k and v."""
    qkv, cache = inp.qkv, inp.k_cache
    b, t, _, hh, dh = qkv.shape
    n = b * t * hh * dh
    read = 3 * n * qkv.element_size() + 2 * dh * inp.q_weight.element_size() + 2 * t * (dh // 2) * 4
    written = n * qkv.element_size() + 2 * n * cache.element_size()
    return read + written


def bench_qkv_prep(args: argparse.Namespace, device: torch.device, hbm_bw: float | None) -> list[dict[str, Any]]:
    cuda = device.type == "cuda"
    dtype, cache_dtype = DTYPES[args.dtype], DTYPES[args.cache_dtype]
    b, t, hh, dh, s, off = args.batch, args.tokens, args.heads, args.head_dim, args.cache_slots, args.offset
    gen = torch.Generator(device=device).manual_seed(0)
    sets = [
        make_qkv_prep_inputs(b, t, hh, dh, s, dtype, cache_dtype, device=device, generator=gen)
        for _ in range(args.sets)
    ]
    offset = torch.tensor(off, device=device)  # as in the captured step: a device tensor

    def call(fn: Callable[..., torch.Tensor], **kw: Any) -> Callable[[int], torch.Tensor]:
        def run(i: int) -> torch.Tensor:
            x = sets[i]
            return fn(x.qkv, x.q_weight, x.k_weight, x.cos, x.sin, x.k_cache, x.v_cache, offset, EPS, **kw)

        return run

    variants: list[tuple[str, Callable[[int], torch.Tensor]]] = [("torch_ref", call(qkv_prep_ref))]
    if cuda and HAS_TRITON:
        variants.append(("triton", call(qkv_prep_triton)))
        if args.sweep:
            for bt, bh, nw in SWEEP:
                variants.append(
                    (f"triton_t{bt}_h{bh}_w{nw}", call(qkv_prep_triton, block_t=bt, block_h=bh, num_warps=nw))
                )

    # Correctness at these shapes first (fresh caches for each variant).
    x0 = sets[0]
    kc_ref, vc_ref = x0.clone_caches()
    q_ref = qkv_prep_ref(x0.qkv, x0.q_weight, x0.k_weight, x0.cos, x0.sin, kc_ref, vc_ref, off, EPS)
    nbytes = qkv_prep_bytes(x0)
    floor_ms = nbytes / hbm_bw * 1e3 if hbm_bw else None
    rows: list[dict[str, Any]] = []
    for name, fn in variants:
        x0.k_cache.copy_(kc_ref.roll(1, dims=2))  # anything but the answer
        q = fn(0)
        errors = {
            "q_rel_err": rel_err(q, q_ref),
            "k_rel_err": rel_err(x0.k_cache[:, :, off : off + t], kc_ref[:, :, off : off + t]),
        }
        timing = time_ms(fn, args.warmup, args.iters, len(sets), cuda)
        row: dict[str, Any] = {"kernel": "qkv_prep", "variant": name, **timing, **errors, "bytes": nbytes}
        row["floor_ms"] = floor_ms
        row["achieved_bytes_per_s"] = nbytes / (timing["median_ms"] * 1e-3)
        row["time_over_floor"] = timing["median_ms"] / floor_ms if floor_ms else None
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------------


def bench_attention(
    args: argparse.Namespace, device: torch.device, hbm_bw: float | None, matmul_flops: float | None
) -> list[dict[str, Any]]:
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    b, tq, hh, dh, s = args.batch, args.tokens, args.heads, args.head_dim, args.cache_slots
    gen = torch.Generator(device=device).manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    sets = [(randn(b, hh, tq, dh), randn(b, hh, s, dh), randn(b, hh, s, dh)) for _ in range(args.sets)]
    q0, k0, v0 = sets[0]
    ref = attention_ref(q0, k0, v0)
    flops = 4 * b * hh * tq * s * dh
    nbytes = (2 * b * hh * tq * dh + 2 * b * hh * s * dh) * q0.element_size()
    flop_floor = flops / matmul_flops * 1e3 if matmul_flops else None
    byte_floor = nbytes / hbm_bw * 1e3 if hbm_bw else None
    floor_ms = max(f for f in (flop_floor, byte_floor) if f is not None) if flop_floor or byte_floor else None
    rows: list[dict[str, Any]] = []
    for backend in available_backends(device, dtype):
        row: dict[str, Any] = {"kernel": "attention", "variant": backend, "flops": flops, "bytes": nbytes}
        try:
            row["rel_err"] = rel_err(attention(q0, k0, v0, backend), ref)
            run = functools.partial(_attention_on_set, sets, backend)
            timing = time_ms(run, args.warmup, args.iters, len(sets), cuda)
        except RuntimeError as e:  # a backend that rejects these shapes: report it, keep going
            row["error"] = str(e).splitlines()[0] if str(e) else repr(e)
            rows.append(row)
            continue
        row.update(timing)
        row.update(flop_floor_ms=flop_floor, byte_floor_ms=byte_floor, floor_ms=floor_ms)
        row["achieved_flops_per_s"] = flops / (timing["median_ms"] * 1e-3)
        row["time_over_floor"] = timing["median_ms"] / floor_ms if floor_ms else None
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------
# The VAE decoder's fused passes
# ------------------------------------------------------------------------------------------------------

DECODER_PASSES = [
    # (kernel, c, T, h, w, count per chunk): the 57b decoder at 704x1088, one latent frame (4 video frames)
    ("norm_silu", 96, 4, 704, 1088, 7),  # full resolution: 2 per residual block + norm_out
    ("norm_silu", 192, 4, 352, 544, 6),
    ("norm_silu", 384, 2, 176, 272, 6),
    ("bias_add", 96, 4, 704, 1088, 2),  # a residual block's last add (bias + residual)
    ("upsample", 192, 4, 352, 544, 1),  # stage 2 -> full resolution, the residual block's add folded in
    ("upsample_fold", 384, 2, 176, 272, 1),  # stage 1: time conv's 768 channels -> 4 frames at 352x544
]
DECODER_SWEEP = [(rows, warps) for rows in (8, 16, 32, 64, 128) for warps in (2, 4, 8)]  # (block_rows, num_warps)


class DecoderPass:
    """One of the decoder's passes at one shape, with `sets` input sets: x and residual (B, cx, T, h, w)
    channels-last, the norm weight (c,) and a bias (cx,); cx = 2c for the time fold, else c."""

    def __init__(self, kernel: str, c: int, t: int, h: int, w: int, n_sets: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        cl = torch.channels_last_3d
        gen = torch.Generator(device=device).manual_seed(c + t)
        self.kernel, self.fold = kernel, kernel == "upsample_fold"
        cx = 2 * c if self.fold else c

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device).to(dtype).contiguous(memory_format=cl)

        self.x = [randn(1, cx, t, h, w) for _ in range(n_sets)]
        self.residual = None if self.fold else [randn(1, cx, t, h, w) for _ in range(n_sets)]
        self.scratch = [x.clone() for x in self.x]  # outputs of in-place passes (the inputs stay intact)
        self.windows = [torch.empty(1, c, 2 + t, h, w, device=device, dtype=dtype).contiguous(memory_format=cl)
                        for _ in range(n_sets)] if kernel == "norm_silu" else []
        self.weight = 1.0 + 0.3 * torch.randn(c, generator=gen, device=device)
        self.bias = torch.randn(cx, generator=gen, device=device).to(dtype)
        n, size = cx * t * h * w, self.x[0].element_size()
        reads = {"norm_silu": 1, "bias_add": 2, "upsample": 2, "upsample_fold": 1}[kernel]
        writes = {"norm_silu": 1, "bias_add": 1}.get(kernel, 4)
        self.nbytes = (reads + writes) * n * size  # the floor: every input read once, every output written once
        self.out: torch.Tensor | None = None

    def res(self, i: int) -> torch.Tensor | None:
        return None if self.residual is None else self.residual[i]

    def call(self, fn: Callable[..., torch.Tensor], **kw: Any) -> Callable[[int], torch.Tensor]:
        """fn as the decoder runs it on input set i: a residual block's second norm (the first conv's bias
        folded in) into a window's tail; a residual block's last add in place; an up-sampling with its add."""

        def run(i: int) -> torch.Tensor:
            if self.kernel == "norm_silu":
                self.out = fn(self.x[i], self.weight, EPS, out=self.windows[i][:, :, 2:], bias=self.bias, **kw)
            elif self.kernel == "bias_add":
                self.out = fn(self.x[i], self.bias, self.res(i), out=self.scratch[i], **kw)
            else:
                self.out = fn(self.x[i], self.bias, self.res(i), fold_time=self.fold, **kw)
            return self.out

        return run

    def unfused(self, i: int) -> torch.Tensor:
        """The passes `upsample_nearest` replaced in characters.vae: the add (in place), the time fold's reshape,
        2-D nearest up-sampling frame by frame, the copy to channels-last cuDNN made of the result."""
        x = (bias_add_triton if self.x[i].is_cuda and HAS_TRITON else bias_add_ref)(
            self.x[i], self.bias, self.res(i), out=self.scratch[i])  # (B, cx, T, h, w)
        b, cx, t, h, w = x.shape
        if self.fold:
            x = x.view(b, 2, cx // 2, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, cx // 2, 2 * t, h, w)
        c, t = x.shape[1], x.shape[2]
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)  # (B*T', c, h, w)
        up = torch.nn.functional.interpolate(frames, scale_factor=2.0, mode="nearest")
        self.out = up.view(b, t, c, 2 * h, 2 * w).transpose(1, 2).contiguous(memory_format=torch.channels_last_3d)
        return self.out

    def reference(self) -> torch.Tensor:
        if self.kernel == "norm_silu":
            return norm_silu_ref(self.x[0], self.weight, EPS, bias=self.bias)
        if self.kernel == "bias_add":
            return bias_add_ref(self.x[0], self.bias, self.res(0))
        return upsample_nearest_ref(self.x[0], self.bias, self.res(0), fold_time=self.fold)


def bench_decoder_passes(args: argparse.Namespace, device: torch.device, hbm_bw: float | None) -> list[dict[str, Any]]:
    """One row per (pass, variant): the PyTorch reference, the Triton kernel (and its tilings with --sweep), and
    for the up-samplings the unfused path they replaced."""
    cuda = device.type == "cuda"
    rows: list[dict[str, Any]] = []
    for kernel, c, t, h, w, count in DECODER_PASSES:
        if not cuda:  # CPU: the same passes with frames 1/16 the size in each dimension
            h, w = max(2, h // 16), max(2, w // 16)
        p = DecoderPass(kernel, c, t, h, w, args.sets, device, torch.bfloat16 if cuda else torch.float32)
        ref = {"norm_silu": norm_silu_ref, "bias_add": bias_add_ref}.get(kernel, upsample_nearest_ref)
        variants: list[tuple[str, Callable[[int], torch.Tensor]]] = [("torch_ref", p.call(ref))]
        if kernel.startswith("upsample"):
            variants.append(("torch_unfused", p.unfused))
        if cuda and HAS_TRITON:
            tri = {"norm_silu": norm_silu_triton, "bias_add": bias_add_triton}.get(kernel, upsample_nearest_triton)
            variants.append(("triton", p.call(tri)))
            if args.sweep:
                variants += [(f"triton_r{r}_w{nw}", p.call(tri, block_rows=r, num_warps=nw)) for r, nw in DECODER_SWEEP]
        want = p.reference()
        floor_ms = p.nbytes / hbm_bw * 1e3 if hbm_bw else None
        for name, fn in variants:
            row: dict[str, Any] = {"kernel": kernel, "variant": f"c{c} T{t} {h}x{w} {name}", "bytes": p.nbytes,
                                   "per_chunk": count}
            try:
                row["rel_err"] = rel_err(fn(0), want)
                timing = time_ms(fn, args.warmup, args.iters, len(p.x), cuda)
            except (RuntimeError, ValueError) as e:  # a tiling that does not compile or fit: report it, keep going
                row["error"] = str(e).splitlines()[0] if str(e) else repr(e)
                rows.append(row)
                continue
            row.update(timing, floor_ms=floor_ms)
            row["achieved_bytes_per_s"] = p.nbytes / (timing["median_ms"] * 1e-3)
            row["time_over_floor"] = timing["median_ms"] / floor_ms if floor_ms else None
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------------


def _attention_on_set(
    sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], backend: AttentionBackend, i: int
) -> torch.Tensor:
    q, k, v = sets[i]
    return attention(q, k, v, backend)


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "gpu": None,
    }
    if HAS_TRITON:
        import triton

        env["triton"] = triton.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
        env["l2_bytes"] = getattr(props, "L2_cache_size", None)
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def print_table(rows: list[dict[str, Any]]) -> None:
    def fmt(v: Any, spec: str) -> str:
        width = int(spec.split(".")[0])
        return f"{'-':>{width}}" if v is None else format(v, spec)

    print(f"{'kernel':13} {'variant':32} {'median ms':>10} {'floor ms':>9} {'x floor':>8} {'rate':>13} {'rel err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:13} {r['variant']:32} error: {r['error'][:70]}")
            continue
        if r["kernel"] == "qkv_prep":
            rate, err = f"{r['achieved_bytes_per_s'] / 1e9:8.0f} GB/s", max(r["q_rel_err"], r["k_rel_err"])
        elif "flops" not in r:  # the decoder's passes: bytes only
            rate, err = f"{r['achieved_bytes_per_s'] / 1e9:8.0f} GB/s", r["rel_err"]
        else:
            rate, err = f"{r['achieved_flops_per_s'] / 1e12:6.1f} TFLOP/s", r["rel_err"]
        print(
            f"{r['kernel']:13} {r['variant']:32} {r['median_ms']:10.4f} {fmt(r['floor_ms'], '9.4f')} "
            f"{fmt(r['time_over_floor'], '8.2f')} {rate:>13} {err:9.2e}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    big = (2992, 18, 128, "bf16") if cuda else (64, 4, 64, "fp32")  # CPU: small shapes
    args.tokens = args.tokens or big[0]
    args.heads = args.heads or big[1]
    args.head_dim = args.head_dim or big[2]
    args.dtype = args.dtype or big[3]
    args.cache_dtype = args.cache_dtype or args.dtype
    args.cache_slots = args.cache_slots or 5 * args.tokens
    args.offset = args.cache_slots - args.tokens if args.offset is None else args.offset
    if not cuda:
        print("CPU run: small shapes, host-clock timing on a noisy machine: read ratios only, no floors.")
        print("The Triton kernel is not timed on CPU (its interpreter is a correctness tool).")

    ceilings: dict[str, Any] = {}
    hbm_bw, matmul_flops = args.hbm_bw, args.matmul_flops
    if cuda:
        if hbm_bw is None:
            hbm_bw = measure_hbm_bandwidth(device)
            ceilings["hbm_bw_source"] = "measured: 2 GiB device-to-device copy, (read + written) / time"
        else:
            ceilings["hbm_bw_source"] = "given (--hbm-bw)"
        if matmul_flops is None:
            matmul_flops = measure_matmul_flops(device, torch.bfloat16)
            ceilings["matmul_source"] = "measured: 8192^3 bf16 torch.mm"
        else:
            ceilings["matmul_source"] = "given (--matmul-flops)"
        print(f"ceilings: HBM {hbm_bw / 1e12:.2f} TB/s, bf16 matmul {matmul_flops / 1e12:.0f} TFLOP/s")
    elif hbm_bw is not None or matmul_flops is not None:
        ceilings["note"] = "given on the command line"
    ceilings.update(hbm_bytes_per_s=hbm_bw, matmul_flops_per_s=matmul_flops, h200_nominal_copy_bw=H200_HBM_BW)

    shapes = {k: getattr(args, k) for k in ("batch", "tokens", "heads", "head_dim", "cache_slots", "offset")}
    print(f"shapes: {shapes}, dtype {args.dtype}, cache dtype {args.cache_dtype}")
    rows = bench_qkv_prep(args, device, hbm_bw) if args.only in (None, "qkv_prep") else []
    if not args.skip_attention and args.only in (None, "attention"):
        rows += bench_attention(args, device, hbm_bw, matmul_flops)
    if args.only in (None, "decoder"):
        rows += bench_decoder_passes(args, device, hbm_bw)
    print_table(rows)
    if args.out:
        result = {
            "env": environment(device),
            "shapes": shapes,
            "dtype": args.dtype,
            "cache_dtype": args.cache_dtype,
            "timing": {"iters": args.iters, "warmup": args.warmup, "input_sets": args.sets, "statistic": "median"},
            "ceilings": ceilings,
            "cpu_note": None if cuda else "small shapes, host clock, noisy: ratios only",
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results.record(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
