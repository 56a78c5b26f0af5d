"""Benchmark: what telemetry costs the chunk step, on and off in one run (tiny engine, in-process, CPU).

    python scripts/benchmarks/bench_telemetry.py                                  # tiny preset, 5 rounds x 24 chunks
    python scripts/benchmarks/bench_telemetry.py --rounds 8 --out benchmarks/cpu/telemetry.json

The slot's three workers (`DiTWorker`, `DecoderWorker`, `RoomWorker`) run in this process, driven by the
real chunk loop (`deployments.pipeline.loop.run_chunk_loop`, unpaced: `wait` returns at once) through a
synchronous in-process pipeline; each published report goes to the session's `SessionTelemetry`, as in a
session actor. Three variants, each its own set of warm workers:

    off      telemetry off (the default): no recorder, no spans, no-op instruments
    on       on, exporting over OTLP/gRPC to a local receiver (`deployments.telemetry.receiver`, its own
             process, as a collector would be):
             stage recorders, default chunk sampling (24 first, then 1 in 60), every metric
    on_all   on, and every chunk traced (6 spans each): the worst case of the sampling policy

Step time (the criterion): one chunk through the workers (DiT step, decode, publish) plus the session's
telemetry for it (`SessionTelemetry.on_chunk`). The variants step in lockstep, chunk by chunk, each on its
own session, in rotating order, so the 2-core machine's drift (other tenants) hits all three alike; the
overhead is the ratio of medians. Then the same through the real chunk loop (`run_chunk_loop`, unpaced:
`wait` returns at once; submit -> report handled), in short interleaved blocks (`--loop-chunks`), one per
variant per round; its overhead is the median over rounds of each round's on/off ratio (paired, so drift
cancels), with the block-to-block spread printed as the noise floor. Also measured: the telemetry time per
chunk in the loop thread (traced and untraced chunks apart), and the CPU time of every other thread of the
process (span and metric export, gRPC) per chunk with telemetry on: work that runs beside the step.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.audio import chunk_sample_range
from characters.config import SessionConfig, session_config
from deployments import telemetry
from deployments.pipeline.loop import run_chunk_loop
from deployments.pipeline.messages import ChunkReport
from deployments.pipeline.output import RoomWorker
from deployments.pipeline.workers import ChunkInput, DecoderWorker, DiTWorker
from deployments.settings import TelemetryConfig
from deployments.telemetry import SessionTelemetry, Telemetry
from deployments.types import OutputSpec, SessionStats
from scripts.benchmarks import results

ROOT = Path(__file__).resolve().parents[2]


class LocalPipeline:
    """The slot's workers in this process: submit computes the chunk, fetch hands its report out."""

    def __init__(self, dit: DiTWorker, dec: DecoderWorker, room: RoomWorker) -> None:
        self.dit, self.dec, self.room = dit, dec, room
        self.reports: list[ChunkReport] = []

    def submit(self, inp: ChunkInput) -> None:
        self.reports.append(self.room.publish(inp, self.dec.decode(self.dit.step(inp))))  # type: ignore[arg-type]

    def preempt(self, session_id: str, chunk: int) -> None:
        self.dit.preempt(session_id, chunk)  # (chunk k - 1 is already made here: a no-op)

    def fetch(self, timeout_s: float) -> ChunkReport:
        return self.reports.pop(0)

    def close(self) -> bool:
        return True


class Variant:
    def __init__(self, name: str, cfg: SessionConfig, tel: Telemetry) -> None:
        self.name, self.cfg, self.tel = name, cfg, tel
        previous = telemetry.reset_for_tests(tel)  # the workers read this process's telemetry when built
        try:
            self.dit, self.dec, self.room = DiTWorker(cfg), DecoderWorker(cfg), RoomWorker(cfg)
            for w in (self.dit, self.dec):
                w.init_device()
            self.dit.init_process_group(0)
            self.dec.init_process_group()
            for w in (self.dit, self.dec):
                w.load_weights()
                w.warm_up()
        finally:
            telemetry.reset_for_tests(previous)
        self.steps_ms: list[float] = []  # lockstep chunks
        self.loop_ms: list[float] = []  # chunk-loop chunks
        self.on_chunk_us: dict[bool, list[float]] = {True: [], False: []}  # traced chunk? -> telemetry time
        self.sessions = 0
        self.st: SessionTelemetry | None = None

    def open(self) -> str:
        """Start a new session on this variant's workers (and its telemetry)."""
        self.sessions += 1
        sid = f"{self.name}-{self.sessions}"
        g = self.cfg.model.generation
        image = np.random.default_rng(self.sessions).integers(0, 256, (g.height, g.width, 3), dtype=np.uint8)
        self.dit.start(sid, self.dec.encode_reference(sid, image), 0)
        self.dec.start(sid)
        self.room.open(sid, OutputSpec("null"))
        self.st = SessionTelemetry(self.tel, sid, {}, preset="tiny", output_kind="null") if self.tel.enabled else None
        if self.st is not None:
            self.st.starting()
        return sid

    def close(self, chunks: int) -> None:
        if self.st is not None:
            self.st.ended("ENDED", "done", SessionStats(chunks=chunks), start_ns=time.time_ns(), phases={})
        for w in (self.dit, self.dec, self.room):
            w.reset()

    def handle(self, report: ChunkReport, submitted_at: float) -> None:
        t0 = time.perf_counter()
        why = self.st.on_chunk(report, submitted_at) if self.st is not None else None
        self.on_chunk_us[why is not None].append((time.perf_counter() - t0) * 1e6)

    def step(self, sid: str, k: int) -> None:
        """Chunk k of the open session, timed: workers, then the session's telemetry."""
        inp = ChunkInput(sid, k, pcm(self.cfg, k))
        t0 = time.monotonic()
        report = self.room.publish(inp, self.dec.decode(self.dit.step(inp)))  # type: ignore[arg-type]
        self.handle(report, t0)
        self.steps_ms.append((time.monotonic() - t0) * 1e3)

    def loop_block(self, chunks: int) -> None:
        """One session of `chunks` chunks through the real chunk loop (unpaced)."""
        sid = self.open()
        g = self.cfg.model.generation
        done = 0

        def on_report(report: ChunkReport, submitted_at: float) -> None:
            nonlocal done
            self.handle(report, submitted_at)
            self.loop_ms.append((time.monotonic() - submitted_at) * 1e3)
            done += 1

        result = run_chunk_loop(LocalPipeline(self.dit, self.dec, self.room), session_id=sid,
                                audio=lambda k: pcm(self.cfg, k), chunk_s=g.frames_per_chunk / g.fps, depth=1,
                                max_duration_s=1e9, fetch_timeout_s=60, clock=time.monotonic, wait=lambda s: None,
                                stop_reason=lambda: "done" if done >= chunks else None, on_report=on_report)
        assert result.failure is None, result
        self.close(done)


def cpu_s(task: str = "") -> float:
    """CPU seconds (user + system) of this process, or of one of its threads (`task`: its native id)."""
    fields = Path(f"/proc/self{'/task/' + task if task else ''}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def us_per_chunk(v: Variant) -> dict[str, float]:
    """The session's telemetry time per chunk, traced chunks (6 spans) apart from the others (metrics only)."""
    out: dict[str, float] = {}
    for traced, name in ((True, "traced"), (False, "untraced")):
        us = v.on_chunk_us[traced]
        out[f"telemetry_us_{name}_chunks"] = len(us)
        out[f"telemetry_us_{name}_p50"] = round(statistics.median(us), 1) if us else 0.0
        out[f"telemetry_us_{name}_p99"] = round(float(np.percentile(us, 99)), 1) if us else 0.0
    return out


def pcm(cfg: SessionConfig, k: int) -> np.ndarray:
    a, b = chunk_sample_range(k, cfg.model.generation.frames_per_chunk)
    return np.zeros(b - a, np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--chunks", type=int, default=120, help="lockstep chunks per variant (one session each)")
    ap.add_argument("--rounds", type=int, default=24, help="chunk-loop rounds (each: one block per variant)")
    ap.add_argument("--loop-chunks", type=int, default=10, help="chunks per chunk-loop block (short blocks, many "
                    "rounds: the machine's drift spreads over every variant)")
    ap.add_argument("--metric-interval-ms", type=int, default=60000, help="metric export period (the default's)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "cpu" / "telemetry.json")
    args = ap.parse_args()
    cfg = session_config(args.preset, "cpu")
    # the receiver runs in its own process, as a collector would: its parsing must not count as our overhead
    rx = subprocess.Popen([sys.executable, "-m", "deployments.telemetry.receiver", "--summary"], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None and rx.stdin is not None
    endpoint = json.loads(rx.stdout.readline())["grpc"]
    try:
        common = {"traces_endpoint": endpoint, "metrics_endpoint": endpoint,
                  "metric_export_interval_ms": args.metric_interval_ms}
        variants = [
            Variant("off", cfg, Telemetry(TelemetryConfig(), "bench", "off")),
            Variant("on", cfg, Telemetry(TelemetryConfig(**common), "bench", "on")),
            Variant("on_all", cfg, Telemetry(TelemetryConfig(**common, trace_chunks_first=10**9), "bench", "on_all")),
        ]
        main_task = str(threading.main_thread().native_id)
        cpu0, main0 = cpu_s(), cpu_s(main_task)
        sids = [v.open() for v in variants]
        for k in range(args.chunks):  # lockstep, rotating which variant goes first
            for i in range(len(variants)):
                j = (i + k) % len(variants)
                variants[j].step(sids[j], k)
            if (k + 1) % 40 == 0:
                print(f"lockstep {k + 1}/{args.chunks}: " + ", ".join(
                    f"{v.name} {statistics.median(v.steps_ms):.1f} ms" for v in variants), flush=True)
        for v in variants:
            v.close(args.chunks)
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:  # alternate the order: no variant always first
                v.loop_block(args.loop_chunks)
            if (r + 1) % 6 == 0:
                print(f"loop round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{v.name} {statistics.median(v.loop_ms):.1f} ms" for v in variants), flush=True)
        for v in variants:
            v.tel.flush(5.0)
        background_s = (cpu_s() - cpu0) - (cpu_s(main_task) - main0)  # every other thread: export, gRPC
        for v in variants:
            v.tel.shutdown()  # before the receiver goes
        rx.stdin.close()
        counts = json.loads(rx.stdout.readline())
    finally:
        if rx.poll() is None:
            rx.kill()
        rx.wait(30)
    spans, points = counts["spans"], counts["metric_points"]
    blocks = [statistics.median(variants[0].loop_ms[i:i + args.loop_chunks])
              for i in range(0, len(variants[0].loop_ms), args.loop_chunks)]
    noise = 100 * statistics.stdev(blocks) / statistics.mean(blocks) if len(blocks) > 1 else 0.0
    off, loop_off = statistics.median(variants[0].steps_ms), statistics.median(variants[0].loop_ms)
    rows: list[dict[str, Any]] = []
    for v in variants:
        med, loop = statistics.median(v.steps_ms), statistics.median(v.loop_ms)
        n = args.loop_chunks  # block r of each variant ran in round r, next to the others': pair them
        paired = [statistics.median(v.loop_ms[i:i + n]) / statistics.median(variants[0].loop_ms[i:i + n]) - 1
                  for i in range(0, len(v.loop_ms), n)]
        rows.append({"variant": v.name, "chunks": len(v.steps_ms), "step_ms_p50": round(med, 3),
                     "step_ms_p90": round(float(np.percentile(v.steps_ms, 90)), 3),
                     "overhead_pct_p50": round(100 * (med / off - 1), 3),
                     "loop_chunks": len(v.loop_ms), "loop_ms_p50": round(loop, 3),
                     "loop_overhead_pct_p50": round(100 * statistics.median(paired), 3),
                     "loop_overhead_pct_of_medians": round(100 * (loop / loop_off - 1), 3),
                     **us_per_chunk(v)})
    print(f"\n{'variant':<8} {'chunks':>6} {'step p50 ms':>11} {'p90 ms':>8} {'overhead':>9} {'loop p50 ms':>11} "
          f"{'overhead':>9} {'telemetry us/chunk p50: traced':>31} {'untraced':>9}")
    for row in rows:
        print(f"{row['variant']:<8} {row['chunks']:>6} {row['step_ms_p50']:>11.2f} {row['step_ms_p90']:>8.2f} "
              f"{row['overhead_pct_p50']:>8.2f}% {row['loop_ms_p50']:>11.2f} {row['loop_overhead_pct_p50']:>8.2f}% "
              f"{row['telemetry_us_traced_p50']:>31.1f} {row['telemetry_us_untraced_p50']:>9.1f}")
    on_chunks = sum(len(v.steps_ms) + len(v.loop_ms) for v in variants[1:])
    background_us = 1e6 * background_s / on_chunks
    print(f"exported to the local receiver: {spans} spans, {points} metric points; the loop's block-to-block "
          f"spread (telemetry off): {noise:.1f}% (the machine's noise)")
    print(f"background threads (span/metric export, gRPC): {background_s:.2f} CPU s in all, {background_us:.0f} us "
          f"per chunk with telemetry on ({100 * background_us / 1e3 / statistics.median(variants[0].steps_ms):.2f}% "
          "of a step, on another core)")
    worst = max(r["overhead_pct_p50"] for r in rows)  # the paired lockstep: the loop's blocks are noisier
    loop_worst = max(r["loop_overhead_pct_p50"] for r in rows)
    result = {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
              "preset": args.preset, "device": "cpu", "lockstep_chunks": args.chunks, "loop_rounds": args.rounds,
              "loop_chunks_per_block": args.loop_chunks,
              "command": " ".join(["python", *sys.argv]), "variants": rows, "spans_exported": spans,
              "metric_points_exported": points, "loop_block_spread_pct": round(noise, 2),
              "background_cpu_s": round(background_s, 3), "background_cpu_us_per_chunk_on": round(background_us, 1),
              "metric_export_interval_ms": args.metric_interval_ms,
              "worst_overhead_pct": worst, "worst_loop_overhead_pct": loop_worst, "limit_pct": 2.0,
              "within_limit": worst < 2.0, "loop_within_noise": loop_worst < max(2.0, noise)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.record(args.out, result)
    print(f"worst step overhead (lockstep, paired) {worst:.2f}% (limit 2%): {'ok' if worst < 2.0 else 'OVER'}; "
          f"chunk loop {loop_worst:.2f}% against a block-to-block spread of {noise:.1f}%; wrote {args.out}")


if __name__ == "__main__":
    main()
