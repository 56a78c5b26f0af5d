"""Every span name, attribute key and metric of the service: the one place they are spelled (STYLE 19).

Attribute values are identifiers, counts, durations and machine-readable codes only: never image
data, audio, tokens, API keys, LiveKit credentials or URLs with query strings (docs/operations.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from characters.stage_times import CHUNK_STAGES

# ------------------------------------------------------------------------------------------ spans

HTTP_SERVER = "{method} {route}"  # OTel HTTP semantic conventions: e.g. "POST /v1/sessions"
GRPC_SERVER = "characters.v1.Characters/{method}"  # OTel RPC semantic conventions
SESSION = "session"  # the scheduler's record of one session: create -> end, whatever the end (the request's child)
SESSION_END_REQUEST = "session.end_request"  # a DELETE (or END) reached the scheduler; linked to the request's trace
ADMISSION = "scheduler.admission"  # request arrives at the scheduler -> it holds a slot (queue wait)
SLOT_BUILD = "slot.build"  # root of a slot's own trace: placement, actors, worker stages
SLOT_PLACEMENT = "slot.placement"  # placement group asked -> ready
SLOT_ACTORS = "slot.start_actors"  # worker actors created -> every init_device returned (process start, imports)
WORKER_STAGES = ("init_device", "init_process_group", "load_weights", "warm_up")
WORKER_STAGE = {s: f"worker.{s}" for s in WORKER_STAGES}  # in each worker's own process
SESSION_START = "session.start"  # session actor run() -> first chunk published
SESSION_PREPARE = "session.prepare"  # reference encoded, every worker started, room open
SESSION_COMPILE = "session.compile"  # the chunk graph compiled
SESSION_END = "session.end"  # stop noticed -> pipeline torn down, output closed (summary attributes)
CHUNK = "chunk"  # one chunk: submitted -> published (sampled: see deployments.telemetry.session)
CHUNK_STAGE = {s: f"chunk.{s}" for s in CHUNK_STAGES}  # dit, cache_write, handoff, decode, publish
NODE_CHANGE = {k: f"cluster.node_{k}" for k in ("joined", "draining", "lost")}  # the scheduler saw a node change


def http_span_name(method: str, route: str) -> str:
    return HTTP_SERVER.format(method=method, route=route)


def grpc_span_name(method: str) -> str:
    return GRPC_SERVER.format(method=method)


# ------------------------------------------------------------------------------------------ attributes

# OpenTelemetry semantic conventions (HTTP, RPC, errors)
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS = "rpc.grpc.status_code"
ERROR_TYPE = "error.type"

# resource
COMPONENT = "characters.component"  # ingress | scheduler | session | dit | decoder | room | bench

# the service's own
SESSION_ID = "characters.session.id"
PRESET = "characters.preset"
OUTPUT_KIND = "characters.output.kind"  # null | file | livekit (never the room URL or token)
SLOT_ID = "characters.slot.id"
SLOT_PURPOSE = "characters.slot.purpose"  # cold (built for one session) | warm (for the pool)
NODE_ID = "characters.node.id"
PLACEMENT_BUNDLES = "characters.placement.bundles"
PLACEMENT_STRATEGY = "characters.placement.strategy"
DEVICE = "characters.device"  # cpu | cuda
WORKER_ROLE = "characters.worker.role"  # dit | decoder
WORKER_RANK = "characters.worker.rank"
STAGE = "characters.stage"  # a worker stage or a chunk stage
TIMING_SOURCE = "characters.timing.source"  # host (timers) | cuda (events read later)
ADMISSION_DECISION = "characters.admission.decision"  # warm | cold | queued | rejected | expired | ended
ADMISSION_QUEUE_POSITION = "characters.admission.queue_position"
ADMISSION_WAIT_S = "characters.admission.wait_s"
WARM_START = "characters.session.warm_start"
SESSION_STATUS = "characters.session.status"  # a SessionStatus value
END_REASON = "characters.session.end_reason"  # machine-readable code: deleted, max_duration, actor_died, ...
TENANT = "characters.tenant"  # the API key id that made the session (never the key); "-" with keys off
SESSION_CHUNKS = "characters.session.chunks"
SESSION_LATE_CHUNKS = "characters.session.late_chunks"
SESSION_DURATION_S = "characters.session.duration_s"
PHASE_S = "characters.session.{phase}_s"  # start-up phases: wait_actor_s, prepare_s, compile_s
CHUNK_INDEX = "characters.chunk.index"
CHUNK_LATE = "characters.chunk.late"
CHUNK_LATENESS_S = "characters.chunk.lateness_s"
CHUNK_LATENCY_S = "characters.chunk.latency_s"
CHUNK_SAMPLED_BY = "characters.chunk.sampled_by"  # first | every | late
DELIVERED_FPS = "characters.playout.delivered_fps"
BUFFER_S = "characters.playout.buffer_s"
AV_OFFSET_S = "characters.playout.av_offset_s"
SLOT_STATE = "characters.slot.state"  # warming | free | leased | draining (placement.WarmPool)
NODE_CHANGE_KIND = "characters.node.change"  # joined | draining | lost
NODE_STATE = "characters.node.state"  # live | draining | lost (deployments.sessions.membership)
NODE_SEEN_BY = "characters.node.seen_by"  # gcs (its node table) | probe (the scheduler's raylet health check)
NODE_DETAIL = "characters.node.detail"  # e.g. "stopped answering (2 health checks of its raylet failed in a row)"
NODE_GPUS = "characters.node.gpus"
NODE_SLOTS = "characters.node.slots"  # the scheduler's slots on the node when it changed
NODE_SESSIONS = "characters.node.sessions"  # its sessions there that the change failed (lost) or left running


def phase_key(phase: str) -> str:
    return PHASE_S.format(phase=phase.removesuffix("_s"))


# ------------------------------------------------------------------------------------------ metrics

Kind = Literal["histogram", "counter", "gauge"]

STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.14, 0.1667, 0.2, 0.25, 0.3, 0.5,
                  1.0, 2.5)
WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its OTel name and unit, and its name in Prometheus (the collector's translation;
    Ray's endpoint adds a `ray_` prefix)."""

    name: str
    kind: Kind
    unit: str
    description: str
    prometheus: str
    attributes: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


CHUNK_STAGE_DURATION = MetricSpec(
    "characters.chunk.stage.duration", "histogram", "s", "Time of one chunk stage (dit, cache_write, handoff, "
    "decode, publish), host timers or CUDA events", "characters_chunk_stage_duration_seconds",
    (STAGE, TIMING_SOURCE), STEP_BUCKETS_S)
CHUNK_LATENCY = MetricSpec(
    "characters.chunk.latency", "histogram", "s", "Chunk submitted -> published by the room",
    "characters_chunk_latency_seconds", (), STEP_BUCKETS_S)
CHUNKS = MetricSpec("characters.chunks", "counter", "{chunk}", "Chunks published", "characters_chunks_total")
LATE_CHUNKS = MetricSpec("characters.chunks.late", "counter", "{chunk}", "Chunks that arrived after their playout "
                         "time (a visible freeze)", "characters_chunks_late_total")
SESSION_FPS = MetricSpec("characters.session.delivered_fps", "gauge", "", "Delivered frames per second of a "
                         "live session (24 when nothing is late)", "characters_session_delivered_fps", (SESSION_ID,))
SESSION_BUFFER = MetricSpec("characters.session.jitter_buffer", "gauge", "s", "Media queued ahead of playout when "
                            "the last chunk arrived", "characters_session_jitter_buffer_seconds", (SESSION_ID,))
SESSION_AV_OFFSET = MetricSpec("characters.session.av_offset", "gauge", "s", "Video minus audio play time "
                               "(positive: video behind)", "characters_session_av_offset_seconds", (SESSION_ID,))
ADMISSION_WAIT = MetricSpec(
    "characters.admission.wait", "histogram", "s", "Request at the scheduler -> slot held (or refused/expired)",
    "characters_admission_wait_seconds", (ADMISSION_DECISION,), WAIT_BUCKETS_S)
QUEUE_LENGTH = MetricSpec("characters.admission.queue_length", "gauge", "{request}", "Requests waiting for a "
                          "bundle", "characters_admission_queue_length")
BUNDLES_FREE = MetricSpec("characters.bundles.free", "gauge", "{bundle}", "Whole session bundles free in the "
                          "cluster", "characters_bundles_free")
BUNDLES_USED = MetricSpec("characters.bundles.used", "gauge", "{bundle}", "Bundles held by slots (warm or busy)",
                          "characters_bundles_used")
SESSIONS = MetricSpec("characters.sessions", "gauge", "{session}", "Known sessions by status",
                      "characters_sessions", (SESSION_STATUS,))
SLOTS = MetricSpec("characters.slots", "gauge", "{slot}", "Slots by state", "characters_slots", (SLOT_STATE,))
LEAKED_PGS = MetricSpec("characters.placement_groups.leaked", "gauge", "{group}", "Slot placement groups alive in "
                        "Ray that the scheduler does not hold", "characters_placement_groups_leaked")
SESSIONS_ENDED = MetricSpec("characters.sessions.ended", "counter", "{session}", "Sessions that reached ENDED or "
                            "FAILED, by reason code", "characters_sessions_ended_total",
                            (SESSION_STATUS, END_REASON))
USAGE_STREAMED = MetricSpec("characters.usage.streamed", "counter", "s", "Seconds streamed (first chunk out -> end) "
                            "by ended sessions, by tenant and preset", "characters_usage_streamed_seconds_total",
                            (TENANT, PRESET))
USAGE_GPU = MetricSpec("characters.usage.gpu_time", "counter", "s", "GPU-seconds held (slot given -> end, times the "
                       "bundle's GPUs) by ended sessions, by tenant and preset", "characters_usage_gpu_seconds_total",
                       (TENANT, PRESET))
USAGE_STARTED = MetricSpec("characters.usage.sessions_started", "counter", "{session}", "Ended sessions that put out "
                           "a first chunk, by tenant and preset", "characters_usage_sessions_started_total",
                           (TENANT, PRESET))
NODES = MetricSpec("characters.nodes", "gauge", "{node}", "Nodes as the scheduler sees them, by state (live: "
                   "slots may be built there)", "characters_nodes", (NODE_STATE,))
NODE_CHANGES = MetricSpec("characters.node.changes", "counter", "{change}", "Nodes that joined, started draining "
                          "or were lost, by who saw it first", "characters_node_changes_total",
                          (NODE_CHANGE_KIND, NODE_SEEN_BY))
NODE_SESSIONS_LOST = MetricSpec("characters.node.sessions_lost", "counter", "{session}", "Sessions whose node "
                                "was lost under them (each FAILED or recovering)",
                                "characters_node_sessions_lost_total")
AUTOSCALER_DEMAND = MetricSpec("characters.autoscaler.demand", "gauge", "{bundle}", "Session bundles the scheduler "
                               "asks the autoscaler to fit (live slots + queued requests; request_resources)",
                               "characters_autoscaler_demand")
WORKER_STAGE_DURATION = MetricSpec(
    "characters.worker.stage.duration", "histogram", "s", "Time of one worker start-up stage",
    "characters_worker_stage_duration_seconds", (WORKER_ROLE, STAGE), WAIT_BUCKETS_S)

METRICS = (CHUNK_STAGE_DURATION, CHUNK_LATENCY, CHUNKS, LATE_CHUNKS, SESSION_FPS, SESSION_BUFFER, SESSION_AV_OFFSET,
           ADMISSION_WAIT, QUEUE_LENGTH, BUNDLES_FREE, BUNDLES_USED, SESSIONS, SLOTS, LEAKED_PGS, SESSIONS_ENDED,
           NODES, NODE_CHANGES, NODE_SESSIONS_LOST, AUTOSCALER_DEMAND, WORKER_STAGE_DURATION, USAGE_STREAMED, USAGE_GPU,
           USAGE_STARTED)
