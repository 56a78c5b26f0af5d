"""The single-session engine: the decoder side (`ReferenceEncoder`, `DecoderRunner`) and `CharacterEngine`, one whole
session in one process; one DiT rank's step is `characters.dit_runner.DiTRunner` (re-exported here).

The hot loop is `DiTRunner.step` (audio windows in, latents out) and `DecoderRunner.decode` (latents in, frames
out). Shapes are static, buffers preallocated, and nothing in either reads a device value back to the host. Ray
actors (deployments/) wrap these classes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from characters.audio import chunk_sample_range
from characters.config import SessionConfig
from characters.dit_runner import DiTRunner, ForwardRecord, cpu_matmul, flow_schedule, torch_dtype
from characters.identity import IdentityAnchor
from characters.stage_times import StageRecorder
from characters.vae import CausalDecoder, VAEEncoder
from characters.weights import load_weights, resolve_weights, seeded_build

__all__ = ["FIRST_FRAMES", "CharacterEngine", "DecoderRunner", "DiTRunner", "ForwardRecord", "ReferenceEncoder",
           "cpu_matmul", "flow_schedule", "torch_dtype"]


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
        self.anchor: IdentityAnchor | None = None  # the session's identity anchor (`start(reference=...)`)
        self._anchors: dict[bytes, IdentityAnchor | None] = {}  # by reference digest: built once per avatar

    def start(self, reference: np.ndarray | None = None) -> None:
        """A new session. `reference`: its framed (H, W, 3) uint8 reference image; decoded frames are then
        anchored on it (`characters.identity`: the reference outside the mouth region, colours matched), when a
        face is found in it. None: frames leave as decoded."""
        self.decoder.reset_state(self.state)
        self.state.pending, self._begun, self._mark = None, False, None
        self.chunk = 0
        self.anchor = None if reference is None else self._anchor_for(reference)
        if self.anchor is not None:
            self.anchor.reset()

    def _anchor_for(self, reference: np.ndarray) -> IdentityAnchor | None:
        import hashlib

        image = np.ascontiguousarray(reference)
        key = hashlib.blake2b(image.data, digest_size=16).digest()
        if key not in self._anchors:
            if len(self._anchors) >= 32:  # avatars kept, as the decoder worker keeps their latents
                self._anchors.pop(next(iter(self._anchors)))
            self._anchors[key] = IdentityAnchor.build(image, self.device)
        return self._anchors[key]

    def _anchored(self, frames: torch.Tensor) -> torch.Tensor:
        return frames if self.anchor is None else self.anchor.apply(frames)

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
        out = self._anchored(out)
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
            return self._anchored(self._decode_first(latents.to(self.device, self.dtype)))
        first, _ = self._graphs
        self._z.copy_(latents, non_blocking=True)
        first.graph.replay()
        return self._anchored(first.out.clone())

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
        out = self._anchored(out)
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

    def start(self, image: np.ndarray, anchor: bool = True) -> None:
        """A session on the framed reference `image`; `anchor`: frames anchored on it (`characters.identity`)."""
        self.dit.start(self.encoder.encode(image))
        self.decoder.start(reference=image if anchor else None)

    def step(self, pcm: np.ndarray) -> np.ndarray:
        """Chunk k's audio samples -> its F frames (F, H, W, 3) uint8."""
        return self.decoder.decode(self.dit.step(pcm)).cpu().numpy()
