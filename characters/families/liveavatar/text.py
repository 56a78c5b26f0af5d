"""LiveAvatar's prompt encoder: the umT5-xxl encoder through `transformers` (`UMT5EncoderModel`), loaded from the
file the Wan2.2-S2V-14B snapshot ships (`models_t5_umt5-xxl-enc-bf16.pth`, the authors' own T5 module names)
with the snapshot's `google/umt5-xxl` tokenizer folder. Run once per avatar; the context is stored with it.

`encode(prompt)` is the authors' `T5EncoderModel.__call__` for one prompt: the text cleaned as their
`HuggingfaceTokenizer(clean="whitespace")` cleans it (ftfy, HTML unescaped twice, whitespace runs collapsed),
tokenized with `</s>`, truncated and padded to `text_len` (512), encoded with the padding masked, and only the
non-padded token states kept: (L, D), L <= text_len.

Their names -> transformers' (`their_names`; i = block):
    token_embedding.weight                  shared.weight (= encoder.embed_tokens.weight, tied)
    blocks.i.norm1.weight                   encoder.block.i.layer.0.layer_norm.weight
    blocks.i.attn.{q,k,v,o}.weight          encoder.block.i.layer.0.SelfAttention.{q,k,v,o}.weight
    blocks.i.pos_embedding.embedding.weight encoder.block.i.layer.0.SelfAttention.relative_attention_bias.weight
    blocks.i.norm2.weight                   encoder.block.i.layer.1.layer_norm.weight
    blocks.i.ffn.gate.0.weight              encoder.block.i.layer.1.DenseReluDense.wi_0.weight  (the GELU branch)
    blocks.i.ffn.fc1.weight                 encoder.block.i.layer.1.DenseReluDense.wi_1.weight  (the linear branch)
    blocks.i.ffn.fc2.weight                 encoder.block.i.layer.1.DenseReluDense.wo.weight
    norm.weight                             encoder.final_layer_norm.weight
The two compute the same function: RMS norms without bias, unscaled attention with a per-layer bucketed
relative-position bias (bidirectional, 32 buckets, max distance 128), tanh-GELU gated feed-forward.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

T5_CHECKPOINT = "models_t5_umt5-xxl-enc-bf16.pth"  # their s2v_14B.t5_checkpoint
T5_TOKENIZER = "google/umt5-xxl"  # their s2v_14B.t5_tokenizer

_BLOCK_NAMES = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
_TOP_NAMES = {"token_embedding.weight": "shared.weight", "norm.weight": "encoder.final_layer_norm.weight"}
_TIED = {"shared.weight": "encoder.embed_tokens.weight"}


class TextEncoderError(ValueError):
    """The umT5 file or tokenizer does not match the encoder (names the file and the tensor)."""


class LiveAvatarTextConfig(BaseModel):
    """umT5-xxl's encoder as the authors build it (`t5.py` `umt5_xxl(encoder_only=True)`, `text_len` 512)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(default=256384, ge=1, description="Token embedding rows (the tokenizer's ids fit below).")
    dim: int = Field(default=4096, ge=1, description="Model width D (the DiT's text_dim).")
    dim_attn: int = Field(default=4096, ge=1, description="Attention width (num_heads x head dim).")
    dim_ffn: int = Field(default=10240, ge=1, description="Gated feed-forward hidden width.")
    num_heads: int = Field(default=64, ge=1, description="Attention heads.")
    num_layers: int = Field(default=24, ge=1, description="Encoder blocks.")
    num_buckets: int = Field(default=32, ge=2, description="Relative-position buckets (per block: umT5).")
    max_distance: int = Field(default=128, ge=2, description="Relative distance past which buckets saturate.")
    eps: float = Field(default=1e-6, gt=0, description="RMS norm epsilon.")
    text_len: int = Field(default=512, ge=1, description="Tokens a prompt is truncated and padded to.")

    @model_validator(mode="after")
    def _check(self) -> LiveAvatarTextConfig:
        if self.dim_attn % self.num_heads:
            raise ValueError(f"liveavatar text.dim_attn={self.dim_attn} must split into num_heads={self.num_heads} "
                             "equal heads")
        return self

    def umt5(self) -> Any:
        """The same encoder as a transformers `UMT5Config` (inference: no dropout)."""
        from transformers import UMT5Config

        return UMT5Config(vocab_size=self.vocab_size, d_model=self.dim, d_kv=self.dim_attn // self.num_heads,
                          d_ff=self.dim_ffn, num_layers=self.num_layers, num_heads=self.num_heads,
                          relative_attention_num_buckets=self.num_buckets,
                          relative_attention_max_distance=self.max_distance, layer_norm_epsilon=self.eps,
                          feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False,
                          use_cache=False)


def their_names(num_layers: int) -> dict[str, str]:
    """Every state-dict name of their encoder with `num_layers` blocks -> transformers' name (`encoder.embed_tokens`
    is tied to `shared` and so has no entry of its own)."""
    names = dict(_TOP_NAMES)
    for i in range(num_layers):
        names |= {f"blocks.{i}.{theirs}": f"encoder.block.{i}.{ours}" for theirs, ours in _BLOCK_NAMES.items()}
    return names


def map_state_dict(theirs: dict[str, torch.Tensor], expected: dict[str, torch.Size], num_layers: int, source: str,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Their tensors under transformers' names, each checked against `expected` (name -> shape) and cast to
    `dtype`; refuses, naming `source` and the tensor, anything unknown, missing, misshapen or not a float."""
    names = their_names(num_layers)
    covered = set(names.values()) | set(_TIED.values())
    if covered != set(expected):  # the mapping itself against this transformers version
        raise TextEncoderError(f"umT5 key mapping does not cover transformers' UMT5EncoderModel: "
                               f"{sorted(covered ^ set(expected))[:5]}; transformers must be the pinned version")
    unknown = sorted(set(theirs) - set(names))
    if unknown:
        raise TextEncoderError(f"{source}: tensors the umT5 encoder does not have: {unknown[:5]} ({len(unknown)} "
                               f"in all); is this {T5_CHECKPOINT}, with {num_layers} blocks?")
    missing = sorted(set(names) - set(theirs))
    if missing:
        raise TextEncoderError(f"{source}: tensors missing: {missing[:5]} ({len(missing)} in all); is this "
                               f"{T5_CHECKPOINT}, with {num_layers} blocks?")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in theirs.items():
        ours = names[name]
        if tuple(tensor.shape) != tuple(expected[ours]):
            raise TextEncoderError(f"{source}: tensor {name!r} ({ours}) has shape {tuple(tensor.shape)}, the encoder "
                                   f"expects {tuple(expected[ours])}; check the config against the file")
        if not tensor.is_floating_point():
            raise TextEncoderError(f"{source}: tensor {name!r} is {tensor.dtype}, not a float tensor")
        out[ours] = tensor.to(dtype)
    for name, tied in _TIED.items():
        out[tied] = out[name]
    return out


def clean_prompt(text: str) -> str:
    """Their `HuggingfaceTokenizer._clean` with clean="whitespace": `whitespace_clean(basic_clean(text))`."""
    try:
        import ftfy
        import regex
    except ImportError as err:
        raise ImportError("LiveAvatar's prompt cleaning needs ftfy and regex: pip install "
                          "'realtime-characters[liveavatar]'") from err
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return str(regex.sub(r"\s+", " ", text)).strip()


class PromptEncoder:
    """umT5's encoder for prompts: `encode(prompt) -> (L, dim)`, as the authors' T5EncoderModel computes it."""

    def __init__(self, checkpoint: Path | str, tokenizer_dir: Path | str,
                 config: LiveAvatarTextConfig | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16) -> None:
        try:
            from transformers import AutoTokenizer, UMT5EncoderModel
        except ImportError as err:
            raise ImportError("LiveAvatar's text encoder needs transformers: pip install "
                              "'realtime-characters[liveavatar]'") from err
        self.config = config or LiveAvatarTextConfig()
        checkpoint, tokenizer_dir = Path(checkpoint), Path(tokenizer_dir)
        if not checkpoint.is_file():
            raise TextEncoderError(f"{checkpoint}: no such file; the Wan2.2-S2V-14B snapshot has {T5_CHECKPOINT} "
                                   "at its top level (`characters weights fetch liveavatar`)")
        if not tokenizer_dir.is_dir():
            raise TextEncoderError(f"{tokenizer_dir}: no such folder; the snapshot has the tokenizer in "
                                   f"{T5_TOKENIZER}/")
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        if len(self.tokenizer) > self.config.vocab_size:
            raise TextEncoderError(f"{tokenizer_dir}: the tokenizer has {len(self.tokenizer)} ids, the encoder's "
                                   f"embedding {self.config.vocab_size} rows; is this umT5's tokenizer?")
        with torch.device("meta"):
            model: Any = UMT5EncoderModel(self.config.umt5())
        expected = {k: v.shape for k, v in model.state_dict().items()}
        try:
            theirs = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
        except (RuntimeError, OSError, EOFError) as err:
            raise TextEncoderError(f"{checkpoint}: not a torch state dict ({err})") from err
        if not isinstance(theirs, dict):
            raise TextEncoderError(f"{checkpoint}: holds a {type(theirs).__name__}, not a state dict")
        state = map_state_dict(theirs, expected, self.config.num_layers, checkpoint.name, dtype)
        model.load_state_dict(state, strict=True, assign=True)
        self.model: torch.nn.Module = model.to(device).eval().requires_grad_(False)
        self.device, self.dtype = torch.device(device), dtype

    @classmethod
    def from_snapshot(cls, root: Path | str, **kwargs: Any) -> PromptEncoder:
        """From the Wan2.2-S2V-14B snapshot folder as the hub serves it."""
        root = Path(root)
        return cls(root / T5_CHECKPOINT, root / T5_TOKENIZER, **kwargs)

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, text_len) ids and attention mask, as their tokenizer wrapper makes them."""
        batch = self.tokenizer([clean_prompt(prompt)], return_tensors="pt", padding="max_length", truncation=True,
                               max_length=self.config.text_len, add_special_tokens=True)
        return batch.input_ids, batch.attention_mask

    @torch.no_grad()
    def encode(self, prompt: str) -> torch.Tensor:
        """(L, dim) in the encoder's dtype: the states of the prompt's L non-padded tokens."""
        ids, mask = self.tokenize(prompt)  # (1, text_len)
        states = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        return states[0, :int(mask.sum())]  # (L, dim)
