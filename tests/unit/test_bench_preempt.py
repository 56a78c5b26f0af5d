"""scripts/benchmarks/bench_preempt.py on the CPU (eager parts): a step of one part is never given up, a step of four is
when the stop comes before its last part, and the runner makes the same chunk after either (the waits are the
benchmark's, not asserted here)."""

from __future__ import annotations

import numpy as np
import torch

from characters.config import TOPOLOGIES, session_config
from characters.engine import DiTRunner
from scripts.benchmarks import bench_preempt as bench


def test_parts_are_given_up_and_one_part_is_not() -> None:
    cfg = session_config("tiny", TOPOLOGIES["cpu"].model_dump(), weights="random")
    runner = DiTRunner(cfg)
    runner.start(torch.zeros(1, cfg.model.dit.latent_channels, *cfg.model.latent_hw))
    windows = runner.frontend.push(np.zeros(runner.frontend.expected_samples, np.float32))
    rows = {}
    for groups in (1, 4):
        runner.groups = groups
        rows[groups] = bench.measure(runner, windows, torch.device("cpu"), iters=2, trials=4)
    assert rows[1]["given_up"] == 0 and rows[4]["given_up"] >= 1
    assert all(r["step_ms"] > 0 and r["wait_ms_p50"] >= 0 for r in rows.values())
    # the timed steps (4 plain, 4 paced a group count) advanced the runner; of the trials, only those not given up
    assert runner.chunk == 2 * 8 + sum(r["trials"] - r["given_up"] for r in rows.values())
