"""Workers as plain objects in this process (no Ray): stages in order, one session's chunk flow DiT ->
decoder -> room through the handoff, crossed messages refused, and a reset that leaves no state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from characters.audio import chunk_sample_range
from characters.config import TOPOLOGIES, SessionConfig, session_config
from characters.media import read_mp4
from characters.process_group import free_port, leave
from deployments.pipeline.handoff import REFERENCE, HandoffError, Latents, pack, unpack
from deployments.pipeline.messages import Ack, ChunkInput, ChunkReport, Frames, SessionMismatch
from deployments.pipeline.output import RoomWorker
from deployments.pipeline.workers import STAGES, DecoderWorker, DiTWorker, StageTimer, first_frame_on
from deployments.types import OutputSpec

SMALL = {"dit": {"num_layers": 1}, "generation": {"height": 64, "width": 96}, "vae": {"num_res_blocks": 0}}


@pytest.fixture(scope="module")
def cfg() -> SessionConfig:
    return session_config("tiny", "cpu", model=SMALL)


def ready(cfg: SessionConfig) -> tuple[DiTWorker, DecoderWorker]:
    """A DiT worker (one rank) and a decoder worker through their stages, on the CPU."""
    dit, dec = DiTWorker(cfg), DecoderWorker(cfg)
    for w in (dit, dec):
        assert w.init_device() == "cpu"
    dit.init_process_group(0)
    dec.init_process_group()
    for w in (dit, dec):
        w.load_weights()
        w.warm_up()
    return dit, dec


@pytest.fixture(scope="module")
def workers(cfg: SessionConfig) -> tuple[DiTWorker, DecoderWorker]:
    return ready(cfg)


def pcm(k: int) -> np.ndarray:
    a, b = chunk_sample_range(k, 4)
    return (0.1 * np.sin(np.arange(a, b) / 7.0)).astype(np.float32)


def run_session(dit: DiTWorker, dec: DecoderWorker, room: RoomWorker, sid: str, image: np.ndarray,
                chunks: int, output: OutputSpec | None = None, path: str | None = None) -> list[str]:
    ref = dec.encode_reference(sid, image)
    dit.start(sid, ref, seed=11)
    dec.start(sid)
    room.open(sid, output or OutputSpec(), path)
    digests = []
    for k in range(chunks):
        inp = ChunkInput(sid, k, pcm(k))
        latents = dit.step(inp)
        assert not isinstance(latents, Ack)
        digests.append(room.publish(inp, dec.decode(latents)).digest)
    room.close()
    return digests


def test_stages_run_in_order_and_are_timed(workers: tuple[DiTWorker, DecoderWorker]) -> None:
    for w in workers:
        assert list(w.stages()) == list(STAGES) and all(t >= 0 for t in w.stages().values())
    timer = StageTimer()
    with pytest.raises(RuntimeError, match="out of order"), timer.stage("load_weights"):
        pass
    with pytest.raises(RuntimeError, match="before the worker is ready"):
        DiTWorker(session_config("tiny", "cpu", model=SMALL)).start("s", pack("s", -1, torch.zeros(1)), 0)


def test_chunks_flow_to_an_mp4_and_a_reset_leaves_no_state(workers: tuple[DiTWorker, DecoderWorker],
                                                           cfg: SessionConfig, tmp_path: Path) -> None:
    dit, dec = workers
    room = RoomWorker(cfg)
    image = np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    first = run_session(dit, dec, room, "a", image, 6, OutputSpec("file"), str(tmp_path / "a.mp4"))
    for w in (dit, dec, room):
        w.reset()
    second = run_session(dit, dec, room, "b", image, 6)
    assert first == second  # same seed and inputs: identical frames, nothing carried over
    assert len(set(first)) > 1
    frames, fps, audio, _ = read_mp4(tmp_path / "a.mp4")
    assert frames.shape == (24, 64, 96, 3) and fps == 24 and audio.size > 0


def test_crossed_messages_are_refused(workers: tuple[DiTWorker, DecoderWorker], cfg: SessionConfig) -> None:
    dit, dec = workers
    image = np.zeros((64, 96, 3), np.uint8)
    dit.start("a", dec.encode_reference("a", image), seed=0)
    dec.start("a")
    with pytest.raises(SessionMismatch, match="got session 'b' chunk 0"):
        dit.step(ChunkInput("b", 0, pcm(0)))
    with pytest.raises(SessionMismatch, match="at chunk 0, got session 'a' chunk 1"):
        dit.step(ChunkInput("a", 1, pcm(1)))
    latents = dit.step(ChunkInput("a", 0, pcm(0)))
    assert not isinstance(latents, Ack)
    with pytest.raises(HandoffError, match="session 'b' chunk 0 reached a receiver expecting session 'a' chunk 0"):
        dec.decode(pack("b", 0, latents.tensor))
    with pytest.raises(SessionMismatch, match="got acks"):
        dec.decode(latents, Ack(1, 5))
    room = RoomWorker(cfg)
    room.open("a", OutputSpec())
    with pytest.raises(SessionMismatch, match="with audio of 'a' chunk 1"):
        room.publish(ChunkInput("a", 1, pcm(1)), Frames("a", 0, np.zeros((4, 64, 96, 3), np.uint8)))
    with pytest.raises(ValueError, match="needs a path"):
        room.open("a", OutputSpec("file"))
    with pytest.raises(ValueError, match=r"needs \(64, 96, 3\) uint8"):
        dec.encode_reference("a", np.zeros((10, 10, 3), np.uint8))


def test_room_measures_playout_on_an_injected_clock(cfg: SessionConfig) -> None:
    now = [10.0]
    room = RoomWorker(cfg, clock=lambda: now[0])
    room.open("s", OutputSpec())
    frames = np.zeros((4, 64, 96, 3), np.uint8)
    reports = []
    for k, at in enumerate([10.0, 10.1, 10.3, 10.9]):
        now[0] = at
        reports.append(room.publish(ChunkInput("s", k, pcm(k)), Frames("s", k, frames)))
    # plays from 10 + 1 chunk (jitter buffer); chunk 3 is due at 10 + 4 chunks = 10.667, arrives at 10.9
    assert [r.late for r in reports] == [False, False, False, True]
    assert reports[3].lateness_s == pytest.approx(10.9 - (10.0 + 4 * 4 / 24))
    assert reports[0].digest == reports[1].digest and reports[3].published_at == 10.9


def test_frames_digest_fingerprints_every_byte_and_ignores_the_layout() -> None:
    from deployments.pipeline.output import frames_digest

    frames = np.random.default_rng(5).integers(0, 256, (4, 16, 24, 3), dtype=np.uint8)
    d = frames_digest(frames)
    assert len(d) == 16 and d == frames_digest(frames.copy())
    for at in ((0, 0, 0, 0), (3, 15, 23, 2)):  # a byte in each half
        changed = frames.copy()
        changed[at] ^= 1
        assert frames_digest(changed) != d
    strided = np.ascontiguousarray(frames.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # same values, other strides
    assert not strided.flags.c_contiguous and frames_digest(strided) == d


def test_reference_encoder_takes_a_read_only_image_without_warning() -> None:
    """Ray hands the decoder worker the reference image as a read-only numpy view."""
    import warnings

    from characters.engine import ReferenceEncoder

    cfg = session_config("tiny")
    g = cfg.model.generation
    image = np.random.default_rng(2).integers(0, 256, (g.height, g.width, 3), dtype=np.uint8)
    enc = ReferenceEncoder(cfg)
    want = enc.encode(image)
    image.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = enc.encode(image)
    assert torch.equal(got, want)


def test_cpu_workers_take_their_threads_from_the_topology() -> None:
    """Serving's CPU stages run with the topology's threads: one each by default (the DiT of chunk k+1 beside
    the decode of chunk k, each on a core), or what the topology asks; an explicit cpu_threads still wins."""
    before = torch.get_num_threads()
    try:
        default = session_config("tiny", "cpu", model=SMALL)
        assert (DiTWorker(default).cpu_threads, DecoderWorker(default).cpu_threads) == (1, 1)
        two = session_config("tiny", {"name": "cpu2", "dit_ranks": 1, "decoder_gpus": 0, "dit_cpu_threads": 2,
                                      "decoder_cpu_threads": 3}, model=SMALL)
        dit, dec = DiTWorker(two), DecoderWorker(two)
        assert (dit.cpu_threads, dec.cpu_threads) == (2, 3)
        dec.init_device()
        assert torch.get_num_threads() == 3  # what the decoder's process runs with
        dit.init_device()
        assert torch.get_num_threads() == 2
        assert DiTWorker(two, cpu_threads=1).cpu_threads == 1
    finally:
        torch.set_num_threads(before)


def test_an_avatars_reference_is_encoded_once_per_decoder_and_reused_exactly(
        workers: tuple[DiTWorker, DecoderWorker]) -> None:
    """Sessions on one avatar (the same processed image) reuse its latent; another image is encoded anew."""
    _, dec = workers
    g = dec.cfg.model.generation
    before = dec.references_encoded
    face = np.random.default_rng(20261202).integers(0, 256, (g.height, g.width, 3), np.uint8)
    other = face.copy()
    other[0, 0, 0] ^= 1  # one bit: another image
    first = dec.encode_reference("s1", face)
    second = dec.encode_reference("s2", face.copy())
    assert dec.references_encoded == before + 1
    assert torch.equal(unpack(first, session_id="s1", chunk=REFERENCE),
                       unpack(second, session_id="s2", chunk=REFERENCE))  # the same latent, for the new session
    dec.encode_reference("s3", other)
    assert dec.references_encoded == before + 2


def test_room_reports_the_real_playouts_late_chunks_when_its_output_has_one(cfg: SessionConfig) -> None:
    """A LiveKit output's playout (its own timeline, trimmed by the adaptive buffer) says which chunks were
    late, not the room's model: a late chunk there is a held frame at the viewer. Each report carries the
    chunks that ended a stall since the one before, and the stall's length."""
    from types import SimpleNamespace

    now = [10.0]
    room = RoomWorker(cfg, clock=lambda: now[0])
    room.open("s", OutputSpec())

    class Output:  # what LiveKitSink exposes to the room: its last RoomStats (only .playout is read)
        def __init__(self) -> None:
            self.latest_stats = SimpleNamespace(playout=SimpleNamespace(
                buffered_s=0.1, av_offset_ms=0.0, fps=24.0, late_chunks=0, stall_s=0.0, audio_dry=0))

        def write(self, *_: object, **__: object) -> None:
            pass

        def close(self) -> None:
            pass

    out = Output()
    room.sink = out  # type: ignore[assignment]
    frames = np.zeros((4, 64, 96, 3), np.uint8)
    playout = out.latest_stats.playout
    reports = []
    for k, (late, stall) in enumerate([(0, 0.0), (1, 0.05), (1, 0.05), (2, 0.17)]):
        now[0] = 10.0 + k * 4 / 24  # on time for the room's model: it would call none late
        playout.late_chunks, playout.stall_s = late, stall
        reports.append(room.publish(ChunkInput("s", k, pcm(k)), Frames("s", k, frames)))
    assert [r.late for r in reports] == [False, True, False, True]
    assert [r.lateness_s for r in reports] == pytest.approx([0.0, 0.05, 0.0, 0.12])


def test_the_dit_raises_its_priority_for_urgent_chunks_only(workers: tuple[DiTWorker, DecoderWorker],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An onset (and the chunks just after it, and idle ones) computed at the chunk path's nice value, the rest of
    the speech at the worker's own; between steps the thread waits at the chunk path's value (its next task wakes it
    at once, whatever else wants the cores)."""
    from deployments.pipeline import workers as module

    dit, dec = workers
    asked: list[int] = []
    monkeypatch.setattr(module, "prioritize_thread", lambda nice: asked.append(nice) or True)
    assert DiTWorker(session_config("tiny", "cpu", model=SMALL)).urgent_nice is None  # none asked: never changes
    monkeypatch.setattr(dit, "urgent_nice", -10)
    calm = dit._calm_nice
    image = np.full((64, 96, 3), 128, np.uint8)
    ref = dec.encode_reference("u", image)
    dit.start("u", ref, seed=1)
    for k, urgent in enumerate([True, True, False, False, True]):
        dit.step(ChunkInput("u", k, pcm(k), urgent=urgent))
    assert asked == [calm, -10, calm, -10]  # the two calm steps only, each raised again after its compute
    dit.step(ChunkInput("u", 5, pcm(5)))  # back to calm for the next test
    dit.reset()


def test_the_dits_process_waits_at_the_chunk_paths_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for a nice value, the DiT worker sets it on every thread of its process at once (Ray's, which deliver
    each chunk's task, and the step's while it waits); refused, it never switches."""
    from deployments.pipeline import workers as module

    asked: list[int] = []
    monkeypatch.setattr(module, "prioritize", lambda nice: asked.append(nice) or nice)
    assert DiTWorker(session_config("tiny", "cpu", model=SMALL), nice=-10).urgent_nice == -10
    assert asked == [-10]
    monkeypatch.setattr(module, "prioritize", lambda nice: None)  # no CAP_SYS_NICE
    assert DiTWorker(session_config("tiny", "cpu", model=SMALL), nice=-10).urgent_nice is None


class Recording:
    """A media sink that keeps what the room writes, in order (the room is under test, not its output)."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int | None, bool, bool]] = []  # frames, samples, speech, onset, continues
        self.frames: list[np.ndarray] = []

    def write(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
              submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0,
              continues: bool = False) -> float:
        self.writes.append((len(frames), pcm.size, speech_samples, onset, continues))
        self.frames.append(frames.copy())
        return 0.05 if onset else 0.0

    def close(self) -> None:
        pass


def test_an_onsets_first_frame_goes_out_before_its_rest(workers: tuple[DiTWorker, DecoderWorker],
                                                        cfg: SessionConfig) -> None:
    """Through `decode_first` -> `publish_first`, then `decode_rest` -> `publish` (the compiled graph's four calls):
    a speech onset's chunk reaches the output as its first frame with its share of the audio, then the other three
    with the rest; any other chunk goes whole. The frames are the plain path's (within 1 where float rounding meets
    a .5 tie: the first frame's convolutions sum in another order), and so are the chunks after it."""
    dit, dec = workers
    image = np.random.default_rng(2).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    assert not dec.first_frame  # "auto" on a CPU: off
    dec.first_frame = True

    def session(sid: str, parts: bool) -> tuple[Recording, list[ChunkReport]]:
        for w in (dit, dec):
            w.reset()
        room = RoomWorker(cfg)
        dit.start(sid, dec.encode_reference(sid, image), seed=11)
        dec.start(sid)
        room.open(sid, OutputSpec())
        sink = room.sink = Recording()
        reports = []
        for k in range(4):
            inp = ChunkInput(sid, k, pcm(k), onset=k == 2)
            latents = dit.step(inp)
            assert not isinstance(latents, Ack)
            if not parts:
                reports.append(room.publish(inp, dec.decode(latents)))
                continue
            first = dec.decode_first(inp, latents)
            rest = dec.decode_rest(first)
            assert (len(first.frames), len(rest.frames)) == ((1, 3) if k == 2 else (4, 0))
            shown = room.publish_first(inp, first)
            assert shown == (1 if k == 2 else 0)
            reports.append(room.publish(inp, rest, shown))
        return sink, reports

    plain, plain_reports = session("plain", parts=False)
    sink, reports = session("parts", parts=True)
    n = pcm(2).size
    assert [w[:2] for w in plain.writes] == [(4, pcm(k).size) for k in range(4)] and plain.writes[2][3]
    assert sink.writes == [(4, pcm(0).size, None, False, False), (4, pcm(1).size, None, False, False),
                           (1, n // 4, n // 4, True, False), (3, n - n // 4, n - n // 4, False, True),
                           (4, pcm(3).size, None, False, False)]
    got, want = np.concatenate(sink.frames).astype(int), np.concatenate(plain.frames).astype(int)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1 and (got != want).mean() < 1e-3
    assert [r.digest for r in reports][3] == plain_reports[3].digest  # the stream goes on exactly
    assert [r.frames for r in reports] == [4] * 4 and reports[2].cut_s == 0.05
    assert [r.head_frames for r in reports] == [0, 0, 1, 0]
    assert [s.stage for s in reports[2].stages].count("publish") == 1  # the head's: the one the viewer waits on
    dec.decode_first(ChunkInput("parts", 4, pcm(4), onset=True), dit.step(ChunkInput("parts", 4, pcm(4))))
    with pytest.raises(SessionMismatch, match="before the rest of chunk 4"):
        dec.decode_first(ChunkInput("parts", 5, pcm(5)), dit.step(ChunkInput("parts", 5, pcm(5))))
    dec.first_frame = False  # off: an onset goes whole too
    dec.start("parts")
    dit.start("parts", dec.encode_reference("parts", image), seed=11)
    onset = ChunkInput("parts", 0, pcm(0), onset=True)
    latents = dit.step(onset)
    assert not isinstance(latents, Ack)
    assert len(dec.decode_first(onset, latents).frames) == 4


def test_onset_first_frame_is_on_for_gpu_decoders_by_default() -> None:
    assert [first_frame_on(m, d) for m in ("auto", "on", "off") for d in ("cpu", "cuda")] == [
        False, True, True, True, False, False]
    with pytest.raises(ValueError, match="one of auto, on, off"):
        first_frame_on("yes", "cpu")


def test_the_decoder_runner_refuses_a_chunk_part_out_of_turn(cfg: SessionConfig) -> None:
    """A chunk begun by `decode_first` must be finished by `decode_rest` before any other decode: the causal windows
    hold its first frame's inputs and have not moved on."""
    from characters.engine import DecoderRunner

    runner = DecoderRunner(cfg)
    z = torch.zeros(1, cfg.model.vae.latent_channels, 1, *cfg.model.latent_hw)
    with pytest.raises(RuntimeError, match="without decode_first"):
        runner.decode_rest()
    assert runner.decode_first(z).shape == (1, 64, 96, 3)
    for call in (lambda: runner.decode(z), lambda: runner.decode_first(z)):
        with pytest.raises(RuntimeError, match="rest is due"):
            call()
    assert runner.decode_rest().shape == (3, 64, 96, 3) and runner.chunk == 1
    assert runner.decode(z).shape == (4, 64, 96, 3)


PREEMPTIBLE = {**SMALL, "dit": {"num_layers": 3}}  # three parts a step (topology.step_groups caps at the blocks)


def _float32_cfg() -> SessionConfig:
    """PREEMPTIBLE with float32 GEMMs on one rank too (as on two: `topology.cpu_matmul`), to compare them."""
    return session_config("tiny", TOPOLOGIES["cpu"].model_dump() | {"cpu_matmul": "float32"}, model=PREEMPTIBLE)


def _preempt_session(dit: DiTWorker, sid: str, ref: Latents, *, give_up: bool) -> list[Latents | Ack]:
    """Idle chunks 0-2 (2 preemptible, asked to be given up when `give_up`), then speech from chunk 3 (an onset)."""
    dit.start(sid, ref, seed=11)
    silence = [np.zeros_like(pcm(k)) for k in range(3)]
    out = [dit.step(ChunkInput(sid, k, silence[k], preemptible=True)) for k in range(2)]
    if give_up:
        dit.preempt(sid, 2)
        out.append(dit.step(ChunkInput(sid, 2, silence[2], preemptible=True)))
    else:  # chunk 2 never made: its audio only, then chunk 3 in its slot
        dit._runner().frontend.push(silence[2])
        dit._runner().given_up = 1
    out += [dit.step(ChunkInput(sid, k, pcm(k), onset=k == 3)) for k in (3, 4)]
    return out


def test_an_onset_takes_the_place_of_the_idle_chunk_the_dit_gives_up(cfg: SessionConfig) -> None:
    """`DiTWorker.preempt`: an idle chunk asked for is given up (latents marked `given_up`), the decoder skips it
    without moving its state and the room publishes nothing, reporting a chunk cut; the onset after it is made in
    its cache slot and from its noise: exactly the chunks a session that never began chunk 2 makes. A chunk that
    is not preemptible, or another chunk, is not given up."""
    small = session_config("tiny", "cpu", model=PREEMPTIBLE)
    dit, dec = ready(small)
    assert dit._runner().groups == 16 and len(dit._runner().dit.blocks) == 3
    image = np.random.default_rng(3).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    ref = dec.encode_reference("a", image)
    given = _preempt_session(dit, "a", ref, give_up=True)
    assert isinstance(given[2], Latents) and given[2].header.given_up and dit._runner().given_up == 1
    assert not any(isinstance(m, Latents) and m.header.given_up for m in given[:2] + given[3:])
    never = _preempt_session(dit, "b", pack("b", REFERENCE, ref.tensor), give_up=False)
    for a, b in zip(given[3:], never[2:], strict=True):
        assert isinstance(a, Latents) and isinstance(b, Latents)
        assert torch.equal(a.tensor, b.tensor)
    # the decoder and the room: nothing of chunk 2 goes out, the stream goes on from chunk 1's state
    room = RoomWorker(small)
    dec.start("a")
    room.open("a", OutputSpec())
    sink = room.sink = Recording()
    reports = []
    for k, msg in enumerate(given):
        assert isinstance(msg, Latents)
        inp = ChunkInput("a", k, np.zeros_like(pcm(k)) if k < 3 else pcm(k), onset=k == 3, preemptible=k < 3)
        first = dec.decode_first(inp, msg)
        reports.append(room.publish(inp, dec.decode_rest(first), room.publish_first(inp, first)))
    assert [r.frames for r in reports] == [4, 4, 0, 4, 4] and [r.given_up for r in reports] == [0, 0, 1, 0, 0]
    assert reports[2].cut_s == pytest.approx(room.chunk_s) and not reports[2].late
    assert len(sink.writes) == 4  # chunk 2 wrote nothing
    dec.start("b")
    skipped = pack("b", 2, torch.zeros(dec.latent_shape), given_up=True)
    plain = [dec.decode(m).frames for m in [*never[:2], skipped, *never[2:]] if isinstance(m, Latents)]
    assert [len(f) for f in plain] == [4, 4, 0, 4, 4]
    assert all(np.array_equal(a, b) for a, b in zip(sink.frames[2:], plain[3:], strict=True))
    # not preemptible (speech), or another chunk asked for: made
    dit.start("c", pack("c", REFERENCE, ref.tensor), seed=11)
    dit.preempt("c", 0)
    made = dit.step(ChunkInput("c", 0, pcm(0)))
    dit.preempt("c", 0)
    made_too = dit.step(ChunkInput("c", 1, np.zeros_like(pcm(1)), preemptible=True))
    assert isinstance(made, Latents) and not made.header.given_up
    assert isinstance(made_too, Latents) and not made_too.header.given_up and dit._runner().given_up == 0


def _preempt_rank(rank: int, port: int, asked: int, out: str) -> None:
    torch.set_num_threads(1)
    dit = DiTWorker(_float32_cfg(), rank=rank, ranks=2, cpu_threads=1)
    dit.init_device()
    dit.init_process_group(port, timeout_s=60)
    dit.load_weights()
    dit.warm_up()
    ref = torch.randn(1, dit.cfg.model.dit.latent_channels, *dit.cfg.model.latent_hw,
                      generator=torch.Generator().manual_seed(1))
    dit.start("s", pack("s", REFERENCE, ref), seed=11)
    got = []
    for k in range(4):  # idle 0-2, chunk 2 given up when rank `asked` alone was asked; speech from 3
        if k == 2 and rank == asked:
            dit.preempt("s", 2)
        msg = dit.step(ChunkInput("s", k, pcm(k) if k == 3 else np.zeros_like(pcm(k)), preemptible=k < 3))
        got.append(msg.header.given_up if isinstance(msg, Latents) else msg)
        if isinstance(msg, Latents) and not msg.header.given_up:
            got[-1] = msg.tensor
    torch.save((got, dit._runner().given_up), f"{out}.{rank}")
    dit.runner = None
    leave()


@pytest.mark.parametrize("asked", [0, 1])
def test_the_ranks_of_a_tensor_parallel_dit_give_a_chunk_up_together(asked: int, tmp_path: Path) -> None:
    """Two gloo ranks, one asked to give chunk 2 up: both stop at the same part (their collectives meet: a rank
    that went on would hang), rank 0's message says so, and the onset after it is the one-rank worker's."""
    torch.multiprocessing.spawn(_preempt_rank, args=(free_port(), asked, str(tmp_path / "out")), nprocs=2, join=True)
    (r0, n0), (r1, n1) = (torch.load(tmp_path / f"out.{r}", weights_only=False) for r in (0, 1))
    assert n0 == n1 == 1
    assert r0[2] is True and isinstance(r1[2], Ack)
    one = DiTWorker(_float32_cfg())
    one.init_device()
    one.init_process_group(0)
    one.load_weights()
    one.warm_up()
    ref = torch.randn(1, one.cfg.model.dit.latent_channels, *one.cfg.model.latent_hw,
                      generator=torch.Generator().manual_seed(1))
    one.start("s", pack("s", REFERENCE, ref), seed=11)
    for k in range(2):
        one.step(ChunkInput("s", k, np.zeros_like(pcm(k))))
    one.preempt("s", 2)
    assert one.step(ChunkInput("s", 2, np.zeros_like(pcm(2)), preemptible=True)).header.given_up  # type: ignore[union-attr]
    onset = one.step(ChunkInput("s", 3, pcm(3)))
    assert isinstance(onset, Latents)
    torch.testing.assert_close(r0[3], onset.tensor, atol=1e-4, rtol=1e-4)
