"""LiveAvatar's published files, read as the model hub serves them, into our transformer.

Base model (`Wan-AI/Wan2.2-S2V-14B`): the transformer as diffusers shards (`diffusion_pytorch_model-*.safetensors`
named by `diffusion_pytorch_model.safetensors.index.json`), beside the VAE, umT5 and wav2vec2 files. The LoRA
(`Quark-Vision/Live-Avatar`, rank 128, alpha 64 on every q, k, v, o, ffn.0 and ffn.2 linear) is merged at load,
W + (alpha / rank) B A, as the authors' PEFT merge does. Our parameter names are the authors', so the mapping
is the identity; every tensor is checked by name and shape, and anything missing, extra or mismatched is refused
naming the file and the tensor. The LoRA file is read as their loader reads it: `.default` adapter keys merge,
other model tensors in it replace the base's, adapter keys without an adapter name are ignored (with a warning).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

INDEX = "diffusion_pytorch_model.safetensors.index.json"
SINGLE = "diffusion_pytorch_model.safetensors"
LORA_FILE = "liveavatar.safetensors"
LORA_RANK = 128
LORA_ALPHA = 64.0
LORA_TARGETS = ("q", "k", "v", "o", "ffn.0", "ffn.2")

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A published file is missing or does not match the model (names the file and the tensor)."""


def shard_map(root: Path) -> dict[str, Path]:
    """tensor name -> shard file, from the index (or the single-file layout)."""
    index = root / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map): {err}") from err
        files = {name: root / fname for name, fname in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.exists()})
        if missing:
            raise CheckpointError(f"{index} names shard files that are not there: {missing[:3]}; "
                                  "download the whole snapshot (`characters weights fetch liveavatar`)")
        return files
    single = root / SINGLE
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has keys(), not iteration)
    raise CheckpointError(f"{root}: neither {INDEX} nor {SINGLE}; is this the Wan2.2-S2V-14B snapshot folder?")


def _tensors(files: dict[str, Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in sorted(by_file.items()):
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{path.name}: the index places tensor {name!r} here but the file lacks it")
                yield name, path, f.get_tensor(name)


def read_lora(path: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor], list[str]]:
    """A LoRA file read as the authors' loader reads it (PEFT `load_state_dict(strict=False)` after prefixing
    `base_model.model.`, then `merge_and_unload`): returns (module -> (A (r, in), B (out, r)) for keys named
    `<module>.lora_{A,B}.default.weight`, plain tensors that overwrite base weights, keys PEFT would ignore)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
            name = key.removeprefix("base_model.model.")
            part = next((p for p in ("lora_A", "lora_B") if f".{p}." in name), None)
            if part is None:
                plain[name] = f.get_tensor(key)
            elif name.endswith(f".{part}.default.weight"):
                pairs.setdefault(name.split(f".{part}.")[0], {})[part] = f.get_tensor(key)
            else:
                ignored.append(key)  # no adapter name: PEFT's strict=False load drops it
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise CheckpointError(f"{path.name}: module {module!r} has only {sorted(ab)}; a LoRA needs A and B")
        out[module] = (ab["lora_A"], ab["lora_B"])
    return out, plain, ignored


def load_liveavatar(model: nn.Module, root: Path | str, lora: Path | str | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Fill `model` (the whole transformer, on any device) from the snapshot folder `root` and merge `lora`."""
    root = Path(root)
    expected = model.state_dict()
    files = shard_map(root)
    extra = sorted(set(files) - set(expected))
    if extra:
        raise CheckpointError(f"{root.name}: tensors the model does not have: {extra[:5]} ({len(extra)} in all); "
                              "is this Wan2.2-S2V-14B?")
    missing = sorted(set(expected) - set(files))
    if missing:
        raise CheckpointError(f"{root.name}: tensors missing from the checkpoint: {missing[:5]} "
                              f"({len(missing)} in all)")
    merges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    overrides: dict[str, torch.Tensor] = {}
    if lora is not None:
        merges, overrides, ignored = read_lora(Path(lora))
        if ignored:
            log.warning("%s: %d LoRA keys carry no adapter name (e.g. %s); the authors' loader ignores them and "
                        "so do we", Path(lora).name, len(ignored), ignored[0])
        unknown = sorted(m for m in merges if f"{m}.weight" not in expected)
        unknown += sorted(n for n in overrides if n not in expected)
        if unknown:
            raise CheckpointError(f"{Path(lora).name}: tensors for modules the model does not have: {unknown[:5]}")
    seen = 0
    with torch.no_grad():
        for name, path, tensor in _tensors(files):
            target = expected[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                                      f"expects {tuple(target.shape)}")
            if not tensor.is_floating_point():
                raise CheckpointError(f"{path.name}: tensor {name!r} is {tensor.dtype}, not a float tensor")
            value = overrides.pop(name, tensor).float()
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(f"{Path(lora or '').name}: tensor {name!r} has shape {tuple(value.shape)}, the "
                                      f"model expects {tuple(target.shape)}")
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in merges:
                a, b = merges.pop(module)
                if a.shape != (a.shape[0], value.shape[1]) or b.shape != (value.shape[0], a.shape[0]):
                    raise CheckpointError(f"LoRA for {module!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                                          f"the weight {tuple(value.shape)}")
                value = value + (LORA_ALPHA / a.shape[0]) * (b.float() @ a.float())
            target.copy_(value)
            seen += 1
    if merges:
        raise CheckpointError(f"LoRA modules left unmerged: {sorted(merges)[:5]}")
    model.to(dtype)
    model.casual_audio_encoder.float()
