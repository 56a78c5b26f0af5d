"""scripts/benchmarks/bench_agree.py: real gloo ranks in their own processes, each calling `DiTWorker._agree` as a DiT
rank does between parts; whichever rank is asked, every rank hears it (the times are the benchmark's, not asserted)."""

from __future__ import annotations

from scripts.benchmarks import bench_agree as bench


def test_three_ranks_agree_on_every_call() -> None:
    row = bench.measure(3, calls=40, part_ms=1.0, skew_ms=0.5)
    assert row["ranks"] == 3 and row["calls"] == 40
    assert row["wrong_answers"] == 0  # 2 x 40 calls a rank, 8 of them asked of one rank each
    for mode in ("back_to_back_us", "paced_us"):
        assert 0 < row[mode]["p50"] <= row[mode]["p99"] <= row[mode]["max"]
