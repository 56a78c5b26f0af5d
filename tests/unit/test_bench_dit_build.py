"""scripts/benchmarks/bench_dit_build.py: both builds it compares make the same FP8 share, and the bf16 share it reports
as the whole-share build's floor is the larger. Pure CPU, no marker (the peaks are the benchmark's, not asserted
here)."""

from __future__ import annotations

import pytest

from scripts.benchmarks import bench_dit_build as bench


@pytest.mark.parametrize(("ranks", "layout"), [(1, "rep"), (2, "spa")])
def test_both_builds_make_the_same_fp8_share(ranks: int, layout: str) -> None:
    whole, blocks = (bench.build_one("tiny", 2, ranks, layout, build, "cpu") for build in ("whole", "blocks"))
    assert whole["fp8_share_bytes"] == blocks["fp8_share_bytes"] > 0
    assert whole["bf16_share_bytes"] > whole["fp8_share_bytes"] and whole["blocks"] == 2
    with pytest.raises(ValueError, match="build 'half'"):
        bench.build_one("tiny", 2, ranks, layout, "half", "cpu")
