"""The 57b latency budget's collectives estimate (`scripts/benchmarks/latency_budget.py`): the NCCL model fitted to the
2-rank runs, the calls it counts per layout, and the table the README quotes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.benchmarks.latency_budget import (
    COLLECTIVE_RUNS,
    collectives_ms,
    dit_wait_ms,
    fit_collectives,
    load,
    preempt_wait_ms,
    rank_session,
)

ROOT = Path(__file__).resolve().parents[2]
RUNS = [load(ROOT / "benchmarks" / "h200x2" / f) for f in COLLECTIVE_RUNS]


def test_the_fit_goes_through_each_measured_call() -> None:
    fit = fit_collectives(RUNS)
    for run in RUNS:
        for op, measured in run["ops"].items():
            traffic = (2 if op == "all_reduce" else 1) * 0.5  # 2 ranks
            model = fit[op]["alpha_ms"] + run["tensor"]["bytes"] * traffic / fit[op]["bytes_per_ms"]
            assert model == pytest.approx(measured["graph_ms"], rel=1e-9)
        assert all(0 < f["alpha_ms"] < 0.1 and 1e8 < f["bytes_per_ms"] < 1e9 for f in fit.values())  # us, GB/s


def test_the_fit_needs_two_sizes_of_one_rank_count() -> None:
    with pytest.raises(ValueError, match="two sizes or more"):
        fit_collectives([RUNS[0], RUNS[0]])
    with pytest.raises(ValueError, match=r"ranks \[2, 3\]"):
        fit_collectives([RUNS[0], {**RUNS[1], "ranks": 3}])


def test_the_estimate_counts_the_layouts_calls() -> None:
    """Every token on every rank, 2 ranks: an all-reduce of (T, D) bf16 after each of a block's 3 row layers, each
    the measured 55 MB call; the token-local layers whole leave self-attention's gather and reduce-scatter (and
    the head's gather) of the 3 + 3 a split block makes."""
    fit = fit_collectives(RUNS)
    per_call = RUNS[0]["ops"]["all_reduce"]["graph_ms"]  # 2992 x 9216 bf16: the 57b chunk's residual stream
    assert collectives_ms(rank_session(2, "rep", "bf16"), fit) == pytest.approx(3 * 58 * per_call, rel=1e-6)
    for ranks in (3, 4):
        split, local = (collectives_ms(rank_session(ranks, layout), fit) for layout in ("sp", "sp_local"))
        assert split / 3 < local < split / 3 * 1.05


def test_the_wait_for_the_dit() -> None:
    assert dit_wait_ms(80.0) == 0.0  # busy under half the chunk: the median arrival finds it idle
    assert dit_wait_ms(500.0) == pytest.approx(250.0)  # always busy: half a step
    assert 0 < dit_wait_ms(120.0) < dit_wait_ms(150.0)


def test_the_wait_for_the_dit_when_the_onset_takes_the_idle_chunks_place() -> None:
    """Busy, the DiT stops at the end of the part after the one running: between one and two parts, never more
    than the wait for the rest of the step at the same arrival's median; one part a step is no better."""
    assert preempt_wait_ms(80.0, 8) == 0.0
    assert preempt_wait_ms(500.0, 8) == pytest.approx(500.0 / 8 * 1.5)  # always busy: a part and a half
    for dit in (120.0, 147.5, 160.0):
        assert dit / 8 < preempt_wait_ms(dit, 8) < 2 * dit / 8 and preempt_wait_ms(dit, 8) < dit_wait_ms(dit)
        assert preempt_wait_ms(dit, 1) > dit_wait_ms(dit)


def test_the_budget_table_is_the_one_in_benchmarks(tmp_path: Path) -> None:
    """The script's table from the stored runs equals benchmarks/estimates/latency_budget_57b.json's last run (the
    table docs/latency.md quotes), and its estimated rows say what the page says of them."""
    out = tmp_path / "budget.json"
    script = ROOT / "scripts" / "benchmarks" / "latency_budget.py"
    subprocess.run([sys.executable, str(script), "--out", str(out)], check=True,
                   cwd=ROOT, capture_output=True)
    got, stored = load(out), load(ROOT / "benchmarks" / "estimates" / "latency_budget_57b.json")
    assert got["rows"] == stored["rows"]
    rows = {r["topology"]: r for r in got["rows"]}
    assert rows["4 + 1, FP8 + cuDNN, local layers"]["met_est"]
    assert not rows["3 + 1, FP8 + cuDNN FP8 attn"]["real_time_est"]
    assert all(r["collectives_est_ms"] > 0 and r["total_est_ms"] > r["total_ms"] for r in got["rows"])
    # 3 + 1 meets 350 ms only with the onset taking the idle chunk's place (its parts' cost not in it)
    for name in ("3 + 1, FP8 + cuDNN, local layers", "3 + 1, FP8 + cuDNN, local layers + attention"):
        assert not rows[name]["met_est"] and rows[name]["met_preempt_est"]
        assert rows[name]["total_preempt_est_ms"] < rows[name]["total_est_ms"] - 30
    # the design's own cards: the ranks' steps measured on an H100 keep 3 + 1 in real time and within 350 ms
    # with the onset in the idle chunk's place, as on the H200
    h100 = {r["topology"]: r for r in got["rows"] if r["gpu"] == "H100"}
    assert {"3 + 1, H100, FP8 + cuDNN, local layers", "4 + 1, H100, FP8 + cuDNN, local layers"} <= set(h100)
    assert all(r["real_time_est"] and r["met_preempt_est"] for r in h100.values())
    assert all(r["dit_source"].startswith("benchmarks/h100/") for r in h100.values())
