"""FP8 attention over a per-tensor-scaled e4m3 KV cache: cuDNN's Hopper FP8 kernel, and its reference.

Details: docs/kernels.md (`kernels.attention_cudnn_fp8`)."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import math
import threading
from typing import Any

import torch

from kernels.fp8 import FP8, FP8_MAX

__all__ = ["CudnnFp8Graph", "attention_cudnn_fp8", "attention_fp8_tensor", "attention_fp8_tensor_ref",
           "cudnn_fp8_supported", "cudnn_handle", "padded_keys"]

KEY_ALIGN = 64  # the keys cuDNN reads are padded to this multiple (masked)


def padded_keys(valid: int) -> int:
    """The key slots cuDNN reads for `valid` keys: `valid` rounded up to a multiple of 64."""
    return -(-valid // KEY_ALIGN) * KEY_ALIGN


def cudnn_fp8_supported(device: torch.device | str, head_dim: int) -> bool:
    """Whether `attention_cudnn_fp8` can run here: a Hopper GPU (compute capability 9.0; cuDNN's FP8 forward
    with an FP8 output), head_dim 64 or 128, and the cudnn-frontend package importable."""
    device = torch.device(device)
    if device.type != "cuda" or head_dim not in (64, 128) or importlib.util.find_spec("cudnn") is None:
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def _check(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, valid: int, qk_scale: torch.Tensor,
           v_scale: torch.Tensor, out: torch.Tensor) -> None:
    def fail(msg: str) -> ValueError:
        return ValueError(f"attention_fp8_tensor: {msg}")

    if q8.ndim != 4 or q8.dtype != FP8:
        raise fail(f"q8 is {q8.dtype} {tuple(q8.shape)}; expected {FP8} (B, Hh, T, Dh)")
    b, hh, t, dh = q8.shape
    for name, x in (("k8", k8), ("v8", v8)):
        if x.ndim != 4 or x.shape[:2] != (b, hh) or x.shape[3] != dh or x.dtype != FP8 or x.stride(-1) != 1:
            raise fail(f"{name} is {x.dtype} {tuple(x.shape)} strides {x.stride()}; expected {FP8} ({b}, {hh}, S, "
                       f"{dh}) with a contiguous last dim (the cache, all its slots)")
    if k8.shape[2] != v8.shape[2]:
        raise fail(f"k8 has {k8.shape[2]} slots, v8 {v8.shape[2]}; they must match")
    if isinstance(valid, bool) or not isinstance(valid, int) or not 0 < valid <= k8.shape[2]:
        raise fail(f"valid={valid!r} must be an int in [1, {k8.shape[2]}] (the cache's slots)")
    if qk_scale.shape != (2,) or v_scale.shape != (1,) or qk_scale.dtype != torch.float32 \
            or v_scale.dtype != torch.float32:
        raise fail(f"qk_scale {qk_scale.dtype} {tuple(qk_scale.shape)}, v_scale {v_scale.dtype} "
                   f"{tuple(v_scale.shape)}: expected float32 (2,) and (1,)")
    if out.shape != (b, hh, t, dh) or out.dtype != FP8 or out.stride(-1) != 1:
        raise fail(f"out is {out.dtype} {tuple(out.shape)}; expected {FP8} ({b}, {hh}, {t}, {dh}) with a "
                   "contiguous last dim")
    for x in (k8, v8, qk_scale, v_scale, out):
        if x.device != q8.device:
            raise fail(f"a tensor is on {x.device} but q8 is on {q8.device}; put all tensors on one device")


def attention_fp8_tensor_ref(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, valid: int,
                             qk_scale: torch.Tensor, v_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reference: exact attention (float32) over the dequantised keys [0, valid), written into `out` as
    e4m3(out / v_scale). Shapes as in the module docstring; returns `out`."""
    _check(q8, k8, v8, valid, qk_scale, v_scale, out)
    q = q8.float() * qk_scale[0]
    k = k8[:, :, :valid].float() * qk_scale[1]
    v = v8[:, :, :valid].float() * v_scale
    scores = q @ k.transpose(-1, -2) / math.sqrt(q8.shape[-1])  # (B, Hh, T, valid)
    o = scores.softmax(dim=-1) @ v  # (B, Hh, T, Dh)
    out.copy_((o / v_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    return out


class CudnnFp8Graph:
    """One cuDNN FP8 SDPA graph for fixed shapes and strides (built once: ~0.1 s); `run` executes it on the given
    tensors of those shapes. `valid`: keys past it hidden by a padding mask (None: no mask, every key of k8 read).
    The output's dtype is `out`'s (e4m3; bf16 is refused by cuDNN on Hopper). `plan`: build only that execution
    plan of the heuristics' list (`plans` long), for probing them; None: the first that builds. `amax`: P's and the
    output's amax as outputs of the graph (the model reads neither; False builds them virtual, for probing)."""

    def __init__(self, cudnn: Any, handle: Any, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                 out: torch.Tensor, valid: int | None, plan: int | None = None, amax: bool = True) -> None:
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        self.t = {n: g.tensor(name=n, dim=list(x.shape), stride=list(x.stride()), data_type=e4m3)
                  for n, x in (("q", q8), ("k", k8), ("v", v8))}
        one = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": f32}
        self.s = {n: g.tensor(name=n, **one) for n in ("dq", "dk", "dv", "ds", "ss", "so")}
        b, dev = q8.shape[0], q8.device
        mask: dict[str, Any] = {}
        self.lens: dict[Any, torch.Tensor] = {}
        if valid is not None:
            seq = {"dim": [b, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": cudnn.data_type.INT32}
            seq_q, seq_kv = g.tensor(name="seq_q", **seq), g.tensor(name="seq_kv", **seq)
            mask = {"use_padding_mask": True, "seq_len_q": seq_q, "seq_len_kv": seq_kv}
            self.lens = {seq_q: torch.full((b, 1, 1, 1), q8.shape[2], device=dev, dtype=torch.int32),
                         seq_kv: torch.full((b, 1, 1, 1), valid, device=dev, dtype=torch.int32)}
        o, _, amax_s, amax_o = g.sdpa_fp8(
            q=self.t["q"], k=self.t["k"], v=self.t["v"], descale_q=self.s["dq"], descale_k=self.s["dk"],
            descale_v=self.s["dv"], descale_s=self.s["ds"], scale_s=self.s["ss"], scale_o=self.s["so"],
            generate_stats=False, attn_scale=1.0 / math.sqrt(q8.shape[-1]), name="attention_fp8", **mask)
        o_type = e4m3 if out.dtype == FP8 else cudnn.data_type.BFLOAT16
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(o_type)
        for a in (amax_s, amax_o):  # `amax` False: left virtual (nothing reads them), for probing
            a.set_output(amax).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        self.plans: int = g.get_execution_plan_count()
        if plan is None:
            g.build_plans()
        else:
            g.build_plan_at_index(plan)
        self.graph, self.o, self.amax, self.plan, self.with_amax = g, o, (amax_s, amax_o), plan, amax
        size = g.get_workspace_size() if plan is None else g.get_workspace_size_plan_at_index(plan)
        self.workspace = torch.empty(max(1, size), device=dev, dtype=torch.uint8)
        self.amax_buf = torch.zeros(2, 1, 1, 1, 1, device=dev)  # P's and the output's amax (cuDNN writes them)
        self.p_scales = (torch.full((1, 1, 1, 1), 1 / FP8_MAX, device=dev),
                         torch.full((1, 1, 1, 1), FP8_MAX, device=dev))  # P's descale and scale

    def run(self, handle: Any, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, qk_scale: torch.Tensor,
            v_scale: torch.Tensor, v_inv: torch.Tensor, out: torch.Tensor) -> None:
        """Attend on the current stream of `handle` (the caller sets it): q8 descaled by qk_scale[0], k8 by
        qk_scale[1], v8 by v_scale, the output scaled by v_inv = 1 / v_scale."""
        s = self.s
        pack = {self.t["q"]: q8, self.t["k"]: k8, self.t["v"]: v8, self.o: out,
                s["dq"]: qk_scale[0:1], s["dk"]: qk_scale[1:2], s["dv"]: v_scale, s["ds"]: self.p_scales[0],
                s["ss"]: self.p_scales[1], s["so"]: v_inv, **self.lens}
        if self.with_amax:
            pack.update({self.amax[0]: self.amax_buf[0], self.amax[1]: self.amax_buf[1]})
        if self.plan is None:
            self.graph.execute(pack, self.workspace, handle=handle)
        else:
            self.graph.execute_plan_at_index(pack, self.workspace, self.plan, handle=handle)


_lock = threading.Lock()
_graphs: dict[tuple[Any, ...], CudnnFp8Graph] = {}


@atexit.register
def _release() -> None:
    """Free the graphs and handles before the interpreter tears the binding's module down (else nanobind reports
    every cuDNN object still alive then as a leak)."""
    _graphs.clear()
    cudnn_handle.cache_clear()


@functools.cache
def cudnn_handle(index: int) -> Any:
    """This process's cuDNN handle for CUDA device `index` (made once)."""
    import cudnn

    with torch.cuda.device(index):
        return cudnn.create_handle()


def attention_cudnn_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, valid: int, qk_scale: torch.Tensor,
                        v_scale: torch.Tensor, out: torch.Tensor, v_inv: torch.Tensor | None = None) -> torch.Tensor:
    """cuDNN's FP8 attention: see the module docstring. k8, v8: the whole cache (B, Hh, S, Dh), S >=
    `padded_keys(valid)`; keys [valid, padded) are masked. `v_inv` (1,): 1 / v_scale, kept beside it by a caller
    that calls often (`KVCache`: no reciprocal kernel per call); computed here when not given.
    No host syncs; capturable in a CUDA graph once the graph for these shapes is built."""
    import cudnn

    _check(q8, k8, v8, valid, qk_scale, v_scale, out)
    padded = padded_keys(valid)
    if padded > k8.shape[2]:
        raise ValueError(f"attention_cudnn_fp8: {valid} keys are read as {padded} (a multiple of {KEY_ALIGN}) but "
                         f"the cache has {k8.shape[2]} slots; allocate the cache with padded_keys(S) slots")
    k8, v8 = k8[:, :, :padded], v8[:, :, :padded]
    index = q8.device.index if q8.device.index is not None else torch.cuda.current_device()
    handle = cudnn_handle(index)
    key = (index, valid, *(tuple(x.shape) + x.stride() for x in (q8, k8, v8, out)))
    graph = _graphs.get(key)
    if graph is None:
        with _lock:
            graph = _graphs.get(key) or CudnnFp8Graph(cudnn, handle, q8, k8, v8, out, valid)
            _graphs[key] = graph
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
    graph.run(handle, q8, k8, v8, qk_scale, v_scale, 1 / v_scale if v_inv is None else v_inv, out)
    return out


def attention_fp8_tensor(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, valid: int, qk_scale: torch.Tensor,
                         v_scale: torch.Tensor, out: torch.Tensor, kernel: str = "auto",
                         v_inv: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: "cudnn" (`attention_cudnn_fp8`), "torch" (the reference), "auto" = cuDNN where it runs."""
    if kernel == "auto":
        kernel = "cudnn" if cudnn_fp8_supported(q8.device, q8.shape[-1]) else "torch"
    if kernel == "cudnn":
        return attention_cudnn_fp8(q8, k8, v8, valid, qk_scale, v_scale, out, v_inv)
    if kernel == "torch":
        return attention_fp8_tensor_ref(q8, k8, v8, valid, qk_scale, v_scale, out)
    raise ValueError(f"attention_fp8_tensor: kernel={kernel!r} is not one of 'auto', 'cudnn', 'torch'")
