"""The single-session engine: one DiT rank's step, the decoder, and both together in one process.

The hot loop is `DiTRunner.step` (audio windows in, latents out) and `DecoderRunner.decode`
(latents in, frames out). Shapes are static, buffers preallocated, and nothing in either reads a
device value back to the host: the slot, valid length and RoPE position of chunk k are host
integers the runner already knows. Ray actors (deployments/) wrap these classes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import torch
import torch.distributed as dist

from characters.audio import AudioEncoder, AudioFrontend, chunk_sample_range
from characters.config import SessionConfig, check_tensor_parallel
from characters.dit import CausalDiT, Parts, run_parts
from characters.kv_cache import KVCache
from characters.rope import RopeTables
from characters.stage_times import StageRecorder
from characters.tp import Overlap, apply_tensor_parallel, set_overlap
from characters.vae import CausalDecoder, VAEEncoder
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


class ReferenceEncoder:
    """The VAE encoder: reference image -> the latent that fills the cache's sink."""

    def __init__(self, cfg: SessionConfig, *, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.encoder = seeded_build(lambda: VAEEncoder(cfg.model.vae), cfg.seed + 2, self.device)
        self.weights = resolve_weights(cfg)
        if self.weights is not None:
            load_weights(self.encoder, self.weights / "vae_encoder.safetensors")
        self.encoder.eval()

    @torch.inference_mode()
    def encode(self, image: np.ndarray) -> torch.Tensor:
        """(H, W, 3) uint8 -> (1, C, h, w) float32."""
        # torch.tensor copies: the image may be a read-only view (Ray hands numpy arrays over without a copy)
        x = torch.tensor(image, device=self.device).permute(2, 0, 1)[None].float() / 127.5 - 1  # (1, 3, H, W)
        return self.encoder.encode_image(x)


FIRST_FRAMES = 1  # frames `DecoderRunner.decode_first` hands out before the rest of a chunk


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor  # its output, rewritten by every replay
    keep: list[torch.Tensor] | None  # tensors of its pool another graph reads


class DecoderRunner:
    """The causal streaming VAE decoder with its per-session temporal state.

    It runs channels-last (3-D) with each causal conv's window preallocated and written in place
    (`windows`; the older concatenating path, compiled by Inductor on CUDA, stays for comparison).
    On CUDA, after `capture_graph`, a chunk is one graph replay; `decode` then only copies the
    latents in. `decode_first` + `decode_rest` make a chunk in two parts, its first frame first (a speech onset's:
    `CausalDecoder.decode_first`); on CUDA each is a graph of its own."""

    def __init__(self, cfg: SessionConfig, *, device: torch.device | str = "cpu",
                 channels_last: bool | None = None, compile: bool | None = None, windows: bool = True,
                 cudnn_benchmark: bool = True) -> None:
        self.cfg, self.device = cfg, torch.device(device)
        m = cfg.model
        cuda = self.device.type == "cuda"
        self.dtype = torch_dtype(cfg.dtype)
        self.decoder = seeded_build(lambda: CausalDecoder(m.vae), cfg.seed + 3, self.device)
        self.weights = resolve_weights(cfg)
        if self.weights is not None:
            load_weights(self.decoder, self.weights / "vae_decoder.safetensors")
        self.decoder = self.decoder.to(self.dtype).eval()
        # channels-last on every device: cuDNN's and oneDNN's fast convolutions both want it
        fmt = torch.contiguous_format if channels_last is False else torch.channels_last_3d
        self.decoder = self.decoder.to(memory_format=fmt)  # type: ignore[call-overload]  # (stubs lack it)
        h, w = m.latent_hw
        # windows: each causal conv's input written in place by the fused norm + SiLU (see characters.vae)
        self.state = self.decoder.init_state(1, h, w, self.device, self.dtype, memory_format=fmt,
                                             chunk_frames=m.generation.latent_frames_per_chunk if windows else None)
        # CPU: up-samplings as sub-pixel convs, and uint8 frames straight from conv_out (one pass: `frames_uint8`)
        self.uint8_out = (not cuda and windows and not compile and fmt == torch.channels_last_3d
                          and self.dtype == torch.float32)
        if self.uint8_out:
            self.decoder.prepare_cpu()
        if cuda:
            self.decoder.pad_output(8)
            # static shapes: let cuDNN time its conv algorithms once (at warm-up, before any capture)
            torch.backends.cudnn.benchmark = cudnn_benchmark
            torch.backends.cudnn.benchmark_limit = 0  # try every algorithm, not cuDNN's first 10
        # The window path calls its own Triton kernel; Inductor would only split the graph around it.
        if compile if compile is not None else (cuda and not windows):  # Inductor fuses norms/acts/layouts
            self._forward = torch.compile(self.decoder.decode_chunk, dynamic=False)
        else:
            self._forward = self.decoder.decode_chunk
        self.graph: torch.cuda.CUDAGraph | None = None
        self._graphs: tuple[_Captured, _Captured] | None = None  # decode_first's and decode_rest's (capture_graph)
        self._mark: tuple[int, str, Any] | None = None  # decode_first's "decode" region, ended by decode_rest
        self._begun = False  # decode_first ran, decode_rest not yet
        self.recorder: StageRecorder | None = None  # optional stage timing ("decode"); off by default
        self.chunk = 0  # chunks decoded since start()

    def start(self) -> None:
        self.decoder.reset_state(self.state)
        self.state.pending, self._begun, self._mark = None, False, None
        self.chunk = 0

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.uint8_out:
            return self.decoder.frames_uint8(latents, self.state)[0]  # (F, H, W, 3)
        return self._to_uint8(self._forward(latents, self.state))

    @staticmethod
    def _to_uint8(video: torch.Tensor) -> torch.Tensor:
        frames = ((video[0].float() + 1) * 127.5).round_().to(torch.uint8)  # (1, 3, F, H, W) -> (3, F, H, W)
        return frames.permute(1, 2, 3, 0).contiguous()  # (F, H, W, 3)

    def _decode_first(self, latents: torch.Tensor) -> torch.Tensor:
        out = self.decoder.decode_first(latents, self.state, FIRST_FRAMES, uint8=self.uint8_out)
        return out[0] if self.uint8_out else self._to_uint8(out)

    def _decode_rest(self) -> torch.Tensor:
        out = self.decoder.decode_rest(self.state, FIRST_FRAMES, uint8=self.uint8_out)
        return out[0] if self.uint8_out else self._to_uint8(out)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(1, C, Cf, h, w) -> (F, H, W, 3) uint8 frames, on the decoder's device (no host sync)."""
        if self._begun:
            raise RuntimeError("decode while a chunk's rest is due: call decode_rest first")
        rec = self.recorder
        if rec is not None:
            rec.chunk = self.chunk
            mark = rec.begin("decode")
        self.chunk += 1
        if self.graph is None:
            out = self._decode(latents.to(self.device, self.dtype))
        else:
            self._z.copy_(latents, non_blocking=True)
            self.graph.replay()
            out = self._frames.clone()
        if rec is not None:
            rec.end(mark)
        return out

    @torch.inference_mode()
    def decode_first(self, latents: torch.Tensor) -> torch.Tensor:
        """(1, C, Cf, h, w) -> the chunk's first `FIRST_FRAMES` frames (n, H, W, 3) uint8; `decode_rest` must come
        next (the "decode" stage spans both). No host sync."""
        if self._begun:
            raise RuntimeError("decode_first while a chunk's rest is due: call decode_rest first")
        rec = self.recorder
        if rec is not None:
            rec.chunk = self.chunk
            self._mark = rec.begin("decode")
        self.chunk += 1
        self._begun = True
        if self._graphs is None:
            return self._decode_first(latents.to(self.device, self.dtype))
        first, _ = self._graphs
        self._z.copy_(latents, non_blocking=True)
        first.graph.replay()
        return first.out.clone()

    @torch.inference_mode()
    def decode_rest(self) -> torch.Tensor:
        """The frames of the chunk `decode_first` began, after its first: (F - n, H, W, 3) uint8."""
        if not self._begun:
            raise RuntimeError("decode_rest without decode_first: decode the chunk's first frames first")
        self._begun = False
        if self._graphs is None:
            out = self._decode_rest()
        else:
            _, rest = self._graphs
            rest.graph.replay()
            out = rest.out.clone()
        if self.recorder is not None and self._mark is not None:
            self.recorder.end(self._mark)
        self._mark = None
        return out

    @torch.inference_mode()
    def capture_graph(self, warmup: int = 2, parts: bool = True) -> None:
        """Capture one chunk's decode as a CUDA graph (state wiped afterwards; call `start`); `parts`: also
        `decode_first`'s and `decode_rest`'s (without them those two run eagerly)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this decoder is on {self.device}")
        m = self.cfg.model
        h, w = m.latent_hw
        self._z = torch.zeros(1, m.vae.latent_channels, m.generation.latent_frames_per_chunk, h, w,
                              device=self.device, dtype=self.dtype)  # (1, C, Cf, h, w)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._decode(self._z)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._frames = self._decode(self._z)
        self.graph = graph
        if not parts:
            torch.cuda.synchronize(self.device)
            self.start()
            return
        # a chunk's first frame and its rest: two more graphs, each in a pool of its own (the first's output and
        # the trunk output it leaves for the rest stay valid while another graph replays)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._decode_first(self._z)
                self._decode_rest()
        torch.cuda.current_stream(self.device).wait_stream(side)
        pair = (torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())
        with torch.cuda.graph(pair[0]):
            first = self._decode_first(self._z)
        pending = self.state.pending  # decode_rest's inputs: its graph reads them where the first graph writes them
        with torch.cuda.graph(pair[1]):
            rest = self._decode_rest()
        self._graphs = (_Captured(pair[0], first, pending), _Captured(pair[1], rest, None))
        torch.cuda.synchronize(self.device)
        self.start()


class CharacterEngine:
    """One whole session in this process: reference encoder, DiT (one rank), decoder."""

    def __init__(self, cfg: SessionConfig, *, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.encoder = ReferenceEncoder(cfg, device=device)
        self.dit = DiTRunner(cfg, device=device)
        self.decoder = DecoderRunner(cfg, device=device)

    @property
    def chunk(self) -> int:
        return self.dit.chunk

    def chunk_samples(self, k: int) -> tuple[int, int]:
        g = self.cfg.model.generation
        return chunk_sample_range(k, g.frames_per_chunk, self.cfg.model.audio.sample_rate, g.fps)

    def start(self, image: np.ndarray) -> None:
        self.dit.start(self.encoder.encode(image))
        self.decoder.start()

    def step(self, pcm: np.ndarray) -> np.ndarray:
        """Chunk k's audio samples -> its F frames (F, H, W, 3) uint8."""
        return self.decoder.decode(self.dit.step(pcm)).cpu().numpy()
