"""Attention over the KV cache, with backend dispatch.

The cache already holds normed, rotated keys in the attention dtype and layout (see `kernels.qkv_prep`),
so attention here is plain, unmasked softmax(q k^T * scale) v over the first S slots of the cache.

Shapes (names as in `characters/config.py`): q (B, Hh, Tq, Dh); k, v (B, Hh, S, Dh), typically the prefix
view `cache[:, :, :S]` of a (B, Hh, S_max, Dh) cache, so not contiguous along S but with a contiguous last
dim; out (B, Hh, Tq, Dh). The flash-attn backends work in (B, T, Hh, Dh) memory order: their `out` is a
(B, Hh, Tq, Dh) view of a (B, Tq, Hh, Dh) tensor (not contiguous), which is what the output projection
wants after its `transpose(1, 2)`.

Backends:
    sdpa             torch SDPA, torch's own choice of kernel
    sdpa_cudnn       SDPA forced to cuDNN          sdpa_flash      SDPA forced to its flash kernel
    sdpa_efficient   SDPA forced to mem-efficient  sdpa_math       SDPA forced to the math path
    flash_attn       FlashAttention-2 `flash_attn.flash_attn_func`
    flash_attn3      FlashAttention-3 `flash_attn_interface.flash_attn_func` (Hopper)
    vllm_flash_attn  `vllm_flash_attn.flash_attn_func`
The flash-attn packages are optional; a backend is offered only when its import works.

`pick_backend` times the available backends on the real shapes at warm-up time (never inside the step or
a graph capture: it synchronizes) and returns the fastest.
"""

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

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "attention", "attention_ref", "available_backends", "pick_backend"]

logger = logging.getLogger(__name__)

AttentionBackend = Literal[
    "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flash_attn", "flash_attn3", "vllm_flash_attn"
]
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
_HALF = (torch.float16, torch.bfloat16)


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
    a kernel that rejects the inputs raises its own RuntimeError.
    """
    _check_qkv(q, k, v)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, Hh, Tq, Dh)
    if backend in _SDPA_FORCED:
        with sdpa_kernel([_SDPA_FORCED[backend]]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, Hh, Tq, Dh)
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
        out += ["sdpa_cudnn", "sdpa_flash"]
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
