"""One DiT rank's step (`DiTRunner`): audio windows in, latents out, with its KV cache, CUDA graphs and parts.

Shapes are static, buffers preallocated, and nothing in the step reads a device value back to the host: the slot,
valid length and RoPE position of chunk k are host integers the runner already knows. `characters.engine` holds
the decoder side and the in-process engine, and re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np
import torch
import torch.distributed as dist

from characters.audio import AudioEncoder, AudioFrontend
from characters.config import SessionConfig, check_tensor_parallel
from characters.dit import CausalDiT, Parts, run_parts
from characters.kv_cache import KVCache
from characters.rope import RopeTables
from characters.stage_times import StageRecorder
from characters.tp import Overlap, apply_tensor_parallel, set_overlap
from characters.weights import load_weights, materialize_dit, resolve_weights, seeded_build
from kernels.attention import AttentionBackend, pick_backend
from kernels.fp8 import check_fp8_device

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_matmul(choice: str) -> Literal["float32", "bfloat16"]:
    """`TopologyConfig.cpu_matmul` on this CPU: 'auto' is bfloat16 where it multiplies bf16 in hardware."""
    from characters.host import cpu_flags

    if choice == "auto":
        return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(cpu_flags()) else "float32"
    return "bfloat16" if choice == "bfloat16" else "float32"


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def flow_schedule(steps: int, shift: float) -> list[float]:
    """Flow-matching times from 1 (noise) to 0 (clean), shifted toward the noisy end."""
    s = np.linspace(1.0, 0.0, steps + 1)
    return [float(shift * x / (1 + (shift - 1) * x)) for x in s]


@dataclass
class ForwardRecord:
    """Inputs of the forward whose K/V stayed in the cache (for equivalence tests)."""

    x: torch.Tensor  # (B, C, Cf, h, w)
    t: float
    ctx: torch.Tensor  # (B, Cf, A, Dc)
    v: torch.Tensor  # (B, C, Cf, h, w) that forward's output


class DiTRunner:
    """One tensor-parallel rank of one session's DiT, with its cache and audio encoder."""

    def __init__(self, cfg: SessionConfig, *, device: torch.device | str = "cpu",
                 group: dist.ProcessGroup | None = None, rank: int = 0, ranks: int = 1,
                 attention_backend: AttentionBackend | Literal["auto"] = "auto", communicate: bool = True,
                 fuse: bool | None = None, tp_overlap: Overlap | None = None, emulate_fp8: bool = False) -> None:
        """`tp_overlap` overrides the topology's `tp_overlap` (sequence-parallel collectives). `emulate_fp8` lets
        an FP8 model (`model.precision` / `model.attention_precision`) run as its float32 reference emulation
        where FP8 does not run (the CPU: tests); without it such a device is refused with a ValueError."""
        self.cfg, self.device = cfg, torch.device(device)
        m, topo = cfg.model, cfg.topology
        self.dtype = torch_dtype(cfg.dtype)
        for field in ("precision", "attention_precision"):
            if getattr(m, field) == "fp8":
                check_fp8_device(self.device, f"model.{field}", emulate=emulate_fp8)
        check_tensor_parallel(m.dit, ranks, m.precision)
        with torch.device("meta"):
            dit = CausalDiT(m)
        apply_tensor_parallel(dit, group, rank=rank, size=ranks, communicate=communicate,
                              sequence_parallel=topo.sequence_parallel, overlap=tp_overlap or topo.tp_overlap,
                              local_layers=topo.local_layers, local_attention=topo.local_attention)
        self.weights = resolve_weights(cfg)  # None: seeded random weights
        # in the compute dtype, a part at a time; FP8 blocks quantised once, as they are made (this rank's share)
        materialize_dit(dit.to(self.dtype), cfg.seed, self.device, weights=self.weights, rank=rank, ranks=ranks,
                        fp8=m.precision == "fp8")
        self.audio_encoder = seeded_build(lambda: AudioEncoder(m.audio, m.dit.audio_dim), cfg.seed + 1, self.device)
        if self.weights is not None:
            load_weights(self.audio_encoder, self.weights / "audio.safetensors")
        self.cpu_matmul = cpu_matmul(topo.cpu_matmul) if self.device.type == "cpu" else None
        if self.cpu_matmul == "bfloat16" and (ranks > 1 or self.dtype != torch.float32 or m.precision == "fp8"):
            self.cpu_matmul = "float32"  # bf16 GEMMs serve one float32 rank (a CPU session has one)
        if self.cpu_matmul == "bfloat16":
            dit.to_cpu_bf16()
        self.dit = dit.eval()
        self.dit.fuse_elementwise(self.device.type == "cuda" if fuse is None else fuse)
        self.audio_encoder.eval()
        heads = m.dit.num_heads if topo.local_attention else m.dit.num_heads // ranks  # self-attention's, per rank
        if attention_backend == "auto":  # (an FP8 cache has its own kernel: ModelConfig.attention_fp8_kernel)
            attention_backend = "sdpa" if m.attention_precision == "fp8" else self._pick_attention(heads)
        self.attention_backend: AttentionBackend = attention_backend
        self.cache = KVCache(m, local_heads=heads, device=self.device, dtype=self.dtype,
                             attention_backend=attention_backend)
        self.attention_kernel = f"{self.cache.fp8_kernel}_fp8" if self.cache.fp8_kernel else attention_backend
        self.rope = RopeTables(m.dit, m.generation.latent_frames_per_chunk, m.token_grid, self.device)
        self.sink_rope = self.rope.sink()
        self.sigmas = flow_schedule(m.generation.denoising_steps, m.generation.timestep_shift)
        self.frontend = AudioFrontend(m.audio, m.generation.frames_per_chunk)
        h, w = m.latent_hw
        self.x = torch.empty(1, m.dit.latent_channels, m.generation.latent_frames_per_chunk, h, w,
                             device=self.device, dtype=torch.float32)  # (B, C, Cf, h, w)
        self.times = {s: torch.full((1,), s, device=self.device) for s in [*self.sigmas, 0.0]}
        # the DiT's timestep modulation per time (`modulation`): made at first use, kept (fixed weights)
        self._modulations: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        self.generator = torch.Generator(device=self.device)
        self.chunk = 0  # the next chunk's cache slot and time: the stream's chunk index less `given_up`
        self.given_up = 0  # chunks given up this session (`step`'s `stop`)
        self.groups = topo.step_groups  # the step's parts: a chunk may be given up between two (`step`'s `stop`)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # valid context length -> the step's parts, captured
        self._graph_out: dict[int, torch.Tensor] = {}
        self._part_done: list[torch.cuda.Event] = []  # (CUDA, a step that may stop) each part's end, as replayed
        self.recorder: StageRecorder | None = None  # optional stage timing ("dit", "cache_write"); off by default

    def _pick_attention(self, heads: int) -> AttentionBackend:
        """The fastest attention backend on this chunk's real shapes (timed on CUDA; SDPA on CPU)."""
        if self.device.type != "cuda":
            return "sdpa"
        m = self.cfg.model
        q = torch.randn(1, heads, m.tokens_per_chunk, m.dit.head_dim, device=self.device, dtype=self.dtype)
        kv = torch.randn(1, heads, m.cache_tokens, m.dit.head_dim, device=self.device, dtype=self.dtype)
        return pick_backend(q, kv, kv)

    @torch.inference_mode()
    def audio_context(self, windows: np.ndarray | torch.Tensor) -> torch.Tensor:
        """(Fa, W) PCM windows -> (1, Cf, A, Dc) cross-attention context."""
        w = torch.as_tensor(windows).to(self.device, non_blocking=True)[None]  # (1, Fa, W)
        return self.dit.audio_context(self.audio_encoder(w).to(self.dtype))

    @torch.inference_mode()
    def modulation(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The DiT's modulation at time `t` (one of the schedule's), made once: every chunk's forwards at t share
        it, so the steps (and the captured graphs) skip the timestep MLPs. The weights must not change after."""
        mod = self._modulations.get(t)
        if mod is None:
            mod = self._modulations[t] = self.dit.modulation(self.times[t][:, None])
        return mod

    def reset(self, seed: int | None = None) -> None:
        """Wipe all per-session state: KV cache, audio history, chunk index; reseed the noise
        (`seed`, default the config's)."""
        self.cache.reset()
        self.frontend.reset()
        self.chunk = self.given_up = 0
        self.generator.manual_seed(self.cfg.seed if seed is None else seed)

    @torch.inference_mode()
    def start(self, ref_latent: torch.Tensor, seed: int | None = None) -> None:
        """Begin a session: wipe all state, then write the reference frame into the sink.
        ref_latent (1, C, h, w); `seed` seeds this session's noise (default: the config's seed)."""
        self.reset(seed)
        ctx = self.audio_context(self.frontend.silence_windows())[:, :1]  # (1, 1, A, Dc)
        ref = ref_latent.to(self.device, self.dtype)[:, :, None]  # (1, C, 1, h, w)
        n = self.cache.sink_tokens
        self.dit(ref, self.times[0.0], ctx, self.sink_rope, self.cache, 0, n, self.modulation(0.0))

    @overload
    def step(self, pcm: np.ndarray, record: list[ForwardRecord] | None = None, stop: None = None) -> torch.Tensor: ...

    @overload
    def step(self, pcm: np.ndarray, record: list[ForwardRecord] | None = None, *,
             stop: Callable[[], bool]) -> torch.Tensor | None: ...

    @torch.inference_mode()
    def step(self, pcm: np.ndarray, record: list[ForwardRecord] | None = None,
             stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """Generate chunk k from its audio samples (float32 mono 16 kHz, exactly the chunk's count).
        Returns latents (1, C, Cf, h, w) in float32.

        `stop`: asked between the step's parts (`topology.step_groups`; on a GPU as each part starts running, the
        next one queued behind it). True gives the chunk up: `step` returns None at once and the next step makes
        chunk k again, in the same cache slot, from the same noise (what the parts wrote there is overwritten).
        The audio stream has moved on: the next step takes the next chunk's samples. Every rank of a
        tensor-parallel DiT must answer alike (`deployments.pipeline.workers.DiTWorker` reduces the answer)."""
        return self.step_windows(self.frontend.push(pcm), record, stop)

    @overload
    def step_windows(self, windows: np.ndarray | torch.Tensor, record: list[ForwardRecord] | None = None,
                     stop: None = None) -> torch.Tensor: ...

    @overload
    def step_windows(self, windows: np.ndarray | torch.Tensor, record: list[ForwardRecord] | None = None,
                     stop: Callable[[], bool] | None = None) -> torch.Tensor | None: ...

    @torch.inference_mode()
    def step_windows(self, windows: np.ndarray | torch.Tensor, record: list[ForwardRecord] | None = None,
                     stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """One chunk from its (Fa, W) audio windows. With graphs enabled this replays the step's parts' graphs."""
        k = self.chunk
        rec = self.recorder
        if rec is not None:
            rec.chunk = k + self.given_up  # the stream's index (the pipeline's)
            mark = rec.begin("dit")
        noise = self.generator.get_state() if stop is not None else None  # (host-side: no device sync)
        out = self._step(k, windows, record, stop)
        if out is None:  # given up: chunk k again next, from the same noise
            assert noise is not None
            self.chunk = k
            self.given_up += 1
            self.generator.set_state(noise)
        if rec is not None:
            rec.end(mark)
        return out

    def _step(self, k: int, windows: np.ndarray | torch.Tensor, record: list[ForwardRecord] | None,
              stop: Callable[[], bool] | None) -> torch.Tensor | None:
        offset, valid = self.cache.chunk_offset(k), self.cache.chunk_valid(k)
        first_frame = k * self.cfg.model.generation.latent_frames_per_chunk
        torch.randn(self.x.shape, generator=self.generator, device=self.device, out=self.x)
        self.chunk += 1
        graphs = self.graphs.get(valid)
        if graphs is None or record is not None:
            parts = self._chunk_parts(torch.as_tensor(windows).to(self.device), offset, first_frame, valid, record)
            return run_parts(parts, stop)
        # staging ring: a pinned buffer is rewritten only once its last upload has run, which only
        # waits when the device is a whole ring of chunks behind (then the chunk is late anyway)
        host, uploaded = self._host_windows[k % len(self._host_windows)], self._uploaded[k % len(self._uploaded)]
        if not uploaded.query():
            uploaded.synchronize()
        host.copy_(torch.as_tensor(windows))
        self._windows.copy_(host, non_blocking=True)
        uploaded.record()
        self._offset.fill_(offset)
        self._first_frame.fill_(first_frame)
        if stop is None:
            for graph in graphs:
                graph.replay()
            return self._graph_out[valid].clone()
        ended = self._part_done
        for i, graph in enumerate(graphs):
            if i >= 2:
                ended[i - 2].synchronize()  # part i - 1 runs now: part i queues behind it
            if i >= 1 and stop():
                return None  # the parts queued still run (the stream orders the next step after them)
            graph.replay()
            ended[i].record()
        return self._graph_out[valid].clone()

    def _chunk(self, windows: torch.Tensor, offset: int | torch.Tensor, first_frame: int | torch.Tensor, valid: int,
               record: list[ForwardRecord] | None = None) -> torch.Tensor:
        """The chunk step: `_chunk_parts` run through."""
        return run_parts(self._chunk_parts(windows, offset, first_frame, valid, record))

    def _chunk_parts(self, windows: torch.Tensor, offset: int | torch.Tensor, first_frame: int | torch.Tensor,
                     valid: int, record: list[ForwardRecord] | None = None) -> Parts:
        """The chunk step: audio context, the denoising loop, the cache update. Static shapes and no
        host reads, so it runs eagerly or under CUDA-graph capture (tensor offset / first_frame). A generator
        that pauses between the step's parts: within each forward after each of its block groups
        (`topology.step_groups`), and between forwards; it returns the latents."""
        g = self.cfg.model.generation
        ctx = self.dit.audio_context(self.audio_encoder(windows[None]).to(self.dtype))  # (1, Cf, A, Dc)
        rope = self.rope.chunk(first_frame)
        x = self.x  # (1, C, Cf, h, w) noise, filled before the step
        for i, (t, t_next) in enumerate(zip(self.sigmas[:-1], self.sigmas[1:], strict=True)):
            if i:
                yield
            x_in = x
            v = yield from self.dit.forward_parts(x.to(self.dtype), self.times[t], ctx, rope, self.cache, offset,
                                                  valid, self.modulation(t), self.groups)
            x = x + (t_next - t) * v.float()  # Euler step of dx/dt = v
        if g.cache_update == "extra_pass":  # timed as "cache_write" when recording (never inside a capture)
            yield
            mark = self.recorder.begin("cache_write") if self.recorder is not None else None
            x_in, t = x, 0.0
            v = yield from self.dit.forward_parts(x.to(self.dtype), self.times[0.0], ctx, rope, self.cache, offset,
                                                  valid, self.modulation(0.0), self.groups)
            if mark is not None and self.recorder is not None:
                self.recorder.end(mark)
        if record is not None:
            record.append(ForwardRecord(x_in.clone(), t, ctx.clone(), v.float().clone()))
        return x

    def set_tp_overlap(self, overlap: Overlap) -> None:
        """Switch the sequence-parallel collectives ('none' / 'ring') at run time, on every rank alike
        between chunks. Captured graphs hold the old path: they are dropped (`capture_graphs` again)."""
        set_overlap(self.dit, overlap)
        self.graphs, self._graph_out = {}, {}

    @torch.inference_mode()
    def capture_graphs(self, warmup: int = 2, share_pool: bool = True) -> None:
        """Capture the chunk step as CUDA graphs: one per warm-up context length, then the steady
        state (R graphs, sharing one memory pool). Needs the write-time cache (tensor slot offsets).
        Leaves the session state wiped; call `start` afterwards."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        if self.cache.mode != "write_time":
            raise ValueError("cache_mode='naive' slices the cache by host offsets and cannot be graph-captured; "
                             "use cache_mode='write_time'")
        a = self.frontend.num_frames, self.cfg.model.audio.window_samples
        self._host_windows = [torch.zeros(a, pin_memory=True) for _ in range(4)]
        self._uploaded = [torch.cuda.Event() for _ in range(4)]
        self._windows = torch.zeros(a, device=self.device)  # (Fa, W)
        self._offset = torch.zeros((), dtype=torch.int64, device=self.device)
        self._first_frame = torch.zeros((), dtype=torch.int64, device=self.device)
        valids = sorted({self.cache.chunk_valid(k) for k in range(self.cfg.model.generation.ring_slots)})
        self.graphs, self._graph_out = {}, {}
        recorder, self.recorder = self.recorder, None  # no events inside a capture
        try:
            self._capture(valids, warmup, share_pool)
        finally:
            self.recorder = recorder
        torch.cuda.synchronize(self.device)
        self.cache.reset()
        self.chunk = 0

    def _capture(self, valids: list[int], warmup: int, share_pool: bool) -> None:
        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compile kernels, settle the allocator
                for valid in valids:
                    for _ in range(warmup):
                        self._chunk(self._windows, self._offset, self._first_frame, valid)
            torch.cuda.current_stream(self.device).wait_stream(side)
            pool = None
            for valid in valids:  # a graph per part, in order: what a part hands the next stays in the pool
                parts, graphs = self._chunk_parts(self._windows, self._offset, self._first_frame, valid), []
                while valid not in self._graph_out:
                    graph = torch.cuda.CUDAGraph()
                    try:
                        with torch.cuda.graph(graph, pool=pool):
                            next(parts)
                    except StopIteration as done:  # (the capture ended with the last part)
                        self._graph_out[valid] = done.value
                    graphs.append(graph)
                    pool = graph.pool() if share_pool else None
                self.graphs[valid] = graphs
            parts_max = max(len(g) for g in self.graphs.values())
            self._part_done = [torch.cuda.Event() for _ in range(parts_max)]
