"""Golden outputs of LiveAvatar's two encoders from the authors' own code: the parity oracle of
``characters/families/liveavatar/text.py`` (umT5) and ``speech.py`` (wav2vec2), issue 41.

    PYTHONPATH=/tmp/lasite .venv/bin/python scripts/liveavatar/golden_encoders.py --authors /tmp/la \\
        --out tests/fixtures/liveavatar

writes, under ``--out``:

- ``tiny_umt5/``: a snapshot-shaped folder for a tiny umT5 encoder: ``models_t5_umt5-xxl-enc-bf16.pth``
  (deterministic synthetic weights in THEIR key layout, bfloat16 as the published file) and the tokenizer
  folder ``google/umt5-xxl/`` (a Unigram SentencePiece-style tokenizer trained here on a few sentences, with
  umT5's special ids: pad 0, eos 1, unk 2, and ``</s>`` appended);
- ``golden_text.json`` / ``golden_text.safetensors``: the prompts, what their tokenizer wrapper made of them
  (cleaned text, ids) and what their ``T5EncoderModel`` returned (the non-padded token states), float32;
  plus every key of the full-size umT5-xxl encoder (their module names, shapes) for the mapping test;
- ``tiny_wav2vec2/``: a tiny ``Wav2Vec2ForCTC`` saved as the hub folder is (config, weights, preprocessor,
  CTC tokenizer vocabulary), random weights by seed;
- ``golden_audio.json`` / ``golden_audio.safetensors``: a synthetic 16 kHz waveform and what their
  ``AudioEncoder`` made of it through the causal pipeline's ``encode_audio`` (all hidden states at 30 Hz,
  then ``get_audio_embed_bucket_fps(fps=25, batch_frames=48, m=0)``, permuted to (1, La, Da, frames)).

Their code is imported from ``--authors`` unmodified. Environment-level adaptations (also recorded in the
manifests under ``adaptations``):

1. Package ``__init__`` files are bypassed (``liveavatar``, ``liveavatar.models``, ``...wan``, ``...wan_2_2``,
   ``...modules``, ``...modules.s2v`` registered as empty packages whose ``__path__`` is the real directory):
   those files import the DiT, VAE and pipelines, which the encoders do not use.
2. ``t5.py`` evaluates ``torch.cuda.current_device()`` as a default argument when it is imported; on a machine
   without CUDA that raises, so it returns ``"cpu"`` while (only while) the module is imported.
3. ``T5EncoderModel`` always builds ``umt5_xxl``; ``t5.umt5_xxl`` is wrapped so that the tiny dimensions are
   passed to it as keyword overrides (its own ``cfg.update(**kwargs)``); everything else of the class runs as
   theirs (``torch.load`` of the .pth, strict ``load_state_dict``, their tokenizer wrapper and ``__call__``).
   It runs on the CPU twice: in float32 and in bfloat16 (their config's ``t5_dtype``).
4. ``librosa`` (imported by ``audio_encoder.py``, used only for ``librosa.load``) is a stub module whose
   ``load(path, sr=16000)`` returns the registered float32 waveform for ``path`` at 16 kHz (no resampling: the
   waveform is made at 16 kHz, any other ``sr`` is refused). Their ``extract_audio_feat`` (the path the
   causal pipeline takes) then runs unmodified; ``extract_audio_feat_from_array`` is not used because it
   casts the input to bfloat16 whatever the model's dtype (a float32 model then refuses it).
5. The pipeline's ``encode_audio`` (causal_s2v_pipeline.py L443-456: ``extract_audio_feat(...,
   return_all_layers=True)``, ``get_audio_embed_bucket_fps(z, fps=self.fps (25), batch_frames=infer_frames
   (48), m=self.audio_sample_m (0))``, unsqueeze + permute(0, 2, 3, 1)) is replicated line by line, driving
   their ``AudioEncoder`` object on the CPU, once with the model in float32 and once moved to bfloat16 as the
   pipeline moves it (L763, ``param_dtype``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from authors import AUTHORS_COMMIT, BYPASSED_PACKAGES, provenance, register_packages

T5_CHECKPOINT = "models_t5_umt5-xxl-enc-bf16.pth"  # wan_s2v_14B_modified.py: s2v_14B.t5_checkpoint
T5_TOKENIZER = "google/umt5-xxl"  # s2v_14B.t5_tokenizer
TEXT_LEN = 512  # shared_config.py: text_len
# The tiny umT5 (their umt5_xxl keyword names): dim_attn != dim so a transposed q/o cannot pass the shape check.
TINY_T5 = {"vocab_size": 256, "dim": 32, "dim_attn": 48, "dim_ffn": 80, "num_heads": 4, "encoder_layers": 2,
           "decoder_layers": 2, "num_buckets": 32}
XXL_T5 = {"vocab": 256384, "dim": 4096, "dim_attn": 4096, "dim_ffn": 10240, "num_heads": 64, "num_layers": 24,
          "num_buckets": 32, "shared_pos": False}  # t5.py umt5_xxl, encoder_only
FPS, INFER_FRAMES, AUDIO_SAMPLE_M = 25, 48, 0  # sample_fps; infinite_inference_*.sh --infer_frames; pipeline L194
SAMPLE_RATE = 16000
TOKENIZER_CORPUS = [
    "A young woman with short black hair talks to the camera in a bright studio and smiles.",
    "The man speaks slowly, nodding his head; his hands rest on the wooden table.",
    "A close-up of a person's face in natural light, soft shadows, a calm and friendly voice.",
    "She laughs, raises her eyebrows and looks to the left, then back at the viewer.",
]
PROMPTS = [
    "A young woman with short black hair talks to the camera in a bright studio, smiling.",
    # ftfy (mojibake, curly quotes), html.unescape twice, whitespace runs, leading/trailing space
    "  The man&amp;amp;his dog\t\n walk   \u201cslowly\u201d \u2014 it&#39;s \u00c3\u00a9t\u00c3\u00a9 "
    "&amp;lt;b&amp;gt; ",
    "",  # the shortest context: </s> alone
    "一位年轻女子对着镜头说话，背景是明亮的工作室。",
    " ".join(["The character talks and nods, the light is warm and steady."] * 60),  # truncated at TEXT_LEN
]


# ----------------------------------------------------------------------------------------------- import


class _Librosa(types.ModuleType):
    """``librosa`` as far as their ``extract_audio_feat`` uses it: ``load(path, sr)`` of a registered array."""

    def __init__(self) -> None:
        super().__init__("librosa")
        self.arrays: dict[str, np.ndarray] = {}

    def load(self, path: str, sr: int = 22050) -> tuple[np.ndarray, int]:
        if sr != SAMPLE_RATE:
            raise ValueError(f"librosa stub: sr={sr}; the registered waveforms are {SAMPLE_RATE} Hz")
        return self.arrays[str(path)], sr


@contextlib.contextmanager
def cuda_device_is_cpu() -> Iterator[None]:
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


def import_authors(root: Path) -> dict[str, types.ModuleType]:
    """Their t5.py and audio_encoder.py, imported from ``root`` without the packages' ``__init__`` files."""
    register_packages(root)
    import transformers  # noqa: F401 (before the stub: transformers probes librosa's import spec at import)

    sys.modules["librosa"] = _Librosa()
    with cuda_device_is_cpu():
        t5 = importlib.import_module("liveavatar.models.wan.wan_2_2.modules.t5")
    audio = importlib.import_module("liveavatar.models.wan.wan_2_2.modules.s2v.audio_encoder")
    return {"t5": t5, "audio": audio}


# ------------------------------------------------------------------------------------------------- text


def build_tokenizer(folder: Path) -> None:
    """A Unigram tokenizer with umT5's special ids and pipeline (NFKC, space runs, Metaspace "▁", ``</s>``
    appended), its vocabulary built deterministically: the specials, "▁", every printable ASCII character, then
    "▁word" for the corpus words (scores rank longer pieces first); saved as the hub's T5 tokenizer folder is."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    words = sorted({w for line in TOKENIZER_CORPUS for w in re.findall(r"[A-Za-z']+", line)})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(chr(c), -8.0) for c in range(33, 127)]
    vocab += [(f"▁{w}", -3.0 - 0.01 * i) for i, w in enumerate(words)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    if len(vocab) > TINY_T5["vocab_size"]:
        raise RuntimeError(f"tiny tokenizer: {len(vocab)} pieces > vocab_size {TINY_T5['vocab_size']}")
    fast = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)
    fast.save_pretrained(str(folder))


def synthetic_t5(keys: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """Weights in their layout: embeddings N(0, 1), linears N(0, fan_in^-1/2), norms 1 + N(0, 0.2) (not ones,
    so swapped norms show), relative-position tables N(0, 0.5); bfloat16 as the published file."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(keys.items()):
        x = torch.randn(shape, generator=g)
        if "norm" in name:
            x = 1 + 0.2 * x
        elif "pos_embedding" in name:
            x = 0.5 * x
        elif name != "token_embedding.weight":
            x = x * shape[1] ** -0.5
        out[name] = x.to(torch.bfloat16)
    return out


def make_text(mods: dict[str, types.ModuleType], args: argparse.Namespace) -> tuple[dict, dict[str, torch.Tensor]]:
    t5 = mods["t5"]
    snapshot = args.out / "tiny_umt5"
    (snapshot / T5_TOKENIZER).mkdir(parents=True, exist_ok=True)
    build_tokenizer(snapshot / T5_TOKENIZER)
    with torch.device("meta"):
        full = t5.T5Encoder(**XXL_T5)
        tiny = t5.T5Encoder(vocab=TINY_T5["vocab_size"], num_layers=TINY_T5["encoder_layers"], shared_pos=False,
                            **{k: v for k, v in TINY_T5.items() if k not in ("vocab_size", "encoder_layers",
                                                                           "decoder_layers")})
    full_keys = {k: list(v.shape) for k, v in full.state_dict().items()}
    state = synthetic_t5({k: v.shape for k, v in tiny.state_dict().items()}, args.weight_seed)
    torch.save(state, snapshot / T5_CHECKPOINT)

    t5.umt5_xxl = functools.partial(t5.umt5_xxl, **TINY_T5)
    encoders = {dtype: t5.T5EncoderModel(text_len=TEXT_LEN, dtype=dtype, device=torch.device("cpu"),
                                         checkpoint_path=str(snapshot / T5_CHECKPOINT),
                                         tokenizer_path=str(snapshot / T5_TOKENIZER))
                for dtype in (torch.float32, torch.bfloat16)}  # bfloat16: their config's t5_dtype
    encoder = encoders[torch.float32]
    tensors: dict[str, torch.Tensor] = {}
    prompts = []
    for i, prompt in enumerate(PROMPTS):
        ids, mask = encoder.tokenizer([prompt], return_mask=True, add_special_tokens=True)
        with torch.no_grad():
            context = encoder([prompt], torch.device("cpu"))  # encode_prompt: a list of (L, dim)
            context_bf16 = encoders[torch.bfloat16]([prompt], torch.device("cpu"))
        n = int(mask.sum())
        tensors[f"context_{i}"] = context[0].float().contiguous()
        tensors[f"context_bf16_{i}"] = context_bf16[0].contiguous()
        tensors[f"ids_{i}"] = ids[0, :n].contiguous()
        prompts.append({"prompt": prompt, "cleaned": encoder.tokenizer._clean(prompt), "tokens": n,
                        "padded_to": int(ids.shape[1])})
    manifest = {
        "adaptations": [
            f"package __init__ bypassed: {', '.join(BYPASSED_PACKAGES)} (registered with their real __path__)",
            "torch.cuda.current_device() -> 'cpu' while t5.py is imported (a default argument of T5EncoderModel)",
            f"t5.umt5_xxl wrapped with keyword overrides {TINY_T5}; T5EncoderModel otherwise theirs",
            "T5EncoderModel(dtype=torch.float32, device=cpu) for context_*, dtype=torch.bfloat16 for context_bf16_*",
        ],
        "checkpoint": f"tiny_umt5/{T5_CHECKPOINT}",
        "tokenizer": f"tiny_umt5/{T5_TOKENIZER}",
        "config": TINY_T5 | {"text_len": TEXT_LEN},
        "weight_seed": args.weight_seed,
        "prompts": prompts,
        "full_size_keys": full_keys,
    }
    return manifest, tensors


# ------------------------------------------------------------------------------------------------ audio


def build_wav2vec2(folder: Path, seed: int) -> None:
    """A tiny Wav2Vec2ForCTC with the structure of wav2vec2-large-xlsr-53-english (stable layer norm, layer-
    normed feature extractor, the same 7 convolutions and so the same 50 Hz rate), saved as its hub folder."""
    from transformers import (
        Wav2Vec2Config,
        Wav2Vec2CTCTokenizer,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2ForCTC,
        Wav2Vec2Processor,
    )

    folder.mkdir(parents=True, exist_ok=True)
    letters = list("ABCDEFGHIJKLMNOPQRSTUVWXYZ'")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4} | {c: 5 + i for i, c in enumerate(letters)}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    config = Wav2Vec2Config(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16,) * 7, conv_kernel=(10, 3, 3, 3, 3, 2, 2), conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_bias=True,
        feat_extract_norm="layer", do_stable_layer_norm=True, num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, pad_token_id=0, ctc_loss_reduction="mean")
    torch.manual_seed(seed)
    model = Wav2Vec2ForCTC(config).eval()
    with torch.no_grad():  # HF's init leaves norms at one and biases at zero: make every tensor count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder), safe_serialization=True)
    extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0,
                                         do_normalize=True, return_attention_mask=True)
    tokenizer = Wav2Vec2CTCTokenizer(str(folder / "vocab.json"), unk_token="<unk>", pad_token="<pad>",
                                     word_delimiter_token="|")
    Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(str(folder))


def waveform(seconds: float, seed: int) -> np.ndarray:
    """Speech-like test audio: a gliding harmonic tone under a syllable-rate envelope, plus noise, 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.3 * envelope * voice + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def make_audio(mods: dict[str, types.ModuleType], args: argparse.Namespace) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = args.out / "tiny_wav2vec2"
    build_wav2vec2(folder, args.weight_seed)
    pcm = waveform(args.audio_seconds, args.input_seed)
    sys.modules["librosa"].arrays["speech.wav"] = pcm  # type: ignore[attr-defined]
    encoder = mods["audio"].AudioEncoder(device="cpu", model_id=str(folder))

    def encode_audio() -> tuple[torch.Tensor, torch.Tensor, int]:  # causal_s2v_pipeline.py L443-456
        with torch.no_grad():
            z = encoder.extract_audio_feat("speech.wav", return_all_layers=True)
            bucket, num_repeat = encoder.get_audio_embed_bucket_fps(z, fps=FPS, batch_frames=INFER_FRAMES,
                                                                     m=AUDIO_SAMPLE_M)
        bucket = bucket.unsqueeze(0)
        bucket = bucket.permute(0, 2, 1) if bucket.ndim == 3 else bucket.permute(0, 2, 3, 1)
        return z, bucket, num_repeat

    z, bucket, num_repeat = encode_audio()
    encoder.model.to(dtype=torch.bfloat16)  # as the pipeline does before encode_audio (L763, param_dtype)
    z_bf16, bucket_bf16, _ = encode_audio()
    manifest = {
        "adaptations": [
            f"package __init__ bypassed: {', '.join(BYPASSED_PACKAGES)} (registered with their real __path__)",
            "librosa stub: load(path, sr=16000) returns the registered 16 kHz float32 waveform",
            "causal_s2v_pipeline.encode_audio replicated (L443-456) on their AudioEncoder on the CPU: the model in "
            "float32 for hidden30/audio_emb, moved to bfloat16 (L763) for hidden30_bf16/audio_emb_bf16",
        ],
        "model": "tiny_wav2vec2",
        "weight_seed": args.weight_seed,
        "input_seed": args.input_seed,
        "seconds": args.audio_seconds,
        "fps": FPS, "batch_frames": INFER_FRAMES, "m": AUDIO_SAMPLE_M,
        "num_repeat": int(num_repeat),
        "shapes": {"hidden30": list(z.shape), "audio_emb": list(bucket.shape)},
    }
    tensors = {"pcm": torch.from_numpy(pcm), "hidden30": z.float().contiguous(),
               "audio_emb": bucket.float().contiguous(), "hidden30_bf16": z_bf16.float().contiguous(),
               "audio_emb_bf16": bucket_bf16.float().contiguous()}
    return manifest, tensors


# ------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--authors", type=Path, required=True, help="checkout of Alibaba-Quark/LiveAvatar")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--weight-seed", type=int, default=0)
    p.add_argument("--input-seed", type=int, default=1)
    p.add_argument("--audio-seconds", type=float, default=3.3, help="waveform length (3.3 s: 2 clips, zero tail)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    mods = import_authors(args.authors.resolve())
    import transformers

    common: dict[str, Any] = provenance(args.authors, AUTHORS_COMMIT, torch=torch.__version__,
                                        transformers=transformers.__version__)
    for name, make in (("text", make_text), ("audio", make_audio)):
        manifest, tensors = make(mods, args)
        save_file(tensors, str(args.out / f"golden_{name}.safetensors"))
        (args.out / f"golden_{name}.json").write_text(json.dumps(common | manifest, indent=1) + "\n")
        print(name, {k: list(v.shape) for k, v in tensors.items()})


if __name__ == "__main__":
    main()
