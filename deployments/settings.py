"""Environment variables (read here and nowhere else) and the service config of the runtime.

Every variable is declared once below with its type, default and meaning; `ServiceConfig.from_env()`
turns them into the one frozen config that the scheduler, its slots and its sessions share.

    CHARACTERS_PRESET                model preset served (tiny, wan-1.3b, 57b)
    CHARACTERS_TOPOLOGY              topology name (cpu, gpu1, b200x3, h100x4, h100x5)
    CHARACTERS_WARM_SLOTS            warm slots to keep (0 on the CPU default)
    CHARACTERS_QUEUE_MAX             requests that may wait for a bundle (0: refuse at once)
    CHARACTERS_QUEUE_TIMEOUT_S       how long a request may wait before it fails
    CHARACTERS_MAX_SESSIONS_PER_KEY  live sessions per API key (0: no limit)
    CHARACTERS_USE_GPUS              auto | true | false: GPU bundles, or CPU bundles of the same shape
    CHARACTERS_TRANSPORT             auto | accelerator | shm: how latents travel DiT -> decoder
    CHARACTERS_OUTPUT_DIR            where "file" outputs are written
    CHARACTERS_PLACEMENT_TIMEOUT_S   wait for a placement group before removing it
    CHARACTERS_WORKER_TIMEOUT_S      wait for a worker stage (load weights, warm up) before failing the slot
    GLOO_SOCKET_IFNAME               interface gloo binds for CPU tensor parallelism (lo: loopback only)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from characters.config import DType, SessionConfig, TopologyConfig, session_config
from deployments.types import SessionSpec

T = TypeVar("T")

Transport = Literal["auto", "accelerator", "shm"]
GraphMode = Literal["compiled", "actor_calls"]


def _parse_bool_or_auto(raw: str) -> bool | None:
    value = raw.strip().lower()
    if value == "auto":
        return None
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ValueError(f"expected auto, true or false, got {raw!r}")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: name, parser, default and what it means."""

    name: str
    parse: Callable[[str], T]
    default: T
    description: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as err:
            raise ValueError(
                f"environment variable {self.name}={raw!r} is invalid ({err}); {self.description}; "
                f"unset it for the default {self.default!r}"
            ) from err


PRESET = EnvVar("CHARACTERS_PRESET", str, "tiny", "model preset served")
TOPOLOGY = EnvVar("CHARACTERS_TOPOLOGY", str, "cpu", "topology name")
WARM_SLOTS = EnvVar("CHARACTERS_WARM_SLOTS", int, 0, "warm slots to keep, an integer >= 0")
QUEUE_MAX = EnvVar("CHARACTERS_QUEUE_MAX", int, 8, "requests that may wait for a bundle, an integer >= 0")
QUEUE_TIMEOUT_S = EnvVar("CHARACTERS_QUEUE_TIMEOUT_S", float, 30.0, "seconds a request may wait, > 0")
MAX_SESSIONS_PER_KEY = EnvVar("CHARACTERS_MAX_SESSIONS_PER_KEY", int, 0, "live sessions per API key, 0: no limit")
USE_GPUS = EnvVar("CHARACTERS_USE_GPUS", _parse_bool_or_auto, None, "auto, true or false")
TRANSPORT = EnvVar("CHARACTERS_TRANSPORT", str, "auto", "auto, accelerator or shm")
OUTPUT_DIR = EnvVar("CHARACTERS_OUTPUT_DIR", str, "out/sessions", "a directory for file outputs")
PLACEMENT_TIMEOUT_S = EnvVar("CHARACTERS_PLACEMENT_TIMEOUT_S", float, 30.0, "seconds to wait for a placement group")
WORKER_TIMEOUT_S = EnvVar("CHARACTERS_WORKER_TIMEOUT_S", float, 600.0, "seconds to wait for one worker stage")
GLOO_SOCKET_IFNAME = EnvVar("GLOO_SOCKET_IFNAME", str, "lo", "network interface for gloo (CPU tensor parallelism)")


class ServiceConfig(BaseModel):
    """What the scheduler serves and how: one model and topology, admission limits, the chunk graph."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str = Field(default="tiny", description="Model preset every session of this service runs.")
    topology: str | TopologyConfig = Field(default="cpu", description="Topology name, or a full topology.")
    model_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Nested model overrides on the preset, e.g. {'dit': {'num_layers': 1}} (tests, benchmarks).",
    )
    dtype: DType | None = Field(
        default=None, description="Compute dtype; None: bfloat16 on CUDA devices, float32 on CPU (per worker)."
    )
    weights: str | None = Field(default=None, description="Weights directory; None: seeded random weights.")
    weights_seed: int = Field(default=0, description="Seed of random weights (shared by every slot).")
    warm_slots: int = Field(default=0, ge=0, description="Warm slots kept across sessions (0 on the CPU default).")
    queue_max: int = Field(default=8, ge=0, description="Requests that may wait for a bundle; 0: refuse at once.")
    queue_timeout_s: float = Field(default=30.0, gt=0, description="Seconds a queued request waits before failing.")
    max_sessions_per_key: int = Field(default=0, ge=0, description="Live sessions per API key; 0: no limit.")
    use_gpus: bool | None = Field(
        default=None, description="GPU bundles (True) or CPU bundles (False); None: True iff the cluster has GPUs."
    )
    transport: Transport = Field(
        default="auto",
        description="Latent transport DiT -> decoder: accelerator (NCCL), shm (shared memory), or auto: "
        "accelerator when the workers run on CUDA and the decoder has its own GPU, else shm.",
    )
    graph: GraphMode = Field(
        default="compiled", description="compiled: a Ray Compiled Graph; actor_calls: plain actor calls (fallback)."
    )
    pipeline_depth: int = Field(
        default=2, ge=1, le=8, description="Chunks in flight: 2 lets the DiT make chunk k+1 while k is decoded."
    )
    output_dir: str = Field(default="out/sessions", description="Directory of 'file' outputs (relative paths).")
    placement_timeout_s: float = Field(default=30.0, gt=0, description="Wait for a placement group, then remove it.")
    worker_timeout_s: float = Field(default=600.0, gt=0, description="Wait for one worker stage before failing.")
    chunk_timeout_s: float = Field(default=30.0, gt=0, description="Wait for one chunk's result before failing.")
    teardown_timeout_s: int = Field(default=2, ge=1, description="Compiled-graph teardown timeout (seconds).")
    report_interval_s: float = Field(default=0.5, gt=0, description="How often a session reports stats and events.")
    events_max: int = Field(default=2000, ge=16, description="Events kept per session for long-polls.")
    ended_max: int = Field(default=1000, ge=0, description="Ended sessions kept for get/list.")
    tick_s: float = Field(default=0.25, gt=0, description="Scheduler housekeeping period (deadlines, node changes).")

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        self.session_config()  # preset, topology and overrides must compose
        return self

    @property
    def topology_config(self) -> TopologyConfig:
        return self.session_config().topology

    def session_config(self) -> SessionConfig:
        """The slot-level config every session of this service shares (weights seed, not noise seed)."""
        topo = self.topology if isinstance(self.topology, str) else self.topology.model_dump()
        return session_config(self.preset, topo, seed=self.weights_seed, dtype=self.dtype or "float32",
                              weights=self.weights, model=dict(self.model_overrides))

    def output_path(self, session_id: str, path: str | None) -> Path:
        """Where a 'file' output goes: `path` under output_dir (default `<session_id>.mp4`), never outside it."""
        root = Path(self.output_dir).resolve()
        target = (root / (path or f"{session_id}.mp4")).resolve()
        if root != target and root not in target.parents:
            raise ValueError(
                f"output path {path!r} resolves to {target}, outside output_dir={root}; "
                "give a path relative to the output directory"
            )
        return target

    def check_spec(self, spec: SessionSpec) -> None:
        """Raise a ValueError naming the field when this service cannot run `spec` as given."""
        g = self.session_config().model.generation
        if spec.preset != self.preset:
            raise ValueError(f"preset={spec.preset!r} is not served here; this service serves {self.preset!r}")
        if spec.image.shape != (g.height, g.width, 3) or spec.image.dtype.name != "uint8":
            raise ValueError(f"image is {spec.image.shape} {spec.image.dtype}, the preset needs "
                             f"({g.height}, {g.width}, 3) uint8; resize it with characters.media.load_image")
        if spec.max_duration_s <= 0:
            raise ValueError(f"max_duration_s={spec.max_duration_s} must be > 0")
        if spec.output.kind == "file":
            self.output_path(spec.session_id, spec.output.path)

    @classmethod
    def from_env(cls, **overrides: Any) -> ServiceConfig:
        """The config from CHARACTERS_* environment variables (see the module docstring), then `overrides`."""
        values: dict[str, Any] = {
            "preset": PRESET.get(), "topology": TOPOLOGY.get(), "warm_slots": WARM_SLOTS.get(),
            "queue_max": QUEUE_MAX.get(), "queue_timeout_s": QUEUE_TIMEOUT_S.get(),
            "max_sessions_per_key": MAX_SESSIONS_PER_KEY.get(), "use_gpus": USE_GPUS.get(),
            "transport": TRANSPORT.get(), "output_dir": OUTPUT_DIR.get(),
            "placement_timeout_s": PLACEMENT_TIMEOUT_S.get(), "worker_timeout_s": WORKER_TIMEOUT_S.get(),
        }
        values.update(overrides)
        return cls.model_validate(values)
