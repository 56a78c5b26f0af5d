"""The chunk loop: a Ray Compiled Graph over one slot's workers, and the paced loop that drives it.

Graph (compiled once per slot by `CompiledPipeline`, in the slot's SessionActor, and kept for every
session the slot serves; torn down only with the slot):

    InputNode: ChunkInput(session, k, pcm)
      ├─> DiTWorker[0].step ── Latents (handoff.bind: NCCL on GPUs, shared memory on CPUs) ──┐
      ├─> DiTWorker[r].step ── Ack (binds rank r >= 1, so its errors surface) ───────────────┴─> DecoderWorker
      │                                                                           .decode_first ──> .decode_rest
      │                                                                                │ Frames        │ Frames
      └──────────────────────────── (chunk k's audio) ──────────────> RoomWorker.publish_first ──> .publish
                                                                                                   │
                                                                                        ChunkReport (the output)

Every rank gets the same input and steps at once (their all-reduces meet). The driver submits chunk
k+1 before it fetches chunk k (`depth` chunks in flight), so the DiT makes k+1 while the decoder
decodes k and the room publishes k-1.

A chunk travels from the decoder to the room in two parts: a speech onset's first frame (made in about half
the chunk's decode: `characters.vae.CausalDecoder.decode_first`) goes out while the decoder makes the other
three, so the viewer hears the onset that much sooner; any other chunk goes whole in the first part. Over plain
actor calls only onsets take the two calls, the rest `DecoderWorker.decode` and `RoomWorker.publish`.
`ServiceConfig.onset_first_frame` turns it on or off (by default on for GPU decoders only); off, an onset too goes
whole in the first part.

The driver uses the graph's synchronous API from the session's loop thread: in Ray 2.60 the asyncio
API (`execute_async`) resolves a failed execution with a `RayChannelError` *value*, which
`CompiledDAGFuture.__await__` then tries to iterate (TypeError), losing which actor died; the
synchronous `CompiledDAGRef.get` raises `ActorDiedError` naming the actor within milliseconds.

Why once per slot: in Ray 2.60 every compiled graph allocates its channels as mutable objects in the
object store that its teardown never frees, and every worker keeps their pages mapped, so a graph per
session would leak memory in every worker and pinned object store per session. One graph per slot costs
that once. Between sessions the workers get their session state through plain actor calls (start, open,
reset), which run on the actors' default thread while the graph's loop waits on its input channel; the
session id travels with every chunk, so a chunk of another session fails loudly (`SessionMismatch`).

`ActorCallPipeline` is the same interface over plain actor calls (`graph="actor_calls"`): the default
on CPUs (`graph_mode`), the fallback, and the baseline the benchmark compares against.

Why not the graph on CPUs: in Ray 2.60 a graph actor waiting on its input channel polls it (`sched_yield`
in a loop), so it spins a core while idle; on the embedded default's two cores the waiting DiT, decoder and
room actors would take what the chunk path needs (`scripts/benchmarks/bench_latency.py` reports `cores_used`).
On a GPU host the spinning costs a few of many cores and buys the NCCL handoff and the graph's per-chunk
latency. The loop that drives either is `deployments.pipeline.loop`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelTimeoutError, RayError, RayTaskError

from deployments.pipeline import handoff
from deployments.pipeline.handoff import ResolvedTransport
from deployments.pipeline.messages import ChunkInput, ChunkReport


class ChunkFailure(RuntimeError):
    """The chunk pipeline broke: `reason` is a machine-readable code, the message says what happened."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def classify(err: BaseException) -> ChunkFailure:
    """A Ray error from the graph -> a ChunkFailure whose reason says why (actor_died, chunk_timeout, ...)."""
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, RayActorError):
        cls = getattr(getattr(err, "_actor_init_failed", None), "class_name", None) or _class_name(str(err))
        return ChunkFailure("actor_died", f"{cls or 'a worker'} died ({type(err).__name__})")
    if isinstance(err, (GetTimeoutError, RayChannelTimeoutError, TimeoutError)):
        return ChunkFailure("chunk_timeout", first_line)
    if isinstance(err, RayTaskError):  # (Ray's as-instance-of-cause copies may lack the task's attributes)
        cause = getattr(err, "cause", None) or err
        return ChunkFailure("worker_error", f"{getattr(err, 'function_name', 'a task')} raised "
                                            f"{type(cause).__name__}: {cause}")
    return ChunkFailure("pipeline_error", f"{type(err).__name__}: {first_line}")


def _class_name(text: str) -> str | None:
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("class_name:"):
            return line.split(":", 1)[1].strip()
    return None


class Pipeline(Protocol):
    def submit(self, inp: ChunkInput) -> None: ...

    def preempt(self, session_id: str, chunk: int) -> None: ...  # give an idle chunk in flight up (DiTWorker.preempt)

    def fetch(self, timeout_s: float) -> ChunkReport: ...  # the oldest chunk in flight

    def close(self) -> bool: ...  # the session is done with it; True: nothing left in flight, it and the
    #                                workers may serve another session


@dataclass(frozen=True)
class Workers:
    """Handles of one slot's workers (rank order) and how latents travel between them."""

    dits: Sequence[Any]
    decoder: Any
    room: Any
    transport: ResolvedTransport
    device: str = "cpu"  # the workers' device type (cpu | cuda): where their stage times come from

    def named(self) -> list[tuple[str, Any]]:
        return [*((f"DiTWorker rank {r}", d) for r, d in enumerate(self.dits)), ("DecoderWorker", self.decoder),
                ("RoomWorker", self.room)]

    def diagnose(self, failure: ChunkFailure, timeout_s: float = 1.0) -> ChunkFailure:
        """Name the dead actor behind a failure that does not (a closed channel after the graph's
        monitor tore it down): ping every worker, the first that cannot answer is the culprit."""
        if failure.reason == "actor_died":
            return failure
        named = self.named()
        refs = [actor.ping.remote() for _, actor in named]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for (name, _), ref in zip(named, refs, strict=True):
            try:
                ray.get(ref, timeout=0)
            except RayActorError as err:
                return ChunkFailure("actor_died", f"{name} died ({type(err).__name__}; the graph said: {failure})")
            except RayError:
                continue  # still busy or timed out: not known dead
        return failure


def graph_mode(mode: str, device: str) -> str:
    """`ServiceConfig.graph` for workers on `device` (cpu | cuda): "auto" is the compiled graph on CUDA
    and plain actor calls on CPUs (see the module docstring)."""
    if mode != "auto":
        return mode
    return "compiled" if device == "cuda" else "actor_calls"


class CompiledPipeline:
    """The chunk graph compiled with `ray.dag` (see the module docstring): one per slot, driven by the
    slot's SessionActor for session after session (`close` ends one). It is never torn down on its own:
    the slot's actors are killed with it (teardown would wait on them, up to `teardown_timeout_s`)."""

    def __init__(self, workers: Workers, *, depth: int, buffer_bytes: int, teardown_timeout_s: int) -> None:
        from ray.dag import DAGContext, InputNode

        self.workers = workers
        DAGContext.get_current().teardown_timeout = teardown_timeout_s  # RAY_CGRAPH_teardown_timeout (at exit)
        with InputNode() as inp:
            outs = [w.step.bind(inp) for w in workers.dits]
            latents = handoff.bind(outs[0], workers.transport)
            # every chunk in two parts (a graph is static): an onset's first frame, then its rest; any other
            # chunk whole in the first part and nothing in the second
            first = workers.decoder.decode_first.bind(inp, latents, *outs[1:])
            rest = workers.decoder.decode_rest.bind(first)
            shown = workers.room.publish_first.bind(inp, first)
            report = workers.room.publish.bind(inp, rest, shown)
        try:
            self.dag = report.experimental_compile(_buffer_size_bytes=buffer_bytes,
                                                   _max_inflight_executions=depth + 1)
        except RayError as err:
            raise classify(err) from err
        self.refs: deque[Any] = deque()
        self.failed = False  # an execution failed: the graph is out of step for good

    def submit(self, inp: ChunkInput) -> None:
        try:
            self.refs.append(self.dag.execute(inp))
        except RayError as err:
            self.failed = True
            raise self.workers.diagnose(classify(err)) from err

    def preempt(self, session_id: str, chunk: int) -> None:
        """Plain actor calls, beside the graph's loop (their own concurrency group), not waited on."""
        for w in self.workers.dits:
            w.preempt.remote(session_id, chunk)

    def fetch(self, timeout_s: float) -> ChunkReport:
        try:
            return self.refs.popleft().get(timeout=timeout_s)
        except RayError as err:
            self.failed = True
            raise self.workers.diagnose(classify(err)) from err

    def alive(self) -> bool:
        """Is every actor's graph loop still running? (One ends only when the graph breaks: an actor
        died, or Ray's monitor tore the graph down; the slot is then of no further use.)"""
        ready, _ = ray.wait(list(self.dag.worker_task_refs.values()), timeout=0)
        return not ready and not self.failed

    def close(self) -> bool:
        """End a session on the graph, keeping it for the next one: True when every chunk submitted was
        fetched and none failed (the channels are empty). False otherwise: the scheduler then removes
        the slot with its actors (unfetched refs are kept: dropping one waits on its result buffer)."""
        return not self.refs and not self.failed

    def teardown(self) -> None:
        """End the graph for good, before the slot's actors are killed: every actor's loop is cancelled and
        exits, so no loop sees its peers die (Ray then logs 'Error cancelling worker task' per actor). Waits
        at most `teardown_timeout_s` per stage; blocking: call it from a thread."""
        self.dag.teardown()


class ActorCallPipeline:
    """The same chunk flow over plain actor calls (one task per worker per chunk)."""

    def __init__(self, workers: Workers, first_frame: bool = False) -> None:
        """`first_frame`: onsets in two parts (`ServiceConfig.onset_first_frame`, as the decoder resolved it)."""
        self.w, self.first_frame = workers, first_frame
        self.refs: deque[Any] = deque()

    def submit(self, inp: ChunkInput) -> None:
        ref = ray.put(inp)
        outs = [w.step.remote(ref) for w in self.w.dits]
        if inp.onset and self.first_frame:  # its first frame first (`DecoderWorker.decode_first`)
            # (each actor runs its calls in the order they were made)
            first = self.w.decoder.decode_first.remote(ref, *outs)
            rest = self.w.decoder.decode_rest.remote(first)
            shown = self.w.room.publish_first.remote(ref, first)
            self.refs.append(self.w.room.publish.remote(ref, rest, shown))
            return
        frames = self.w.decoder.decode.remote(*outs)
        self.refs.append(self.w.room.publish.remote(ref, frames))

    def preempt(self, session_id: str, chunk: int) -> None:
        for w in self.w.dits:  # (their own concurrency group: not queued behind the step it stops)
            w.preempt.remote(session_id, chunk)

    def fetch(self, timeout_s: float) -> ChunkReport:
        try:
            return ray.get(self.refs.popleft(), timeout=timeout_s)
        except RayError as err:
            raise self.w.diagnose(classify(err)) from err

    def close(self) -> bool:
        self.refs.clear()
        return True
