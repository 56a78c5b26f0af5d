"""`scripts/benchmarks/bench_pipeline.py` end to end on logical GPUs: two sessions side by side, each on its own slot.

The benchmark the GPU machine runs for the multi-GPU topologies (4+1, 3+1, two sessions on 8 GPUs),
here with the cut-down tiny preset on CPU workers holding logical GPUs: it must build one placement
group per session, give no GPU to two workers, stream both sessions, and report what it measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "benchmarks"))

import bench_pipeline

from scripts.benchmarks import results

pytestmark = pytest.mark.ray


def test_two_sessions_side_by_side_hold_disjoint_gpus(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    rc = bench_pipeline.main(["--small", "--dit-ranks", "1", "--decoder-gpus", "1", "--sessions", "2",
                              "--seconds", "4", "--skip", "2", "--cpus", "8", "--out", str(out)])
    assert rc == 0
    result = results.latest(out)
    (variant,) = result["variants"]
    assert (variant["layout"], variant["depth"], result["topology"]) == ("replicated", 2, "1+1")
    sessions = variant["sessions"]
    assert [s["status"] for s in sessions] == ["ENDED", "ENDED"], sessions
    held = []
    for s in sessions:
        assert s["chunks"] >= 4 and 0 < s["ms_per_chunk"] < 10_000, s
        assert {"dit", "handoff", "decode"} <= set(s["stage_ms"]), s["stage_ms"]
        assert 0 < s["ready_after_s"] <= variant["build_s"], (s["ready_after_s"], variant["build_s"])
        for worker in ("dit0", "decoder"):
            stages = s["slot_build_s"][worker]
            assert list(stages) == ["init_device", "init_process_group", "load_weights", "warm_up"], stages
            assert sum(stages.values()) <= s["ready_after_s"], (stages, s["ready_after_s"])
        gpus = [*(g for rank in s["gpus"]["dit"] for g in rank), *s["gpus"]["decoder"]]
        assert len(gpus) == 2, s["gpus"]  # one GPU each: the DiT rank and the decoder
        held += gpus
    assert len(set(held)) == 4  # no GPU shared, within a session or across the two


def test_more_gpus_than_the_machine_has_is_refused_before_starting_ray(capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_pipeline.main(["--device", "cuda", "--dit-ranks", "4", "--decoder-gpus", "1", "--sessions", "2"])
    assert rc == 2
    assert "needs 10 GPUs" in capsys.readouterr().err


def test_layers_override_builds_that_many_blocks_and_keeps_the_small_cut() -> None:
    args = bench_pipeline.parse_args(["--small", "--layers", "3", "--dit-ranks", "2"])
    model = bench_pipeline.service_for(args, "sp_ring", 1).session_config().model
    assert model.dit.num_layers == 3
    assert (model.generation.height, model.generation.width, model.vae.num_res_blocks) == (64, 96, 0)
    assert bench_pipeline.SMALL["dit"] == {"num_layers": 1}  # the shared cut is not mutated
    full = bench_pipeline.service_for(bench_pipeline.parse_args(["--preset", "57b", "--layers", "15"]), "replicated", 2)
    assert full.session_config().model.dit.num_layers == 15
    assert full.session_config().model.dit.dim == 9216
