"""`characters.cpu`: the cores found, the two-thread stage pipeline (same frames, overlapped, never further
ahead than one chunk), the one-core path, and the calibration's advice; `characters demo` calibrating first."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from characters.audio import chunk_sample_range
from characters.config import session_config
from characters.cpu import Calibration, StagePipeline, calibrate, cores, cpu_flags, cpu_model
from characters.demo import run_demo
from characters.engine import CharacterEngine

SMALL = {"dit": {"num_layers": 1}}  # tiny with one DiT layer (random weights): the same stages, faster


@pytest.fixture(scope="module")
def engine() -> CharacterEngine:
    return CharacterEngine(session_config("tiny", "cpu", model=SMALL))


def speech(engine: CharacterEngine, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        a, b = engine.chunk_samples(k)
        out.append((0.3 * rng.standard_normal(b - a)).astype(np.float32))
    return out


def test_cores_are_the_affinity_mask() -> None:
    assert cores() == len(os.sched_getaffinity(0))
    assert cpu_model() and cpu_model() != "unknown"
    assert set(cpu_flags()) <= {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize("overlap", [True, False])
def test_pipeline_frames_equal_the_engine_step_by_step(engine: CharacterEngine, overlap: bool) -> None:
    image = np.full((176, 272, 3), 128, np.uint8)
    pcms = speech(engine, 6)
    torch.set_num_threads(1)  # the pipeline's intra-op threads (a reduction split otherwise rounds differently)
    engine.start(image)
    want = [engine.step(p) for p in pcms]
    engine.start(image)
    with StagePipeline(engine, overlap=overlap) as pipe:
        got = list(pipe.stream(pcms))
    assert [r.chunk for r in got] == list(range(6))
    for r, w in zip(got, want, strict=True):
        assert r.frames.shape == (4, 176, 272, 3) and r.frames.dtype == np.uint8
        assert np.array_equal(r.frames, w)
        assert r.dit.cpu_ms > 0 and r.decode.cpu_ms > 0 and r.cpu_ms == r.dit.cpu_ms + r.decode.cpu_ms
    assert pipe.overlap is overlap
    assert torch.get_num_threads() == 1  # as it was before the pipeline (set above), not the pipeline's own


@dataclass
class FakeEngine:
    """Stages that log what ran where; decode of chunk k waits (bounded) for the DiT of chunk k+1 to begin."""

    chunks: int
    log: list[tuple[str, int, int]] = field(default_factory=list)  # (event, chunk, thread id)
    began: dict[int, threading.Event] = field(default_factory=dict)
    overlapped: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cfg = session_config("tiny", "cpu")
        self.began = {k: threading.Event() for k in range(self.chunks + 1)}
        self.chunk = 0
        self.dit = SimpleNamespace(step=self._step)
        self.decoder = SimpleNamespace(decode=self._decode)

    def _step(self, pcm: np.ndarray) -> torch.Tensor:
        k = int(pcm[0])
        self.log.append(("dit", k, threading.get_ident()))
        self.began[k].set()
        return torch.tensor([k])

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        k = int(latents[0])
        self.log.append(("decode", k, threading.get_ident()))
        if k + 1 < self.chunks:  # does the next chunk's DiT run while this decode is still going?
            self.overlapped.append(self.began[k + 1].wait(timeout=2.0))
        return torch.full((1, 1, 1, 1), k, dtype=torch.uint8)


def test_the_next_dit_runs_beside_this_decode_and_never_further_ahead() -> None:
    fake = FakeEngine(5)
    taken: list[int] = []
    with StagePipeline(fake, overlap=True) as pipe:  # type: ignore[arg-type]
        for res in pipe.stream(np.full(1, k, np.float32) for k in range(5)):
            started = [k for e, k, _ in fake.log if e == "dit"]
            assert max(started) <= res.chunk + 1  # by the time chunk k is out, at most the DiT of k+1 has run
            taken.append(int(res.frames[0, 0, 0, 0]))
    assert taken == [0, 1, 2, 3, 4]
    assert fake.overlapped == [True] * 4  # each decode saw the next DiT begin before it finished
    main = threading.get_ident()
    assert {t for e, _, t in fake.log if e == "dit"} == {main}
    assert {t for e, _, t in fake.log if e == "decode"} != {main}  # the decoder's own thread


def test_one_core_runs_both_stages_in_turn_on_the_callers_thread() -> None:
    fake = FakeEngine(3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with StagePipeline(fake, overlap=False) as pipe:  # type: ignore[arg-type]
            assert torch.get_num_threads() == 1  # the topology's dit_cpu_threads
            out = [int(r.frames[0, 0, 0, 0]) for r in pipe.stream(np.full(1, k, np.float32) for k in range(3))]
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert out == [0, 1, 2]
    assert {t for _, _, t in fake.log} == {threading.get_ident()}
    assert [(e, k) for e, k, _ in fake.log] == [("dit", 0), ("decode", 0), ("dit", 1), ("decode", 1), ("dit", 2),
                                                 ("decode", 2)]


def test_a_decoder_failure_reaches_the_caller() -> None:
    fake = FakeEngine(3)

    def broken(latents: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("decoder broke")

    fake.decoder = SimpleNamespace(decode=broken)
    with pytest.raises(RuntimeError, match="decoder broke"), StagePipeline(fake, overlap=True) as pipe:  # type: ignore[arg-type]
        list(pipe.stream(np.full(1, k, np.float32) for k in range(3)))


def _cal(chunk_ms: float, load: float | None, cores_: int = 2) -> Calibration:
    return Calibration(cores=cores_, overlap=cores_ > 1, chunk_ms=chunk_ms, dit_ms=chunk_ms, decode_ms=chunk_ms / 2,
                       cpu_ms=1.5 * chunk_ms, budget_ms=1000 * 4 / 24, load=load)


def test_calibration_advice_warns_with_the_reason_and_what_to_do() -> None:
    fine = _cal(60.0, 0.4)
    assert not fine.too_slow
    assert "warning" not in fine.advice() and "60 ms per chunk" in fine.advice() and "166.7 ms budget" in fine.advice()
    busy = _cal(150.0, 7.5)
    assert busy.too_slow
    text = busy.advice()
    assert "warning: --realtime will likely deliver late chunks" in text
    assert "other programs keep the 2 cores busy (load 7.5)" in text and "without --realtime" in text
    slow = _cal(200.0, 0.5, cores_=1)
    assert "too slow" in slow.advice() and "DiT then decoder on one core" in slow.advice()


def test_calibrate_measures_this_engine_and_leaves_it_restartable(engine: CharacterEngine) -> None:
    image = np.full((176, 272, 3), 90, np.uint8)
    cal = calibrate(engine, image, chunks=6, measured=2)
    assert cal.cores == cores() and cal.budget_ms == pytest.approx(166.667, abs=0.01)
    assert cal.dit_ms > 0 and cal.decode_ms > 0 and cal.cpu_ms > 0 and cal.chunk_ms > 0
    pcms = speech(engine, 2)
    engine.start(image)
    after = [engine.step(p) for p in pcms]
    fresh = CharacterEngine(engine.cfg)
    fresh.start(image)
    assert all(np.array_equal(a, fresh.step(p)) for a, p in zip(after, pcms, strict=True))


def test_realtime_demo_calibrates_before_the_first_chunk(tmp_path: Path) -> None:
    events: list[str] = []
    now = [0.0]
    report = run_demo(session_config("tiny", "cpu", model=SMALL), out=tmp_path / "o.mp4", seconds=0.5, realtime=True,
                      clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
                      on_calibration=lambda cal: events.append("calibration"),
                      on_chunk=lambda k, ms: events.append(f"chunk {k}"))
    assert events == ["calibration", "chunk 0", "chunk 1", "chunk 2"]
    assert report.calibration is not None and report.calibration["cores"] == cores()
    assert report.late_chunks == 0 and report.chunks == 3 and report.cpu_ms_p50 > 0  # the injected clock stood still


PRIORITIZE = """
import os, threading, time
from characters.cpu import prioritize
before = threading.Thread(target=time.sleep, args=(1.0,))
before.start()
assert prioritize({nice}) == {nice}
after: list[int] = []
t = threading.Thread(target=lambda: after.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
t.start(); t.join()
seen = set()
for tid in (int(x) for x in os.listdir("/proc/self/task")):
    try:
        seen.add(os.getpriority(os.PRIO_PROCESS, tid))
    except ProcessLookupError:  # a thread that ended meanwhile
        pass
print(sorted(seen), after)
"""


def test_prioritize_sets_every_thread_and_new_threads_inherit_it() -> None:
    """In a child process (this one keeps its nice value): raising the nice value needs no privilege."""
    import subprocess
    import sys

    base = os.getpriority(os.PRIO_PROCESS, 0)
    nice = min(19, base + 3)
    proc = subprocess.run([sys.executable, "-c", PRIORITIZE.format(nice=nice)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [f"[{nice}]", f"[{nice}]"]  # every thread (one started before too); a new one


FREEZE = """
import gc, logging, sys, time
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from characters.cpu import GcPauses, freeze_heap

class Node:
    def __init__(self, nxt): self.nxt, self.me = nxt, self  # every node in a cycle: only the collector frees them

built = None
for _ in range(300_000):
    built = Node(built)
t = time.perf_counter(); gc.collect(); before = time.perf_counter() - t
freeze_heap("worker")
freeze_heap("worker")
assert sum(isinstance(c, GcPauses) for c in gc.callbacks) == 1, "one callback per process"
frozen = gc.get_freeze_count()
t = time.perf_counter(); gc.collect(); after = time.perf_counter() - t
del built
gc.collect()
assert gc.get_freeze_count() == frozen, "frozen objects stay, garbage or not"
print("MADE", file=sys.stderr, flush=True)
made = [Node(None) for _ in range(1_000_000)]  # after the freeze: scanned, so a full collection is slow again
t = time.perf_counter(); gc.collect(); last = time.perf_counter() - t
print(frozen, before, after, last, flush=True)
gc.disable()  # (the collection at exit is not part of the test)
"""


def test_freeze_heap_takes_what_a_warm_process_built_out_of_the_collectors_reach() -> None:
    """In a child process (freezing this one would keep every test's objects): 300k objects in cycles, a full
    collection over them; frozen, the same collection scans none of them (and is not logged); 1M objects made
    after, a collection over them is slow again, and logged."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert proc.returncode == 0, proc.stderr
    frozen, before, after, last = proc.stdout.split()
    assert int(frozen) >= 300_000  # the nodes, and what the imports made
    assert float(after) < float(before) / 10, (before, after)
    quick, slow = proc.stderr.split("MADE\n")
    assert "garbage collection" not in quick, quick  # the collections over the frozen heap: fast, not logged
    assert float(last) >= 0.02, last  # over 1M new objects (~0.25 s here)
    lines = [ln for ln in slow.splitlines() if "garbage collection held the interpreter" in ln]
    assert lines and all(ln.startswith("worker: a generation-") for ln in lines), slow
    assert any(ln.startswith("worker: a generation-2 ") for ln in lines), slow


def test_a_refused_priority_leaves_the_worker_as_it_was(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from deployments.pipeline import workers

    asked: list[int] = []
    monkeypatch.setattr(workers, "prioritize", lambda nice: asked.append(nice))  # the OS said no: None
    with caplog.at_level("INFO", logger=workers.__name__):
        workers.realtime(-10, "DiT rank 0")
        workers.realtime(None, "decoder")
    assert asked == [-10]  # None asks nothing
    assert "DiT rank 0 keeps its nice value" in caplog.text and "CAP_SYS_NICE" in caplog.text


def test_bf16_linear_layers_match_float32_and_auto_picks_them_only_with_bf16_hardware(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import characters.host as cpu_mod
    from characters.config import TOPOLOGIES
    from characters.engine import DiTRunner, cpu_matmul
    from characters.tp import ParallelLinear

    layer = ParallelLinear(64, 96, "column")
    x = torch.randn(3, 7, 64)
    want = layer(x)
    layer.to_cpu_bf16_()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 1e-2  # bf16 operands, float32 accumulation
    monkeypatch.setattr(cpu_mod, "cpu_flags", lambda: ["avx2", "fma"])
    assert cpu_matmul("auto") == "float32" and cpu_matmul("bfloat16") == "bfloat16"
    monkeypatch.setattr(cpu_mod, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
    assert cpu_matmul("auto") == "bfloat16" and cpu_matmul("float32") == "float32"
    # a whole DiT: a few chunks of the bf16 runner stay within 3% of the float32 one's latents
    topo = {c: TOPOLOGIES["cpu"].model_copy(update={"cpu_matmul": c}).model_dump() for c in ("float32", "bfloat16")}
    runners = {c: DiTRunner(session_config("tiny", topo[c], model=SMALL)) for c in topo}
    assert runners["bfloat16"].cpu_matmul == "bfloat16" and runners["float32"].cpu_matmul == "float32"
    cfg = session_config("tiny", "cpu", model=SMALL)
    ref = torch.zeros(1, cfg.model.dit.latent_channels, *cfg.model.latent_hw)
    outs = {}
    for c, r in runners.items():
        r.start(ref, seed=0)
        for k in range(4):
            a, b = chunk_sample_range(k, 4)
            out = r.step((0.1 * np.sin(np.arange(a, b) * 0.05)).astype(np.float32))
        outs[c] = out
    assert float((outs["bfloat16"] - outs["float32"]).norm() / outs["float32"].norm()) < 0.03
