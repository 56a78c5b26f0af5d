"""docs/benchmarks.md and the README's headline table are what `scripts/benchmarks/page.py` generates from
benchmarks/ (a number on either page cannot drift from its JSON), every file in benchmarks/ is a measurement file
whose runs carry date, commit, machine and command, and `results.record` appends a run in that shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.benchmarks import page, results

ROOT = Path(__file__).resolve().parents[2]
RUN_KEYS = {"date", "commit", "machine", "command", "label", "figures"}


def test_the_committed_benchmarks_page_is_the_generated_one() -> None:
    assert (ROOT / "docs" / "benchmarks.md").read_text() == page.page(), (
        "docs/benchmarks.md differs from what scripts/benchmarks/page.py generates from benchmarks/: "
        "run `python scripts/benchmarks/page.py` and commit the page")


def test_the_readme_headline_table_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme == page.readme_with_headline(readme), (
        "README.md's headline table differs from what scripts/benchmarks/page.py generates: run it and commit")
    table = readme.partition(page.START)[2].partition(page.END)[0].strip().splitlines()
    assert 3 <= len(table) <= 2 + 15  # header, rule, at most 15 figures
    assert all(row.count("](benchmarks/") == 1 for row in table[2:])  # each figure links its JSON


def test_the_page_changes_when_a_figure_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a figure's JSON edited by hand shows up on both pages."""
    before = page.headline("")
    source = json.loads((ROOT / "benchmarks" / "h200" / "decoder_57b.json").read_text())
    source["runs"][-1]["figures"]["ms"]["windows_graph_bench"] = 12.25
    (tmp_path / "h200").mkdir()
    for kind in results.MACHINE_KINDS:
        if (ROOT / "benchmarks" / kind).is_dir() and kind != "h200":
            (tmp_path / kind).symlink_to(ROOT / "benchmarks" / kind)
    for f in (ROOT / "benchmarks" / "h200").iterdir():
        (tmp_path / "h200" / f.name).symlink_to(f)
    (tmp_path / "h200" / "decoder_57b.json").unlink()
    (tmp_path / "h200" / "decoder_57b.json").write_text(json.dumps(source))
    monkeypatch.setattr(page, "BENCH", tmp_path)
    after = page.headline("")
    assert "**12.2 ms (34.5)**" in after and after != before


def test_every_result_is_a_measurement_file_with_its_runs() -> None:
    files = sorted((ROOT / "benchmarks").rglob("*.json"))
    assert files
    for path in files:
        kind = path.relative_to(ROOT / "benchmarks").parts[0]
        assert kind in results.MACHINE_KINDS and path.parent.name == kind, f"{path}: not in benchmarks/<kind>/"
        data = json.loads(path.read_text())
        assert set(data) == {"measurement", "runs"} and data["runs"], path
        for run in data["runs"]:
            assert set(run) == RUN_KEYS and all(run[k] for k in ("date", "commit", "machine", "command")), path


def test_record_appends_a_run_and_latest_reads_it(tmp_path: Path) -> None:
    out = tmp_path / "cpu" / "x.json"
    results.record(out, {"ms": 1.0}, label="first", command_line="python a.py")
    results.record(out, {"ms": 2.0}, command_line="python a.py --again")
    data = json.loads(out.read_text())
    assert data["measurement"] == "x" and [r["figures"] for r in data["runs"]] == [{"ms": 1.0}, {"ms": 2.0}]
    assert set(data["runs"][0]) == RUN_KEYS and data["runs"][1]["command"] == "python a.py --again"
    assert results.latest(out) == {"ms": 2.0} and results.latest(out, "first") == {"ms": 1.0}
    with pytest.raises(LookupError, match="no run labelled 'nope'"):
        results.latest(out, "nope")
    (tmp_path / "old.json").write_text('{"ms": 3}')
    with pytest.raises(ValueError, match="not a measurement file"):
        results.latest(tmp_path / "old.json")


def test_merge_files_a_sessions_results(tmp_path: Path) -> None:
    session, dest = tmp_path / "out", tmp_path / "h200"
    results.record(session / "step.json", {"ms": 5.0}, command_line="python s.py")
    results.record(dest / "step.json", {"ms": 6.0}, command_line="python s.py")
    assert results.merge(session, dest) == [dest / "step.json"]
    assert [r["figures"]["ms"] for r in results.runs(dest / "step.json")] == [6.0, 5.0]
