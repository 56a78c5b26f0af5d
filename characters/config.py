"""Typed, frozen configuration: one config per component, composed into `SessionConfig`.

Dimension names used in shape comments across the package (defined once, here):

    B   batch (always 1 in serving: sessions are one-on-one)
    C   latent channels                     Cf  latent frames per chunk
    F   video frames (F = Cf * temporal_factor per chunk)
    h,w latent height / width               H,W image height / width
    N   tokens per latent frame             T   tokens per chunk (Cf * N)
    S   key/value slots in the cache        D   model dim; Dh head dim; Hh heads
    A   audio tokens per latent frame       Fa  audio frames (video frames + context)

One module on purpose: every component's config, their cross-field checks and the presets built from them
are read together as the single source of truth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DType = Literal["float32", "bfloat16", "float16"]
Precision = Literal["bf16", "fp8"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DiTConfig(_Frozen):
    """The audio-conditioned video diffusion transformer."""

    num_layers: int = Field(description="Number of transformer blocks.", ge=1)
    dim: int = Field(description="Model width D.", ge=8)
    num_heads: int = Field(description="Attention heads Hh; dim must divide evenly.", ge=1)
    ffn_dim: int = Field(description="Hidden width of the MLP.", ge=8)
    latent_channels: int = Field(description="Channels C of the VAE latent (DiT in and out).", ge=1)
    patch_size: tuple[int, int] = Field(default=(2, 2), description="Spatial patch (ph, pw); temporal patch is 1.")
    freq_dim: int = Field(default=256, description="Sinusoidal timestep embedding width.", ge=2)
    audio_dim: int = Field(description="Width of the audio encoder's per-frame features.", ge=1)
    cross_dim: int = Field(description="Width of the audio context after the audio embedding MLP (K/V input).", ge=1)
    rope_theta: float = Field(default=10000.0, description="RoPE base.", gt=0)
    eps: float = Field(default=1e-6, description="Norm epsilon.", gt=0)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Head-dim channels given to the (time, height, width) RoPE axes (Wan's split)."""
        d = self.head_dim
        hw = 2 * (d // 6)
        return d - 2 * hw, hw, hw

    @model_validator(mode="after")
    def _check(self) -> DiTConfig:
        if self.dim % self.num_heads:
            raise ValueError(
                f"dit.dim={self.dim} is not divisible by dit.num_heads={self.num_heads}; "
                "choose num_heads that divides dim"
            )
        if any(x % 2 for x in self.rope_split):
            raise ValueError(
                f"dit head_dim={self.head_dim} splits into RoPE axes {self.rope_split}, which must all be even; "
                "use a head_dim that is a multiple of 12 or 16"
            )
        return self


class VAEConfig(_Frozen):
    """Reference-image encoder and causal streaming decoder."""

    latent_channels: int = Field(description="Latent channels C.", ge=1)
    spatial_factor: Literal[8] = Field(default=8, description="Spatial down-sampling of the latent.")
    temporal_factor: Literal[4] = Field(default=4, description="Video frames per latent frame.")
    base_channels: int = Field(description="Decoder channels at full resolution times the first multiplier.", ge=1)
    channel_mult: tuple[int, ...] = Field(description="Per-stage channel multipliers, lowest resolution last.")
    num_res_blocks: int = Field(
        default=2, description="Residual blocks per encoder stage; each decoder stage has one more (Wan).", ge=0)
    encoder_base_channels: int = Field(description="Encoder channels at full resolution.", ge=1)
    decoder_output: Literal["conv", "pixel_shuffle"] = Field(
        default="conv",
        description="How the decoder reaches full resolution. 'conv' (Wan's): a third 2x up-sampling, a "
        "full-resolution stage and a causal 3x3x3 conv to RGB. 'pixel_shuffle': no full-resolution stage (the "
        "first multiplier is then the encoder's only); the half-resolution stage's 3x3 output conv makes "
        "each position's 2x2 RGB pixels (12 channels, a learned 2x pixel shuffle): the CPU default's choice, "
        "where full-resolution passes were over half of the decoder's time.",
    )
    decoder_last_channels: int | None = Field(
        default=None, ge=1,
        description="'pixel_shuffle' only: channels of the last (half-resolution) stage and the output conv's input; "
        "None: base_channels x channel_mult[1], the stage's width in the 'conv' decoder.",
    )
    decoder_last_kt: Literal[1, 3] = Field(
        default=1,
        description="'pixel_shuffle' only: temporal kernel of the last stage's convs and the output conv; 1: each "
        "frame on its own, 3: causal 3x3x3 convs that see the 2 frames before (3x that stage's conv work).",
    )
    # Options that make the decoder Wan2.1's VAE decoder exactly (LiveAvatar: characters/families/liveavatar/vae.py).
    norm_eps: float = Field(
        default=1e-6, ge=0,
        description="Epsilon of every RMSNorm (added to the mean square). Wan2.1 normalises with F.normalize (the "
        "norm floored at 1e-12): 1e-24 gives its values for every vector not within ~1e-9 of zero.",
    )
    upsample_halves: bool = Field(
        default=False,
        description="Wan2.1's widths: each up-sampling's 3x3 conv halves the channels (c -> c/2) and the next stage's "
        "first residual block widens them to its width, with a 1x1x1 conv on its residual path where they "
        "differ. False: the up-sampling's conv goes straight to the next stage's width.",
    )
    latent_in_conv: bool = Field(
        default=False,
        description="A 1x1x1 conv on the latents before conv_in (Wan2.1's `conv2`; its loader folds the latent "
        "de-normalisation, z * std + mean, into it).",
    )
    first_latent_frames: Literal[1, 4] = Field(
        default=4,
        description="Video frames decoded from a stream's first latent frame. 4: every latent frame alike. 1 "
        "(Wan2.1): the temporal up-samplings pass that frame through without their time conv, which first sees "
        "the stream's second latent frame (zeros before it), so a stream of T latent frames makes 1 + 4(T - 1).",
    )

    @model_validator(mode="after")
    def _check(self) -> VAEConfig:
        if len(self.channel_mult) != 4:
            raise ValueError(
                f"vae.channel_mult={self.channel_mult} must have 4 stages (8x spatial = 3 up-samplings); "
                "give four multipliers such as (1, 2, 4, 4)"
            )
        if self.decoder_output == "conv" and (self.decoder_last_channels is not None or self.decoder_last_kt != 1):
            raise ValueError(
                f"vae.decoder_last_channels={self.decoder_last_channels} / vae.decoder_last_kt={self.decoder_last_kt} "
                "shape a 'pixel_shuffle' decoder's last stage; with decoder_output='conv' leave them at None / 1"
            )
        return self


class AudioConfig(_Frozen):
    """16 kHz PCM -> one feature vector per video frame."""

    sample_rate: Literal[16000] = Field(default=16000, description="PCM rate the engine consumes (Hz).")
    window_samples: int = Field(default=1024, description="Analysis window ending at each video frame's end.", ge=64)
    n_fft: int = Field(default=256, description="Sub-frame FFT size inside the window.", ge=16)
    hop: int = Field(default=128, description="Sub-frame hop inside the window.", ge=1)
    n_bands: int = Field(default=32, description="Log-power bands per sub-frame.", ge=1)
    context_frames: int = Field(default=4, description="Past video frames each latent frame also hears.", ge=0)

    @property
    def sub_frames(self) -> int:
        return 1 + (self.window_samples - self.n_fft) // self.hop

    @model_validator(mode="after")
    def _check(self) -> AudioConfig:
        if self.n_fft > self.window_samples:
            raise ValueError(
                f"audio.n_fft={self.n_fft} exceeds audio.window_samples={self.window_samples}; "
                "lower n_fft or widen the window"
            )
        return self


class GenerationConfig(_Frozen):
    """Resolution, chunking, context and sampling of the autoregressive loop."""

    height: int = Field(description="Output height H in pixels.", ge=8)
    width: int = Field(description="Output width W in pixels.", ge=8)
    fps: Literal[24] = Field(default=24, description="Video frame rate.")
    latent_frames_per_chunk: int = Field(default=1, description="Latent frames Cf generated per step.", ge=1)
    window_latent_frames: int = Field(default=3, description="Past latent frames kept in the rolling window.", ge=0)
    denoising_steps: int = Field(default=1, description="Denoising forwards per chunk.", ge=1)
    cache_update: Literal["last_step", "extra_pass"] = Field(
        default="last_step",
        description="Which forward's K/V stay in the cache: the last denoising step's, or one extra forward "
        "over the clean chunk at t=0.",
    )
    timestep_shift: float = Field(default=5.0, description="Flow-matching sigma shift of the step schedule.", gt=0)
    cache_mode: Literal["write_time", "naive"] = Field(
        default="write_time",
        description="write_time: norm/RoPE/cast/layout applied once when K/V enter the cache. naive: raw K/V "
        "kept and the whole cache re-processed in every attention call (for measurement and equivalence).",
    )

    @property
    def frames_per_chunk(self) -> int:
        return self.latent_frames_per_chunk * 4

    @property
    def ring_slots(self) -> int:
        """Chunk-sized cache slots in the ring: the window plus the chunk being generated."""
        return self.window_latent_frames // self.latent_frames_per_chunk + 1

    @property
    def forwards_per_chunk(self) -> int:
        return self.denoising_steps + (1 if self.cache_update == "extra_pass" else 0)

    @model_validator(mode="after")
    def _check(self) -> GenerationConfig:
        if self.window_latent_frames % self.latent_frames_per_chunk:
            raise ValueError(
                f"generation.window_latent_frames={self.window_latent_frames} must be a multiple of "
                f"generation.latent_frames_per_chunk={self.latent_frames_per_chunk} (the ring holds whole chunks)"
            )
        return self


class ModelConfig(_Frozen):
    """One character model: DiT, VAE, audio encoder and the generation loop."""

    name: str = Field(description="Preset name this model came from (or a custom label).")
    dit: DiTConfig
    vae: VAEConfig
    audio: AudioConfig = AudioConfig()
    generation: GenerationConfig
    precision: Precision = Field(
        default="bf16",
        description="The DiT blocks' linear layers: 'bf16' GEMMs in the session's compute dtype (the reference), or "
        "'fp8': e4m3 weights quantised once at load per output channel, activations quantised per token inside the "
        "kernel that produces them, FP8 tensor-core GEMMs (CUDA compute capability >= 8.9; docs/fp8.md).",
    )
    attention_precision: Precision = Field(
        default="bf16",
        description="Self-attention over the KV cache: 'bf16' (the cache in the compute dtype, cuDNN/SDPA kernels) or "
        "'fp8': the write-time kernel stores K and V in e4m3 with their scales (half the cache memory) and an FP8 "
        "kernel attends over them (attention_fp8_kernel; needs cache_mode='write_time' and a GPU with FP8; "
        "docs/fp8.md).",
    )
    attention_fp8_kernel: Literal["auto", "triton", "cudnn"] = Field(
        default="auto",
        description="With attention_precision='fp8', the kernel and the cache form it reads: 'cudnn' (cuDNN's Hopper "
        "FP8 attention through the optional nvidia-cudnn-frontend package; q, K and V each with one scale per layer, "
        "the output in e4m3 straight into the output projection), 'triton' (kernels.attention_fp8: V with a scale "
        "per key, stored transposed) or 'auto': 'cudnn' where it runs (compute capability 9.0, head_dim 64 or 128, "
        "the package installed), else 'triton'.",
    )

    @property
    def latent_hw(self) -> tuple[int, int]:
        f = self.vae.spatial_factor
        return self.generation.height // f, self.generation.width // f

    @property
    def token_grid(self) -> tuple[int, int]:
        h, w = self.latent_hw
        ph, pw = self.dit.patch_size
        return h // ph, w // pw

    @property
    def tokens_per_frame(self) -> int:
        gh, gw = self.token_grid
        return gh * gw

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_frame * self.generation.latent_frames_per_chunk

    @property
    def cache_tokens(self) -> int:
        """Key/value slots S: the reference sink plus every ring slot (the current chunk included)."""
        return self.tokens_per_frame + self.generation.ring_slots * self.tokens_per_chunk

    @property
    def audio_tokens_per_latent(self) -> int:
        return self.vae.temporal_factor + self.audio.context_frames

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        f = self.vae.spatial_factor
        ph, pw = self.dit.patch_size
        g = self.generation
        for field, value, mult in (("height", g.height, f * ph), ("width", g.width, f * pw)):
            if value % mult:
                raise ValueError(
                    f"generation.{field}={value} must be a multiple of {mult} "
                    f"(VAE factor {f} x patch); round it to {value // mult * mult or mult}"
                )
        if self.attention_precision == "fp8" and self.generation.cache_mode != "write_time":
            raise ValueError(
                f"attention_precision='fp8' needs generation.cache_mode='write_time' (the FP8 cache is written in the "
                f"form attention reads); got cache_mode={self.generation.cache_mode!r}: use 'write_time' or "
                "attention_precision='bf16'"
            )
        if self.precision == "fp8":
            for field, value in (("dim", self.dit.dim), ("ffn_dim", self.dit.ffn_dim)):
                if value % 16:
                    raise ValueError(
                        f"precision='fp8' needs dit.{field} divisible by 16 (FP8 GEMM operands); got {value}: "
                        f"round it to {value // 16 * 16 or 16} or use precision='bf16'"
                    )
        if self.dit.latent_channels != self.vae.latent_channels:
            raise ValueError(
                f"dit.latent_channels={self.dit.latent_channels} differs from "
                f"vae.latent_channels={self.vae.latent_channels}; they must match"
            )
        return self


class TopologyConfig(_Frozen):
    """How one session is laid over GPUs: DiT tensor-parallel ranks plus decoder GPUs."""

    name: str = Field(description="Topology name, e.g. h100x5.")
    dit_ranks: int = Field(description="Tensor-parallel DiT ranks (one GPU each).", ge=1, le=8)
    decoder_gpus: Literal[0, 1] = Field(
        description="1: the VAE decoder has its own GPU; 0: it shares DiT rank 0's GPU."
    )
    accelerator: str | None = Field(
        default=None, description="Ray accelerator label to pin sessions to a GPU type (e.g. H100); None: any."
    )
    room_cpus: float = Field(default=1.0, description="CPUs reserved for the room worker.", gt=0)
    dit_cpu_threads: int = Field(
        default=1, ge=1, le=64,
        description="Intra-op threads of each DiT rank on a CPU. One: the DiT of chunk k+1 runs beside the decode of "
        "chunk k (serving's pipeline, `characters demo`'s two threads), one core each; a second thread per stage "
        "costs CPU time for little wall time at the tiny preset's sizes (benchmarks/cpu/compute_tiny.json).")
    decoder_cpu_threads: int = Field(
        default=1, ge=1, le=64, description="Intra-op threads of the VAE decoder on a CPU (see dit_cpu_threads).")
    cpu_matmul: Literal["float32", "bfloat16", "auto"] = Field(
        default="auto",
        description="The DiT blocks' linear layers on a CPU: 'float32', or 'bfloat16' (bf16 weights and inputs, "
        "float32 out and everything else float32), or 'auto': bfloat16 where the CPU multiplies bf16 in hardware "
        "(AVX512_BF16 or AMX; on a 2-core EPYC the tiny DiT's step went 57 -> 47 ms), float32 elsewhere (bf16 "
        "emulated is slower). The lip-sync score holds (docs/training.md).")
    sequence_parallel: bool = Field(
        default=False,
        description="With dit_ranks > 1: split the residual stream by tokens between the tensor-parallel layers "
        "(all-gather before, reduce-scatter after them) so each rank runs 1/dit_ranks of the token-wise work; "
        "False: every rank holds every token (all-reduce after the row-parallel layers). Off by default: on 2 "
        "H200s the 57b step ran 389.5 ms with it and 376.4 ms without (its collectives cost more in place than "
        "the compute they save; benchmarks/h200x2/tp_57b_2_all.json).",
    )
    local_layers: bool = Field(
        default=False,
        description="With sequence_parallel: the token-by-token layers (the MLP, the audio cross-attention) keep "
        "their whole weights on every rank and run on the rank's own tokens, so only self-attention communicates "
        "(2 of a block's 6 collectives: an all-gather and a reduce-scatter). The same FLOPs per rank; the memory of "
        "those weights whole on each: 57b over 3 ranks holds 44.4 B parameters a rank against 19.6 B split "
        "(characters.flops.chunk_cost), ~25 GB more per rank in FP8.",
    )
    local_attention: bool = Field(
        default=False,
        description="With local_layers: self-attention keeps its whole weights on every rank too. Each rank projects "
        "Q, K and V of its own tokens, writes its K/V rows in the cache's form, all-gathers the chunk's other rows "
        "from the other ranks (one collective a block: K and V, e4m3 in FP8; no reduce-scatter) and attends its own "
        "queries over every key. The same FLOPs per rank; every rank holds the whole model and every head's KV cache "
        "(57b: 59.3 + 16.0 GB in FP8, against 46.1 + 5.3 at 3 ranks with local_layers alone; characters presets): "
        "tight on an 80 GB H100.",
    )
    step_groups: int = Field(
        default=16, ge=1, le=64,
        description="The DiT's chunk step runs as this many parts, each a run of consecutive blocks (one CUDA graph "
        "each on GPUs), so that a speech onset can take the place of the idle chunk in flight: the DiT gives that "
        "chunk up between two parts and makes the onset in its cache slot instead of after it "
        "(`ServiceConfig.preempt_idle`), waiting for about a part and a half instead of the rest of the step. On an "
        "H200, a 57b rank of 3 steps as fast in 16 parts as in one (133.6 against 133.7 ms) and the onset waits "
        "13.3 ms (p50) instead of 67.1 (benchmarks/h200/preempt_57b_tp3_spl.json). 1: the step is one part (one "
        "graph), never given up.",
    )
    tp_overlap: Literal["none", "ring", "symm_mem"] = Field(
        default="none",
        description="Sequence-parallel collectives: 'none' = NCCL's all-gather / reduce-scatter next to the GEMMs; "
        "'ring' = decomposed into peer-to-peer ring steps, each overlapped with the GEMM of the tokens already "
        "here (all-gather+matmul, matmul+reduce-scatter); 'symm_mem' = PyTorch's fused all-gather+matmul and "
        "matmul+reduce-scatter on symmetric memory (CUDA GPUs with peer access only).",
    )

    @property
    def gpus(self) -> int:
        return self.dit_ranks + self.decoder_gpus

    @model_validator(mode="after")
    def _check_local_layers(self) -> TopologyConfig:
        if self.local_layers and not self.sequence_parallel:
            raise ValueError("topology.local_layers=true needs topology.sequence_parallel=true: the layers kept whole "
                             "run on each rank's own tokens (with every token on every rank, each would run them all)")
        if self.local_attention and not self.local_layers:
            raise ValueError("topology.local_attention=true needs topology.local_layers=true: self-attention is kept "
                             "whole on each rank's own tokens only beside the token-local layers")
        return self


def check_tensor_parallel(dit: DiTConfig, ranks: int, precision: Precision = "bf16") -> None:
    """Raise a ValueError naming the field when `dit` cannot be split over `ranks` ranks (in `precision`)."""
    if ranks < 1:
        raise ValueError(f"tensor-parallel ranks={ranks} must be >= 1")
    for field, value in (("num_heads", dit.num_heads), ("ffn_dim", dit.ffn_dim)):
        if value % ranks:
            ok = [r for r in range(1, 9) if dit.num_heads % r == 0 and dit.ffn_dim % r == 0]
            raise ValueError(
                f"dit.{field}={value} is not divisible by {ranks} tensor-parallel ranks; "
                f"this model splits over {ok} ranks"
            )
    if precision == "fp8" and ranks > 1:
        for field, value in (("dim", dit.dim), ("ffn_dim", dit.ffn_dim)):
            if value % (16 * ranks):
                raise ValueError(
                    f"precision='fp8' with {ranks} tensor-parallel ranks needs dit.{field}={value} divisible by "
                    f"{16 * ranks} (each rank's FP8 GEMM operand a multiple of 16); use fewer ranks or "
                    "precision='bf16'"
                )


class SessionConfig(_Frozen):
    """Everything one session needs; the single source of truth, loadable from YAML."""

    model: ModelConfig
    topology: TopologyConfig
    seed: int = Field(default=0, description="Seed for random weights and the session's noise.")
    dtype: DType = Field(default="float32", description="Compute dtype (bfloat16 on GPUs, float32 on CPUs).")
    weights: str | None = Field(
        default=None,
        description="Weights directory; None: the preset's shipped weights (characters/weights/<preset>/) when "
        "they exist and fit the model, else seeded random; 'random': seeded random weights.",
    )

    @model_validator(mode="after")
    def _check(self) -> SessionConfig:
        check_tensor_parallel(self.model.dit, self.topology.dit_ranks, self.model.precision)
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> SessionConfig:
        """Load a YAML file: either a full config, or `{preset: NAME, topology: NAME, ...overrides}`."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        return session_config(**data) if "preset" in data else cls.model_validate(data)


# --------------------------------------------------------------------------------------------- presets

_AUDIO = AudioConfig()

MODEL_PRESETS: dict[str, ModelConfig] = {
    # The embedded CPU default: real time on 2 cores at 176x272.
    "tiny": ModelConfig(
        name="tiny",
        dit=DiTConfig(num_layers=4, dim=192, num_heads=4, ffn_dim=768, latent_channels=8, audio_dim=128,
                      cross_dim=192),
        vae=VAEConfig(latent_channels=8, base_channels=4, channel_mult=(1, 2, 4, 8), num_res_blocks=0,
                      encoder_base_channels=8, decoder_output="pixel_shuffle"),  # no full-resolution conv (CPU)
        audio=_AUDIO,
        # one denoising step: the shipped DiT, trained on a 2-step schedule, scores the same on the 51 held-out
        # clips at 1 step (lip sync r 0.754 vs 0.752, PSNR to the ground truth 18.97 vs 19.02 dB) at half the DiT's
        # compute (docs/training.md, "One denoising step")
        generation=GenerationConfig(height=176, width=272, latent_frames_per_chunk=1, window_latent_frames=3,
                                    denoising_steps=1, cache_update="last_step"),
    ),
    # Public Wan2.1-T2V-1.3B DiT dimensions; audio replaces text in cross-attention.
    "wan-1.3b": ModelConfig(
        name="wan-1.3b",
        dit=DiTConfig(num_layers=30, dim=1536, num_heads=12, ffn_dim=8960, latent_channels=16, audio_dim=1024,
                      cross_dim=1536),
        vae=VAEConfig(latent_channels=16, base_channels=96, channel_mult=(1, 2, 4, 4), num_res_blocks=2,
                      encoder_base_channels=96),
        audio=_AUDIO,
        generation=GenerationConfig(height=480, width=832, latent_frames_per_chunk=3, window_latent_frames=6,
                                    denoising_steps=4, cache_update="extra_pass"),
    ),
    # ~57B parameters: 58 layers, dim 9216, 72 heads of 128, ffn 24576, audio cross-attention.
    "57b": ModelConfig(
        name="57b",
        dit=DiTConfig(num_layers=58, dim=9216, num_heads=72, ffn_dim=24576, latent_channels=16, audio_dim=1024,
                      cross_dim=1024),
        vae=VAEConfig(latent_channels=16, base_channels=96, channel_mult=(1, 2, 4, 4), num_res_blocks=2,
                      encoder_base_channels=96),
        audio=_AUDIO,
        generation=GenerationConfig(height=704, width=1088, latent_frames_per_chunk=1, window_latent_frames=3,
                                    denoising_steps=1, cache_update="last_step"),
    ),
}

TOPOLOGIES: dict[str, TopologyConfig] = {
    "cpu": TopologyConfig(name="cpu", dit_ranks=1, decoder_gpus=0),
    "gpu1": TopologyConfig(name="gpu1", dit_ranks=1, decoder_gpus=0),
    "b200x3": TopologyConfig(name="b200x3", dit_ranks=2, decoder_gpus=1, accelerator="B200"),
    "h100x4": TopologyConfig(name="h100x4", dit_ranks=3, decoder_gpus=1, accelerator="H100"),
    "h100x5": TopologyConfig(name="h100x5", dit_ranks=4, decoder_gpus=1, accelerator="H100"),
}


def explain(err: ValidationError | ValueError) -> str:
    """A config error as one readable line (pydantic's wrapping removed)."""
    if isinstance(err, ValidationError):
        return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in err.errors())
    return str(err)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """A model preset by name, with nested overrides, e.g. `generation={"cache_mode": "naive"}`."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"preset={name!r} is unknown; choose one of {sorted(MODEL_PRESETS)}")
    base = MODEL_PRESETS[name]
    return base if not overrides else ModelConfig.model_validate(_merge(base.model_dump(), overrides))


def topology(name: str) -> TopologyConfig:
    if name not in TOPOLOGIES:
        raise ValueError(f"topology={name!r} is unknown; choose one of {sorted(TOPOLOGIES)}")
    return TOPOLOGIES[name]


def session_config(preset: str = "tiny", topology: str | dict[str, Any] = "cpu", **fields: Any) -> SessionConfig:
    """Compose a session config from a preset name, a topology name and optional overrides.

    `model` in `fields` holds nested model overrides (`{"generation": {"cache_mode": "naive"}}`).
    """
    model = model_preset(preset, **fields.pop("model", {}))
    topo = TOPOLOGIES.get(topology) if isinstance(topology, str) else TopologyConfig.model_validate(topology)
    if topo is None:
        raise ValueError(f"topology={topology!r} is unknown; choose one of {sorted(TOPOLOGIES)}")
    return SessionConfig(model=model, topology=topo, **fields)
