"""Benchmark results: one JSON file per measurement, its runs as entries.

    {"measurement": "latency_ray", "runs": [{"date": ..., "commit": ..., "machine": ..., "command": ...,
                                             "label": ..., "figures": {...what the script measured...}}, ...]}

A script records a run with `record(path, figures)`: the entry is appended (a later run does not erase an earlier
one; git keeps what a cleanup removes). Readers take `latest(path)` (or the run of a label), so they never depend
on a file's history. `docs/benchmarks.md` is generated from these files (`scripts/benchmarks/page.py`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MACHINE_KINDS = ("cpu", "h100", "h200", "h200x2", "estimates")  # benchmarks/<kind>/


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def commit() -> str:
    """The checkout's commit, `+dirty` when tracked files differ from it (a run of uncommitted code)."""
    head = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty and dirty != "unknown" else "")


def machine() -> str:
    """The machine in words: GPU name and count where CUDA is up, else the CPU model and core count."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {model}"


def command(argv: list[str] | None = None) -> str:
    """The command line that ran, with the script's path relative to the checkout."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = Path(argv[0]).resolve()
        if script.is_relative_to(ROOT):
            argv[0] = str(script.relative_to(ROOT))
    return "python " + shlex.join(argv)


def kind(device_type: str = "cuda") -> str:
    """The folder of benchmarks/ a run on this machine belongs in: `cpu`, or the GPU and its count (`h200`,
    `h200x2`, `h100`)."""
    if device_type == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    found = re.search(r"\b([A-Z])(\d{3})\b", torch.cuda.get_device_name(0))
    name = (found.group(1) + found.group(2)).lower() if found else "gpu"
    n = torch.cuda.device_count()
    return name if n == 1 else f"{name}x{n}"


def default_path(measurement: str, device_type: str = "cuda") -> Path:
    """benchmarks/<kind>/<measurement>.json for a run on this machine."""
    return ROOT / "benchmarks" / kind(device_type) / f"{measurement}.json"


def entry(figures: dict[str, Any], *, label: str = "", command_line: str | None = None,
          machine_name: str | None = None, date: str | None = None, commit_id: str | None = None) -> dict[str, Any]:
    return {"date": date or dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit_id or commit(),
            "machine": machine_name or machine(),
            "command": command_line if command_line is not None else command(),
            "label": label,
            "figures": figures}


def read(path: Path) -> dict[str, Any]:
    """The measurement file at `path` ({"measurement", "runs"}); an empty one where there is none yet."""
    path = Path(path)
    if not path.is_file():
        return {"measurement": path.stem, "runs": []}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path} is not a measurement file (expected {{'measurement', 'runs': [...]}}); "
                         "benchmark results are written through scripts/benchmarks/results.py")
    return data


def write(path: Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def record(path: Path | str, figures: dict[str, Any], *, label: str = "", command_line: str | None = None) -> Path:
    """Append one run (date, commit, machine, command, label, figures) to the measurement file at `path`."""
    path = Path(path)
    data = read(path)
    data["runs"].append(entry(figures, label=label, command_line=command_line))
    write(path, data)
    return path


def runs(path: Path | str) -> list[dict[str, Any]]:
    return list(read(Path(path))["runs"])


def latest(path: Path | str, label: str | None = None) -> dict[str, Any]:
    """The figures of the file's last run (of that label, where one is given)."""
    found = [r for r in runs(path) if label is None or r.get("label") == label]
    if not found:
        raise LookupError(f"{path} has no run{'' if label is None else f' labelled {label!r}'}")
    figures: dict[str, Any] = found[-1]["figures"]
    return figures


def merge(source: Path, dest: Path) -> list[Path]:
    """Append the runs of every measurement file in `source` (a GPU session's $OUT) to the same-named file in
    `dest` (e.g. benchmarks/h200); returns the files written."""
    written = []
    for path in sorted(Path(source).glob("*.json")):
        target = Path(dest) / path.name
        data = read(target)
        data["runs"].extend(read(path)["runs"])
        write(target, data)
        written.append(target)
    return written


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="benchmark results: merge a session's measurement files into benchmarks/")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="append the runs of SOURCE/*.json to DEST/<same name>")
    m.add_argument("source", type=Path)
    m.add_argument("dest", type=Path)
    a = ap.parse_args()
    for p in merge(a.source, a.dest):
        print(f"-> {p}")
