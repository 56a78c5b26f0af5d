"""Environment variables (read here and nowhere else) and the service config of the runtime.

Every variable is declared once below with its type, default and meaning; `ServiceConfig.from_env()`
turns them into the one frozen config that the scheduler, its slots and its sessions share.

    CHARACTERS_PRESET                model preset served (tiny, wan-1.3b, 57b)
    CHARACTERS_TOPOLOGY              topology name (cpu, gpu1, b200x3, h100x4, h100x5)
    CHARACTERS_PRECISION             the DiT's linear layers: bf16 (default) or fp8 (GPUs of compute capability >= 8.9)
    CHARACTERS_WARM_SLOTS            warm slots to keep (0 on the CPU default)
    CHARACTERS_QUEUE_MAX             requests that may wait for a bundle (0: refuse at once)
    CHARACTERS_QUEUE_TIMEOUT_S       how long a request may wait before it fails
    CHARACTERS_MAX_SESSIONS_PER_KEY  live sessions per API key (0: no limit)
    CHARACTERS_USE_GPUS              auto | true | false: GPU bundles, or CPU bundles of the same shape
    CHARACTERS_TRANSPORT             auto | accelerator | shm: how latents travel DiT -> decoder
    CHARACTERS_OUTPUT_DIR            where "file" outputs are written
    CHARACTERS_PLACEMENT_TIMEOUT_S   wait for a placement group before removing it
    CHARACTERS_WORKER_TIMEOUT_S      wait for a worker stage (load weights, warm up) before failing the slot
    CHARACTERS_DATA_DIR              directory of the embedded SQLite database (avatars, sessions, usage); created
                                     on first run; `characters serve` defaults it to ~/.local/share/characters
    CHARACTERS_DATABASE_URL          the service's database by URL instead (postgresql+psycopg://...; never logged)
    GLOO_SOCKET_IFNAME               interface gloo binds for CPU tensor parallelism (lo: loopback only)
    CHARACTERS_REALTIME_NICE         nice value the chunk path's workers ask for (DiT, decoder, room, session actor;
                                     default -10; below 0 needs CAP_SYS_NICE, else they keep Ray's worker niceness)

Request limits (defaults of `deployments.api.requests.ApiConfig`; the app args' `api:` section overrides them;
docs/security.md has the table):

    CHARACTERS_MAX_BODY_BYTES        largest HTTP request body (413 body_too_large)
    CHARACTERS_MAX_IMAGE_BYTES       largest reference image file, decoded from base64 (413 image_too_large)
    CHARACTERS_MAX_IMAGE_PIXELS      largest reference image width x height (413 image_too_large)
    CHARACTERS_MAX_AUDIO_CHUNK_BYTES largest PCM payload of one audio message (422 invalid_field pcm)
    CHARACTERS_MAX_DURATION_S        largest maxDuration a request may ask for (422 invalid_field maxDuration)
    CHARACTERS_CORS_ORIGINS          comma-separated origins allowed by CORS (empty: CORS off, the default)

LiveKit server of the watch page (`deployments.api.watch`; `characters serve --livekit-dev` sets them):

    CHARACTERS_LIVEKIT_URL           ws(s)://host[:port] the watch page's sessions publish to; empty: page off
    CHARACTERS_LIVEKIT_PUBLIC_URL    the same server as browsers reach it (empty: CHARACTERS_LIVEKIT_URL)
    CHARACTERS_LIVEKIT_API_KEY       API key of that server (mints the character's and viewers' tokens)
    CHARACTERS_LIVEKIT_API_SECRET    its secret (never logged)
    CHARACTERS_LIVEKIT_DEV           true: it is `characters serve --livekit-dev`'s (GET /v1/livekit shows its
                                     public development secret)

Telemetry (`TelemetryConfig.from_env()`; OFF unless an OTLP endpoint or exporter is set; docs/operations.md):

    OTEL_SDK_DISABLED                true: no telemetry at all, whatever else is set
    OTEL_SERVICE_NAME                service.name of every process (default realtime-characters)
    OTEL_RESOURCE_ATTRIBUTES         extra resource attributes, k=v,k2=v2 (e.g. k8s.pod.name)
    OTEL_EXPORTER_OTLP_ENDPOINT      collector base URL, e.g. http://otel-collector:4317; set: telemetry on
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_METRICS_ENDPOINT   per-signal URL, used as is
    OTEL_EXPORTER_OTLP_PROTOCOL      grpc | http/protobuf
    OTEL_EXPORTER_OTLP_HEADERS       k=v,k2=v2 sent with every export (vendor auth: never logged)
    OTEL_EXPORTER_OTLP_TIMEOUT       export timeout, milliseconds
    OTEL_TRACES_EXPORTER             otlp | none (unset: otlp iff an endpoint is set)
    OTEL_METRICS_EXPORTER            otlp | none (unset: otlp iff an endpoint is set)
    OTEL_TRACES_SAMPLER              always_on | always_off | traceidratio | parentbased_always_on |
                                     parentbased_always_off | parentbased_traceidratio
    OTEL_TRACES_SAMPLER_ARG          the ratio of the *traceidratio samplers, 0..1
    OTEL_BSP_SCHEDULE_DELAY          span batch export period, milliseconds
    OTEL_BSP_MAX_QUEUE_SIZE          spans held for export per process (beyond: dropped, never blocking)
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE   spans per export request
    OTEL_METRIC_EXPORT_INTERVAL      metric export period, milliseconds
    OTEL_METRIC_EXPORT_TIMEOUT       metric export timeout, milliseconds
    CHARACTERS_TRACE_CHUNKS_FIRST    chunk spans kept at a session's start (every chunk up to this many)
    CHARACTERS_TRACE_CHUNKS_EVERY    then one chunk span every N chunks (0: none)
    CHARACTERS_TRACE_LATE_PER_MIN    late chunks traced per session and minute, beyond the above
    CHARACTERS_RAY_METRICS           true: also record the metrics with ray.util.metrics (Ray's Prometheus port)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, model_validator

from characters.chunk_policy import ChunkPathConfig
from characters.config import DType, SessionConfig, TopologyConfig, session_config
from deployments.types import SessionSpec

T = TypeVar("T")

Transport = Literal["auto", "accelerator", "shm"]
GraphMode = Literal["auto", "compiled", "actor_calls"]


def _parse_bool_or_auto(raw: str) -> bool | None:
    value = raw.strip().lower()
    if value == "auto":
        return None
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ValueError(f"expected auto, true or false, got {raw!r}")


def _parse_bool(raw: str) -> bool:
    value = _parse_bool_or_auto(raw)
    if value is None:
        raise ValueError(f"expected true or false, got {raw!r}")
    return value


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
PRECISION = EnvVar("CHARACTERS_PRECISION", str, "bf16", "the DiT's linear layers: bf16 or fp8 (GPU bundles only)")
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
REALTIME_NICE = EnvVar("CHARACTERS_REALTIME_NICE", int, -10, "the chunk path's workers' nice value, -20..19")
MiB = 1024 * 1024
MAX_BODY_BYTES = EnvVar("CHARACTERS_MAX_BODY_BYTES", int, 16 * MiB, "bytes, an integer >= 1024")
MAX_IMAGE_BYTES = EnvVar("CHARACTERS_MAX_IMAGE_BYTES", int, 10 * MiB, "bytes, an integer >= 1")
MAX_IMAGE_PIXELS = EnvVar("CHARACTERS_MAX_IMAGE_PIXELS", int, 4096 * 4096, "pixels, an integer >= 256")
MAX_AUDIO_CHUNK_BYTES = EnvVar("CHARACTERS_MAX_AUDIO_CHUNK_BYTES", int, 1 * MiB, "bytes, an integer >= 2")
MAX_DURATION_S = EnvVar("CHARACTERS_MAX_DURATION_S", float, 3600.0, "seconds, > 0")
CORS_ORIGINS: EnvVar[tuple[str, ...]] = EnvVar(
    "CHARACTERS_CORS_ORIGINS", lambda raw: tuple(o.strip() for o in raw.split(",") if o.strip()), (),
    "comma-separated origins, e.g. https://app.example.com")
LIVEKIT_URL = EnvVar("CHARACTERS_LIVEKIT_URL", str, "", "the LiveKit server of watch-page sessions, ws(s)://host[:port]")
LIVEKIT_PUBLIC_URL = EnvVar("CHARACTERS_LIVEKIT_PUBLIC_URL", str, "", "that server's URL as browsers reach it")
LIVEKIT_API_KEY = EnvVar("CHARACTERS_LIVEKIT_API_KEY", str, "", "the LiveKit server's API key")
LIVEKIT_API_SECRET = EnvVar("CHARACTERS_LIVEKIT_API_SECRET", str, "", "the LiveKit server's API secret")
LIVEKIT_DEV = EnvVar("CHARACTERS_LIVEKIT_DEV", _parse_bool, False, "true: that server is `characters serve "
                     "--livekit-dev`'s, whose public development secret GET /v1/livekit may show")


def _parse_pairs(raw: str) -> dict[str, str]:
    """`k=v,k2=v2` (W3C baggage-like, values URL-encoded) -> a dict."""
    out = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected key=value pairs separated by commas, got an item {item.split('=')[0]!r}=...")
        out[unquote(key.strip())] = unquote(value.strip())
    return out


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return value

    return parse


def _non_negative(parse: Callable[[str], T]) -> Callable[[str], T]:
    def check(raw: str) -> T:
        value = parse(raw)
        if value < 0:  # type: ignore[operator]
            raise ValueError("must be >= 0")
        return value

    return check


SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")
OTEL_SDK_DISABLED = EnvVar("OTEL_SDK_DISABLED", _parse_bool, False, "true or false")
OTEL_SERVICE_NAME = EnvVar("OTEL_SERVICE_NAME", str, "realtime-characters", "the service.name resource attribute")
OTEL_RESOURCE_ATTRIBUTES: EnvVar[dict[str, str]] = EnvVar("OTEL_RESOURCE_ATTRIBUTES", _parse_pairs, {},
                                                          "resource attributes, k=v,k2=v2")
OTEL_ENDPOINT = EnvVar("OTEL_EXPORTER_OTLP_ENDPOINT", str, "", "the collector's URL, e.g. http://127.0.0.1:4317")
OTEL_TRACES_ENDPOINT = EnvVar("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", str, "", "the URL traces are sent to")
OTEL_METRICS_ENDPOINT = EnvVar("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", str, "", "the URL metrics are sent to")
OTEL_PROTOCOL = EnvVar("OTEL_EXPORTER_OTLP_PROTOCOL", _choice("grpc", "http/protobuf"), "grpc",
                       "grpc or http/protobuf")
OTEL_HEADERS: EnvVar[dict[str, str]] = EnvVar("OTEL_EXPORTER_OTLP_HEADERS", _parse_pairs, {},
                                              "export headers, k=v,k2=v2")
OTEL_TIMEOUT_MS = EnvVar("OTEL_EXPORTER_OTLP_TIMEOUT", _non_negative(int), 10000, "milliseconds, an integer >= 0")
OTEL_TRACES_EXPORTER = EnvVar("OTEL_TRACES_EXPORTER", _choice("otlp", "none"), "", "otlp or none")
OTEL_METRICS_EXPORTER = EnvVar("OTEL_METRICS_EXPORTER", _choice("otlp", "none"), "", "otlp or none")
OTEL_SAMPLER = EnvVar("OTEL_TRACES_SAMPLER", _choice(*SAMPLERS), "parentbased_always_on", ", ".join(SAMPLERS))
OTEL_SAMPLER_ARG = EnvVar("OTEL_TRACES_SAMPLER_ARG", _non_negative(float), 1.0, "a ratio in [0, 1]")
OTEL_BSP_SCHEDULE_DELAY_MS = EnvVar("OTEL_BSP_SCHEDULE_DELAY", _non_negative(int), 5000, "milliseconds, >= 0")
OTEL_BSP_MAX_QUEUE_SIZE = EnvVar("OTEL_BSP_MAX_QUEUE_SIZE", _non_negative(int), 2048, "spans, an integer > 0")
OTEL_BSP_MAX_EXPORT_BATCH_SIZE = EnvVar("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _non_negative(int), 512,
                                        "spans, an integer > 0 and <= OTEL_BSP_MAX_QUEUE_SIZE")
OTEL_METRIC_EXPORT_INTERVAL_MS = EnvVar("OTEL_METRIC_EXPORT_INTERVAL", _non_negative(int), 60000,
                                        "milliseconds, an integer > 0")
OTEL_METRIC_EXPORT_TIMEOUT_MS = EnvVar("OTEL_METRIC_EXPORT_TIMEOUT", _non_negative(int), 30000,
                                       "milliseconds, an integer > 0")
TRACE_CHUNKS_FIRST = EnvVar("CHARACTERS_TRACE_CHUNKS_FIRST", _non_negative(int), 24, "chunks, an integer >= 0")
TRACE_CHUNKS_EVERY = EnvVar("CHARACTERS_TRACE_CHUNKS_EVERY", _non_negative(int), 60, "chunks, an integer >= 0")
TRACE_LATE_PER_MIN = EnvVar("CHARACTERS_TRACE_LATE_PER_MIN", _non_negative(int), 30, "chunks, an integer >= 0")
RAY_METRICS = EnvVar("CHARACTERS_RAY_METRICS", _parse_bool, False, "true or false")
DATA_DIR = EnvVar("CHARACTERS_DATA_DIR", str, "", "the directory of the embedded SQLite database (created on first "
                  "run); empty, and no CHARACTERS_DATABASE_URL: in memory, nothing outlives the process")
DATABASE_URL = EnvVar("CHARACTERS_DATABASE_URL", str, "", "the service's database as an SQLAlchemy URL, e.g. "
                      "postgresql+psycopg://user:password@host:5432/characters; it overrides CHARACTERS_DATA_DIR")


# the chunk path's former flat keys of ServiceConfig -> (ChunkPathConfig field, former units per new unit)
DEPRECATED_CHUNK_KEYS: dict[str, tuple[str, float]] = {
    "pipeline_depth": ("depth", 1), "jitter_buffer_chunks": ("jitter_buffer_chunks", 1),
    "jitter_min_slack_ms": ("min_slack_s", 1000), "run_ahead_chunks": ("run_ahead_chunks", 1),
    "onset_slack_ms": ("onset_slack_s", 1000), "onset_first_frame": ("onset_first_frame", 1),
    "preempt_idle": ("preempt_idle", 1), "audio_lead_ms": ("audio_lead_s", 1000), "pacing": ("pacing", 1),
    "chunk_timeout_s": ("chunk_timeout_s", 1),
}


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
    precision: Literal["bf16", "fp8"] = Field(
        default="bf16", description="The DiT's linear layers: bf16, or fp8 (e4m3 weights per output channel, "
        "activations per token; GPUs of compute capability >= 8.9, GPU bundles only). docs/fp8.md.")
    attention_precision: Literal["bf16", "fp8"] = Field(
        default="bf16", description="Attention over the KV cache: bf16 (cuDNN), or fp8 (K/V cached in e4m3, a "
        "Triton kernel; measured slower on the H200: docs/fp8.md).")
    weights: str | None = Field(
        default=None, description="Weights directory; None: the preset's shipped weights if any, else seeded random; "
        "'random': seeded random weights.")
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
        default="auto",
        description="compiled: a Ray Compiled Graph; actor_calls: plain actor calls; auto: compiled when the workers "
        "run on CUDA, actor_calls on CPUs, where each graph actor spins a core while it waits for its input "
        "(Ray 2.60's shared-memory channels poll with sched_yield).",
    )
    chunk_path: ChunkPathConfig = Field(
        default_factory=ChunkPathConfig, description="The real-time chunk path: chunks in flight, run-ahead, speech "
        "onsets, preemption, the output's jitter buffer (characters.chunk_policy).")
    realtime_nice: int | None = Field(
        default=-10, ge=-20, le=19, description="Nice value of the chunk path's workers (DiT ranks, decoder, room, "
        "session actor), asked of the OS for every thread of theirs: real-time work beside a voice agent, a LiveKit "
        "server and a viewer on the same cores. Below 0 needs CAP_SYS_NICE (root in most containers); refused, they "
        "keep Ray's worker niceness (0 on a cluster `deployments.sessions.cluster` starts). None: leave it.")
    output_dir: str = Field(default="out/sessions", description="Directory of 'file' outputs (relative paths).")
    placement_timeout_s: float = Field(default=30.0, gt=0, description="Wait for a placement group, then remove it.")
    worker_timeout_s: float = Field(default=600.0, gt=0, description="Wait for one worker stage before failing.")
    teardown_timeout_s: int = Field(default=2, ge=1, description="Compiled-graph teardown timeout (seconds).")
    report_interval_s: float = Field(default=0.5, gt=0, description="How often a session reports stats and events.")
    events_max: int = Field(default=2000, ge=16, description="Events kept per session for long-polls.")
    ended_max: int = Field(default=1000, ge=0, description="Ended sessions kept for get/list.")
    tick_s: float = Field(default=0.25, gt=0, description="Scheduler housekeeping period (deadlines, node changes).")
    data_dir: str = Field(default="", description="Directory of the embedded SQLite database (avatars, session "
                          "records, usage), created on first run; empty with no database_url: in memory only.")
    database_url: str = Field(default="", repr=False, description="SQLAlchemy URL of the service's database "
                              "(postgresql+psycopg://...); overrides data_dir. May hold a password: never logged.")

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, data: Any) -> Any:
        """The chunk path's former flat keys (e.g. `jitter_min_slack_ms: 200`) go into `chunk_path`, converted to
        its units, with a DeprecationWarning: accepted for one release."""
        if not isinstance(data, dict) or not DEPRECATED_CHUNK_KEYS.keys() & data.keys():
            return data
        data, moved, said = dict(data), {}, []
        for old in sorted(DEPRECATED_CHUNK_KEYS.keys() & data.keys()):
            new, scale = DEPRECATED_CHUNK_KEYS[old]
            value = data.pop(old)
            moved[new] = value / scale if scale != 1 and value is not None else value
            said.append(f"{old} is deprecated; set chunk_path.{new}{' (seconds)' if scale != 1 else ''} instead")
        warnings.warn(f"ServiceConfig: {'; '.join(said)}", DeprecationWarning, stacklevel=2)
        path = data.get("chunk_path") or {}
        base = path.model_dump() if isinstance(path, ChunkPathConfig) else dict(path)
        data["chunk_path"] = {**base, **moved}
        return data

    def __getattr__(self, name: str) -> Any:
        """The deprecated flat keys read through to `chunk_path`, in their former units (one release)."""
        if name in DEPRECATED_CHUNK_KEYS:
            new, scale = DEPRECATED_CHUNK_KEYS[name]
            value = getattr(self.chunk_path, new)
            return value * scale if scale != 1 and value is not None else value
        return super().__getattr__(name)  # type: ignore[misc]

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        for field in ("precision", "attention_precision"):
            if getattr(self, field) == "fp8" and self.use_gpus is False:
                raise ValueError(f"{field}='fp8' needs GPU bundles and use_gpus={self.use_gpus}: FP8 runs only on "
                                 "GPUs of compute capability >= 8.9; set use_gpus to true (or auto on a GPU cluster) "
                                 f"or {field}='bf16'")
        self.session_config()  # preset, topology, precision and overrides must compose
        return self

    @property
    def topology_config(self) -> TopologyConfig:
        return self.session_config().topology

    def session_config(self) -> SessionConfig:
        """The slot-level config every session of this service shares (weights seed, not noise seed)."""
        topo = self.topology if isinstance(self.topology, str) else self.topology.model_dump()
        model = {"precision": self.precision, "attention_precision": self.attention_precision, **self.model_overrides}
        return session_config(self.preset, topo, seed=self.weights_seed, dtype=self.dtype or "float32",
                              weights=self.weights, model=model)

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
            "preset": PRESET.get(), "topology": TOPOLOGY.get(), "precision": PRECISION.get(),
            "warm_slots": WARM_SLOTS.get(),
            "queue_max": QUEUE_MAX.get(), "queue_timeout_s": QUEUE_TIMEOUT_S.get(),
            "max_sessions_per_key": MAX_SESSIONS_PER_KEY.get(), "use_gpus": USE_GPUS.get(),
            "transport": TRANSPORT.get(), "output_dir": OUTPUT_DIR.get(),
            "placement_timeout_s": PLACEMENT_TIMEOUT_S.get(), "worker_timeout_s": WORKER_TIMEOUT_S.get(),
            "realtime_nice": REALTIME_NICE.get(), "data_dir": DATA_DIR.get(), "database_url": DATABASE_URL.get(),
        }
        values.update(overrides)
        return cls.model_validate(values)


def _signal_endpoint(exporter: str, specific: str, base: str, protocol: str, path: str) -> str:
    """Where one signal goes, by the OTel rules; "" when the signal is off (the default)."""
    if exporter == "none":
        return ""
    if specific:
        return specific
    if not base and exporter != "otlp":
        return ""  # nothing asked for telemetry
    if protocol == "http/protobuf":
        return (base or "http://localhost:4318").rstrip("/") + path
    return base or "http://localhost:4317"


class TelemetryConfig(BaseModel):
    """OpenTelemetry export of one process (every Ray actor builds its own from its environment)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    service_name: str = Field(default="realtime-characters", description="service.name of every span and metric.")
    resource: dict[str, str] = Field(default_factory=dict, description="Extra resource attributes.")
    traces_endpoint: str = Field(default="", description="OTLP URL of traces; empty: no traces (no-op tracer).")
    metrics_endpoint: str = Field(default="", description="OTLP URL of metrics; empty: no OTLP metrics.")
    protocol: Literal["grpc", "http/protobuf"] = Field(default="grpc", description="OTLP transport.")
    headers: dict[str, str] = Field(default_factory=dict, repr=False, description="Headers of every export.")
    timeout_s: float = Field(default=10.0, ge=0, description="Timeout of one export request.")
    sampler: str = Field(default="parentbased_always_on", description="Head sampler (OTEL_TRACES_SAMPLER).")
    sampler_arg: float = Field(default=1.0, ge=0, le=1, description="Ratio of the traceidratio samplers.")
    bsp_schedule_delay_ms: int = Field(default=5000, ge=1, description="Span batch export period.")
    bsp_max_queue_size: int = Field(default=2048, ge=1, description="Spans queued per process; beyond: dropped.")
    bsp_max_export_batch_size: int = Field(default=512, ge=1, description="Spans per export request.")
    metric_export_interval_ms: int = Field(default=60000, ge=1, description="Metric export period.")
    metric_export_timeout_ms: int = Field(default=30000, ge=1, description="Metric export timeout.")
    trace_chunks_first: int = Field(default=24, ge=0, description="Chunk spans kept at a session's start.")
    trace_chunks_every: int = Field(default=60, ge=0, description="Then one chunk span every N chunks; 0: none.")
    trace_late_per_min: int = Field(default=30, ge=0, description="Late chunks traced per session and minute.")
    ray_metrics: bool = Field(default=False, description="Also record metrics with ray.util.metrics.")

    @model_validator(mode="after")
    def _check(self) -> TelemetryConfig:
        if self.bsp_max_export_batch_size > self.bsp_max_queue_size:
            raise ValueError(f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE={self.bsp_max_export_batch_size} exceeds "
                             f"OTEL_BSP_MAX_QUEUE_SIZE={self.bsp_max_queue_size}; lower the batch or raise the queue")
        return self

    @property
    def traces(self) -> bool:
        return bool(self.traces_endpoint)

    @property
    def metrics(self) -> bool:
        return bool(self.metrics_endpoint) or self.ray_metrics

    @property
    def enabled(self) -> bool:
        return self.traces or self.metrics

    @classmethod
    def from_env(cls, **overrides: Any) -> TelemetryConfig:
        """The config from the OTEL_* / CHARACTERS_TRACE_* variables (module docstring), then `overrides`."""
        if OTEL_SDK_DISABLED.get():
            return cls.model_validate(overrides)
        protocol, base = OTEL_PROTOCOL.get(), OTEL_ENDPOINT.get()
        values: dict[str, Any] = {
            "service_name": OTEL_SERVICE_NAME.get(), "resource": OTEL_RESOURCE_ATTRIBUTES.get(),
            "traces_endpoint": _signal_endpoint(OTEL_TRACES_EXPORTER.get(), OTEL_TRACES_ENDPOINT.get(), base,
                                                protocol, "/v1/traces"),
            "metrics_endpoint": _signal_endpoint(OTEL_METRICS_EXPORTER.get(), OTEL_METRICS_ENDPOINT.get(), base,
                                                 protocol, "/v1/metrics"),
            "protocol": protocol, "headers": OTEL_HEADERS.get(), "timeout_s": OTEL_TIMEOUT_MS.get() / 1000,
            "sampler": OTEL_SAMPLER.get(), "sampler_arg": OTEL_SAMPLER_ARG.get(),
            "bsp_schedule_delay_ms": OTEL_BSP_SCHEDULE_DELAY_MS.get(),
            "bsp_max_queue_size": OTEL_BSP_MAX_QUEUE_SIZE.get(),
            "bsp_max_export_batch_size": OTEL_BSP_MAX_EXPORT_BATCH_SIZE.get(),
            "metric_export_interval_ms": OTEL_METRIC_EXPORT_INTERVAL_MS.get(),
            "metric_export_timeout_ms": OTEL_METRIC_EXPORT_TIMEOUT_MS.get(),
            "trace_chunks_first": TRACE_CHUNKS_FIRST.get(), "trace_chunks_every": TRACE_CHUNKS_EVERY.get(),
            "trace_late_per_min": TRACE_LATE_PER_MIN.get(), "ray_metrics": RAY_METRICS.get(),
        }
        values.update(overrides)
        return cls.model_validate(values)
