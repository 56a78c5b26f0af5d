"""Workers of one slot: the DiT ranks and the decoder (the room: `deployments.pipeline.output`), thin adapters
over `characters.engine`. The messages chunks travel in: `deployments.pipeline.messages`.

Each is a plain class (tests construct them directly); `deployments.sessions.slot` makes Ray actors of them
with `ray.remote(cls).options(...)` (the DiT's with a concurrency group for `preempt`), inside the slot's
placement group. DiT and decoder workers go through named, timed stages, in this order, before the slot is ready:

    init_device -> init_process_group -> load_weights -> warm_up -> ready

Per session: `DecoderWorker.encode_reference` -> `DiTWorker.start` on every rank -> `DecoderWorker.start`
-> `RoomWorker.open`; then chunks flow DiT ranks -> decoder -> room (`deployments.pipeline.graph`); at the
end `reset` on every worker wipes all session state (KV cache, audio history, decoder state, sink).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import ray
import torch
import torch.distributed as dist

from characters.config import SessionConfig
from characters.engine import DecoderRunner, DiTRunner, ReferenceEncoder
from characters.host import freeze_heap, prioritize, prioritize_thread
from characters.process_group import free_port, join
from characters.stage_times import StageTime
from deployments.pipeline.handoff import REFERENCE, Latents, pack, unpack
from deployments.pipeline.messages import Ack, ChunkInput, Frames, SessionMismatch, TimedLatents
from deployments.settings import GLOO_SOCKET_IFNAME
from deployments.telemetry.stages import StageHook, chunk_recorder, stage_spans

STAGES = ("init_device", "init_process_group", "load_weights", "warm_up")
log = logging.getLogger(__name__)


def realtime(nice: int | None, name: str) -> None:
    """A worker of the chunk path asks for `nice` (`ServiceConfig.realtime_nice`; None: keep what it has)."""
    if nice is not None and prioritize(nice) is None:
        log.info("%s keeps its nice value %d: the OS refused %d (lowering it needs CAP_SYS_NICE)", name,
                 os.getpriority(os.PRIO_PROCESS, 0), nice)
REFERENCES_KEPT = 32  # reference latents a decoder keeps, by image: sessions on one avatar encode it once


# ------------------------------------------------------------------------------------------ stages


class StageTimer:
    """Runs named stages in the fixed order of STAGES and keeps each one's duration (seconds);
    `on_stage` hears every stage's wall-clock span, failed ones too (telemetry)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, on_stage: StageHook | None = None) -> None:
        self.clock, self.on_stage = clock, on_stage
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        want = STAGES[len(self.seconds)] if len(self.seconds) < len(STAGES) else None
        if name != want:
            raise RuntimeError(f"stage {name!r} out of order: done {list(self.seconds)}, next is {want!r}")
        t0, w0 = self.clock(), time.time_ns()
        try:
            yield
        except BaseException as err:
            if self.on_stage is not None:
                self.on_stage(name, w0, time.time_ns(), type(err).__name__)
            raise
        self.seconds[name] = self.clock() - t0
        if self.on_stage is not None:
            self.on_stage(name, w0, time.time_ns(), None)


    @property
    def ready(self) -> bool:
        return len(self.seconds) == len(STAGES)

    def require_ready(self, what: str) -> None:
        if not self.ready:
            raise RuntimeError(f"{what} before the worker is ready (stages done: {list(self.seconds)}); "
                               "run every stage first")


def first_frame_on(mode: str, device: str) -> bool:
    """`ServiceConfig.onset_first_frame` for a decoder on `device` (cpu | cuda): auto is on for CUDA only."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"onset_first_frame={mode!r}: one of auto, on, off")
    return mode == "on" or (mode == "auto" and device == "cuda")


def _device(use_gpus: bool, cpu_threads: int) -> torch.device:
    """CUDA device 0 (Ray's CUDA_VISIBLE_DEVICES maps it to this actor's GPU) or the CPU."""
    if use_gpus and torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    torch.set_num_threads(max(1, cpu_threads))
    return torch.device("cpu")


def _device_config(cfg: SessionConfig, device: torch.device, auto_dtype: bool) -> SessionConfig:
    if not auto_dtype:
        return cfg
    return cfg.model_copy(update={"dtype": "bfloat16" if device.type == "cuda" else "float32"})


# ------------------------------------------------------------------------------------------ DiT


class DiTWorker:
    """One tensor-parallel rank of a slot's DiT."""

    def __init__(self, cfg: SessionConfig, *, rank: int = 0, ranks: int = 1, use_gpus: bool = False,
                 auto_dtype: bool = True, cpu_threads: int | None = None,
                 trace_context: Mapping[str, str] | None = None, nice: int | None = None) -> None:
        """`cpu_threads`: intra-op threads on a CPU (default: the topology's `dit_cpu_threads`); `nice`: the
        process's nice value (`realtime`), the step's compute at it for urgent chunks only (intra-op threads, when
        `cpu_threads` > 1, keep the value they started with)."""
        if not 0 <= rank < ranks:
            raise ValueError(f"rank={rank} must be in [0, ranks={ranks})")
        # The DiT, the heaviest of the chunk path, computes at `nice` only for urgent chunks (`run_chunk_loop`: all
        # but speech made a chunk or more ahead): at nice -10 throughout it left a voice agent on the same cores too
        # little to answer an interruption within a chunk (measured: docs/operations.md). Everything else of the
        # process is at `nice`, the step's thread too while it waits: each chunk's task arrives through Ray's
        # threads and wakes it, and at the calm value a voice agent's burst at a speech onset held an idle chunk's
        # start for up to 128 ms (perf sched: the task's delivery thread waited 61 ms for a core).
        self.urgent_nice, self._calm_nice = nice, os.getpriority(os.PRIO_PROCESS, 0)
        if nice is not None and prioritize(nice) is None:
            self.urgent_nice = None  # refused (no CAP_SYS_NICE): nothing to switch
        self.cfg, self.rank, self.ranks = cfg, rank, ranks
        self.use_gpus, self.auto_dtype = use_gpus, auto_dtype
        self.cpu_threads = cpu_threads or cfg.topology.dit_cpu_threads
        self.timer = StageTimer(on_stage=stage_spans("dit", rank, trace_context, STAGES[-1]))
        self.device = torch.device("cpu")
        self.group: dist.ProcessGroup | None = None
        self.signals: dist.ProcessGroup | None = None  # (ranks > 1) gloo, on the host: the ranks agree to give up
        self.runner: DiTRunner | None = None
        self.session_id: str | None = None
        self._preempt: tuple[str, int] | None = None  # the (session, chunk) to give up, set by `preempt`
        m = cfg.model
        self.latent_shape = (1, m.dit.latent_channels, m.generation.latent_frames_per_chunk, *m.latent_hw)

    def init_device(self) -> str:
        with self.timer.stage("init_device"):
            self.device = _device(self.use_gpus, self.cpu_threads)
            self.cfg = _device_config(self.cfg, self.device, self.auto_dtype)
        return self.device.type

    def free_port(self) -> int:
        """A free TCP port on loopback for the process group's rendezvous (asked of rank 0)."""
        return free_port()

    def init_process_group(self, port: int, timeout_s: float = 120.0) -> None:
        """Join the slot's tensor-parallel group (gloo on CPU, NCCL on CUDA); nothing to do for one rank."""
        with self.timer.stage("init_process_group"):
            if self.ranks == 1:
                return
            self.group = join("nccl" if self.device.type == "cuda" else "gloo", port, self.rank, self.ranks,
                              timeout_s=timeout_s, gloo_ifname=GLOO_SOCKET_IFNAME.get())
            self.signals = dist.new_group(backend="gloo")  # host-side, beside the step's stream (`_agree`)

    def load_weights(self) -> None:
        with self.timer.stage("load_weights"):
            self.runner = DiTRunner(self.cfg, device=self.device, group=self.group, rank=self.rank, ranks=self.ranks)

    def warm_up(self, steps: int = 2) -> None:
        """Run `steps` chunks at the real shapes (every rank at once: they all-reduce); on CUDA capture
        the step's graphs; then wipe."""
        with self.timer.stage("warm_up"):
            runner = self._runner()
            m = self.cfg.model
            runner.start(torch.zeros(1, m.dit.latent_channels, *m.latent_hw, device=self.device))
            for _ in range(steps):
                runner.step(np.zeros(runner.frontend.expected_samples, np.float32))
            if self.device.type == "cuda":
                if m.generation.cache_mode == "write_time":
                    runner.capture_graphs()
                torch.cuda.synchronize(self.device)  # outside any session: a one-off
            runner.reset()
            if self.rank == 0:  # rank 0's times travel with its latents
                runner.recorder = chunk_recorder(self.device)

    def stages(self) -> dict[str, float]:
        return dict(self.timer.seconds)

    def settle(self) -> None:
        """Warm: take what this process built out of the garbage collector's reach (`characters.host.freeze_heap`)."""
        freeze_heap(f"DiT rank {self.rank}")

    def start(self, session_id: str, reference: Latents, seed: int) -> None:
        """Begin a session: wipe state, fill the sink with the reference latent (1, C, h, w)."""
        self.timer.require_ready("DiTWorker.start")
        runner = self._runner()
        m = self.cfg.model
        ref = unpack(reference, session_id=session_id, chunk=REFERENCE, shape=(1, m.dit.latent_channels, *m.latent_hw))
        runner.start(ref, seed=seed)
        if runner.recorder is not None:
            runner.recorder.reset()
            runner.recorder.anchor()  # re-tie GPU and host clocks at every session start (outside the loop)
        self.session_id, self._preempt = session_id, None

    @ray.method(concurrency_group="signal")
    def preempt(self, session_id: str, chunk: int) -> None:
        """Give chunk `chunk` of `session_id` up if it is still being made (`ChunkInput.preemptible`: an idle chunk):
        a speech onset came after it. The DiT stops between two parts of its step (`topology.step_groups`) and
        makes the onset, the next chunk, in its place: the same cache slot, after the chunks the viewer has. Sent
        to every rank, any one's is enough (`_agree`); one for a chunk already made does nothing. The slot's
        actors run it beside the chunk path (its own concurrency group: `deployments.sessions.slot`)."""
        self._preempt = (session_id, chunk)

    def step(self, inp: ChunkInput) -> Latents | Ack:
        """Chunk k's audio -> rank 0: its latents (1, C, Cf, h, w) for the decoder; other ranks: an Ack. A
        preemptible chunk given up (`preempt`) -> latents marked `given_up`."""
        runner = self._runner()
        if inp.session_id != self.session_id or inp.chunk != runner.chunk + runner.given_up:
            raise SessionMismatch(
                f"DiT rank {self.rank} serves session {self.session_id!r} at chunk {runner.chunk + runner.given_up}, "
                f"got session {inp.session_id!r} chunk {inp.chunk}; start the session on this worker first"
            )
        urgent = self.urgent_nice
        calm = urgent is not None and not inp.urgent and prioritize_thread(self._calm_nice)
        rec = runner.recorder
        which = (inp.session_id, inp.chunk)
        stop = (lambda: self._agree(self._preempt == which)) if inp.preemptible else None
        t0 = time.time_ns()
        try:
            latents = runner.step(inp.pcm, stop=stop)  # (1, C, Cf, h, w) float32, None: given up
        finally:
            if calm and urgent is not None:  # and waits for the next chunk at the chunk path's priority
                prioritize_thread(urgent)
        if self.rank != 0:
            return Ack(self.rank, inp.chunk)
        if latents is None:  # the decoder skips it; the tensor fills the graph's channel (its shape is static)
            return pack(inp.session_id, inp.chunk, torch.zeros_like(runner.x), given_up=True)
        msg = pack(inp.session_id, inp.chunk, latents)
        if rec is None:
            return msg
        stages = rec.harvest()  # host: this chunk's; CUDA: earlier chunks' (only completed events)
        if rec.cuda:  # the host's view too: the handoff is measured from it
            stages.append(StageTime(inp.chunk, "dit", t0, time.time_ns() - t0, "host"))
        return TimedLatents(msg.header, msg.tensor, tuple(stages))

    def _agree(self, mine: bool) -> bool:
        """Whether any rank was asked to give the chunk up: every rank stops at the same part (their collectives
        must meet). One all-reduce over the host-side gloo group a part."""
        if self.signals is None:
            return mine
        flag = torch.tensor([int(mine)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.signals)
        return bool(flag.item())

    def reset(self) -> None:
        """Wipe every trace of the last session (KV cache, audio history, chunk index)."""
        if self.runner is not None:
            self.runner.reset()
        self.session_id, self._preempt = None, None

    def ping(self) -> int:
        return self.rank

    def _runner(self) -> DiTRunner:
        if self.runner is None:
            raise RuntimeError(f"DiT rank {self.rank} used before load_weights (stages done: "
                               f"{list(self.timer.seconds)}); run the stages in order first")
        return self.runner


# ------------------------------------------------------------------------------------------ decoder


class DecoderWorker:
    """The slot's VAE: the reference encoder and the streaming decoder (own GPU, or DiT rank 0's)."""

    def __init__(self, cfg: SessionConfig, *, use_gpus: bool = False, auto_dtype: bool = True,
                 cpu_threads: int | None = None, trace_context: Mapping[str, str] | None = None,
                 nice: int | None = None, first_frame: str = "auto") -> None:
        """`cpu_threads`: intra-op threads on a CPU (default: the topology's `decoder_cpu_threads`); `nice`: the
        process's nice value (`realtime`); `first_frame`: `ServiceConfig.onset_first_frame`."""
        realtime(nice, "decoder")
        self.first_frame_mode = first_frame
        self.first_frame = False  # onsets in two parts (`decode_first`); resolved by `init_device`
        self.cfg, self.use_gpus, self.auto_dtype = cfg, use_gpus, auto_dtype
        self.cpu_threads = cpu_threads or cfg.topology.decoder_cpu_threads
        self.timer = StageTimer(on_stage=stage_spans("decoder", None, trace_context, STAGES[-1]))
        self.device = torch.device("cpu")
        self.runner: DecoderRunner | None = None
        self.encoder: ReferenceEncoder | None = None
        self.session_id: str | None = None
        self.chunk = 0
        self._rest: tuple[int, tuple[StageTime, ...]] | None = None  # a chunk's rest is due: (its t0, stages so far)
        m = cfg.model
        self.latent_shape = (1, m.dit.latent_channels, m.generation.latent_frames_per_chunk, *m.latent_hw)
        self.frame_shape = (m.generation.height, m.generation.width, 3)
        self._references: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # image digest -> (1, C, h, w) latent
        self.references_encoded = 0
        self._reference: tuple[str, np.ndarray] | None = None  # (session, image) the next start anchors frames on

    def init_device(self) -> str:
        with self.timer.stage("init_device"):
            self.device = _device(self.use_gpus, self.cpu_threads)
            self.cfg = _device_config(self.cfg, self.device, self.auto_dtype)
            self.first_frame = first_frame_on(self.first_frame_mode, self.device.type)
        return self.device.type

    def init_process_group(self) -> None:
        with self.timer.stage("init_process_group"):
            pass  # the decoder is in no collective group: latents reach it over the graph's channel

    def load_weights(self) -> None:
        with self.timer.stage("load_weights"):
            self.encoder = ReferenceEncoder(self.cfg, device=self.device)
            self.runner = DecoderRunner(self.cfg, device=self.device)

    def warm_up(self, steps: int = 2) -> None:
        with self.timer.stage("warm_up"):
            runner, encoder = self._parts()
            g = self.cfg.model.generation
            encoder.encode(np.zeros((g.height, g.width, 3), np.uint8))
            runner.start()
            zeros = torch.zeros(self.latent_shape, device=self.device)
            for _ in range(steps):
                runner.decode(zeros)
                if self.first_frame:  # an onset's two parts: their shapes are warm before the first onset
                    runner.decode_first(zeros)
                    runner.decode_rest()
            if self.device.type == "cuda":
                runner.capture_graph(parts=self.first_frame)
            runner.start()
            runner.recorder = chunk_recorder(self.device)

    def stages(self) -> dict[str, float]:
        return dict(self.timer.seconds)

    def settle(self) -> None:
        """Warm: take what this process built out of the garbage collector's reach (`characters.host.freeze_heap`)."""
        freeze_heap("decoder")

    def encode_reference(self, session_id: str, image: np.ndarray) -> Latents:
        """(H, W, 3) uint8 reference image -> the reference latent message for every DiT rank. An image this
        worker encoded before (an avatar's, session after session) is not encoded again: its latent is kept,
        by the image's digest, for the last REFERENCES_KEPT images (no session state: the image decides)."""
        _, encoder = self._parts()
        g = self.cfg.model.generation
        if image.shape != (g.height, g.width, 3) or image.dtype != np.uint8:
            raise ValueError(
                f"reference image is {image.shape} {image.dtype}, the model needs ({g.height}, {g.width}, 3) uint8; "
                "resize it with characters.media.load_image"
            )
        image = np.ascontiguousarray(image)
        key = hashlib.blake2b(image.data, digest_size=16).digest()
        latent = self._references.pop(key, None)
        if latent is None:
            latent = encoder.encode(image).cpu()  # (1, C, h, w)
            self.references_encoded += 1
        self._references[key] = latent  # most recent last
        self._reference = (session_id, image)
        while len(self._references) > REFERENCES_KEPT:
            self._references.popitem(last=False)
        return pack(session_id, REFERENCE, latent)

    def start(self, session_id: str) -> None:
        self.timer.require_ready("DecoderWorker.start")
        runner, _ = self._parts()
        ref = self._reference
        runner.start(reference=ref[1] if ref is not None and ref[0] == session_id else None)  # characters.identity
        if runner.recorder is not None:
            runner.recorder.reset()
            runner.recorder.anchor()  # as DiT rank 0 does: the handoff compares the two GPUs' times on the host clock
        self.session_id, self.chunk, self._rest = session_id, 0, None

    def decode(self, latents: Latents, *acks: Ack) -> Frames:
        """Chunk k's latents (from DiT rank 0; acks from the other ranks) -> its (F, H, W, 3) uint8 frames. A chunk
        the DiT gave up (`DiTWorker.preempt`) -> no frames, marked `given_up`; the decoder's state stays where it
        was, for the onset that takes its place."""
        runner, _ = self._parts()
        z = self._latents(latents, acks)
        if latents.header.given_up:
            self.chunk += 1
            return Frames(latents.header.session_id, self.chunk - 1, np.zeros((0, *self.frame_shape), np.uint8),
                          given_up=True)
        t0 = time.time_ns()
        frames = runner.decode(z).cpu().numpy()  # (F, H, W, 3) uint8 (the copy to host waits for the decode)
        return self._frames(frames, latents, t0)

    def decode_first(self, inp: ChunkInput, latents: Latents, *acks: Ack) -> Frames:
        """`decode`, but a speech onset's chunk (`inp.onset`) in two parts: this returns its first frame, made in
        about half of the chunk's decode (`CausalDecoder.decode_first`), for the room to play at once; `decode_rest`
        the rest. Any other chunk: all its frames here, and none from `decode_rest` (the graph calls both)."""
        if not (inp.onset and self.first_frame) or latents.header.given_up:
            return self.decode(latents, *acks)
        runner, _ = self._parts()
        z = self._latents(latents, acks)
        self._rest = (time.time_ns(), tuple(getattr(latents, "stages", ())))
        return Frames(inp.session_id, self.chunk, runner.decode_first(z).cpu().numpy())  # (1, H, W, 3) uint8

    def decode_rest(self, first: Frames) -> Frames:
        """The frames of `first`'s chunk after it (`decode_first`); none when `first` was the whole chunk."""
        runner, _ = self._parts()
        if self._rest is None:
            return Frames(first.session_id, first.chunk, first.frames[:0])  # (0, H, W, 3): all went with `first`
        if (first.session_id, first.chunk) != (self.session_id, self.chunk):
            raise SessionMismatch(f"decoder at chunk {self.chunk} of {self.session_id!r} asked for the rest of chunk "
                                  f"{first.chunk} of {first.session_id!r}")
        (t0, stages), self._rest = self._rest, None
        frames = runner.decode_rest().cpu().numpy()  # (F - 1, H, W, 3) uint8
        return self._frames(frames, stages, t0)

    def _latents(self, latents: Latents, acks: tuple[Ack, ...]) -> torch.Tensor:
        if self.session_id is None:
            raise SessionMismatch("decoder got latents before start(); start the session on this worker first")
        if self._rest is not None:
            raise SessionMismatch(f"decoder got chunk {latents.header.chunk}'s latents before the rest of chunk "
                                  f"{self.chunk}: call decode_rest first")
        z = unpack(latents, session_id=self.session_id, chunk=self.chunk, shape=self.latent_shape)
        stale = [a for a in acks if a.chunk != self.chunk]
        if stale:
            raise SessionMismatch(f"decoder at chunk {self.chunk} got acks {stale} from other chunks")
        return z

    def _frames(self, frames: np.ndarray, came_with: Latents | tuple[StageTime, ...], t0: int) -> Frames:
        """The chunk's (last) frames, with the stage times so far; the decoder moves on a chunk."""
        assert self.session_id is not None
        self.chunk += 1
        rec = self._parts()[0].recorder
        if rec is None:
            return Frames(self.session_id, self.chunk - 1, frames)
        before = came_with if isinstance(came_with, tuple) else getattr(came_with, "stages", ())
        stages = [*before, *rec.harvest()]
        if rec.cuda:
            stages.append(StageTime(self.chunk - 1, "decode", t0, time.time_ns() - t0, "host"))
        return Frames(self.session_id, self.chunk - 1, frames, tuple(stages))

    def reset(self) -> None:
        if self.runner is not None:
            self.runner.start()
        self.session_id, self.chunk, self._rest = None, 0, None

    def ping(self) -> str:
        return "decoder"

    def _parts(self) -> tuple[DecoderRunner, ReferenceEncoder]:
        if self.runner is None or self.encoder is None:
            raise RuntimeError(f"decoder used before load_weights (stages done: {list(self.timer.seconds)}); "
                               "run the stages in order first")
        return self.runner, self.encoder
