"""Seeded random initialisation and safetensors checkpoints, whole or in per-rank shards.

Details: docs/dit.md (`characters.weights`)."""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from characters.config import ModelConfig, SessionConfig
from characters.dit import Block, CausalDiT
from characters.tp import ParallelLinear

M = TypeVar("M", bound=nn.Module)

SHIPPED = Path(__file__).parent / "weights"
RANDOM = "random"


def shipped_weights(model: ModelConfig) -> Path | None:
    """The directory of trained weights shipped for `model`'s preset, if there is one and it fits the model's
    shapes (a preset with architecture overrides has no shipped weights)."""
    directory = SHIPPED / model.name
    if not (directory / "model.json").is_file():
        return None
    try:
        check_model_config(model, directory)
    except ValueError:
        return None
    return directory


def resolve_weights(cfg: SessionConfig) -> Path | None:
    """The weights directory a session loads, or None for seeded random weights (see the module docstring)."""
    if cfg.weights is None:
        return shipped_weights(cfg.model)
    if cfg.weights == RANDOM:
        return None
    path = Path(cfg.weights)
    if not path.is_dir():
        raise FileNotFoundError(f"weights={cfg.weights!r} is not a directory; give a checkpoint directory "
                                f"(model.json, dit.safetensors, ...), {RANDOM!r}, or None for the preset's default")
    check_model_config(cfg.model, path)
    return path


def seeded_build(build: Callable[[], M], seed: int, device: torch.device | str = "cpu") -> M:
    """Build a replicated module with its own default initialisation, deterministic under `seed`,
    without touching the process's global random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build()
    return module.to(device)


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _logical(module: nn.Module, pname: str, param: torch.Tensor) -> tuple[tuple[int, ...], ParallelLinear | None]:
    if isinstance(module, ParallelLinear) and pname in ("weight", "bias"):
        return module.full_shape(pname), module  # type: ignore[arg-type]
    return tuple(param.shape), None


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, prefix: str = "", recurse: bool = True) -> nn.Module:
    """Materialise (from ``meta`` if needed) and initialise every parameter and buffer deterministically.

    Linear weights ~ N(0, 1/fan_in), biases 0, norm weights 1, modulation tables ~ N(0, 1/dim). `prefix`: the
    model's name inside a larger one (`'blocks.3.'`): its parameters draw the values they draw there, so a model
    materialised a part at a time (`materialize_dit`) equals one materialised whole. `recurse=False`: only the
    model's own parameters and buffers, not its children's (for a model on ``meta``: one already made moves whole).
    """
    tensors = [*model.parameters(recurse=recurse), *model.buffers(recurse=recurse)]
    modules = list(model.named_modules()) if recurse else [("", model)]
    if any(t.is_meta for t in tensors):
        model.to_empty(device=device or "cpu", recurse=recurse)
        for _, module in modules:  # to_empty leaves buffers uninitialised
            if any(True for _ in module.buffers(recurse=False)):
                _rebuild_buffers(module)
    elif device is not None:
        model.to(device)
    for mname, module in modules:
        for pname, param in module.named_parameters(recurse=False):
            name = prefix + (f"{mname}.{pname}" if mname else pname)
            shape, plinear = _logical(module, pname, param)
            g = _generator(seed, name, param.device)
            if pname == "bias":
                full = torch.zeros(shape, device=param.device)
            elif pname.endswith("norm") or (pname == "weight" and isinstance(module, nn.LayerNorm)):
                full = torch.ones(shape, device=param.device)
            elif "modulation" in pname:
                full = torch.randn(shape, generator=g, device=param.device) / math.sqrt(shape[-1])
            else:
                fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
                full = torch.randn(shape, generator=g, device=param.device) / math.sqrt(fan_in)
            local = plinear.shard_tensor(pname, full) if plinear is not None else full  # type: ignore[arg-type]
            param.copy_(local)
    if dtype is not None:
        model.to(dtype)
    return model


def _rebuild_buffers(module: nn.Module) -> None:
    rebuild = getattr(module, "rebuild_buffers", None)
    if rebuild is None:
        raise RuntimeError(f"{type(module).__name__} has buffers but no rebuild_buffers(); build it off meta")
    rebuild()


def save_weights(model: nn.Module, path: str | Path) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(path))


def load_weights(model: M, path: str | Path, *, strict: bool = True) -> M:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    device = next(model.parameters()).device
    state = load_file(str(path), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if strict and (missing or unexpected):
        raise ValueError(f"weights {path} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def shard_path(directory: str | Path, rank: int, ranks: int) -> Path:
    return Path(directory) / (f"dit-rank{rank}-of-{ranks}.safetensors" if ranks > 1 else "dit.safetensors")


class DiTCheckpoint:
    """Rank `rank` of `ranks`'s share of a DiT checkpoint, read one tensor at a time into the model a part at a time
    (`load_into`): its own shard file if the checkpoint has one, else its slices of the whole `dit.safetensors`
    (each `ParallelLinear` cuts its own rows or columns, on the host, before the tensor reaches the model's device:
    the whole file never sits in memory at once; 57b's is 115 GB in bf16). A model with layers kept whole
    (`topology.local_layers`) reads the whole file: a shard file holds 1/n of those layers. `close` refuses a
    checkpoint that did not fit: tensors missing, left over or of another shape, named. A context manager."""

    def __init__(self, directory: str | Path, rank: int, ranks: int, *, kept_whole: bool) -> None:
        path = shard_path(directory, rank, ranks)
        self.slices = not (ranks == 1 or (path.is_file() and not kept_whole))
        if self.slices:
            whole = Path(directory) / "dit.safetensors"
            if not whole.is_file():
                if kept_whole:
                    raise FileNotFoundError(
                        f"weights directory {directory} has no dit.safetensors: topology.local_layers keeps the MLP "
                        "and the audio cross-attention (with local_attention, self-attention too) whole on every "
                        f"rank, and {path.name} holds 1/{ranks} of them; give the whole checkpoint or set "
                        "topology.local_layers=false")
                raise FileNotFoundError(f"weights directory {directory} has neither {path.name} nor dit.safetensors")
            path = whole
        elif not path.is_file():
            raise FileNotFoundError(f"weights file {path} does not exist")
        self.path = path
        self._file = safe_open(str(path), framework="pt", device="cpu")
        self.names = set(self._file.keys())
        self.fp8 = any(k.endswith(".weight_scale") for k in self.names)  # FP8 linear weights (`to_fp8`)
        self._taken: set[str] = set()
        self._missing: list[str] = []
        self._wrong: dict[str, str] = {}  # name -> what was there against what the model has

    def __enter__(self) -> DiTCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file = None  # type: ignore[assignment]

    @torch.no_grad()
    def load_into(self, module: nn.Module, prefix: str = "", recurse: bool = True) -> None:
        """Copy the checkpoint's `prefix + name` into each of `module`'s parameters and persistent buffers `name`
        (`recurse=False`: only its own)."""
        targets = module.state_dict(keep_vars=True)  # name -> the module's own parameter or buffer
        modules = dict(module.named_modules())
        for local, target in targets.items():
            if not recurse and "." in local:
                continue
            name = prefix + local
            if name not in self.names:
                self._missing.append(name)
                continue
            tensor = self._file.get_tensor(name)
            mname, _, pname = local.rpartition(".")
            owner = modules.get(mname)
            if self.slices and isinstance(owner, ParallelLinear) and pname in ("weight", "bias", "weight_scale"):
                tensor = owner.shard_tensor(pname, tensor)  # type: ignore[arg-type]
            if tensor.shape != target.shape:
                self._wrong[name] = f"{name} {tuple(tensor.shape)} for {tuple(target.shape)}"
                continue
            target.data.copy_(tensor)
            self._taken.add(name)

    def close(self) -> None:
        """Refuse a checkpoint that did not fit what `load_into` was given (call once every part is loaded)."""
        unexpected = sorted(self.names - self._taken - self._wrong.keys())
        missing, wrong = sorted(self._missing), list(self._wrong.values())
        self._file = None  # type: ignore[assignment]
        if missing or unexpected or wrong:
            raise ValueError(f"weights {self.path} do not fit the model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]}, wrong shapes {wrong[:5]}")


def _kept_whole(model: nn.Module) -> bool:
    return any(isinstance(m, ParallelLinear) and m.kept_whole for m in model.modules())


@torch.no_grad()
def materialize_dit(dit: CausalDiT, seed: int, device: torch.device | str, *, weights: str | Path | None = None,
                    rank: int = 0, ranks: int = 1, fp8: bool = False) -> CausalDiT:
    """Materialise a DiT built on ``meta`` (and split by `apply_tensor_parallel`) on `device`, a part at a time: its
    own tensors, each module beside the blocks, then each block: seeded random weights (`init_weights`, the values
    the whole model draws), then the checkpoint's if `weights` (`DiTCheckpoint`, rank `rank` of `ranks`). With
    `fp8` each block is quantised (`Block.to_fp8_`; before loading an FP8 checkpoint into it, after loading a bf16
    one) before the next is made, so the build holds at most one block in the compute dtype beside the FP8 ones:
    57b's rank with the token-local layers whole needs 89 GB at once in bf16 at 3 ranks (44.4 B parameters; 115 GB
    with self-attention whole too), more than an H100 has, and 46-59 GB in FP8. Refuses an FP8 checkpoint when not
    `fp8`."""
    if not all(t.is_meta for t in [*dit.parameters(), *dit.buffers()]):
        raise ValueError("materialize_dit makes a DiT built on the meta device (`with torch.device('meta')`); this "
                         "one already holds tensors")
    with contextlib.ExitStack() as stack:
        ckpt = None
        if weights is not None:
            ckpt = stack.enter_context(DiTCheckpoint(weights, rank, ranks, kept_whole=_kept_whole(dit)))
            if ckpt.fp8 and not fp8:
                raise ValueError(f"weights={str(weights)!r} hold FP8 linear layers but model.precision='bf16'; set "
                                 "model.precision='fp8' or give bf16 weights")
        parts: list[tuple[nn.Module, str, bool]] = [(dit, "", False)]
        parts += [(child, f"{name}.", True) for name, child in dit.named_children() if name != "blocks"]
        parts += [(block, f"blocks.{i}.", True) for i, block in enumerate(dit.blocks)]
        for module, prefix, recurse in parts:
            init_weights(module, seed, device=device, prefix=prefix, recurse=recurse)
            block = module if fp8 and isinstance(module, Block) else None  # quantised here
            if block is not None and ckpt is not None and ckpt.fp8:
                block.to_fp8_()  # an FP8 checkpoint loads into the converted block as is
            if ckpt is not None:
                ckpt.load_into(module, prefix, recurse)
            if block is not None:
                block.to_fp8_()  # (a no-op when converted above)
        if ckpt is not None:
            ckpt.close()
    if fp8:
        dit.to_fp8()  # the elementwise steps in their quantising form (every block is converted)
    return dit


def save_dit_shards(full_model: nn.Module, directory: str | Path, ranks: int) -> list[Path]:
    """Split a whole (unsharded) DiT's state into `ranks` per-rank safetensors files."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    modules = dict(full_model.named_modules())
    paths = []
    for rank in range(ranks):
        state: dict[str, torch.Tensor] = {}
        for name, tensor in full_model.state_dict().items():
            mname, _, pname = name.rpartition(".")
            module = modules.get(mname)
            if isinstance(module, ParallelLinear) and ranks > 1:
                saved = module.tp_rank, module.tp_size
                module.tp_rank, module.tp_size = rank, ranks
                tensor = module.shard_tensor(pname, tensor)  # type: ignore[arg-type]
                module.tp_rank, module.tp_size = saved
            state[name] = tensor.detach().contiguous().cpu()
        path = shard_path(directory, rank, ranks)
        save_file(state, str(path))
        paths.append(path)
    return paths


def save_model_config(cfg: ModelConfig, directory: str | Path) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "model.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=1))


def check_model_config(cfg: ModelConfig, directory: str | Path) -> None:
    """Refuse weights made for another model shape (names the first differing field)."""
    path = Path(directory) / "model.json"
    if not path.is_file():
        return
    saved = ModelConfig.model_validate_json(path.read_text())
    for part in ("dit", "vae", "audio"):
        a, b = getattr(saved, part).model_dump(), getattr(cfg, part).model_dump()
        for key in a:
            if a[key] != b.get(key):
                raise ValueError(f"weights in {directory} were made for {part}.{key}={a[key]!r}, "
                                 f"but the config says {b.get(key)!r}; use matching weights or config")
