"""The VAE: a reference-image encoder and a causal, streaming video decoder.

Shapes follow the names in `characters.config` (B batch, C latent channels, F video frames, H/W image
size, h/w latent size); `T` is a number of frames at whatever level a tensor lives, and `c` a width.

One module on purpose: the decoder's three forms (whole sequence, cached stream, serving windows with the CPU's
sub-pixel path) and the encoder share every block class, and they must stay in step with each other.

Details: docs/dit.md (`characters.vae`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from characters.config import VAEConfig
from kernels.norm_silu import bias_add, norm_silu
from kernels.upsample import upsample_nearest

_CL3D = torch.channels_last_3d


class RMSNorm(nn.Module):
    """Channel RMSNorm at each position (frame, pixel) on its own: it never mixes time, so stays causal."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c, ...) -> same
        # Channels last, the norm is over the innermost (contiguous) dimension.
        return F.rms_norm(x.movedim(1, -1), (x.shape[1],), self.weight, self.eps).movedim(-1, 1)


# ----------------------------------------------------------------------------------------------- decoder


Span = tuple[int, int]  # output frames a .. b - 1 of a chunk, where a decoder step runs on part of one


class Unsummed(NamedTuple):
    """A block's output before its last add: `y + bias (per channel) + residual`, all (B, c, T, h', w'), left
    for the next step to add in a pass it makes anyway (the same float32 sum, rounded once)."""

    y: torch.Tensor
    bias: torch.Tensor
    residual: torch.Tensor | None = None

    def sum_into(self, out: torch.Tensor) -> torch.Tensor:
        """The sum, written into `out` (e.g. a window's tail, or y itself)."""
        return bias_add(self.y, self.bias, residual=self.residual, out=out)


def summed(x: torch.Tensor | Unsummed) -> torch.Tensor:
    """x itself, or an `Unsummed` x added up in place (into its y)."""
    return x.sum_into(x.y) if isinstance(x, Unsummed) else x


class CausalConv3d(nn.Conv3d):
    """A (kt, kh, kw) convolution, zero-padded in space and fed `kt - 1` past frames from a cache.

    `scale` (spatial size relative to the latent) and `frames` (frames per latent frame) say where the
    layer sits; they size its cache and count its FLOPs. `slot` is its index in `DecoderState.caches`,
    set by the decoder (-1 for layers with kt == 1, which keep no cache).
    """

    def __init__(self, cin: int, cout: int, kernel: tuple[int, int, int], scale: int, frames: int) -> None:
        kt, kh, kw = kernel
        super().__init__(cin, cout, kernel, padding=(0, kh // 2, kw // 2))
        self.past = kt - 1
        self.scale = scale
        self.frames = frames
        self.slot = -1

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        # x: (B, cin, T, h', w') -> (B, cout, T, h', w')
        if self.past:
            cache = caches[self.slot]  # (B, cin, kt - 1, h', w')
            x = torch.cat([cache, x], dim=2)  # (B, cin, kt - 1 + T, h', w')
            cache.copy_(x[:, :, -self.past :].detach())  # state carries values, never gradients
        return self._conv(x, self.weight, self.bias)

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type != "cpu" or torch.is_grad_enabled():  # training: conv3d's backward is the fast one
            return F.conv3d(x, weight, bias, padding=self.padding)
        return self._conv_per_tap(x, weight, bias)

    def run_window(self, window: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   *, with_bias: bool = True, span: Span | None = None) -> torch.Tensor:
        """Convolve a window whose tail already holds this chunk's input, then keep its last `kt - 1`
        frames as the next chunk's cache. window (B, cin, kt - 1 + T, h', w') -> (B, cout, T, h', w').
        The conv runs without its bias, added after in one fused pass, or (`with_bias=False`) left to
        the caller to fold into the next step (the next `norm_silu`, a residual add, an up-sampling).
        `span` (a, b): only output frames a .. b - 1 (their input is in the window up to frame b); the cache
        moves on only with the span that ends the chunk (see `CausalDecoder.decode_first`)."""
        if with_bias:
            bias = self.bias if bias is None else bias
            assert bias is not None  # every decoder conv has one
        inline = with_bias and window.device.type == "cpu"  # oneDNN adds a bias for free; cuDNN's is a pass
        t = window.shape[2] - self.past
        a, b = span if span is not None and self.past else (0, t)  # (kt = 1: the "window" is the span's frames)
        part = window if (a, b) == (0, t) else window[:, :, a : self.past + b]  # a view: B == 1, time outermost
        y = self._conv(part, self.weight if weight is None else weight, bias if inline else None)
        if b == t:  # the chunk's last frames: move the cache on (before, the window holds what later frames need)
            frames = window.permute(0, 2, 3, 4, 1)  # (B, kt - 1 + T, h', w', cin): dense blocks when channels-last
            tail = frames[:, t:]
            frames[:, : self.past].copy_(tail if t >= self.past else tail.clone())  # overlapping when T < kt - 1
        if with_bias and not inline:
            assert bias is not None
            y = bias_add(y, bias, out=y)
        return y

    def _tail(self, window: torch.Tensor, span: Span | None) -> torch.Tensor:
        """Where this chunk's input frames (all, or `span`'s) go in the window: a view of its tail."""
        a, b = span or (0, window.shape[2] - self.past)
        return window[:, :, self.past + a : self.past + b]

    def norm_silu_window(self, x: torch.Tensor, norm: RMSNorm, windows: list[torch.Tensor],
                         bias: torch.Tensor | None = None, span: Span | None = None) -> torch.Tensor:
        """This conv's window with `silu(norm(x (+ bias)))` written into its tail (`span`: x is those frames of the
        chunk, written into theirs) (a new tensor for a kt = 1 conv, which keeps no window)."""
        if not self.past:
            return norm_silu(x, norm.weight, norm.eps, bias=bias)
        window = windows[self.slot]
        norm_silu(x, norm.weight, norm.eps, out=self._tail(window, span), bias=bias)
        return window

    def write_window(self, x: torch.Tensor | Unsummed, windows: list[torch.Tensor], span: Span | None = None
                     ) -> torch.Tensor:
        """This conv's window, (B, cin, kt - 1 + T, h', w'), with x in its tail (`span`: x is those frames, written
        into theirs) (an `Unsummed` x summed on the way)."""
        window = windows[self.slot]
        tail = self._tail(window, span)
        if isinstance(x, Unsummed):
            x.sum_into(tail)
        else:
            tail.permute(0, 2, 3, 4, 1).copy_(x.permute(0, 2, 3, 4, 1))  # (B, T, h', w', cin)
        return window

    def forward_window(self, x: torch.Tensor | Unsummed, windows: list[torch.Tensor], span: Span | None = None
                       ) -> torch.Tensor:
        """The serving form of `forward`: x written into this conv's window (no concatenation). `span`: x is
        those output frames of the chunk (`run_window`)."""
        if not self.past:
            assert self.bias is not None  # every decoder conv has one
            x = summed(x)
            if x.device.type == "cpu":
                return self._conv(x, self.weight, self.bias)  # oneDNN adds the bias in the conv
            return bias_add(y := self._conv(x, self.weight, None), self.bias, out=y)
        return self.run_window(self.write_window(x, windows, span), span=span)

    def _conv_per_tap(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same convolution as a sum of per-tap 2-D convolutions over frames.

        On CPU, oneDNN's channels-last conv2d is an order of magnitude faster than conv3d at the small
        widths of the `tiny` decoder (on an H200, cuDNN's conv3d beats it: scripts/probe_conv_forms.py);
        the result is the same up to float rounding. Inference only: with
        autograd on (training), conv3d is used, whose backward is the fast one there.
        """
        x = x.contiguous(memory_format=_CL3D)  # (B, cin, T + kt - 1, h', w'), stored (B, T, h', w', cin)
        b, cin, tp, h, w = x.shape
        t, pad = tp - self.past, self.padding[1:]
        frames = x.transpose(1, 2)  # (B, T + kt - 1, cin, h', w')
        # Tap k sees frames k .. k + T - 1; each is (B*T, cin, h', w'), a view when B == 1.
        out = F.conv2d(frames[:, :t].reshape(b * t, cin, h, w), weight[:, :, 0], bias, padding=pad)
        for k in range(1, self.past + 1):
            out.add_(F.conv2d(frames[:, k : k + t].reshape(b * t, cin, h, w), weight[:, :, k], padding=pad))
        return out.view(b, t, weight.shape[0], h, w).transpose(1, 2)  # (B, cout, T, h', w')


class ResBlock(nn.Module):
    """norm -> SiLU -> causal conv -> norm -> SiLU -> causal conv, plus the input. `kt` = 1: per-frame 3x3 convs.
    `cin` != c (Wan2.1's stage entries): the first conv widens cin -> c and the input goes through a 1x1x1 conv
    (`shortcut`) before the add."""

    def __init__(self, c: int, scale: int, frames: int, kt: int = 3, *, cin: int | None = None,
                 eps: float = 1e-6) -> None:
        super().__init__()
        cin = c if cin is None else cin
        self.norm1 = RMSNorm(cin, eps)
        self.conv1 = CausalConv3d(cin, c, (kt, 3, 3), scale, frames)
        self.norm2 = RMSNorm(c, eps)
        self.conv2 = CausalConv3d(c, c, (kt, 3, 3), scale, frames)
        self.shortcut = CausalConv3d(cin, c, (1, 1, 1), scale, frames) if cin != c else None

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:  # (B, cin, T, h', w') -> c
        y = self.conv1(F.silu(self.norm1(x)), caches)
        y = self.conv2(F.silu(self.norm2(y)), caches)
        return (x if self.shortcut is None else self.shortcut(x, caches)) + y

    def forward_window(self, x: torch.Tensor | Unsummed, windows: list[torch.Tensor], span: Span | None = None
                       ) -> Unsummed:
        """The serving form: each norm + SiLU (with the previous conv's bias) writes straight into its
        conv's window; the last bias and the residual are left for the next step to add in its own pass.
        `span`: x is those frames of the chunk (`CausalConv3d.run_window`)."""
        x = summed(x)  # (B, c, T, h', w')
        y, bias = x, None
        for norm, conv in ((self.norm1, self.conv1), (self.norm2, self.conv2)):
            window = conv.norm_silu_window(y, norm, windows, bias, span)
            y, bias = conv.run_window(window, with_bias=False, span=span), conv.bias
        assert bias is not None
        return Unsummed(y, bias, x if self.shortcut is None else self.shortcut.forward_window(x, windows))


class FrameAttention(nn.Module):
    """Single-head self-attention over the pixels of each frame on its own (no mixing across time)."""

    def __init__(self, c: int, scale: int, frames: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = RMSNorm(c, eps)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.scale = scale
        self.frames = frames

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:  # (B, c, T, h', w')
        b, c, t, h, w = x.shape
        tokens = self.norm(x).permute(0, 2, 3, 4, 1).reshape(b * t, h * w, c)  # (B*T, h'w', c)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)  # 3 x (B*T, h'w', c)
        y = self.proj(self._attend(q, k, v))  # (B*T, h'w', c)
        return x + y.view(b, t, h, w, c).permute(0, 4, 1, 2, 3)

    def forward_window(self, x: torch.Tensor | Unsummed, windows: list[torch.Tensor], span: Span | None = None
                       ) -> torch.Tensor:
        return self(summed(x), windows)  # per frame: no temporal state (any span of frames is the same)

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(c)) v. One head as wide as the channels (384 in Wan's decoder) is past
        every fused kernel's head-size limit (256), where SDPA falls back to its float32 math path; on
        CUDA two half-precision GEMMs around a float32 softmax do the same work at tensor-core speed."""
        c = q.shape[-1]
        if not q.is_cuda:  # (N', 1, n, c): one head, 4-D, takes the fused (flash) CPU kernel; 3-D took the math path
            return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        if c <= 256 or q.dtype == torch.float32:
            return F.scaled_dot_product_attention(q, k, v)
        scores = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=c**-0.5)  # (N', n, n)
        return torch.bmm(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v)  # (N', n, c)


class Upsample(nn.Module):
    """Optional 2x temporal up-sampling (a causal time conv to 2c channels, folded into 2 frames each),
    then 2x nearest spatial up-sampling and a per-frame 3x3 conv from `cin` to `cout` channels."""

    def __init__(self, cin: int, cout: int, scale: int, frames: int, temporal: bool) -> None:
        super().__init__()
        self.time_conv = CausalConv3d(cin, 2 * cin, (3, 1, 1), scale, frames) if temporal else None
        frames = 2 * frames if temporal else frames
        self.conv = CausalConv3d(cin, cout, (1, 3, 3), 2 * scale, frames)
        self._subpixel: tuple[torch.Tensor, torch.Tensor] | None = None  # see prepare_subpixel

    @torch.no_grad()
    def prepare_subpixel(self) -> None:
        """The CPU serving form of up-sampling + 3x3 conv: nearest 2x followed by a 3x3 conv is, exactly, one 3x3
        conv over the input with 4 cout outputs (one 2x2-tap kernel per output pixel phase (dy, dx), zeros in the
        other taps) whose outputs are then shuffled into the 2x grid. The 4x up-sampled tensor is never made.
        Call after the weights are final (loaded, cast)."""
        w = self.conv.weight.detach()[:, :, 0]  # (cout, cin, 3, 3): taps at offsets -1, 0, +1 of the 2x grid
        cout, cin = w.shape[:2]
        # phase d of the 2x grid, input tap a (offset a - 1) -> the 2x-grid taps that land on it
        lands = (((0,), (1, 2), ()), ((), (0, 1), (2,)))
        k = w.new_zeros(2, 2, cout, cin, 3, 3)  # (dy, dx, cout, cin, 3, 3)
        for dy, dx, a, b in ((dy, dx, a, b) for dy in range(2) for dx in range(2) for a in range(3) for b in range(3)):
            for ky in lands[dy][a]:
                for kx in lands[dx][b]:
                    k[dy, dx, :, :, a, b] += w[:, :, ky, kx]
        bias = self.conv.bias
        assert bias is not None  # every decoder conv has one
        self._subpixel = (k.reshape(4 * cout, cin, 3, 3).contiguous(memory_format=torch.channels_last),
                          bias.detach().repeat(4))

    def _forward_subpixel(self, x: torch.Tensor | Unsummed, windows: list[torch.Tensor], span: Span | None = None
                          ) -> torch.Tensor:
        """`forward_window` on CPU after `prepare_subpixel`: the same values (float rounding aside)."""
        assert self._subpixel is not None
        if self.time_conv is not None:
            conv = self.time_conv
            y = conv.run_window(conv.write_window(x, windows, span), span=span)  # (B, 2c, T, h', w'), bias in
            b, c2, t, h, w = y.shape
            c = c2 // 2
            # frame 2t + i is half i of frame t: (B, T, h', w', 2, c) -> (B*2T, h', w', c), one copy
            frames = y.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, 2, c).permute(0, 1, 4, 2, 3, 5).reshape(
                b * 2 * t, h, w, c).permute(0, 3, 1, 2)  # (B*T', c, h', w') channels-last
            t = 2 * t
        else:
            s = summed(x)  # (B, c, T, h', w') channels-last
            b, c, t, h, w = s.shape
            frames = s.transpose(1, 2).reshape(b * t, c, h, w)  # (B*T, c, h', w'), a view
        weight, bias = self._subpixel
        r = F.conv2d(frames, weight, bias, padding=1)  # (B*T', 4 cout, h', w') channels-last, (dy, dx, cout)
        cout = weight.shape[0] // 4
        out = r.new_empty(b, t, 2 * h, 2 * w, cout).permute(0, 4, 1, 2, 3)  # (B, cout, T', 2h', 2w') channels-last
        # (B, T', h', w', dy, dx, cout) -> (B, T', h', dy, w', dx, cout): the 2x grid's row-major order
        src = r.permute(0, 2, 3, 1).reshape(b, t, h, w, 2, 2, cout).permute(0, 1, 2, 4, 3, 5, 6)
        out.permute(0, 2, 3, 4, 1).view(b, t, h, 2, w, 2, cout).copy_(src)
        return out

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], first: bool = False) -> torch.Tensor:
        """(B, cin, T, h', w') -> (B, cout, T', 2h', 2w'). `first`: x begins a stream whose first frame passes the
        temporal up-sampling unchanged (`VAEConfig.first_latent_frames` = 1): T' = 1 + 2(T - 1)."""
        if self.time_conv is not None:
            head = x[:, :, :1] if first else None
            x = x[:, :, 1:] if first else x
            b, c, t, h, w = x.shape
            if t:
                y = self.time_conv(x, caches).view(b, 2, c, t, h, w)  # (B, 2, cin, T, h', w')
                x = y.permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)  # frame 2t + i from half i
            if head is not None:
                x = torch.cat([head, x], dim=2)  # (B, cin, 1 + 2(T - 1), h', w')
        x = F.interpolate(x, scale_factor=(1.0, 2.0, 2.0), mode="nearest")  # (B, cin, T, 2h', 2w')
        return self.conv(x, caches)  # (B, cout, T, 2h', 2w')

    def forward_window(self, x: torch.Tensor | Unsummed, windows: list[torch.Tensor], span: Span | None = None
                       ) -> torch.Tensor:
        """The serving form: one pass reads the up-sampling's input (with its pending bias and residual, or
        the time conv's output with its bias) and writes the 2x copies in the 3x3 conv's channels-last layout.
        On CPU after `prepare_subpixel`, the sub-pixel form instead (no 2x copies at all). `span` (a, b): x is those
        frames of the chunk; a temporal up-sampling then makes frames 2a .. 2b - 1 of its output (frame 2i + h from
        half h of its causal time conv's output for frame i)."""
        if self._subpixel is not None and (x.y if isinstance(x, Unsummed) else x).device.type == "cpu":
            return self._forward_subpixel(x, windows, span)
        if self.time_conv is not None:
            conv = self.time_conv
            y = conv.run_window(conv.write_window(x, windows, span), with_bias=False, span=span)  # (B, 2cin, T, ..)
            up = upsample_nearest(y, conv.bias, fold_time=True)  # (B, cin, 2T, 2h', 2w'): frame 2t + i from half i
        elif isinstance(x, Unsummed):
            up = upsample_nearest(x.y, x.bias, x.residual)  # (B, cin, T, 2h', 2w')
        else:
            up = upsample_nearest(x)
        return self.conv.forward_window(up, windows)  # (B, cout, T', 2h', 2w')


@dataclass
class DecoderState:
    """One stream's temporal caches: the last input frames of every causal conv, in `slot` order.

    The tensors are allocated once by `CausalDecoder.init_state` and only ever written in place. With
    `chunk_frames` set, `windows[i]` is conv i's (B, cin, kt - 1 + T, h', w') window for chunks of that
    many latent frames and `caches[i]` its first `kt - 1` frames (a view).
    """

    caches: list[torch.Tensor]
    batch: int
    latent_hw: tuple[int, int]
    chunk_frames: int | None = None
    windows: list[torch.Tensor] | None = None
    pending: list[torch.Tensor] | None = None  # `CausalDecoder.decode_first`'s unfinished frames per stage
    started: bool = False  # a chunk was decoded since init/reset (`VAEConfig.first_latent_frames` = 1 reads it)


class CausalDecoder(nn.Module):
    """Latent chunk (B, C, Tc, h, w) -> video (B, 3, 4*Tc, 8h, 8w) in [-1, 1], causal and streaming."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        widths = [cfg.base_channels * m for m in reversed(cfg.channel_mult)]  # lowest resolution first
        self.shuffle = 2 if cfg.decoder_output == "pixel_shuffle" else 1  # output pixels per position, each way
        last_kt = 3
        if self.shuffle > 1:
            widths = widths[:-1]  # no full-resolution stage: the output conv makes 2x2 pixels per position
            widths[-1] = cfg.decoder_last_channels or widths[-1]
            last_kt = cfg.decoder_last_kt
        scale, frames, eps = 1, 1, cfg.norm_eps
        c_lat = cfg.latent_channels
        self.latent_in = CausalConv3d(c_lat, c_lat, (1, 1, 1), scale, frames) if cfg.latent_in_conv else None
        self.conv_in = CausalConv3d(c_lat, widths[0], (3, 3, 3), scale, frames)
        # The mid block, then the stages from the lowest resolution up, run in this order.
        self.blocks = nn.ModuleList(
            [
                ResBlock(widths[0], scale, frames, eps=eps),
                FrameAttention(widths[0], scale, frames, eps),
                ResBlock(widths[0], scale, frames, eps=eps),
            ]
        )
        cin = widths[0]  # the next stage's input width
        for i, c in enumerate(widths):
            kt = last_kt if i == len(widths) - 1 else 3  # a shuffled decoder's last stage: per frame by default
            self.blocks.extend(ResBlock(c, scale, frames, kt, cin=c if j else cin, eps=eps)
                               for j in range(cfg.num_res_blocks + 1))
            if i < len(widths) - 1:
                temporal = i < 2  # 4x = two 2x temporal up-samplings, at the two lowest resolutions
                cin = c // 2 if cfg.upsample_halves else widths[i + 1]
                self.blocks.append(Upsample(c, cin, scale, frames, temporal))
                scale, frames = 2 * scale, (2 * frames if temporal else frames)
        self.norm_out = RMSNorm(widths[-1], eps)
        # 3 output channels, or 3 per pixel of each position's s x s block, ordered (dy, dx, rgb): `unshuffle`
        self.conv_out = CausalConv3d(widths[-1], 3 * self.shuffle**2, (kt, 3, 3), scale, frames)
        # From the first temporal up-sampling on, every step keeps its frames apart in time at its stage's rate:
        # frame i of a stage is made from frame i of the stage's input and the frames before it, and a temporal
        # up-sampling makes frames 2i and 2i + 1 from its input's frame i. So a chunk's first output frames need
        # only the first frames of each stage (`decode_first`): the blocks before `split` run on the whole chunk,
        # each stage after it (block ranges `stages`, each ending at a temporal up-sampling but the last) on the
        # frames it needs.
        ups = [i + 1 for i, b in enumerate(self.blocks) if isinstance(b, Upsample) and b.time_conv is not None]
        self.split = ups[0] if ups else 0
        self.stages = list(zip([self.split, *ups[1:]], [*ups[1:], len(self.blocks)], strict=True))
        self.cached_convs = [m for m in self.modules() if isinstance(m, CausalConv3d) and m.past > 0]
        for slot, conv in enumerate(self.cached_convs):
            conv.slot = slot
        self._out_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # conv_out padded, see pad_output
        self._u8_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # conv_out in 0..255, see frames_uint8

    def unshuffle(self, y: torch.Tensor) -> torch.Tensor:
        """conv_out's output (B, 3 s^2, T, h', w'), channels (dy, dx, rgb), -> the video (B, 3, T, s h', s w')."""
        s = self.shuffle
        if s == 1:
            return y
        b, _, t, h, w = y.shape
        y = y.reshape(b, s, s, 3, t, h, w).permute(0, 3, 4, 5, 1, 6, 2)  # (B, 3, T, h', dy, w', dx)
        return y.reshape(b, 3, t, h * s, w * s)

    def pad_output(self, multiple: int = 8) -> None:
        """Serve `conv_out` with its 3 output channels zero-padded to `multiple` (cuDNN's channels-last
        kernels want output channels in multiples of 8), the extra channels dropped after. Call after
        the weights are final (loaded, cast, laid out)."""
        w, b = self.conv_out.weight.detach(), self.conv_out.bias
        assert b is not None  # conv_out is built with a bias
        b = b.detach()
        pad = -w.shape[0] % multiple
        wp = torch.cat([w, w.new_zeros(pad, *w.shape[1:])]).contiguous(memory_format=_CL3D)
        self._out_weight = (wp, torch.cat([b, b.new_zeros(pad)]))

    def forward_window(self, z: torch.Tensor, windows: list[torch.Tensor]) -> torch.Tensor:
        """`forward` for a serving state (`init_state(..., chunk_frames)`), same result: every
        norm + SiLU before a causal conv writes into that conv's window, nothing is concatenated."""
        return self._video(self._trunk_window(z, windows), None)  # (B, 3, 4*Tc, 8h, 8w)

    def _video(self, window: torch.Tensor, span: Span | None) -> torch.Tensor:
        """conv_out over its window (or `span`'s frames of it) -> video (B, 3, t, 8h, 8w) in [-1, 1]."""
        conv = self.conv_out
        if self._out_weight is None:
            x = conv.run_window(window, span=span)
        else:
            x = conv.run_window(window, *self._out_weight, span=span)[:, : conv.out_channels]
        return self.unshuffle(x).clamp(-1.0, 1.0)

    def _trunk_window(self, z: torch.Tensor, windows: list[torch.Tensor]) -> torch.Tensor:
        """Everything up to conv_out, whose window it returns with this chunk's input written in."""
        return self._finish_window(self._split_window(z, windows), windows)

    def _split_window(self, z: torch.Tensor, windows: list[torch.Tensor]) -> torch.Tensor:
        """The blocks up to `split`, on the whole chunk: (B, C, Tc, h, w) -> (B, c, frames, h', w')."""
        if self.latent_in is not None:
            z = self.latent_in.forward_window(z, windows)  # (B, C, Tc, h, w)
        x: torch.Tensor | Unsummed = self.conv_in.forward_window(z, windows)  # (B, c0, Tc, h, w)
        for block in self.blocks[: self.split]:
            x = block.forward_window(x, windows)  # type: ignore[operator]
        return summed(x)

    def _finish_window(self, x: torch.Tensor, windows: list[torch.Tensor]) -> torch.Tensor:
        """The blocks from `split` on, on the whole chunk (x: `split`'s output), up to conv_out: its window (with
        this chunk's input written in) or, for a kt = 1 conv_out, its input."""
        for j in range(len(self.stages)):
            x = self._stage(j, x, windows, None)
        return x

    def _stage(self, j: int, x: torch.Tensor | Unsummed, windows: list[torch.Tensor], span: Span | None
               ) -> torch.Tensor:
        """Stage j's blocks on its frames `span` (a, b) (x holds just those; None: x is the whole chunk's): the
        next stage's input for frames 2a .. 2b - 1, or, the last stage, conv_out's window with those frames
        written in (or, for a kt = 1 conv_out, its input)."""
        lo, hi = self.stages[j]
        for block in self.blocks[lo:hi]:
            x = block.forward_window(x, windows, span)  # type: ignore[operator]
        if j < len(self.stages) - 1:
            return summed(x)
        return self.conv_out.norm_silu_window(summed(x), self.norm_out, windows, span=span)

    def decode_first(self, z: torch.Tensor, state: DecoderState, frames: int = 1, *, uint8: bool = False
                     ) -> torch.Tensor:
        """A chunk's first `frames` output frames, before the rest (`decode_rest`, which must come next): the
        blocks before `split` run on the whole chunk, each stage after it on the frames of it those need (at 57b:
        the 176x272 stage on the first of its two frames, the two stages above it on the first of their four).
        The two calls give the same frames as `decode_chunk` (or, `uint8`, `frames_uint8`): (B, 3, frames, 8h, 8w)
        or (B, frames, 8h, 8w, 3). Needs a serving state (`init_state(..., chunk_frames=...)`). For a speech
        onset: its first frame reaches the viewer after the low-resolution trunk plus its own share of each stage
        above, instead of after the whole chunk's decode."""
        windows = self._serving(z, state, uint8)
        total = self.cfg.temporal_factor * z.shape[2]
        if not 0 < frames < total:
            raise ValueError(f"decode_first takes 1 .. {total - 1} frames of a chunk of {total}, got {frames}")
        x = self._split_window(z, windows)  # (B, c, the first stage's frames, h', w')
        rest = []  # per stage, its input's frames past those run here, for decode_rest
        for j in range(len(self.stages)):
            need = -(-frames >> (len(self.stages) - 1 - j))  # ceil(frames / 2^(stages above this one))
            rest.append(x[:, :, need:])  # a view (B == 1: time is outermost channels-last)
            x = self._stage(j, x[:, :, :need], windows, (0, need))
        state.pending = rest
        return self._out(x, (0, frames), uint8)

    def decode_rest(self, state: DecoderState, frames: int = 1, *, uint8: bool = False) -> torch.Tensor:
        """The chunk's frames after the first `frames` (`decode_first`'s); the state then moves on a chunk."""
        rest, state.pending = state.pending, None
        if rest is None or state.windows is None or state.chunk_frames is None:
            raise ValueError("decode_rest without decode_first: decode the chunk's first frames first")
        total = self.cfg.temporal_factor * state.chunk_frames
        x: torch.Tensor | None = None  # the previous stage's output, its frames past decode_first's
        span = (frames, total)
        for j, left in enumerate(rest):
            x = left if x is None else x if left.shape[2] == 0 else torch.cat([left, x], 2)  # (B, c, n, h', w')
            if x.shape[2] == 0:  # decode_first ran all of this stage (its cache moved on then)
                x = None
                continue
            end = total >> (len(rest) - 1 - j)  # this stage's frames
            span = (end - x.shape[2], end)
            x = self._stage(j, x, state.windows, span)
        assert x is not None and span[0] == frames
        return self._out(x, span, uint8)

    def _out(self, window: torch.Tensor, span: Span | None, uint8: bool) -> torch.Tensor:
        return self._uint8(window, span) if uint8 else self._video(window, span)

    def _serving(self, z: torch.Tensor, state: DecoderState, uint8: bool = False) -> list[torch.Tensor]:
        """The serving windows for z's chunk (and uint8 frames prepared, if asked), before any work."""
        if uint8:
            self._u8()
        if state.windows is None or z.shape[2] != state.chunk_frames:
            raise ValueError(f"this decode needs a serving state for chunks of {z.shape[2]} latent frames; "
                             "call init_state(..., chunk_frames=...)")
        if self.cfg.first_latent_frames == 1 and not state.started:
            raise ValueError("a stream's first latent frame decodes to 1 frame here (vae.first_latent_frames=1), "
                             "which the serving forms do not make: decode the stream's first chunk with "
                             "decode_chunk (e.g. its motion/context latents) first")
        self._check_latents(z, state)
        return state.windows

    def prepare_cpu(self) -> None:
        """The CPU serving forms, from the final weights (call after loading, casting, laying out): every
        up-sampling as a sub-pixel conv (`Upsample.prepare_subpixel`), and conv_out for `frames_uint8`."""
        for m in self.modules():
            if isinstance(m, Upsample):
                m.prepare_subpixel()
        self.prepare_uint8()

    @torch.no_grad()
    def prepare_uint8(self) -> None:
        """Fold the frames' [-1, 1] -> 0..255 mapping (and the +0.5 of rounding) into conv_out's weight and bias,
        for `frames_uint8`. Call after the weights are final (loaded, cast, laid out)."""
        w, b = self.conv_out.weight.detach(), self.conv_out.bias
        assert b is not None  # conv_out is built with a bias
        self._u8_weight = ((w * 127.5).contiguous(memory_format=_CL3D), b.detach() * 127.5 + 128.0)

    def frames_uint8(self, z: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """The serving output on CPU: (B, C, Tc, h, w) -> frames (B, 4*Tc, 8h, 8w, 3) uint8, equal to
        `round((decode_chunk(z) + 1) * 127.5)` in frame-major layout (rounding ties aside: within 1 of it).
        conv_out runs with the mapping folded in (`prepare_uint8`); then one clamp and one copy that casts, puts
        the pixels in frame-major order and un-shuffles. Needs a serving state (`init_state(..., chunk_frames)`)."""
        return self._uint8(self._trunk_window(z, self._serving(z, state, uint8=True)), None)

    def _u8(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._u8_weight is None:
            raise ValueError("uint8 frames before prepare_uint8: call decoder.prepare_uint8() (or prepare_cpu()) once "
                             "the weights are final")
        return self._u8_weight

    def _uint8(self, window: torch.Tensor, span: Span | None) -> torch.Tensor:
        """conv_out over its window (or `span`'s frames of it) -> frames (B, t, 8h, 8w, 3) uint8 (`frames_uint8`)."""
        y = self.conv_out.run_window(window, *self._u8(), span=span)  # (B, 3 s^2, t, h', w')
        y = y.clamp_(0.0, 255.5)  # truncation below is rounding: +0.5 is in the bias
        b, _, t, h, w = y.shape
        s = self.shuffle
        out = torch.empty(b, t, h * s, w * s, 3, dtype=torch.uint8, device=y.device)  # (B, F, H, W, 3)
        src = y.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, s, s, 3)  # a view when channels-last: (.., dy, dx, rgb)
        out.view(b, t, h, s, w, s, 3).copy_(src.permute(0, 1, 2, 4, 3, 5, 6))
        return out

    def forward(self, z: torch.Tensor, caches: list[torch.Tensor], first: bool = False) -> torch.Tensor:
        """`first`: z begins a stream that decodes its first latent frame to one frame (see `decode_chunk`)."""
        if self.latent_in is not None:
            z = self.latent_in(z, caches)  # (B, C, Tc, h, w)
        x = self.conv_in(z, caches)  # (B, c0, Tc, h, w)
        for block in self.blocks:
            x = block(x, caches, first) if isinstance(block, Upsample) else block(x, caches)  # to (B, c, 4Tc, ..)
        x = self.conv_out(F.silu(self.norm_out(x)), caches)  # (B, 3 s^2, 4*Tc, 8h/s, 8w/s)
        return self.unshuffle(x).clamp(-1.0, 1.0)  # (B, 3, 4*Tc, 8h, 8w)

    def init_state(
        self, batch: int, latent_h: int, latent_w: int, device: torch.device | str, dtype: torch.dtype,
        chunk_frames: int | None = None, memory_format: torch.memory_format = _CL3D,
    ) -> DecoderState:
        """Zeroed caches for one stream at latent size (latent_h, latent_w); allocate once per session.
        `chunk_frames`: allocate the serving windows for chunks of that many latent frames."""
        caches, windows = [], []
        for conv in self.cached_convs:
            frames = conv.past + (conv.frames * chunk_frames if chunk_frames else 0)
            shape = (batch, conv.in_channels, frames, latent_h * conv.scale, latent_w * conv.scale)
            buf = torch.zeros(shape, device=device, dtype=dtype).contiguous(memory_format=memory_format)
            windows.append(buf)
            caches.append(buf[:, :, : conv.past])
        return DecoderState(caches=caches, batch=batch, latent_hw=(latent_h, latent_w), chunk_frames=chunk_frames,
                            windows=windows if chunk_frames else None)

    @staticmethod
    def reset_state(state: DecoderState) -> None:
        """Start a new stream: zero every cache in place (tensor identities stay, for captured graphs)."""
        for cache in state.caches:
            cache.zero_()
        state.started = False

    def decode_chunk(self, z: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """(B, C, Tc, h, w) -> (B, 3, 4*Tc, 8h, 8w); advances `state` in place by Tc latent frames. With
        `first_latent_frames` = 1, a stream's first chunk (any Tc) makes 1 + 4(Tc - 1) frames."""
        self._check_latents(z, state)
        if self.cfg.first_latent_frames == 1 and not state.started:
            state.started = True
            return self(z, state.caches, first=True)
        if state.windows is not None and z.shape[2] == state.chunk_frames:
            return self.forward_window(z, state.windows)
        return self(z, state.caches)

    def _check_latents(self, z: torch.Tensor, state: DecoderState) -> None:
        b, c, _, h, w = z.shape
        if (b, c, h, w) != (state.batch, self.cfg.latent_channels, *state.latent_hw):
            raise ValueError(
                f"latent chunk shape {tuple(z.shape)} does not fit the decoder state "
                f"(batch {state.batch}, {self.cfg.latent_channels} channels, latent {state.latent_hw}); "
                "call init_state with this chunk's batch and latent size"
            )

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """A whole latent sequence (B, C, T, h, w) in one pass from a zero state -> (B, 3, 4T, 8h, 8w)."""
        b, _, _, h, w = z.shape
        return self.decode_chunk(z, self.init_state(b, h, w, z.device, z.dtype))


def decoder_param_count(cfg: VAEConfig) -> int:
    """Parameters of `CausalDecoder(cfg)`, counted on the meta device (no memory)."""
    with torch.device("meta"):
        decoder = CausalDecoder(cfg)
    return sum(p.numel() for p in decoder.parameters())


def decoder_flops_per_chunk(cfg: VAEConfig, latent_h: int, latent_w: int) -> float:
    """FLOPs (2 x multiply-adds) to decode one latent frame: every convolution, plus the mid-block
    attention's projections and score/value products. A chunk of Tc latent frames costs Tc times this.
    Norms, activations and up-sampling copies are not counted."""
    with torch.device("meta"):
        decoder = CausalDecoder(cfg)
    macs = 0
    for m in decoder.modules():
        if isinstance(m, CausalConv3d):
            per_pixel = m.in_channels * m.out_channels * m.kernel_size[0] * m.kernel_size[1] * m.kernel_size[2]
            macs += per_pixel * (latent_h * m.scale) * (latent_w * m.scale) * m.frames
        elif isinstance(m, FrameAttention):
            n, c = (latent_h * m.scale) * (latent_w * m.scale), m.proj.in_features
            macs += m.frames * (4 * n * c * c + 2 * n * n * c)
    return 2.0 * macs


# ----------------------------------------------------------------------------------------------- encoder


class ResBlock2d(nn.Module):
    """Per-frame residual block: norm -> SiLU -> 3x3 conv, twice, plus the input."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = RMSNorm(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, c, H', W')
        y = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(y)))


class VAEEncoder(nn.Module):
    """Video (B, 3, F, H, W) in [-1, 1] -> latent mean (B, C, F/4, H/8, W/8).

    Each frame goes through 2-D stages (three stride-2 down-samplings, 8x); then each group of 4 frames
    is folded into channels and a 1x1x1 conv gives the posterior's mean and log-variance. It is used for
    the reference image only, so it is neither causal nor streaming.
    """

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        widths = [cfg.encoder_base_channels * m for m in cfg.channel_mult]  # full resolution first
        self.conv_in = nn.Conv2d(3, widths[0], 3, padding=1)
        self.stages = nn.ModuleList()
        for i, c in enumerate(widths):
            stage: list[nn.Module] = [ResBlock2d(c) for _ in range(cfg.num_res_blocks)]
            if i < len(widths) - 1:
                stage.append(nn.Conv2d(c, widths[i + 1], 3, stride=2, padding=1))
            self.stages.append(nn.Sequential(*stage))
        self.mid = ResBlock2d(widths[-1])
        t = cfg.temporal_factor
        self.norm_out = RMSNorm(t * widths[-1])
        self.to_moments = nn.Conv3d(t * widths[-1], 2 * cfg.latent_channels, 1)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        b, _, f, hh, ww = video.shape
        t, s = self.cfg.temporal_factor, self.cfg.spatial_factor
        if f % t or hh % s or ww % s:
            raise ValueError(
                f"video shape {tuple(video.shape)} needs frames a multiple of {t} and height/width multiples "
                f"of {s}; trim or pad the clip"
            )
        x = video.transpose(1, 2).reshape(b * f, 3, hh, ww)  # (B*F, 3, H, W)
        x = self.conv_in(x)
        for stage in self.stages:
            x = stage(x)  # ends at (B*F, c, h, w)
        x = self.mid(x)
        _, c, h, w = x.shape
        x = x.reshape(b, f // t, t * c, h, w).transpose(1, 2)  # (B, 4c, F/4, h, w): 4 frames folded into channels
        moments = self.to_moments(F.silu(self.norm_out(x)))  # (B, 2C, F/4, h, w)
        return moments[:, : self.cfg.latent_channels]  # the mean: (B, C, F/4, h, w)

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, C, H/8, W/8): the image as a static 4-frame clip."""
        clip = image.unsqueeze(2).expand(-1, -1, self.cfg.temporal_factor, -1, -1)  # (B, 3, 4, H, W)
        return self.forward(clip)[:, :, 0]
