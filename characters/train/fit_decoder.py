"""Fitting a decoder on a GPU to what the lip-sync score reads, for the frozen encoder and DiT.

Details: docs/training.md (`characters.train.fit_decoder`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from characters.config import ModelConfig, SessionConfig
from characters.engine import DecoderRunner, DiTRunner, ReferenceEncoder
from characters.train.data import Clip, reference_image, render_clip
from characters.train.evaluate import decode_latents, generate_latents
from characters.train.face import mouth_box
from characters.train.fit_vae import optimizer, optimizer_step
from characters.train.lipsync import LipSync, lipsync_of_signals, mouth_signal
from characters.vae import CausalDecoder, VAEEncoder
from characters.weights import seeded_build

T = TypeVar("T")
R = TypeVar("R")
_LUMA = (0.299, 0.587, 0.114)  # characters.train.lipsync's


@dataclass(frozen=True)
class DecoderFitConfig:
    steps: int = 3000
    batch: int = 16  # spans per step
    latents: int = 3  # latent frames per span (decoded from a zero state, as a stream starts)
    lr: float = 1e-3
    mouth_weight: float = 4.0  # pixel L1 inside the mouth box counts 1 + this
    signal_weight: float = 0.0  # the mouth-signal L1's weight beside the pixel L1
    dit_share: float = 0.0  # fraction of each batch from the DiT's latents (the rest: the encoder's + noise)
    dit_target: Literal["truth", "teacher"] = "teacher"
    latent_noise: float = 0.05  # on the encoder's latents
    seed: int = 0
    device: str = "cuda"


@dataclass
class DecoderData:
    """The training split on one device. Clip k's frames are frames[4 first[k] : 4 (first[k] + count[k])] and its
    latent frames [first[k], first[k] + count[k])."""

    frames: torch.Tensor  # (N, H, W, 3) uint8, every clip's frames end to end
    encoder_latents: torch.Tensor  # (N/4, C, h, w) float32, the frozen encoder's
    dit_latents: torch.Tensor | None  # (S, N/4, C, h, w) float32: S generations (noise seeds) of every clip
    first: np.ndarray  # (K,) first latent frame of each clip
    count: np.ndarray  # (K,) latent frames of each clip
    reference_luma: torch.Tensor  # (K, H, W) luminance 0..255 of each identity's reference image
    mouth_mask: torch.Tensor  # (K, H, W) 1 inside the identity's mouth box


def pool_map(fn: Callable[[T], R], items: Sequence[T], workers: int, init: Callable[..., None] | None = None,
             initargs: tuple[Any, ...] = ()) -> list[R]:
    """fn over items in `workers` spawned processes of one intra-op thread each, in order; 0: in this process."""
    if workers <= 0:
        if init is not None:
            init(*initargs)
        return [fn(x) for x in items]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(init, initargs)) as pool:
        return list(pool.map(fn, items))


def _init_worker(init: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    if init is not None:
        init(*initargs)


_WORKER: dict[str, Any] = {}  # a pool worker's engine pieces, built once by its initializer


def _init_dit(cfg_json: str) -> None:
    cfg = SessionConfig.model_validate_json(cfg_json)
    _WORKER["dit"], _WORKER["encoder"] = DiTRunner(cfg), ReferenceEncoder(cfg)


def _clip_latents(task: tuple[Clip, int]) -> np.ndarray:
    clip, seed = task
    return generate_latents(_WORKER["dit"], _WORKER["encoder"], reference_image(clip.identity), clip.pcm, clip.frames,
                            seed).numpy()  # arrays travel back by pickle, tensors by shared-memory handles


def dit_latents(cfg: SessionConfig, clips: Sequence[Clip], seeds: Iterable[int], workers: int
                ) -> list[torch.Tensor]:
    """The DiT's latents (C, L, h, w) of each clip, generated on the CPU as
    `scripts/benchmarks/eval_lipsync.py` generates
    them (clip i with noise seed seeds[i])."""
    tasks = list(zip(clips, seeds, strict=True))
    return [torch.from_numpy(z) for z in pool_map(_clip_latents, tasks, workers, _init_dit, (cfg.model_dump_json(),))]


def _init_decoder(cfg_json: str) -> None:
    _WORKER["decoder"] = DecoderRunner(SessionConfig.model_validate_json(cfg_json))


def _clip_signal(task: tuple[Clip, torch.Tensor]) -> np.ndarray:
    clip, latents = task
    ref = reference_image(clip.identity)
    frames = decode_latents(_WORKER["decoder"], latents, clip.frames, reference=ref)  # anchored, as eval_lipsync's
    return mouth_signal(frames, clip.identity, ref)


def score_decoder(cfg: SessionConfig, clips: Sequence[Clip], latents: Sequence[torch.Tensor], workers: int
                  ) -> LipSync:
    """The lip-sync score of `cfg`'s decoder (its weights directory, on the CPU serving path) on clips whose DiT
    latents are given (`dit_latents`)."""
    signals = pool_map(_clip_signal, list(zip(clips, latents, strict=True)), workers, _init_decoder,
                       (cfg.model_dump_json(),))
    return lipsync_of_signals(signals, [c.pcm for c in clips])


def render_frames(clips: Sequence[Clip], workers: int) -> list[np.ndarray]:
    return pool_map(render_clip, list(clips), workers)


@torch.no_grad()
def build_data(cfg: ModelConfig, clips: Sequence[Clip], encoder: VAEEncoder, frames: Sequence[np.ndarray],
               dit: Sequence[Sequence[torch.Tensor]] | None, device: str) -> DecoderData:
    """`DecoderData` on `device` from each clip's rendered frames (`render_frames`) and, optionally, S lists of
    each clip's DiT latents (`dit_latents`, one list per noise seed)."""
    encoder = encoder.to(device).eval()
    count = np.array([f.shape[0] // cfg.vae.temporal_factor for f in frames])
    all_frames = torch.cat([torch.from_numpy(f) for f in frames]).to(device)  # (N, H, W, 3)
    enc = [encoder(_video(torch.from_numpy(f).to(device))[None])[0].transpose(0, 1) for f in frames]  # (L, C, h, w)
    luma = torch.tensor(_LUMA, device=device)
    refs = torch.stack([torch.from_numpy(reference_image(c.identity)) for c in clips]).to(device).float() @ luma
    mask = torch.zeros_like(refs)  # (K, H, W)
    for k, c in enumerate(clips):
        top, bot, left, right = mouth_box(c.identity)
        mask[k, max(0, top):bot, max(0, left):right] = 1.0
    dit_t = None
    if dit:
        dit_t = torch.stack([torch.cat([z.transpose(0, 1) for z in seed], dim=0) for seed in dit]).to(device)
    return DecoderData(all_frames, torch.cat(enc), dit_t, np.cumsum(count) - count, count, refs, mask)


def _video(frames: torch.Tensor) -> torch.Tensor:
    """(..., F, H, W, 3) uint8 -> (..., 3, F, H, W) float in [-1, 1]."""
    return frames.movedim(-1, -4).float() / 127.5 - 1


def mouth_signal_torch(video: torch.Tensor, reference_luma: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`characters.train.lipsync.mouth_signal` on decoded video, differentiable: video (B, 3, F, H, W) in
    [-1, 1]; reference_luma (B, H, W) 0..255; mask (B, H, W) the mouth box -> (B, F) mean luminance drop."""
    luma = torch.tensor(_LUMA, device=video.device, dtype=video.dtype)
    lum = torch.einsum("bcfhw,c->bfhw", (video + 1) * 127.5, luma)  # (B, F, H, W)
    drop = (reference_luma[:, None] - lum).clamp(min=0) * mask[:, None]
    return drop.sum((2, 3)) / mask.sum((1, 2))[:, None]


@torch.no_grad()
def init_from(decoder: CausalDecoder, state: dict[str, torch.Tensor]) -> list[str]:
    """Start `decoder` from another decoder's weights where they fit: tensors of equal shape are copied; a per-frame
    (kt = 1) conv's weight becomes the current-frame tap of the same conv with kt = 3 (its past taps zero: the same
    function to start from). Tensors of other shapes (a wider stage) keep their seeded initialisation. Returns the
    names taken over."""
    own = decoder.state_dict()  # views of the parameters
    taken = []
    for name, value in state.items():
        t = own.get(name)
        if t is None:
            continue
        if t.shape == value.shape:
            t.copy_(value)
        elif t.dim() == 5 and value.shape[2] == 1 and t.shape[:2] + t.shape[3:] == value.shape[:2] + value.shape[3:]:
            t.zero_()
            t[:, :, -1:].copy_(value)  # (cout, cin, kt, 3, 3): the last tap reads the current frame
        else:
            continue
        taken.append(name)
    return taken


def _spans(data: DecoderData, n: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n random spans of `length` latent frames, each inside one clip: their clips (n,) and latent indices (n, L)."""
    room = data.count - length + 1  # start positions per clip
    k = rng.choice(len(room), size=n, p=room / room.sum())
    start = data.first[k] + (rng.uniform(size=n) * room[k]).astype(np.int64)
    return k, start[:, None] + np.arange(length)[None]


def fit_decoder(cfg: ModelConfig, data: DecoderData, fc: DecoderFitConfig, init: dict[str, torch.Tensor] | None = None,
                teacher: CausalDecoder | None = None, log: Callable[[str], None] = print,
                deadline: float | None = None) -> tuple[CausalDecoder, list[dict[str, float]]]:
    """A decoder for `cfg.vae` fitted to `data` (see the module docstring); `init`: a state dict to start from
    (`init_from`), else the seeded initialisation; `deadline` (a `time.time()`): stop there even before
    `fc.steps` (the history's last row says where). Returns it on the CPU, and its loss history."""
    if fc.dit_share > 0 and data.dit_latents is None:
        raise ValueError(f"dit_share={fc.dit_share} needs the DiT's latents in the data; build it with dit=...")
    if fc.dit_share > 0 and fc.dit_target == "teacher" and teacher is None:
        raise ValueError("dit_target='teacher' needs a teacher decoder (e.g. the previous full-resolution one)")
    torch.manual_seed(fc.seed)
    rng = np.random.default_rng(fc.seed)
    decoder = seeded_build(lambda: CausalDecoder(cfg.vae), fc.seed + 3)
    if init is not None:
        init_from(decoder, init)
    decoder = decoder.to(fc.device).to(memory_format=torch.channels_last_3d)  # type: ignore[call-overload]
    if teacher is not None:
        teacher = teacher.to(fc.device).eval().requires_grad_(False)
    params = list(decoder.parameters())
    opt, sched = optimizer(params, fc.lr, fc.steps)
    n_dit = round(fc.batch * fc.dit_share)
    tf = cfg.vae.temporal_factor
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for step in range(fc.steps):
        k_np, idx_np = _spans(data, fc.batch, fc.latents, rng)  # (B,), (B, L)
        k, idx = (torch.from_numpy(a).to(fc.device) for a in (k_np, idx_np))
        z = data.encoder_latents[idx[n_dit:]]  # (B - n, L, C, h, w)
        z = z + fc.latent_noise * torch.randn_like(z)
        frame_idx = (idx[:, :, None] * tf + torch.arange(tf, device=fc.device)).reshape(fc.batch, -1)  # (B, F)
        target = _video(data.frames[frame_idx])  # (B, 3, F, H, W)
        if n_dit:
            assert data.dit_latents is not None
            seed = torch.from_numpy(rng.integers(data.dit_latents.shape[0], size=(n_dit, 1))).to(fc.device)
            z_dit = data.dit_latents[seed, idx[:n_dit]]  # (n, L, C, h, w)
            z = torch.cat([z_dit, z])
            if fc.dit_target == "teacher":
                assert teacher is not None
                with torch.no_grad():
                    target[:n_dit] = teacher.decode(z_dit.transpose(1, 2).contiguous(
                        memory_format=torch.channels_last_3d))
        z = z.transpose(1, 2).contiguous(memory_format=torch.channels_last_3d)  # (B, C, L, h, w)
        recon = decoder.decode(z)  # (B, 3, F, H, W)
        mask = data.mouth_mask[k]  # (B, H, W)
        weight = 1 + fc.mouth_weight * mask[:, None, None]  # (B, 1, 1, H, W)
        l1 = ((recon - target).abs() * weight).mean() / weight.mean()
        loss = l1
        signal = torch.zeros(())
        if fc.signal_weight:
            ref = data.reference_luma[k]
            signal = (mouth_signal_torch(recon, ref, mask) - mouth_signal_torch(target, ref, mask)).abs().mean() / 127.5
            loss = loss + fc.signal_weight * signal
        optimizer_step(loss, params, opt, sched)
        last = step == fc.steps - 1 or (deadline is not None and time.time() > deadline)
        if step % 50 == 0 or last:
            row = {"step": step, "l1": float(l1.detach()), "signal": float(signal.detach()),
                   "s": time.perf_counter() - t0}
            history.append(row)
            log(f"decoder step {step:5d}  l1 {row['l1']:.4f}  mouth signal {row['signal']:.4f}  {row['s']:.0f}s")
        if last:
            break
    return decoder.cpu().to(memory_format=torch.contiguous_format).eval(), history
