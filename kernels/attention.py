"""Attention over the KV cache, with backend dispatch.

The cache already holds normed, rotated keys in the attention dtype and layout (`kernels.qkv_prep`), so
attention is plain softmax(q k^T * scale) v over the cache's first S slots; `pick_backend` times the backends
on the real shapes at warm-up and keeps the fastest.

Details: docs/kernels.md (`kernels.attention`)."""

from __future__ import annotations

import functools
import importlib
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.fp8 import Fp8Act, quantize_rows, quantize_rows_ref

__all__ = [
    "ATTENTION_BACKENDS",
    "PARTS",
    "AttentionBackend",
    "MergeFn",
    "PartsFn",
    "attention",
    "attention_fp8_out",
    "attention_ref",
    "available_backends",
    "merge_parts",
    "merge_parts_fp8",
    "parts_cudnn",
    "parts_flash",
    "parts_ref",
    "pick_backend",
    "split_attention",
]

logger = logging.getLogger(__name__)

AttentionBackend = Literal[
    "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flash_attn", "flash_attn3", "vllm_flash_attn",
    "sdpa_cudnn_split2", "sdpa_cudnn_split4", "sdpa_cudnn_split8",
    "sdpa_flash_split2", "sdpa_flash_split4", "sdpa_flash_split8",
]  # fmt: skip
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = get_args(AttentionBackend)

_SDPA_FORCED: dict[str, SDPBackend] = {
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
# Optional packages: backend -> (module, function).
_FLASH_IMPORTS: dict[str, tuple[str, str]] = {
    "flash_attn": ("flash_attn", "flash_attn_func"),
    "flash_attn3": ("flash_attn_interface", "flash_attn_func"),
    "vllm_flash_attn": ("vllm_flash_attn", "flash_attn_func"),
}
_FLASH_BACKENDS: tuple[AttentionBackend, ...] = ("flash_attn", "flash_attn3", "vllm_flash_attn")
# Split-KV backend -> (kernel of the parts, part count).
_SPLIT: dict[str, tuple[str, int]] = {f"sdpa_{kernel}_split{n}": (kernel, n) for kernel in ("cudnn", "flash")
                                      for n in (2, 4, 8)}  # fmt: skip
_SPLIT_BACKENDS: tuple[AttentionBackend, ...] = tuple(b for b in ATTENTION_BACKENDS if b in _SPLIT)
# How the split backends hand q to each kernel: "expand" (batch stride 0, no copy) or "repeat" (a copy).
# Whether each kernel accepts a stride-0 batch is settled on the GPU by scripts/benchmarks/bench_attention_split.py.
_Q_FOLD: dict[str, Literal["expand", "repeat"]] = {"cudnn": "expand", "flash": "expand"}
_HALF = (torch.float16, torch.bfloat16)

PartsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
"""(q, k, v, scale) -> (out (B, Hh, Tq, Dh) in q's dtype, lse (B, Hh, Tq) float32): softmax(q k^T * scale) v
and the natural-log log-sum-exp of the scaled scores, log sum_j exp(scale * q.k_j), per query row."""
MergeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Readable reference: softmax(q k^T * scale) v with the softmax in float32; returns q's dtype.

    q: (B, Hh, Tq, Dh); k, v: (B, Hh, S, Dh); scale defaults to 1/sqrt(Dh). Out: (B, Hh, Tq, Dh).
    """
    _check_qkv(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, Hh, Tq, S)
    probs = scores.softmax(dim=-1)  # (B, Hh, Tq, S)
    return torch.matmul(probs, v.float()).to(q.dtype)  # (B, Hh, Tq, Dh)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: AttentionBackend = "sdpa",
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v through `backend`. q (B, Hh, Tq, Dh); k, v (B, Hh, S, Dh) -> (B, Hh, Tq, Dh).

    No mask. scale defaults to 1/sqrt(Dh). Raises ValueError for an unknown or not-importable backend;
    a kernel that rejects the inputs raises its own RuntimeError. A split backend on CPU tensors runs the
    float32 reference parts through the same fold and merge.
    """
    _check_qkv(q, k, v)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, Hh, Tq, Dh)
    if backend in _SDPA_FORCED:
        with sdpa_kernel([_SDPA_FORCED[backend]]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, Hh, Tq, Dh)
    if backend in _SPLIT:
        return _split_backend(q, k, v, backend, scale)  # (B, Hh, Tq, Dh)
    if backend in _FLASH_IMPORTS:
        fn = _flash_fn(backend)
        if fn is None:
            module = _FLASH_IMPORTS[backend][0]
            raise ValueError(f"attention: backend={backend!r} needs the package {module!r}, which does not import")
        # flash-attn layout (B, T, Hh, Dh): transposed views, last dim stays contiguous.
        res = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=False)
        out = res[0] if isinstance(res, tuple) else res  # FA3 builds may also return the log-sum-exp
        return out.transpose(1, 2)  # (B, Hh, Tq, Dh) view of (B, Tq, Hh, Dh)
    raise ValueError(f"attention: backend={backend!r} is unknown; expected one of {list(ATTENTION_BACKENDS)}")


def attention_fp8_out(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: AttentionBackend = "sdpa",
    scale: float | None = None,
) -> Fp8Act:
    """`attention`, its output per token quantised to e4m3: (B, Tq, Hh*Dh) values and (B, Tq, 1) scales.

    Split backends on CUDA fold the quantisation into their compiled merge; others run one compiled
    quantisation pass after the kernel; on CPU everything is the reference."""
    _check_qkv(q, k, v)
    b, _, tq, _ = q.shape
    if backend in _SPLIT and q.is_cuda:
        kernel, n = _SPLIT[backend]
        n = _part_count(k.shape[2], n)
        if n > 1:
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            out, lse = PARTS[kernel](_fold_q(q, n, _Q_FOLD[kernel]), _fold_kv(k, n), _fold_kv(v, n), scale)
            out5, lse4 = out.unflatten(0, (b, n)), lse.unflatten(0, (b, n))  # (B, n, Hh, Tq, Dh), (B, n, Hh, Tq)
            return Fp8Act(*_compiled_merge_fp8()(out5.transpose(2, 3), lse4.transpose(2, 3)))
    return quantize_rows(attention(q, k, v, backend, scale).transpose(1, 2).reshape(b, tq, -1))  # (B, Tq, Hh*Dh)


def merge_parts_fp8(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_parts` over token-major parts, then the per-token quantisation of the merged rows.
    out (B, n, Tq, Hh, Dh), lse (B, n, Tq, Hh) -> e4m3 (B, Tq, Hh*Dh), scales (B, Tq, 1)."""
    act = quantize_rows_ref(merge_parts(out, lse).flatten(-2))
    return act.data, act.scale


@functools.cache
def _compiled_merge_fp8() -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`merge_parts_fp8` compiled (one fused kernel per shape; warm up before any capture)."""
    fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = torch.compile(
        merge_parts_fp8, dynamic=False)
    return fn


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[AttentionBackend]:
    """Backends that can plausibly run on `device` for `dtype` (importable, dtype and architecture supported).

    A backend listed here may still reject particular shapes or strides; `pick_backend` skips those.
    """
    device = torch.device(device)
    if device.type != "cuda":  # SDPA's CPU kernels: math for every dtype, flash for float32 / float16 / bfloat16
        cpu: list[AttentionBackend] = ["sdpa", "sdpa_math"]
        return [*cpu, "sdpa_flash"] if dtype in (torch.float32, *_HALF) else cpu
    major, _ = torch.cuda.get_device_capability(device)
    half = dtype in _HALF
    out: list[AttentionBackend] = ["sdpa"]
    if half and major >= 8:
        out += ["sdpa_cudnn", "sdpa_flash", *_SPLIT_BACKENDS]
    out += ["sdpa_efficient", "sdpa_math"]
    for name in _FLASH_BACKENDS:
        ok_arch = major == 9 if name == "flash_attn3" else major >= 8
        if half and ok_arch and _flash_fn(name) is not None:
            out.append(name)
    return out


def pick_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    candidates: Sequence[AttentionBackend] | None = None,
    iters: int = 20,
    warmup: int = 3,
) -> AttentionBackend:
    """The fastest backend on these real inputs, by median CUDA-event time; "sdpa" on CPU (not timed).

    candidates: backends to try (default: all of `available_backends`); unavailable ones are dropped.
    A backend that raises, or whose output disagrees with the first working one (relative error > 2e-2),
    is skipped with a warning. Synchronizes: call at warm-up, never in the step or a graph capture.
    """
    _check_qkv(q, k, v)
    if not q.is_cuda:
        logger.info("attention backend: 'sdpa' (CPU, not timed)")
        return "sdpa"
    avail = available_backends(q.device, q.dtype)
    names = [c for c in (candidates or avail) if c in avail]
    if not names:
        raise ValueError(f"pick_backend: none of candidates={list(candidates or [])} is available; available: {avail}")
    times: dict[AttentionBackend, float] = {}
    baseline: tuple[AttentionBackend, torch.Tensor] | None = None
    for name in names:
        try:
            out = attention(q, k, v, name)
            torch.cuda.synchronize(q.device)
        except RuntimeError as e:
            logger.warning("attention backend %r skipped: %s", name, str(e).splitlines()[0] if str(e) else e)
            continue
        if baseline is None:
            baseline = (name, out.float())
        else:
            ref_name, ref = baseline
            err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err <= 2e-2:  # also catches NaN
                logger.warning("attention backend %r skipped: relative error %.3g against %r", name, err, ref_name)
                continue
        times[name] = _median_ms(functools.partial(attention, q, k, v, name), iters, warmup)
    if not times:
        raise RuntimeError(f"pick_backend: every candidate failed on q {tuple(q.shape)}, k {tuple(k.shape)}: {names}")
    best = min(times, key=lambda n: times[n])
    logger.info(
        "attention backend: %r for q %s, k %s, %s (median ms: %s)",
        best, tuple(q.shape), tuple(k.shape), q.dtype, {n: round(t, 4) for n, t in times.items()},
    )  # fmt: skip
    return best


# --------------------------------------------------------------------------------------------------------
# split-KV
# --------------------------------------------------------------------------------------------------------


def split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n: int,
    parts: PartsFn | None = None,
    scale: float | None = None,
    q_fold: Literal["expand", "repeat"] = "expand",
    merge: MergeFn | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v as n key parts in one `parts` call, merged by log-sum-exp.

    q (B, Hh, Tq, Dh); k, v (B, Hh, S, Dh) with S % n == 0, else ValueError. parts: the per-part kernel
    (default `parts_ref`, the float32 reference); q_fold: "expand" hands the kernel q with batch stride 0
    (a view when B == 1), "repeat" a copy; merge: default `merge_parts`. Returns (B, Hh, Tq, Dh) in q's
    dtype, token-major (a view of (B, Tq, Hh, Dh)) when q is. No host syncs: graph-capturable if `parts`
    and `merge` are.
    """
    _check_qkv(q, k, v)
    b, dh = q.shape[0], q.shape[3]
    if n < 1 or k.shape[2] % n:
        raise ValueError(
            f"split_attention: S={k.shape[2]} keys do not split into n={n} equal parts; "
            f"pass an n that divides S (the backends pick the largest such n up to theirs)"
        )
    scale = 1.0 / math.sqrt(dh) if scale is None else scale
    parts = parts_ref if parts is None else parts
    qf = _fold_q(q, n, q_fold)  # (B*n, Hh, Tq, Dh)
    out, lse = parts(qf, _fold_kv(k, n), _fold_kv(v, n), scale)  # (B*n, Hh, Tq, Dh), (B*n, Hh, Tq)
    if n == 1:
        return out  # one part: the merge would be the identity
    out5, lse4 = out.unflatten(0, (b, n)), lse.unflatten(0, (b, n))  # (B, n, Hh, Tq, Dh), (B, n, Hh, Tq)
    merge = merge_parts if merge is None else merge
    if _token_major(q):  # merge in (B, n, Tq, Hh, Dh) order so the result is (B, Tq, Hh, Dh) in memory
        return merge(out5.transpose(2, 3), lse4.transpose(2, 3)).transpose(1, 2)  # (B, Hh, Tq, Dh)
    return merge(out5, lse4)  # (B, Hh, Tq, Dh)


def merge_parts(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Combine n attention parts over disjoint key sets into attention over all their keys.

    out (B, n, Hh, Tq, Dh), any float dtype; lse (B, n, Hh, Tq), natural log. The two middle dims are
    only carried along (Tq before Hh works the same). Weights exp(lse_i - logsumexp_i(lse_i)) in float32;
    returns (B, Hh, Tq, Dh) in out's dtype. Torch ops only, static shapes, no host syncs.
    """
    lse = lse.float()
    total = torch.logsumexp(lse, dim=1, keepdim=True)  # (B, 1, Hh, Tq): the lse over all keys
    weight = torch.exp(lse - total).unsqueeze(-1)  # (B, n, Hh, Tq, 1), sums to 1 over n
    return (weight * out.float()).sum(dim=1).to(out.dtype)  # (B, Hh, Tq, Dh)


def parts_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`PartsFn` in float32 math (the CPU path and the tests' reference): (out in q's dtype, lse float32).

    Like the kernels, out is allocated like q (`empty_like`: q's memory order when q is dense)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, Hh, Tq, S)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hh, Tq)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # (B, Hh, Tq, S)
    return torch.empty_like(q).copy_(torch.matmul(probs, v.float())), lse  # (B, Hh, Tq, Dh), (B, Hh, Tq)


def parts_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`PartsFn` by cuDNN (SDPA's cuDNN kernel with its softmax stats; CUDA, half dtypes)."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    return res[0], _lse_rows(res[1], q)  # stats: (B, Hh, Tq, 1), natural log


def parts_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`PartsFn` by SDPA's flash kernel (FlashAttention-2 in torch; CUDA sm80+, half dtypes)."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return res[0], _lse_rows(res[1], q)  # softmax_lse: (B, Hh, Tq), natural log


PARTS: dict[str, PartsFn] = {"cudnn": parts_cudnn, "flash": parts_flash}


def _split_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, scale: float | None
) -> torch.Tensor:
    """A split backend: its kernel's parts on CUDA (merge compiled), the float32 reference parts elsewhere."""
    kernel, n = _SPLIT[backend]
    n = _part_count(k.shape[2], n)
    if not q.is_cuda:
        return split_attention(q, k, v, n, parts_ref, scale)
    if n == 1:  # nothing to merge: the plain kernel (no log-sum-exp to write)
        with sdpa_kernel([_SDPA_FORCED[f"sdpa_{kernel}"]]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, Hh, Tq, Dh)
    return split_attention(q, k, v, n, PARTS[kernel], scale, _Q_FOLD[kernel], _compiled_merge())


def _part_count(s: int, n: int) -> int:
    """The largest part count <= n that divides s (1 when none other does)."""
    return next(d for d in range(n, 0, -1) if s % d == 0)


@functools.cache
def _compiled_merge() -> MergeFn:
    """`merge_parts` compiled into one fused kernel (CUDA), specialised per shape and layout on first use:
    warm up (e.g. `pick_backend`) before any graph capture. Not `fullgraph`: past dynamo's recompile limit
    (8 shapes / layouts in one process) a new shape runs the merge eagerly, with dynamo's warning, instead of
    failing. It has no graph breaks (tests/unit/test_attention_split.py checks)."""
    fn: MergeFn = torch.compile(merge_parts, dynamic=False)
    return fn


def _token_major(x: torch.Tensor) -> bool:
    """x (B, Hh, T, Dh) is laid out as (B, T, Hh, Dh) in memory."""
    return x.stride(1) < x.stride(2)


def _fold_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, Hh, S, Dh) -> (B*n, Hh, S/n, Dh), part i of batch b at index b*n + i.

    A view when B == 1: batch stride = the part stride (S/n) * stride(S), whatever the cache's S_max.
    For B > 1 the batch and part strides do not combine into one and `flatten` copies.
    """
    s = x.shape[2]
    parts = x.unflatten(2, (n, s // n)).transpose(1, 2)  # (B, n, Hh, s/n, Dh), a view
    return parts.flatten(0, 1)  # (B*n, Hh, s/n, Dh)


def _fold_q(q: torch.Tensor, n: int, q_fold: Literal["expand", "repeat"]) -> torch.Tensor:
    """(B, Hh, Tq, Dh) -> (B*n, Hh, Tq, Dh), q once per part, in q's own memory order.

    "expand": batch stride 0, a view when B == 1 (a copy otherwise); "repeat": always a copy.
    """
    token_major = _token_major(q)
    base = q.transpose(1, 2) if token_major else q  # (B, Tq, Hh, Dh) or (B, Hh, Tq, Dh): memory order
    rep = base.unsqueeze(1).expand(base.shape[0], n, *base.shape[1:])  # (B, n, ., ., Dh), stride 0 over n
    if q_fold == "repeat":
        rep = rep.contiguous()
    elif q_fold != "expand":
        raise ValueError(f"split_attention: q_fold={q_fold!r}; expected 'expand' or 'repeat'")
    folded = rep.flatten(0, 1)  # (B*n, ., ., Dh)
    return folded.transpose(1, 2) if token_major else folded  # (B*n, Hh, Tq, Dh)


def _lse_rows(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A kernel's log-sum-exp, (B, Hh, Tq[, 1]) or padded along Tq, as (B, Hh, Tq) float32."""
    b, hh, tq, _ = q.shape
    return lse[:, :, :tq].reshape(b, hh, tq).float()


def _median_ms(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """Median milliseconds of `fn` over `iters` calls, by CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


@functools.cache
def _flash_fn(backend: str) -> Callable[..., Any] | None:
    """The optional package's `flash_attn_func`, or None when it does not import."""
    module, attr = _FLASH_IMPORTS[backend]
    try:
        fn: Callable[..., Any] = getattr(importlib.import_module(module), attr)
        return fn
    except (ImportError, OSError, AttributeError) as e:  # missing, or built against another torch / CUDA
        logger.debug("attention backend %r unavailable: %s", backend, e)
        return None


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shapes (B, Hh, Tq, Dh) / (B, Hh, S, Dh), one dtype and device, contiguous last dim; else ValueError."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            "expected q (B, Hh, Tq, Dh) and k, v (B, Hh, S, Dh) with equal B, Hh, Dh"
        )
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(
            f"attention: q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} on {q.device}/{k.device}/{v.device}; "
            "expected one dtype on one device"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"attention: {name} has strides {x.stride()}; the last dim (Dh) must be contiguous")
